"""Direct Preference Optimization (Rafailov et al., 2023).

A batch holds N chosen rows then N rejected rows (`input_ids`, `labels` with -100 off the
response). With policy and reference sequence log-probs (summed over response tokens):

    loss = -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))

Reference log-probs come from the batch (`ref_logps`, precomputed) or from a frozen reference
model that `prepare_batch` runs.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from tierlm.primitives.losses import token_logprobs

Batch = Mapping[str, torch.Tensor]


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of log p(label) over each row's labelled tokens (B,)."""
    return token_logprobs(logits, labels).sum(dim=-1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair (loss, chosen reward, rejected reward); rewards are beta * (policy - reference).

    >>> loss, c, r = dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]),
    ...     beta=0.5)
    >>> round(loss.item(), 4), c.item(), r.item()   # -log sigmoid(0.5 * (1 - (-1)))
    (0.3133, 0.5, -0.5)
    """
    chosen_rewards = beta * (policy_chosen - ref_chosen)
    rejected_rewards = beta * (policy_rejected - ref_rejected)
    return -F.logsigmoid(chosen_rewards - rejected_rewards), chosen_rewards, rejected_rewards


class DPOStrategy:
    """DPO as a strategy for the ordinary `Trainer`: losses are summed per pair and counted in pairs."""

    def __init__(self, beta: float = 0.1, reference=None):
        """`reference`: anything with the protocol's `forward(batch, fn)` (a `FrozenReference`); None
        when batches carry precomputed `ref_logps`."""
        assert beta > 0, f"beta must be > 0, got {beta}"
        self.beta, self.reference = beta, reference

    def prepare_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        out = dict(batch)
        if "ref_logps" not in out:
            assert self.reference is not None, "DPO needs a reference model or precomputed ref_logps in the batch"
            out["ref_logps"] = self.reference.forward(out, self._logps).wait()["logps"]
        return out

    def _logps(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        return {"logps": sequence_logprobs(logits, batch["labels"])}

    def _pairs(self, logits: torch.Tensor, batch: Batch):
        policy = sequence_logprobs(logits, batch["labels"])
        ref = batch["ref_logps"].to(policy.device)
        n = policy.shape[0] // 2
        return policy[:n], policy[n:], *dpo_loss(policy[:n], policy[n:], ref[:n], ref[n:], self.beta)

    def compute_loss(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        *_, losses, _, _ = self._pairs(logits, batch)
        return losses.sum(), torch.tensor(float(losses.numel()), device=losses.device)

    def compute_metrics(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        chosen, rejected, losses, chosen_rewards, rejected_rewards = self._pairs(logits, batch)
        margin = chosen_rewards - rejected_rewards
        return {
            "loss_sum": losses.sum(),
            "num_pairs": torch.tensor(float(losses.numel())),
            "margin_sum": margin.sum(),
            # A tie (e.g. every pair before the first update, when policy == reference) is half right: chance level.
            "correct": ((margin > 0).float() + 0.5 * (margin == 0).float()).sum(),
            "policy_correct": ((chosen > rejected).float() + 0.5 * (chosen == rejected).float()).sum(),
        }

    # -- the JAX backend's twins (tierlm.primitives.jax_losses.jax_twin), tested equal to the methods above --------
    def jax_logps(self, logits, batch):
        from tierlm.primitives.jax_losses import token_logprobs

        return {"logps": token_logprobs(logits, batch["labels"]).sum(axis=-1)}

    def _jax_pairs(self, logits, batch):
        from tierlm.primitives.jax_losses import dpo_loss as jax_dpo_loss

        policy = self.jax_logps(logits, batch)["logps"]
        ref, n = batch["ref_logps"], policy.shape[0] // 2
        return policy[:n], policy[n:], *jax_dpo_loss(policy[:n], policy[n:], ref[:n], ref[n:], self.beta)

    def jax_compute_loss(self, logits, batch):
        *_, losses, _, _ = self._jax_pairs(logits, batch)
        return losses.sum(), float(losses.shape[0])

    def jax_compute_metrics(self, logits, batch):
        chosen, rejected, losses, chosen_rewards, rejected_rewards = self._jax_pairs(logits, batch)
        margin = chosen_rewards - rejected_rewards
        return {
            "loss_sum": losses.sum(),
            "num_pairs": float(losses.shape[0]),
            "margin_sum": margin.sum(),
            "correct": ((margin > 0) + 0.5 * (margin == 0)).sum(),
            "policy_correct": ((chosen > rejected) + 0.5 * (chosen == rejected)).sum(),
        }

    @staticmethod
    def summarize(totals: Mapping[str, float]) -> dict[str, float]:
        """val_loss, reward_margin, pref_acc (implicit reward prefers chosen) and policy_pref_acc
        (the policy gives the chosen response the higher log-prob) over the eval pairs."""
        n = max(totals["num_pairs"], 1.0)
        return {
            "val_loss": totals["loss_sum"] / n,
            "reward_margin": totals["margin_sum"] / n,
            "pref_acc": totals["correct"] / n,
            "policy_pref_acc": totals["policy_correct"] / n,
        }

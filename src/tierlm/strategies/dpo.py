"""Direct Preference Optimization (Rafailov et al., 2023) and KTO (Ethayarajh et al., 2024) as strategies for the
ordinary `Trainer`: the policy's (and the reference's) log-probs of each response, the loss of the `dpo.loss_type`
row in `tierlm.strategies.preference_losses` (whose docstring has the formulas), and the preference metrics.

A batch holds N chosen rows then N rejected rows (`input_ids`, `labels` with -100 off the response); KTO's holds
N judged replies then N mismatched prompt / reply rows for its KL estimate. Reference log-probs come from the batch
(`ref_logps`, precomputed) or from a frozen reference model that `prepare_batch` runs.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from tierlm.primitives.losses import IGNORE_INDEX, splits_by_rows, token_logprobs
from tierlm.strategies.preference_losses import (
    PREFERENCE_LOSSES,
    PreferenceSettings,
    combined,
    kto,
    length_desensitised,
    preference_row,
)

Batch = Mapping[str, torch.Tensor]


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of log p(label) over each row's labelled tokens (B,)."""
    return token_logprobs(logits, labels).sum(dim=-1)


def preference_strategy(dpo, reference=None) -> "DPOStrategy | KTOStrategy":
    """The strategy of a `dpo` section: its losses' rows (pairs, or KTO's unpaired replies) and settings;
    `reference` is the frozen reference model (None: precomputed log-probs, or a reference-free loss)."""
    if not (row := preference_row(dpo)).paired:
        return KTOStrategy(dpo.beta, reference, dpo.desirable_weight, dpo.undesirable_weight, row.fn, row.kl_rows)
    gamma = dpo.simpo_gamma if dpo.simpo_gamma is not None else PreferenceSettings.simpo_gamma
    tau = dpo.discopop_tau if dpo.discopop_tau is not None else PreferenceSettings.discopop_tau
    f_divergence = dict(f_divergence=dpo.f_divergence_type, f_alpha=dpo.f_alpha_divergence_coef)
    return DPOStrategy(
        dpo.beta, reference, dpo.loss_type, dpo.label_smoothing, gamma, tau, dpo.ld_alpha, dpo.rpo_alpha,
        loss_weights=dpo.loss_weights, use_weighting=dpo.use_weighting, **f_divergence,
    )  # fmt: skip


def wpo_weights(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """WPO's weight of each row (B,), without gradient: exp of the mean over its labelled tokens of log p(y) - log
    sum_v p(v)^2, the token's log-prob under the policy's distribution renormalised as p^2 / sum p^2 (TRL's
    use_weighting); 1 for a row without labels.

    >>> logits = torch.zeros(1, 2, 4)   # uniform over 4 tokens: p = 1/4, sum p^2 = 1/4, so each token's term is 0
    >>> wpo_weights(logits, torch.tensor([[1, 2]]))
    tensor([1.])
    """
    with torch.no_grad():
        mask, terms = labels != IGNORE_INDEX, []
        for row, targets in zip(logits, labels):  # a row's (T, V) log-probs at a time, not the batch's
            logp = row.float().log_softmax(-1)
            picked = logp.gather(-1, targets.clamp(min=0)[:, None])[:, 0]
            terms.append(picked - torch.logsumexp(2 * logp, dim=-1))
        return torch.exp((torch.stack(terms) * mask).sum(-1) / mask.sum(-1).clamp(min=1))


class DPOStrategy:
    """DPO (or `loss_type`, or several added) as a strategy for the ordinary `Trainer`: losses are summed per pair
    and counted in pairs."""

    def __init__(
        self,
        beta: float = 0.1,
        reference=None,
        loss_type: str | Sequence[str] = "sigmoid",
        label_smoothing: float = 0.0,
        simpo_gamma: float = 0.5,
        discopop_tau: float = 0.05,
        ld_alpha: float | None = None,
        rpo_alpha: float = 0.0,
        f_divergence: str = "reverse_kl",
        f_alpha: float = 0.5,
        loss_weights: Sequence[float] | None = None,
        use_weighting: bool = False,
    ):
        """`reference`: anything with the protocol's `forward(batch, fn)` (a `FrozenReference`); None
        when batches carry precomputed `ref_logps`, or for a reference-free loss. `loss_type`: a row of
        `PREFERENCE_LOSSES`, or a list of them added with `loss_weights` (1 each by default). `ld_alpha`: LD-DPO's
        weight of the tokens past the pair's shorter response; `rpo_alpha`: RPO's weight of the chosen responses'
        NLL (an added "sft" loss); `f_divergence` / `f_alpha`: f-DPO's divergence
        (`tierlm.strategies.preference_losses.F_DIVERGENCES`); `use_weighting`: WPO's weights (`wpo_weights`)."""
        assert beta > 0, f"beta must be > 0, got {beta}"
        names = [loss_type] if isinstance(loss_type, str) else list(loss_type)
        weights = list(loss_weights) if loss_weights is not None else [1.0] * len(names)
        assert len(weights) == len(names), "one weight per loss"
        if rpo_alpha:
            names, weights = [*names, "sft"], [*weights, rpo_alpha]
        self.terms = [(PREFERENCE_LOSSES[name], weight) for name, weight in zip(names, weights)]
        self.row = combined([row for row, _ in self.terms])
        self.ld_alpha, self.use_weighting, self.reference = ld_alpha, use_weighting, reference
        settings = PreferenceSettings(beta, label_smoothing, simpo_gamma, discopop_tau, f_divergence, f_alpha)
        self.beta, self.settings = beta, settings

    def prepare_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        out = dict(batch)
        if not self.row.reference:
            return out
        if "ref_logps" not in out:
            assert self.reference is not None, "DPO needs a reference model or precomputed ref_logps in the batch"
            out["ref_logps"] = self.reference.forward(out, self.reference_logps).wait()["logps"]
        return out

    def reference_logps(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """{"logps": each row's summed response log-prob (LD-DPO: the tails weighted)}: what a reference model's
        `logits` give the batch's `ref_logps`, as precomputed ones are."""
        return {"logps": (token_logprobs(logits, batch["labels"]) * self._weights(batch["labels"])).sum(dim=-1)}

    def _weights(self, labels: torch.Tensor) -> torch.Tensor:
        """Each token's weight in its response's log-prob: 1 on the response (LD-DPO: alpha on its tail), else 0."""
        return (labels != IGNORE_INDEX).float() if self.ld_alpha is None else length_desensitised(labels, self.ld_alpha)

    def _pairs(self, logits: torch.Tensor, batch: Batch):
        labels = batch["labels"]
        token_logps, mask = token_logprobs(logits, labels), labels != IGNORE_INDEX
        sums, counts = (token_logps * self._weights(labels)).sum(dim=-1), mask.sum(dim=-1).clamp(min=1)
        n = sums.shape[0] // 2
        ref = batch["ref_logps"].to(sums.device) if self.row.reference else None
        # the sft loss: each pair's share of the chosen tokens' mean NLL over the micro-batch (their mean is it)
        nll = -(token_logps[:n] * mask[:n]).sum(dim=-1) * n / mask[:n].sum().clamp(min=1)
        loss, shown = 0.0, None
        for row, weight in self.terms:
            policy = sums / counts if row.averaged else sums  # averaged: each response's mean token log-prob
            reference = None if ref is None or not row.reference else ref / counts if row.averaged else ref
            ref_chosen, ref_rejected = (None, None) if reference is None else (reference[:n], reference[n:])
            term = row.fn(policy[:n], policy[n:], ref_chosen, ref_rejected, self.settings, nll)
            loss = loss + weight * term[0]
            if shown is None or (row.reference and not shown[0].reference):  # metrics: the first loss against the
                shown = (row, policy, term[1], term[2])  # reference (rewards beta (pi - ref)), else the first
        if self.use_weighting:  # WPO: both responses' weights, per pair
            wpo = wpo_weights(logits, labels).to(sums.dtype)
            loss = loss * wpo[:n] * wpo[n:]
        _, policy, chosen_rewards, rejected_rewards = shown
        return policy[:n], policy[n:], loss, chosen_rewards, rejected_rewards

    @splits_by_rows(2)  # N chosen rows, then their N rejected rows
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
    def jax_reference_logps(self, logits, batch):
        from tierlm.primitives.jax_losses import token_logprobs

        return {"logps": token_logprobs(logits, batch["labels"]).sum(axis=-1)}

    def _jax_pairs(self, logits, batch):
        from tierlm.primitives.jax_losses import dpo_loss as jax_dpo_loss

        policy = self.jax_reference_logps(logits, batch)["logps"]
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


class KTOStrategy:
    """KTO (`dpo.loss_type=kto`; or `losses`, another unpaired row's) for the `Trainer`, on `UnpairedLoader` batches
    (N replies, `kto_label` 1 for a desirable one, then with `kl_rows` N mismatched rows for the KL estimate); losses
    are summed per reply and counted in replies. The mismatched rows run through the policy with the others (their
    log-probs detached: the estimate is a baseline). Under data parallelism each rank estimates the KL from its own
    rows (TRL averages the ranks' estimates)."""

    def __init__(
        self,
        beta: float,
        reference=None,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        losses: Callable = kto,
        kl_rows: bool = True,
    ):
        assert beta > 0, f"beta must be > 0, got {beta}"
        self.beta, self.reference, self.losses, self.kl_rows = beta, reference, losses, kl_rows
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    def prepare_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        out = dict(batch)
        if "ref_logps" not in out:
            assert self.reference is not None, "KTO needs a reference model"
            out["ref_logps"] = self.reference.forward(out, self.reference_logps).wait()["logps"]
        return out

    def reference_logps(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """{"logps": each row's summed response log-prob}: the policy's, and a reference model's for `ref_logps`."""
        return {"logps": sequence_logprobs(logits, batch["labels"])}

    def _terms(self, logits: torch.Tensor, batch: Batch):
        policy = self.reference_logps(logits, batch)["logps"]
        ref = batch["ref_logps"].to(policy.device)
        n = policy.shape[0] // 2 if self.kl_rows else policy.shape[0]
        kl = (policy[n:].detach() - ref[n:]).mean().clamp(min=0) if self.kl_rows else policy.new_zeros(())
        ratio, desirable = policy[:n] - ref[:n], batch["kto_label"].to(policy.device) > 0
        as_desirable, as_undesirable = self.losses(ratio, kl, self.beta)
        losses = torch.where(desirable, self.desirable_weight * as_desirable, self.undesirable_weight * as_undesirable)
        return ratio.detach(), desirable, kl, losses

    def compute_loss(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        *_, losses = self._terms(logits, batch)
        return losses.sum(), torch.tensor(float(losses.numel()), device=losses.device)

    def compute_metrics(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        ratio, desirable, kl, losses = self._terms(logits, batch)
        right = torch.where(desirable, ratio > 0, ratio < 0).float() + 0.5 * (ratio == 0).float()
        return {
            "loss_sum": losses.sum(),
            "num_replies": torch.tensor(float(losses.numel())),
            "kl_sum": kl * losses.numel(),
            "desirable": desirable.float().sum(),
            "desirable_reward_sum": (self.beta * ratio * desirable).sum(),
            "undesirable_reward_sum": (self.beta * ratio * ~desirable).sum(),
            "correct": right.sum(),
        }

    @staticmethod
    def summarize(totals: Mapping[str, float]) -> dict[str, float]:
        """val_loss, kl (the batches' mean estimate), the mean implicit reward of desirable and undesirable replies,
        and kto_acc: the share of replies whose implicit reward has their label's sign (ties half)."""
        n, good = max(totals["num_replies"], 1.0), totals["desirable"]
        return {
            "val_loss": totals["loss_sum"] / n,
            "kl": totals["kl_sum"] / n,
            "reward_desirable": totals["desirable_reward_sum"] / max(good, 1.0),
            "reward_undesirable": totals["undesirable_reward_sum"] / max(totals["num_replies"] - good, 1.0),
            "kto_acc": totals["correct"] / n,
        }

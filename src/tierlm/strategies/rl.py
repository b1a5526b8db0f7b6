"""Policy-gradient strategies: what the RL loop optimises, named by `rl.loss` — REINFORCE with a group-mean
baseline (nanochat's default), GRPO, DAPO, Dr. GRPO, GSPO, CISPO, RLOO, REINFORCE++ and PPO (with a critic) — each
loss one function of `tierlm.strategies.rl_losses`; here the advantages they start from and the strategy object.

A rollout batch holds `input_ids`/`labels` (labels are the next tokens, -100 on prompt, tool
results and padding), `advantages` (B,), and optionally `old_logprobs` and `ref_logprobs` (B, T).
A loss returns its sum and its normaliser, so the backend normalises over the whole step (tokens, sequences or
Dr. GRPO's constant, as the loss says).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping

import torch

from tierlm.primitives.losses import IGNORE_INDEX, splits_by_rows, token_entropy, token_logprobs, vocab_logprobs  # noqa: F401  (token_logprobs: also this module's name)
from tierlm.strategies.off_policy import high_entropy_tokens
from tierlm.strategies.rl_losses import RL_LOSSES, loss_settings, token_loss
from tierlm.strategies.rl_terms import KL_ESTIMATORS, LossSettings

Batch = Mapping[str, torch.Tensor]


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool | str = False, eps: float = 1e-6, total=None
) -> torch.Tensor:
    """Reward minus its group's mean (groups: consecutive `group_size` samples of one prompt); GRPO also divides
    by the group's standard deviation (`normalize_std` true or "group"), Lite PPO (Liu et al., 2025; TRL's
    `scale_rewards="batch"`) by the whole step's (`"batch"`; `total` sums a dict of floats over the ranks, None:
    this batch is the step). Both stds are population ones.

    >>> group_advantages(torch.tensor([1., 0., 0., 1., 1., 1., 1., 0.]), group_size=4).tolist()
    [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]
    >>> group_advantages(torch.tensor([1., 1., 1.]), group_size=3, normalize_std=True).tolist()  # no signal
    [0.0, 0.0, 0.0]
    >>> rewards = torch.tensor([1., 0., 1., 1.])
    >>> [round(a, 4) for a in group_advantages(rewards, 2, normalize_std="group").tolist()]
    [1.0, -1.0, 0.0, 0.0]
    >>> [round(a, 4) for a in group_advantages(rewards, 2, normalize_std="batch").tolist()]  # 0.5 / std(1, 0, 1, 1)
    [1.1547, -1.1547, 0.0, 0.0]
    """
    assert rewards.numel() % group_size == 0, f"{rewards.numel()} rewards do not split into groups of {group_size}"
    groups = rewards.float().view(-1, group_size)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std == "batch":
        advantages = advantages / (step_moments(rewards, total)[1] + eps)
    elif normalize_std:
        advantages = advantages / (groups.std(dim=1, keepdim=True, unbiased=False) + eps)
    return advantages.view(-1)


def decoupled_rewards(components: torch.Tensor, weights: torch.Tensor, group_size: int, eps: float = 1e-6):
    """GDPO's rewards (TRL's multi_objective_aggregation="normalize_then_sum"): each reward of `components` (N, K)
    normalised in its group (minus the group's mean, over its population std), then weighted by `weights` (K,) and
    summed (N,). `group_advantages(..., normalize_std="batch")` of the sum then divides it by the step's std.

    >>> task, bonus = [1., 0., 1., 1.], [0.1, 0.0, 0.1, 0.0]   # the bonus's small spread counts as much as the task's
    >>> [round(x, 4) for x in decoupled_rewards(torch.tensor([task, bonus]).T, torch.ones(2), 2).tolist()]
    [2.0, -2.0, 1.0, -1.0]
    """
    groups = components.float().view(-1, group_size, components.shape[1])
    mean, std = groups.mean(dim=1, keepdim=True), groups.std(dim=1, keepdim=True, unbiased=False)
    return ((groups - mean) / (std + eps) * weights.float()).sum(dim=-1).view(-1)


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO's advantages: each reward minus the mean of its group's other rewards, r_i - (sum_j r_j - r_i) / (G - 1).

    >>> leave_one_out_advantages(torch.tensor([1., 0., 0., 1.]), group_size=2).tolist()
    [1.0, -1.0, -1.0, 1.0]
    """
    assert group_size > 1, "a leave-one-out baseline needs two samples per prompt"
    groups = rewards.float().view(-1, group_size)
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others).view(-1)


def step_moments(rewards: torch.Tensor, total=None) -> tuple[float, float]:
    """(mean, population std) of the whole step's rewards; `total` sums a dict of floats over the ranks (None: this
    batch is the step)."""
    sums = {
        "n": float(rewards.numel()),
        "sum": float(rewards.double().sum()),
        "squares": float((rewards.double() ** 2).sum()),
    }
    sums = total(sums) if total is not None else sums
    mean = sums["sum"] / sums["n"]
    return mean, math.sqrt(max(sums["squares"] / sums["n"] - mean**2, 0.0))


def batch_advantages(rewards: torch.Tensor, total=None, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++'s advantages: the rewards normalised by the mean and std of the whole step's rewards; `total` sums
    a dict of floats over the ranks (None: this batch is the step).

    >>> [round(a, 4) for a in batch_advantages(torch.tensor([1., 0., 0., 1.])).tolist()]
    [1.0, -1.0, -1.0, 1.0]
    """
    mean, std = step_moments(rewards, total)
    return (rewards.float() - mean) / (std + eps)


def adapted_entropy_coef(coef: float, entropy: float, rl) -> float:
    """Skywork-OR1's adaptive entropy control (TRL's use_adaptive_entropy), after a step whose mean entropy over
    every rank was `entropy`: the coefficient up by rl.entropy_coef_delta at or below rl.entropy_target, down above,
    within rl.entropy_coef_min..max.

    >>> from tierlm.config import RLConfig
    >>> rl = RLConfig(entropy_target=0.5, entropy_coef=0.01, entropy_coef_max=0.012)
    >>> adapted_entropy_coef(0.01, 0.4, rl), adapted_entropy_coef(0.01, 0.6, rl), adapted_entropy_coef(0.003, 0.6, rl)
    (0.012, 0.005, 0.0)
    """
    if entropy <= rl.entropy_target:
        return min(coef + rl.entropy_coef_delta, rl.entropy_coef_max)
    return max(coef - rl.entropy_coef_delta, rl.entropy_coef_min)


def overlong_penalty(length: int, max_new_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to max - buffer tokens, then falling linearly to -1 at the maximum.

    >>> [overlong_penalty(n, 100, 20) for n in (80, 90, 100)]
    [0.0, -0.5, -1.0]
    """
    if not buffer or length <= max_new_tokens - buffer:
        return 0.0
    return max(-1.0, (max_new_tokens - buffer - length) / buffer)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate k3 = exp(r - p) - (r - p) - 1 (>= 0, unbiased)."""
    return KL_ESTIMATORS["k3"](logprobs, ref_logprobs)


def policy_gradient_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    clip_range: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(summed loss, trained tokens, statistics) of PPO's clipped surrogate with a symmetric `clip_range`, the
    token-level loss of `rl.loss=ppo`. `advantages`: one per row (B,) or one per token (B, T) (a critic's GAE).

    Per token: -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) with ratio = p / p_old, plus
    `kl_coef` * KL. Without `old_logprobs` the ratio is 1 with the gradient of log p: REINFORCE.
    Without `clip_range` nothing is clipped. `importance` (B, T), for samples drawn by an older policy: each
    token's policy-gradient term is weighted by it (the truncated importance ratio p_policy / p_sampler).
    `clipped_sum` counts the tokens the clip took the gradient from.
    """
    batch = {"advantages": advantages, "old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs}
    batch = {k: v for k, v in {**batch, "importance": importance}.items() if v is not None}
    total, count, stats = token_loss(logprobs, batch, mask, LossSettings(clip_range, clip_range, kl_coef))
    if clip_range is not None:
        stats["clipped_sum"] = stats["clip_low_sum"] + stats["clip_high_sum"]
    return total, count, stats


def generalized_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al., 2016) over each row's trained tokens (B, T), the row's reward arriving after its
    last one: delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next. Untrained positions
    (prompt, tool results, padding) are skipped: the next value is the next trained token's. Returns
    (advantages, returns = advantages + values), 0 off the trained tokens.

    >>> adv, ret = generalized_advantages(torch.tensor([1.0]), torch.tensor([[0.5, 0.0, 0.25]]), torch.tensor([[1, 0,
    ...     1]]), 1.0, 1.0)
    >>> adv.tolist(), ret.tolist()   # lam = 1: the reward minus each value
    ([[0.5, 0.0, 0.75]], [[1.0, 0.0, 1.0]])
    """
    advantages = torch.zeros_like(values, dtype=torch.float32)
    for row in range(values.shape[0]):
        positions = mask[row].nonzero().squeeze(1).tolist()
        next_value, running = 0.0, 0.0
        for i, t in enumerate(reversed(positions)):
            reward = float(rewards[row]) if i == 0 else 0.0
            delta = reward + gamma * next_value - float(values[row, t])
            running = delta + gamma * lam * running
            advantages[row, t], next_value = running, float(values[row, t])
    return advantages, (advantages + values.float()) * mask


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip_range: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, trained tokens) of PPO's value loss: 0.5 max((V - R)^2, (V_clipped - R)^2), V_clipped
    kept within `clip_range` of the value at sampling time (None: unclipped)."""
    mask = mask.float()
    loss = (values - returns) ** 2
    if clip_range is not None:
        clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * (loss * mask).sum(), mask.sum()


class ValueStrategy:
    """The critic's strategy: its model's one-column head is the value of each position (the state from
    which that position's label was sampled); trained on the returns with the clipped value loss."""

    def __init__(self, clip_range: float | None = 0.2):
        self.clip_range = clip_range

    def prepare_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        return dict(batch)

    def compute_loss(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return clipped_value_loss(
            logits[..., 0].float(),
            batch["old_values"],
            batch["returns"],
            batch["labels"] != IGNORE_INDEX,
            self.clip_range,
        )

    def compute_metrics(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        return {"values": logits[..., 0].float() * (batch["labels"] != IGNORE_INDEX)}


class PolicyGradientStrategy:
    """What the RL loop optimises, as a strategy: `compute_loss` for updates (the function of the `rl.loss` row of
    `tierlm.strategies.rl_losses.RL_LOSSES`), `compute_metrics` for the trainer-side log-probs of a rollout batch
    (old log-probs and the parity check), `advantages` from the rewards (the row's baseline: the group's mean,
    divided by the group's or the step's std with `normalize_std`; leave-one-out; the whole step's), and
    `token_advantages` (GAE with `gamma` and `lam`) when a critic trains beside the policy. `take_stats()` hands
    the loop the statistics of the loss calls since the last one (clip fractions, GSPO's sequence ratios)."""

    def __init__(
        self,
        loss: str = "ppo",
        settings: LossSettings | None = None,
        normalize_std: bool | str = False,
        temperature: float = 1.0,
        gamma: float = 1.0,
        lam: float = 0.95,
    ):
        self.loss, self.spec = loss, RL_LOSSES[loss]
        # what the loss averages over is its row's, whatever the settings say (`RLLoss.normalise`)
        self.settings = replace(settings or LossSettings(), normalise=self.spec.normalise)
        assert self.settings.kl_coef >= 0, f"kl_coef must be >= 0, got {self.settings.kl_coef}"
        assert 0 < gamma <= 1 and 0 <= lam <= 1, f"gamma must be in (0, 1] and lam in [0, 1], got {gamma}, {lam}"
        self.normalize_std, self.temperature, self.baseline = normalize_std, temperature, self.spec.baseline
        self.gamma, self.lam = gamma, lam
        self._stats: list[dict[str, torch.Tensor]] = []

    def advantages(self, rewards: torch.Tensor, group_size: int, total=None) -> torch.Tensor:
        """One advantage per rollout; `total` sums a dict of floats over the ranks (the "batch" baseline's)."""
        if self.baseline == "leave_one_out":
            return leave_one_out_advantages(rewards, group_size)
        if self.baseline == "batch":
            return batch_advantages(rewards, total)
        return group_advantages(rewards, group_size, self.normalize_std, total=total)

    def token_advantages(
        self, rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, total=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(whitened GAE advantages, returns) per token; whitened by the mean and (unbiased) std of the trained
        tokens' advantages over the whole step: `total` sums a dict of floats over the ranks (None: this batch).

        >>> ppo = PPOStrategy(lam=1.0)
        >>> adv, _ = ppo.token_advantages(torch.tensor([1.0, 0.0]), torch.zeros(2, 2), torch.ones(2, 2))
        >>> [round(a, 4) for a in adv.flatten().tolist()]
        [0.866, 0.866, -0.866, -0.866]
        """
        advantages, returns = generalized_advantages(rewards, values, mask, self.gamma, self.lam)
        trained = mask.bool()
        picked = advantages[trained].double()
        sums = {"n": float(trained.sum()), "sum": float(picked.sum()), "squares": float((picked**2).sum())}
        sums = total(sums) if total is not None else sums
        if sums["n"] > 1:
            mean = sums["sum"] / sums["n"]
            std = math.sqrt(max(sums["squares"] - sums["n"] * mean**2, 0.0) / (sums["n"] - 1))
            advantages = torch.where(trained, (advantages - mean) / (std + 1e-8), torch.zeros_like(advantages))
        return advantages, returns

    def prepare_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        return dict(batch)

    @splits_by_rows(1)  # every loss of `rl_losses` sums over rows (its normaliser too)
    def compute_loss(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        labels = batch["labels"]
        share, coef = self.settings.top_entropy_quantile, self.settings.entropy_coef
        measured = bool(coef) or self.settings.measure_entropy
        # The policy's entropy per token, once: what picks the tokens trained and what the bonus raises (its gradient
        # kept only for the bonus).
        entropy = None
        if share < 1 or measured:
            entropy = token_entropy(logits if coef else logits.detach(), self.temperature)
        if share < 1:  # the high-entropy tokens alone carry the loss
            batch = {**batch, "token_keep": high_entropy_tokens(entropy, labels != IGNORE_INDEX, share)}
        if self.spec.vocab:  # the whole vocabulary's log-probs (distill_topk)
            inputs = vocab_logprobs(logits, self.temperature)
        else:
            inputs = token_logprobs(logits, labels, self.temperature)
        total, count, stats = self.spec.fn(inputs, batch, labels != IGNORE_INDEX, self.settings)
        if measured:  # the bonus: the mean entropy over the tokens the loss trains
            trained = (labels != IGNORE_INDEX).float() * batch.get("token_keep", 1.0)
            if coef:
                total = total - coef * (entropy * trained).sum() / trained.sum().clamp(min=1) * count
            stats = {**stats, "entropy_sum": (entropy.detach() * trained).sum(), "entropy_n_sum": trained.sum()}
        self._stats.append({k: v.detach() for k, v in stats.items()})
        return total, count

    # -- the JAX backend's twins (tierlm.primitives.jax_losses.jax_twin), tested equal to the methods above --------
    def jax_compute_loss(self, logits, batch):
        from tierlm.primitives.jax_losses import IGNORE_INDEX as IGNORE
        from tierlm.primitives.jax_losses import token_logprobs as jax_token_logprobs
        from tierlm.strategies import rl_losses_jax

        assert self.spec.jax is not None, f"rl.loss={self.loss} has no JAX twin (refused when the run is resolved)"
        labels = batch["labels"]
        logprobs = jax_token_logprobs(logits, labels, self.temperature)
        twin = getattr(rl_losses_jax, self.spec.jax)
        return twin(logprobs, batch, (labels != IGNORE).astype(logprobs.dtype), self.settings)

    def jax_compute_metrics(self, logits, batch):
        from tierlm.primitives.jax_losses import token_logprobs as jax_token_logprobs

        return {"logprobs": jax_token_logprobs(logits, batch["labels"], self.temperature)}

    def take_stats(self) -> dict[str, float]:
        """The summed statistics of the loss calls since the last take (this rank's)."""
        sums: dict[str, float] = {}
        for stats in self._stats:
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        self._stats = []
        return sums

    def compute_metrics(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        return {"logprobs": token_logprobs(logits, batch["labels"], self.temperature)}


class ReinforceStrategy(PolicyGradientStrategy):
    """nanochat's simplified GRPO: on-policy, advantage = reward - group mean, no clipping (and by default no KL)."""

    def __init__(self, temperature: float = 1.0, kl_coef: float = 0.0):
        super().__init__("reinforce", LossSettings(None, None, kl_coef), temperature=temperature)


class GRPOStrategy(PolicyGradientStrategy):
    """GRPO: group-relative advantages divided by the group's std, the clipped ratio, each sequence's token mean,
    optional KL."""

    def __init__(
        self, clip_range: float = 0.2, kl_coef: float = 0.0, normalize_std: bool = True, temperature: float = 1.0
    ):
        super().__init__("grpo", LossSettings(clip_range, clip_range, kl_coef), normalize_std, temperature)


class PPOStrategy(PolicyGradientStrategy):
    """PPO: clipping over stored old log-probs for several inner epochs, KL to a frozen reference.

    Critic-free by default (the baseline is the group mean, as in GRPO). With a critic the RL loop trains a value
    model beside the policy (`tierlm.loops.critic`): per-token advantages by GAE (`gamma`, `lam`), whitened over
    the batch (`token_advantages`).
    """

    def __init__(
        self,
        kl_coef: float = 0.1,
        clip_range: float = 0.2,
        normalize_std: bool = False,
        temperature: float = 1.0,
        gamma: float = 1.0,
        lam: float = 0.95,
    ):
        super().__init__("ppo", LossSettings(clip_range, clip_range, kl_coef), normalize_std, temperature, gamma, lam)


def policy_gradient_strategy(rl) -> PolicyGradientStrategy:
    """The strategy of a resolved `rl` section (`tierlm.strategies.rl_losses.resolve_rl`): its loss's row, the clip
    bounds, std division and GAE settings the resolution filled in.

    >>> from tierlm.config import RLConfig
    >>> from tierlm.strategies.rl_losses import resolve_rl
    >>> s = policy_gradient_strategy(resolve_rl(RLConfig(loss="dapo")))
    >>> s.loss, s.baseline, s.normalize_std, s.settings.clip_low, s.settings.clip_high
    ('dapo', 'group', True, 0.2, 0.28)
    """
    assert rl.normalize_std is not None, "the rl section is resolved first (tierlm.strategies.rl_losses.resolve_rl)"
    return PolicyGradientStrategy(
        rl.loss, loss_settings(rl), rl.normalize_std, rl.temperature, rl.gae_gamma, rl.gae_lambda
    )

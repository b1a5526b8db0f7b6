"""The parts the policy-gradient losses of `tierlm.strategies.rl_losses` share, each written once: what a loss
reads from the rl section (`LossSettings`), the ratio to the sampling policy, PPO's clipped surrogate and its clip
statistics, the KL penalty and its estimators, and the normalisations (what a loss averages over: see
`tierlm.strategies.rl_losses`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

Batch = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class LossSettings:
    """What a loss reads from the rl section (clip bounds resolved: see `resolve_rl`)."""

    clip_low: float | None = 0.2  # the ratio's lower bound is 1 - clip_low (None: not clipped)
    clip_high: float | None = 0.2  # its upper bound 1 + clip_high (None: not clipped)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # the penalty's per-token estimate of KL(policy || reference): KL_ESTIMATORS
    unbiased_kl: bool = False  # the penalty times the loss's importance ratio to the sampling policy (DeepSeek-V3.2)
    max_new_tokens: int = 32  # Dr. GRPO's constant normaliser per row
    normalise: str = "tokens"  # what the loss averages over: tokens, sequences, rows or constant
    off_policy_mask: float | None = None  # DeepSeek-V3.2's sequence mask: the KL past which a negative sequence drops
    top_entropy_quantile: float = 1.0  # the share of a micro-batch's tokens trained, those of highest entropy
    ratio_cap: float | None = None  # INTELLECT-2's two-sided clip: the ratio's cap before PPO's clipped surrogate
    entropy_coef: float = 0.0  # the entropy bonus's weight, on the micro-batch's mean token entropy
    measure_entropy: bool = False  # the entropy's statistics without a bonus too (adaptive control reads them)
    sapo_temperatures: tuple[float, float] = (1.0, 1.05)  # SAPO's gate temperatures for A > 0 and A <= 0
    vespo_shape: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)  # VESPO's k, lambda for A >= 0, then A < 0


def per_token(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Row values (B,) spread over the row's tokens (B, T); per-token values (B, T) as they are."""
    return values.float() if values.dim() == 2 else values.float()[:, None].expand_as(like)


def ratio_to_old(logprobs: torch.Tensor, batch: Batch) -> torch.Tensor:
    """p / p_old per token; 1 on-policy (old = the current log-probs, detached: the gradient of log p remains)."""
    old = batch.get("old_logprobs")
    return torch.exp(logprobs - (logprobs.detach() if old is None else old))


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float | None, high: float | None, cap: float | None = None
) -> torch.Tensor:
    """PPO's pessimistic surrogate, per element: -min(r A, clip(r, 1 - low, 1 + high) A), with r capped at `cap` in
    the first term (INTELLECT-2's two-sided clipping: a negative advantage's loss is bounded too)."""
    unclipped = (ratio.clamp(max=cap) if cap is not None else ratio) * advantages
    if low is None and high is None:
        return -unclipped
    lower = None if low is None else 1.0 - low
    upper = None if high is None else 1.0 + high
    return -torch.minimum(unclipped, torch.clamp(ratio, lower, upper) * advantages)


def clip_statistics(ratio, advantages, mask, low, high) -> dict[str, torch.Tensor]:
    """Summed counts of tokens (or rows) whose gradient the lower / upper clip removes, and of those looked at."""
    mask = mask.float()
    below = (ratio < 1.0 - low) & (advantages < 0) if low is not None else torch.zeros_like(mask, dtype=torch.bool)
    above = (ratio > 1.0 + high) & (advantages > 0) if high is not None else torch.zeros_like(mask, dtype=torch.bool)
    return {
        "clip_low_sum": (below.float() * mask).sum(),
        "clip_high_sum": (above.float() * mask).sum(),
        "clip_n_sum": mask.sum(),
    }


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": lambda logprobs, ref: logprobs - ref,
    "k2": lambda logprobs, ref: 0.5 * (logprobs - ref) ** 2,
    "k3": lambda logprobs, ref: (ref - logprobs).exp() - (ref - logprobs) - 1.0,
}
"""rl.kl_estimator -> the per-token estimate of KL(policy || reference) from the sampled tokens' log-probs (Schulman,
2020: k1 = log p/ref, k2 = (log p/ref)^2 / 2, k3 = ref/p - 1 - log ref/p). As a loss on on-policy samples their
gradients differ: k1's is 0 in expectation, k2's is the reverse KL's, k3's is KL(reference || policy)'s
(`tests/test_rl_losses.py` checks each against the exact gradients)."""


def kl_term(
    logprobs: torch.Tensor, batch: Batch, mask: torch.Tensor, s: LossSettings, ratio: torch.Tensor | None = None
) -> tuple[torch.Tensor | float, dict]:
    """`s.kl_coef` x the `s.kl_estimator` estimate of KL(policy || reference) per token (0 without a reference), and
    the summed KL (k3's, whichever estimator the penalty uses: unbiased, never negative). With `s.unbiased_kl`, the
    penalty is weighted by the loss's `ratio` to the sampling policy (per token (B, T), or per sequence (B,)), with
    its gradient: DeepSeek-V3.2's unbiased KL estimate, whose gradient is the reverse KL's even off-policy (on-policy
    the ratio is 1 and adds k x grad log p)."""
    ref = batch.get("ref_logprobs")
    if ref is None or not s.kl_coef:
        return 0.0, {}
    kl = KL_ESTIMATORS["k3"](logprobs.detach(), ref)
    penalty = s.kl_coef * KL_ESTIMATORS[s.kl_estimator](logprobs, ref)
    if s.unbiased_kl:
        assert ratio is not None, "the unbiased KL estimate weights the penalty by the loss's importance ratio"
        penalty = penalty * per_token(ratio, logprobs)
    return penalty, {"kl_sum": (kl * mask.float()).sum()}


def normalise(per_tok: torch.Tensor, mask: torch.Tensor, how: str, max_new_tokens: int = 0):
    """(summed loss, normaliser) of per-token losses: see the module's docstring."""
    mask = mask.float()
    masked = per_tok * mask
    rows = (mask.sum(dim=1) > 0).float()
    if how == "tokens":
        return masked.sum(), mask.sum()
    if how == "sequences":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum(), rows.sum()
    if how == "rows":
        return masked.sum(), rows.sum()
    assert how == "constant", f"unknown normalisation {how!r}"
    return masked.sum(), rows.sum() * max_new_tokens

"""The policy-gradient losses `rl.loss` names, each one small function over the same inputs, with its reference.

Every loss takes the trainer's log-probs of the sampled tokens `logprobs` (B, T), the rollout batch (its
`advantages`, one per row; `old_logprobs`, the log-probs before this update, absent on-policy; `ref_logprobs` for
a KL penalty; `importance`, off-policy weights) and the trained-token `mask`, and returns (summed loss, normaliser,
statistics). The backend divides the step's summed loss by its summed normaliser over every micro-batch and rank,
so the normaliser decides what the loss averages over:

- `tokens`: every trained token of the step alike (DAPO's token-level loss);
- `sequences`: each row's mean over its tokens, then the mean over rows (GRPO as published);
- `constant`: the sum over tokens / (rows x rl.max_new_tokens), no length normalisation (Dr. GRPO).

The shared parts are here once: the ratio, the clipped surrogate, the KL term, the normalisation, the clip
statistics. The advantages (group baselines, leave-one-out, the whole batch's) are in `tierlm.strategies.rl`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

Batch = Mapping[str, torch.Tensor]
Result = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class LossSettings:
    """What a loss reads from the rl section (clip bounds resolved: see `tierlm.strategies.rl.CLIP_DEFAULTS`)."""

    clip_low: float | None = 0.2  # the ratio's lower bound is 1 - clip_low (None: not clipped)
    clip_high: float | None = 0.2  # its upper bound 1 + clip_high (None: not clipped)
    kl_coef: float = 0.0
    max_new_tokens: int = 32  # Dr. GRPO's constant normaliser per row


# -- the shared parts ---------------------------------------------------------------------------
def per_token(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Row values (B,) spread over the row's tokens (B, T); per-token values (B, T) as they are."""
    return values.float() if values.dim() == 2 else values.float()[:, None].expand_as(like)


def ratio_to_old(logprobs: torch.Tensor, batch: Batch) -> torch.Tensor:
    """p / p_old per token; 1 on-policy (old = the current log-probs, detached: the gradient of log p remains)."""
    old = batch.get("old_logprobs")
    return torch.exp(logprobs - (logprobs.detach() if old is None else old))


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float | None, high: float | None
) -> torch.Tensor:
    """PPO's pessimistic surrogate, per element: -min(r A, clip(r, 1 - low, 1 + high) A)."""
    unclipped = ratio * advantages
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


def kl_term(logprobs: torch.Tensor, batch: Batch, mask: torch.Tensor, coef: float) -> tuple[torch.Tensor | float, dict]:
    """`coef` x the k3 estimate of KL(policy || reference) per token (0 without a reference), and its summed KL."""
    ref = batch.get("ref_logprobs")
    if ref is None or not coef:
        return 0.0, {}
    delta = ref - logprobs
    kl = delta.exp() - delta - 1.0
    return coef * kl, {"kl_sum": (kl.detach() * mask.float()).sum()}


def normalise(per_tok: torch.Tensor, mask: torch.Tensor, how: str, max_new_tokens: int = 0):
    """(summed loss, normaliser) of per-token losses: see the module's docstring."""
    mask = mask.float()
    masked = per_tok * mask
    rows = (mask.sum(dim=1) > 0).float()
    if how == "tokens":
        return masked.sum(), mask.sum()
    if how == "sequences":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum(), rows.sum()
    assert how == "constant", f"unknown normalisation {how!r}"
    return masked.sum(), rows.sum() * max_new_tokens


def _token_loss(logprobs, batch, mask, settings, how, low, high) -> Result:
    """The clipped token-level surrogate (+ KL), weighted by off-policy importance, normalised `how`."""
    ratio = ratio_to_old(logprobs, batch)
    adv = per_token(batch["advantages"], logprobs)
    loss = clipped_surrogate(ratio, adv, low, high)
    if batch.get("importance") is not None:
        loss = loss * batch["importance"]
    kl, stats = kl_term(logprobs, batch, mask, settings.kl_coef)
    total, count = normalise(loss + kl, mask, how, settings.max_new_tokens)
    return total, count, {**stats, **clip_statistics(ratio.detach(), adv, mask, low, high)}


# -- the losses ---------------------------------------------------------------------------------
def reinforce(logprobs, batch, mask, s: LossSettings) -> Result:
    """REINFORCE with a group-mean baseline, nanochat's simplified GRPO: -A log p per token, the step's token mean."""
    return _token_loss(logprobs, batch, mask, s, "tokens", None, None)


def grpo(logprobs, batch, mask, s: LossSettings) -> Result:
    """GRPO (Shao et al., 2024, DeepSeekMath): the clipped surrogate with eps = rl.clip_range, averaged over each
    sequence's tokens, then over the sequences; advantages are the group-normalised rewards."""
    return _token_loss(logprobs, batch, mask, s, "sequences", s.clip_low, s.clip_high)


def dapo(logprobs, batch, mask, s: LossSettings) -> Result:
    """DAPO (Yu et al., 2025): decoupled clip 1 - rl.clip_low .. 1 + rl.clip_high (0.2 / 0.28), the token-level mean
    over the whole step; dynamic sampling and overlong shaping happen in the RL loop."""
    return _token_loss(logprobs, batch, mask, s, "tokens", s.clip_low, s.clip_high)


def dr_grpo(logprobs, batch, mask, s: LossSettings) -> Result:
    """Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-like training"): GRPO without the per-group std division
    (in the advantages) and without per-sequence length normalisation: the sum over tokens / (rows x max tokens)."""
    return _token_loss(logprobs, batch, mask, s, "constant", s.clip_low, s.clip_high)


def ppo(logprobs, batch, mask, s: LossSettings) -> Result:
    """PPO's clipped surrogate (Schulman et al., 2017) over stored old log-probs, the token-level mean; with a critic
    the advantages are per-token GAE."""
    return _token_loss(logprobs, batch, mask, s, "tokens", s.clip_low, s.clip_high)


def rloo(logprobs, batch, mask, s: LossSettings) -> Result:
    """RLOO (Ahmadian et al., 2024): REINFORCE with each sample's baseline the mean reward of the other samples of its
    prompt (leave-one-out advantages), clipped like PPO, the token-level mean."""
    return _token_loss(logprobs, batch, mask, s, "tokens", s.clip_low, s.clip_high)


def reinforce_pp(logprobs, batch, mask, s: LossSettings) -> Result:
    """REINFORCE++ (Hu, 2025): no group baseline; the rewards normalised over the whole batch (every rank's) are the
    advantages, with PPO's clip and the token-level mean."""
    return _token_loss(logprobs, batch, mask, s, "tokens", s.clip_low, s.clip_high)


def distill(logprobs, batch, mask, s: LossSettings) -> Result:
    """On-policy distillation (Agarwal et al., 2024, GKD; Lu & Thinking Machines, 2025): the student samples, the
    teacher scores every sampled token, and each token's advantage is log p_teacher - log p_student (the negative
    per-token reverse KL, set by the RL loop); REINFORCE over them, the token-level mean. No verifier is needed."""
    return _token_loss(logprobs, batch, mask, s, "tokens", None, None)


def cispo(logprobs, batch, mask, s: LossSettings) -> Result:
    """CISPO (MiniMax-M1, 2025): every token keeps its gradient; the importance ratio is clipped from above at
    1 + rl.clip_high and detached, weighting -A log p; the token-level mean."""
    ratio = ratio_to_old(logprobs, batch).detach()
    weight = ratio.clamp(max=1.0 + s.clip_high) if s.clip_high is not None else ratio
    adv = per_token(batch["advantages"], logprobs)
    loss = -weight * adv * logprobs
    if batch.get("importance") is not None:
        loss = loss * batch["importance"]
    kl, stats = kl_term(logprobs, batch, mask, s.kl_coef)
    total, count = normalise(loss + kl, mask, "tokens")
    return total, count, {**stats, **clip_statistics(ratio, adv, mask, None, s.clip_high)}


def gspo(logprobs, batch, mask, s: LossSettings) -> Result:
    """GSPO (Zheng et al., 2025): one importance ratio per sequence, the geometric mean of its tokens' ratios
    s = exp(mean_t(log p - log p_old)), clipped to 1 - rl.clip_low .. 1 + rl.clip_high (3e-4 / 4e-4):
    -min(s A, clip(s) A) per sequence, averaged over the sequences."""
    maskf = mask.float()
    lengths = maskf.sum(dim=1).clamp(min=1)
    old = batch.get("old_logprobs")
    delta = (logprobs - (logprobs.detach() if old is None else old)) * maskf
    seq_ratio = torch.exp(delta.sum(dim=1) / lengths)
    adv = batch["advantages"].float()
    assert adv.dim() == 1, "GSPO takes one advantage per sequence"
    loss = clipped_surrogate(seq_ratio, adv, s.clip_low, s.clip_high)
    if batch.get("importance") is not None:
        loss = loss * (batch["importance"] * maskf).sum(dim=1) / lengths
    kl, stats = kl_term(logprobs, batch, maskf, s.kl_coef)
    if torch.is_tensor(kl):
        loss = loss + (kl * maskf).sum(dim=1) / lengths
    rows = (maskf.sum(dim=1) > 0).float()
    clip = clip_statistics(seq_ratio.detach(), adv, rows, s.clip_low, s.clip_high)
    stats = {**stats, **clip, "seq_ratio_sum": (seq_ratio.detach() * rows).sum(), "rows_sum": rows.sum()}
    return (loss * rows).sum(), rows.sum(), stats


LOSSES: dict[str, Callable[..., Result]] = {
    "reinforce": reinforce,
    "grpo": grpo,
    "dapo": dapo,
    "dr_grpo": dr_grpo,
    "gspo": gspo,
    "cispo": cispo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "ppo": ppo,
    "distill": distill,
}
"""rl.loss -> its function: the one place a policy-gradient loss is named."""

"""The off-policy corrections every RL loss applies alike (`tierlm.strategies.rl_losses`): the importance weights of
samples drawn by another policy than the trainer's (older weights under rl.max_off_policy_steps, or a sampler whose
arithmetic differs, as vLLM's in bf16), made once per step from the sampler's log-probs as `rl.importance` says,
and DeepSeek-V3.2's off-policy sequence mask (`rl.off_policy_mask`)."""

from __future__ import annotations

import math
from typing import Mapping

import torch

Batch = Mapping[str, torch.Tensor]


IMPORTANCE_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""rl.importance: how the trainer's p / the sampler's p of each sampled token corrects the loss."""


def importance_weights(
    old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, mode: str, floor: float | None, cap: float | None
) -> torch.Tensor:
    """The weights (B, T) that correct samples drawn by another policy than the trainer's (older weights, or a sampler
    whose arithmetic differs): r = p_trainer / p_sampler per token (`token_*`) or its product over the row's trained
    tokens (`sequence_*`, one weight per row: (B, 1)), then truncated into [floor, cap] (`*_truncate`, TIS) or set
    to 0 outside it (`*_mask`; per token this is IcePop's calibration, per sequence MIS). A token the sampler could
    not score (NaN) counts as r = 1. TRL's vLLM importance-sampling modes are the same four.

    >>> old, sampler = torch.tensor([[0.5, 0.2]]).log(), torch.tensor([[0.25, 0.4]]).log()
    >>> mask = torch.ones(1, 2)
    >>> [round(w, 3) for w in importance_weights(old, sampler, mask, "token_truncate", None, 1.5)[0].tolist()]
    [1.5, 0.5]
    >>> importance_weights(old, sampler, mask, "token_mask", 0.6, 3.0)[0].tolist()
    [2.0, 0.0]
    >>> importance_weights(old, sampler, mask, "sequence_truncate", None, 3.0).round(decimals=4).tolist()  # 2 x 0.5
    [[1.0]]
    """
    assert mode in IMPORTANCE_MODES[1:], f"unknown importance mode {mode!r}"
    diff = torch.nan_to_num((old - sampler) * mask.float(), nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=1, keepdim=True)
    ratio = diff.exp()
    if mode.endswith("truncate"):
        ratio = ratio.clamp(min=floor, max=cap) if (floor, cap) != (None, None) else ratio
    else:
        low, high = floor if floor is not None else -math.inf, cap if cap is not None else math.inf
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    return ratio


def off_policy_weight(logprobs: torch.Tensor, batch: Batch, mask: torch.Tensor, delta: float | None):
    """What multiplies each token's loss besides the loss's own ratio: the importance weights (`batch["importance"]`,
    `importance_weights`) times, with rl.off_policy_mask = `delta`, DeepSeek-V3.2's off-policy sequence mask (a row
    with a negative advantage whose mean KL(sampler || policy), log p_sampler - log p per trained token, exceeds
    `delta` trains nothing; as TRL's `off_policy_mask_threshold`), times the tokens rl.top_entropy_quantile keeps
    (`batch["token_keep"]`). None when none applies."""
    weight, keep_tokens = batch.get("importance"), batch.get("token_keep")
    if keep_tokens is not None:
        weight = keep_tokens if weight is None else weight * keep_tokens
    if delta is None:
        return weight
    maskf = mask.float()
    sampler = batch.get("sampler_logprobs", batch.get("old_logprobs"))
    sampler = logprobs.detach() if sampler is None else sampler
    kl = torch.nan_to_num(sampler - logprobs.detach(), nan=0.0) * maskf
    mean_kl = kl.sum(dim=1, keepdim=True) / maskf.sum(dim=1, keepdim=True).clamp(min=1)
    adv = batch["advantages"].float()
    adv = adv[:, None] if adv.dim() == 1 else adv
    keep = ((adv >= 0) | (mean_kl <= delta)).float().expand_as(logprobs)
    return keep if weight is None else weight * keep


def importance_mode(rl) -> str:
    """rl.importance, or its default: token_truncate when sampling runs ahead of training or a rollout goes on
    across steps (partial rollouts), else none."""
    ahead = rl.max_off_policy_steps or rl.partial_rollouts
    return rl.importance or ("token_truncate" if ahead else "none")


def high_entropy_tokens(entropy: torch.Tensor, mask: torch.Tensor, share: float) -> torch.Tensor:
    """The trained tokens (`mask`) whose `entropy` (B, T) is at or above the (1 - `share`) quantile of theirs, as float
    0/1 (B, T): rl.top_entropy_quantile's tokens (Wang et al., 2025; TRL's `get_high_entropy_mask`, over this rank's
    micro-batch).

    >>> from tierlm.primitives.losses import token_entropy
    >>> logits = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.99, 0.01], [0.6, 0.4]]]))
    >>> high_entropy_tokens(token_entropy(logits), torch.tensor([[True, True, False, True]]), share=0.5)
    tensor([[1., 0., 0., 1.]])
    """
    entropy = entropy.detach()
    if not mask.any():
        return torch.zeros_like(entropy)
    threshold = torch.quantile(entropy[mask], 1.0 - share)
    return ((entropy >= threshold) & mask).float()

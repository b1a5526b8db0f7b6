"""Tier 1: token-level losses as pure functions.

Convention used everywhere in tierlm: `labels[b, t]` is the target for the logits at position
`t` (already shifted, as nanoGPT/nanochat "targets"); -100 marks a position that is not trained.
An optional `loss_mask` (0/1 or weights) multiplies the per-token loss.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


def get_labels(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The batch's `labels`, or its `targets` (the nanoGPT name) when there are no labels."""
    if "labels" in batch:
        return batch["labels"]
    assert "targets" in batch, f"batch needs 'labels' or 'targets', has {sorted(batch)}"
    return batch["targets"]


def token_weights(labels: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token weight (B, T) in fp32: 0 where the label is ignored, else `loss_mask` (or 1)."""
    weights = (labels != IGNORE_INDEX).float()
    if loss_mask is not None:
        weights = weights * loss_mask.float()
    return weights


def count_loss_tokens(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Number of trained tokens in a batch (a 0-dim fp32 tensor, no host sync).

    >>> count_loss_tokens({"labels": torch.tensor([[1, -100, 3]]), "loss_mask": torch.tensor([[1, 1, 0]])})
    tensor(1.)
    """
    return token_weights(get_labels(batch), batch.get("loss_mask")).sum()


def per_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position (B, T) in fp32; 0 where the label is -100."""
    vocab_size = logits.shape[-1]
    losses = F.cross_entropy(
        logits.float().reshape(-1, vocab_size), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return losses.view(labels.shape)


def cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy over trained tokens, and how many tokens were trained.

    The caller divides by the token count of the whole optimizer step (all micro-batches, all
    ranks); dividing per micro-batch would weight short micro-batches too much.

    >>> logits = torch.zeros(1, 2, 4)  # uniform over 4 classes: loss ln(4) per token
    >>> total, n = cross_entropy_sum(logits, torch.tensor([[0, -100]]))
    >>> round(total.item(), 4), n.item()
    (1.3863, 1.0)
    """
    weights = token_weights(labels, loss_mask)
    return (per_token_cross_entropy(logits, labels) * weights).sum(), weights.sum()


def create_cross_entropy_loss() -> LossFn:
    """A `loss_fn(logits, batch) -> scalar`: mean cross-entropy over the batch's trained tokens.

    `batch["labels"]` (or `targets`) uses -100 for ignored positions; an optional
    `batch["loss_mask"]` weights tokens. The backend re-weights each micro-batch by its token
    count, so accumulation is normalised by the tokens of the whole optimizer step.

    >>> loss_fn = create_cross_entropy_loss()
    >>> logits = torch.randn(2, 10, 100)  # (B, T, V)
    >>> batch = {"labels": torch.randint(0, 100, (2, 10)), "loss_mask": torch.ones(2, 10)}
    >>> loss = loss_fn(logits, batch)
    >>> loss.item() > 0
    True
    """

    def cross_entropy_loss(logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        total, num_tokens = cross_entropy_sum(logits, get_labels(batch), batch.get("loss_mask"))
        return total / num_tokens.clamp(min=1.0)

    return cross_entropy_loss

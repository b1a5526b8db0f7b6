"""Supervised fine-tuning: learn the assistant's tokens only, with the loss `training.sft_loss` names (a row of
`SFT_LOSSES`)."""

from __future__ import annotations

import torch

from tierlm.primitives.losses import get_labels, per_token_cross_entropy, splits_by_rows, token_weights
from tierlm.strategies.base import Batch, CrossEntropyStrategy


class SFTStrategy(CrossEntropyStrategy):
    """Labels are the next tokens where the loader's mask says "train", -100 elsewhere.

    The mask comes from the chat rendering: assistant content and its end-of-turn token are
    trained; system, user, tool and padding tokens are not.

    >>> batch = SFTStrategy().prepare_batch({"tokens": torch.tensor([[5, 6, 7, 8]]), "mask": torch.tensor([[0, 0, 1,
    ...     1]])})
    >>> batch["labels"]
    tensor([[-100,    7,    8]])
    """

    def prepare_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        assert "input_ids" in batch or "mask" in batch, "SFT batches need the loader's loss mask"
        return super().prepare_batch(batch)


class DFTStrategy(SFTStrategy):
    """Dynamic Fine-Tuning (Wu et al., 2025, "On the Generalization of SFT: A Reinforcement Learning Perspective
    with Reward Rectification"; TRL's `SFTConfig(loss_type="dft")`): each trained token's cross-entropy weighed by
    the probability the model gives it, the weight held out of the gradient, sum_t sg(p_t) * -log p_t. The
    gradient is SFT's scaled by p_t: tokens the model finds unlikely move it less, which the paper reads as SFT's
    implicit reward 1/p rectified. It reads the logits of every trained token (no fused LM head); the held-out loss
    is the plain cross-entropy, comparable with SFT's.

    >>> logits = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1]]]))  # p = 0.5, then 0.1 for label 1
    >>> total, count = DFTStrategy().compute_loss(logits, {"labels": torch.tensor([[1, 1]])})
    >>> round(total.item(), 4), count.item()  # 0.5 ln 2 + 0.1 ln 10
    (0.5768, 2.0)
    """

    @splits_by_rows()
    def compute_loss(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        labels = get_labels(batch)
        weights = token_weights(labels, batch.get("loss_mask"))
        losses = per_token_cross_entropy(logits, labels)
        return (losses * torch.exp(-losses).detach() * weights).sum(), weights.sum()

    def jax_compute_loss(self, logits, batch):
        import jax
        import jax.numpy as jnp

        from tierlm.primitives.jax_losses import per_token_cross_entropy as jax_per_token_cross_entropy
        from tierlm.primitives.jax_losses import token_weights as jax_token_weights

        labels = get_labels(batch)
        weights = jax_token_weights(labels, batch.get("loss_mask"))
        losses = jax_per_token_cross_entropy(logits, labels)
        return (losses * jax.lax.stop_gradient(jnp.exp(-losses)) * weights).sum(), weights.sum()


SFT_LOSSES = {"nll": SFTStrategy, "dft": DFTStrategy}
"""training.sft_loss -> the strategy that trains it: nll, the token cross-entropy (its LM head fused into the loss
where the model allows); dft, Dynamic Fine-Tuning."""

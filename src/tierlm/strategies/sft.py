"""Supervised fine-tuning: learn the assistant's tokens only."""

from __future__ import annotations

import torch

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

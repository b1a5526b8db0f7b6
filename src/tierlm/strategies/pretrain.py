"""Pretraining: predict every next token."""

from __future__ import annotations

import torch

from tierlm.strategies.base import Batch, CrossEntropyStrategy


class PretrainStrategy(CrossEntropyStrategy):
    """Rows of T+1 tokens become inputs (first T) and labels (last T).

    >>> PretrainStrategy().prepare_batch({"tokens": torch.tensor([[1, 2, 3, 4]])})
    {'input_ids': tensor([[1, 2, 3]]), 'labels': tensor([[2, 3, 4]])}
    """

    def prepare_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        if "input_ids" in batch:
            return dict(batch)
        tokens = batch["tokens"]  # (B, T+1)
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

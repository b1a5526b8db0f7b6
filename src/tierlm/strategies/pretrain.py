"""Pretraining: predict every next token."""

from __future__ import annotations

from tierlm.strategies.base import CrossEntropyStrategy


class PretrainStrategy(CrossEntropyStrategy):
    """Rows of T+1 tokens become inputs (first T) and labels (last T).

    >>> import torch
    >>> PretrainStrategy().prepare_batch({"tokens": torch.tensor([[1, 2, 3, 4]])})
    {'input_ids': tensor([[1, 2, 3]]), 'labels': tensor([[2, 3, 4]])}
    """

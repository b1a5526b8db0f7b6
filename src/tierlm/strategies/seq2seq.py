"""Encoder–decoder pretraining (UL2): cross-entropy of the decoder's targets given the encoder's input."""

from __future__ import annotations

from tierlm.strategies.base import CrossEntropyStrategy


class Seq2SeqStrategy(CrossEntropyStrategy):
    """Batches come ready from `UL2DataCollator` (`input_ids`, `decoder_input_ids`, `labels`, segment ids
    and positions); the loss is the decoder's next-token cross-entropy on the labelled positions, and
    evaluation reports it with bits per byte over the target tokens that carry text (sentinels carry none).

    >>> import torch
    >>> batch = {"input_ids": torch.tensor([[5, 6]]), "decoder_input_ids": torch.tensor([[0, 7]]),
    ...     "labels": torch.tensor([[7, 2]])}
    >>> sorted(Seq2SeqStrategy().prepare_batch(batch))
    ['decoder_input_ids', 'input_ids', 'labels']
    """

"""What is optimised: a strategy turns loader batches into model batches and defines the loss."""

from __future__ import annotations

import math
from typing import Mapping, Protocol, runtime_checkable

import torch

from tierlm.primitives.losses import cross_entropy_sum, get_labels, per_token_cross_entropy, token_weights

Batch = Mapping[str, torch.Tensor]


@runtime_checkable
class TrainingStrategy(Protocol):
    def prepare_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Loader batch -> model batch (`input_ids`, `labels`, ...)."""
        ...

    def compute_loss(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, number of loss units); the backend normalises over the whole step."""
        ...

    def compute_metrics(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """Summable eval statistics of one batch (sums and counts, never means)."""
        ...


class CrossEntropyStrategy:
    """Next-token cross-entropy on the labelled positions, with bits-per-byte in eval.

    `token_bytes` (V,) gives each token's UTF-8 length (0 for special tokens); with it the eval
    reports bits per byte, a tokenizer-independent measure, over tokens that carry bytes.
    """

    def __init__(self, token_bytes: torch.Tensor | None = None):
        self.token_bytes = token_bytes

    def prepare_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def compute_loss(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return cross_entropy_sum(logits, get_labels(batch), batch.get("loss_mask"))

    def compute_metrics(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        labels = get_labels(batch)
        weights = token_weights(labels, batch.get("loss_mask"))  # (B, T)
        losses = per_token_cross_entropy(logits, labels)  # (B, T) nats
        metrics = {"loss_sum": (losses * weights).sum(), "num_tokens": weights.sum()}
        if self.token_bytes is not None:
            nbytes = self.token_bytes.to(labels.device)[labels.clamp(min=0)].float() * weights
            metrics["bpb_nats"] = (losses * (nbytes > 0)).sum()
            metrics["num_bytes"] = nbytes.sum()
        return metrics

    @staticmethod
    def summarize(totals: Mapping[str, float]) -> dict[str, float]:
        """Eval line values from summed `compute_metrics` outputs.

        >>> out = CrossEntropyStrategy.summarize({"loss_sum": 6.0, "num_tokens": 3.0, "bpb_nats": 6.0, "num_bytes": 4.0})
        >>> out["val_loss"], round(out["val_bpb"], 4)  # 6 nats over 4 bytes = 1.5 / ln 2 bits per byte
        (2.0, 2.164)
        """
        out = {"val_loss": totals["loss_sum"] / max(totals["num_tokens"], 1.0)}
        if totals.get("num_bytes"):
            out["val_bpb"] = totals["bpb_nats"] / (math.log(2) * totals["num_bytes"])
        return out

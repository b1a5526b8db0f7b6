"""GPT-2 research variant: causal KV pruning (V14, V15, V17-V19 of the V-series).

Each query attends only to the keys that matter most among those it may see. How it stays causal:
the importance of key j *for query i* is the attention mass key j received from the queries j..i
(a cumulative sum down the causal attention matrix), divided by how many queries that is
(i - j + 1). Every quantity query i uses comes from positions <= i, so no future token can change
an earlier position's output (upstream scored keys with every query, future ones included, and
applied no causal mask). Query i then keeps

    k_i = min(i + 1, max(recency, ceil(keep_ratio * (i + 1))))

keys: the `recency` most recent ones always, and the most important of the rest. The scoring pass
runs without gradients (a selection signal); attention is then one masked call.

- `learned`: the keep ratio is a learned parameter (sigmoid of a logit, initialised at keep_ratio)
  and the selection is soft — a key of importance rank r is kept with weight
  sigmoid((k_i - r) / temperature), added to the scores as its log — so the ratio gets a gradient
  (upstream's learned ratio never received one).
- `values_only`: every key still takes part in the softmax, but the values of the pruned keys are
  dropped from the weighted sum (their weight is set to 0, nothing renormalised).

This computes the full (T, T) attention twice: a research variant of what attention uses, not a
speed-up on CPU.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class CausalKVPruning(nn.Module):
    def __init__(
        self,
        keep_ratio: float = 0.382,
        recency: int = 64,
        learned: bool = False,
        values_only: bool = False,
        temperature: float = 1.0,
    ):
        super().__init__()
        assert 0 < keep_ratio <= 1, f"keep_ratio must be in (0, 1], got {keep_ratio}"
        self.keep_ratio, self.recency, self.learned, self.values_only = keep_ratio, recency, learned, values_only
        self.temperature = temperature
        self.ratio_logit = nn.Parameter(torch.empty(())) if learned else None

    @torch.no_grad()
    def init_weights(self) -> None:
        if self.ratio_logit is not None:
            p = min(max(self.keep_ratio, 1e-4), 1 - 1e-4)
            self.ratio_logit.fill_(math.log(p / (1 - p)))

    def ratio(self) -> torch.Tensor:
        return torch.sigmoid(self.ratio_logit) if self.ratio_logit is not None else torch.tensor(self.keep_ratio)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention (B, H, T, D) over each query's kept keys; `allowed` (B, 1, T, T) is the causal (or
        packed-document) mask, None for plain causal."""
        B, H, T, D = q.shape
        causal = allowed if allowed is not None else torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)  # (B, H, T, T)
        scores = scores.masked_fill(~causal, float("-inf"))
        with torch.no_grad():
            mass = scores.softmax(-1).cumsum(dim=2)  # [i, j]: attention key j received from queries 0..i (0 for i < j)
            queries = (torch.arange(T, device=q.device)[:, None] - torch.arange(T, device=q.device)[None, :] + 1).clamp(
                min=1
            )
            importance = (mass / queries).masked_fill(~causal, float("-inf"))  # (B, H, T, T), from positions <= i only
            recent = causal & (queries <= self.recency)  # the `recency` newest keys a query may see
            importance = importance.masked_fill(recent, float("inf"))  # the most recent keys rank first, always kept
            rank = (
                importance.argsort(dim=-1, descending=True).argsort(dim=-1).float()
            )  # 0 = most important key for query i
        seen = causal.sum(-1, keepdim=True).float()  # (.., T, 1): keys query i may see
        floor = torch.full_like(seen, float(self.recency))
        ratio = self.ratio().to(q.device)
        if self.learned:  # soft: a gradient reaches the ratio through the threshold
            budget = torch.minimum(seen, torch.maximum(floor, ratio * seen))
            keep = torch.sigmoid((budget - rank - 0.5) / self.temperature).masked_fill(~causal, 0.0)
        else:
            budget = torch.minimum(seen, torch.maximum(floor, torch.ceil(ratio * seen)))
            keep = ((rank < budget) & causal).to(q.dtype)
        if self.values_only:
            weights = scores.softmax(-1) * keep
        else:
            weights = (scores + torch.log(keep.clamp(min=1e-20))).masked_fill(~causal, float("-inf")).softmax(-1)
        return weights @ v

    def gate_stats(self) -> dict[str, torch.Tensor]:
        return {"kv_keep_ratio": self.ratio().detach().reshape(1)} if self.learned else {}

"""GPT-2 research variants on attention: Unified RA
and self-restart, each a small module the attention calls, so `gpt2.py` stays the plain model.

**Unified RA** ("reciprocal attention"): each head's D dimensions are split into D - R standard
and R reciprocal ones. Before the one causal attention call, the standard slices of q and k are
scaled by sqrt(w_std) and the reciprocal slices by sqrt(w_rec) (gates clamped at >= 1e-8), so
a score is (w_std <q_std, k_std> + w_rec <q_rec, k_rec>) / sqrt(D). The gates are learned, one
pair per layer or per head, initialised to (D - R) / D and R / D. From scratch this is a gated
split of each head: the same parameters and FLOPs as GPT-2, plus the gates.

**Self-restart**: out = (1 - a) attention + a V per head, a learned, initialised to 0.05 and
clamped to [0, 0.5]: each head can keep some of its own value vector.
"""

from __future__ import annotations

import torch
from torch import nn

MIN_GATE = 1e-8


class ReciprocalGates(nn.Module):
    """The (w_std, w_rec) gates of one attention layer and the q/k scaling they apply."""

    def __init__(self, n_head: int, head_dim: int, r: int, per_head: bool):
        super().__init__()
        assert 0 < r < head_dim, f"RA needs 0 < R < head_dim, got R={r}, head_dim={head_dim}"
        self.head_dim, self.r = head_dim, r
        shape = (n_head,) if per_head else (1,)
        self.w_std = nn.Parameter(torch.empty(shape))
        self.w_rec = nn.Parameter(torch.empty(shape))

    @torch.no_grad()
    def init_weights(self) -> None:
        self.w_std.fill_((self.head_dim - self.r) / self.head_dim)
        self.w_rec.fill_(self.r / self.head_dim)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, coupling: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k (B, H, T, D) scaled per slice by the square roots of the gates (w_rec times the
        delayed-activation `coupling` scale, when there is one)."""
        w_rec = self.w_rec * coupling if coupling is not None else self.w_rec
        std = self.w_std.clamp(min=MIN_GATE).sqrt()[:, None].expand(-1, self.head_dim - self.r)  # (H or 1, D - R)
        rec = w_rec.clamp(min=MIN_GATE).sqrt()[:, None].expand(-1, self.r)  # (H or 1, R)
        scale = torch.cat([std, rec], dim=1)[None, :, None, :].to(q.dtype)  # (1, H or 1, 1, D)
        return q * scale, k * scale

    def gate_stats(self) -> dict[str, torch.Tensor]:
        return {"ra_w_std": self.w_std.detach(), "ra_w_rec": self.w_rec.detach()}


class SelfRestart(nn.Module):
    """out = (1 - a) y + a v per head, a in [0, 0.5]."""

    def __init__(self, n_head: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.empty(n_head))

    @torch.no_grad()
    def init_weights(self) -> None:
        self.alpha.fill_(0.05)

    def forward(self, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        a = self.alpha.clamp(0.0, 0.5)[None, :, None, None].to(y.dtype)  # (1, H, 1, 1)
        return (1 - a) * y + a * v

    def gate_stats(self) -> dict[str, torch.Tensor]:
        return {"self_restart_alpha": self.alpha.detach()}


def gate_summary(model: nn.Module) -> dict[str, float]:
    """mean / std / min / max of every gate family in `model`, for the train and eval lines.

    >>> layer = ReciprocalGates(n_head=2, head_dim=8, r=2, per_head=True); layer.init_weights()
    >>> gate_summary(layer)["ra_w_rec_mean"]
    0.25
    """
    families: dict[str, list[torch.Tensor]] = {}
    for module in model.modules():  # the model itself included; every variant module reports its gates
        if hasattr(module, "gate_stats"):
            for name, value in module.gate_stats().items():
                value = (
                    value.full_tensor() if hasattr(value, "full_tensor") else value
                )  # FSDP: every rank asks, all gather
                families.setdefault(name, []).append(value.float().flatten())
    out = {}
    for name, values in families.items():
        v = torch.cat(values)
        out.update(
            {
                f"{name}_mean": float(v.mean()),
                f"{name}_std": float(v.std()) if v.numel() > 1 else 0.0,
                f"{name}_min": float(v.min()),
                f"{name}_max": float(v.max()),
            }
        )
    return out

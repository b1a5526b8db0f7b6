"""Tier 1: optimizers. Parameter groups are a function of (model, config), not a model method."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim import Optimizer

from tierlm.errors import ConfigError


def split_decay_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decayed, not decayed) trainable parameters.

    Matrices are decayed; biases, norm weights (every parameter with fewer than 2 dims) and
    embedding tables are not. Tied parameters appear once.

    >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    >>> decay, no_decay = split_decay_params(model)
    >>> [tuple(p.shape) for p in decay], sorted(tuple(p.shape) for p in no_decay)
    ([(4, 4)], [(4,), (4,), (4,), (10, 4)])
    """
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if param.ndim < 2 or id(param) in embedding_ids:
            no_decay.append(param)
        else:
            decay.append(param)
    return decay, no_decay


def create_adamw_optimizer(
    model: nn.Module,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    exclude_norms_biases_embeddings: bool = False,
    fused: bool | None = None,
) -> Optimizer:
    """AdamW over the model's trainable parameters (defaults from nanochat: beta2 = 0.95).

    `exclude_norms_biases_embeddings=True` puts biases, norm weights and embeddings in a group
    with weight decay 0. `fused=None` uses the fused kernel when every parameter is on the CPU or a
    GPU (4x faster than the per-tensor loop on CPU for a 10M-parameter model).

    >>> model = nn.Linear(10, 10)
    >>> optimizer = create_adamw_optimizer(model, lr=1e-4)
    >>> optimizer.param_groups[0]["lr"]
    0.0001
    >>> groups = create_adamw_optimizer(model, 1e-3, weight_decay=0.1, exclude_norms_biases_embeddings=True).param_groups
    >>> [(len(g["params"]), g["weight_decay"]) for g in groups]
    [(1, 0.1), (1, 0.0)]
    """
    if not 0 < lr < 1.0:
        raise ConfigError(f"lr must be in (0, 1), got {lr}")
    for i, beta in enumerate(betas):
        if not 0 <= beta < 1:
            raise ConfigError(f"beta{i + 1} must be in [0, 1), got {beta}")
    if eps <= 0:
        raise ConfigError(f"eps must be > 0, got {eps}")
    if weight_decay < 0:
        raise ConfigError(f"weight_decay must be >= 0, got {weight_decay}")

    if exclude_norms_biases_embeddings:
        decay, no_decay = split_decay_params(model)
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
    else:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    all_params = [p for g in groups for p in g["params"]]
    if not all_params:
        raise ConfigError("the model has no trainable parameters")
    if fused is None:
        fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in all_params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused or None)

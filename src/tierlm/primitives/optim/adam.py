"""Tier 1: the AdamW update of one parameter, shared by the optimizers built on it (AdamWSPAM, AdamWPrune)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake


def init_adam_state(state: dict, p: torch.Tensor) -> None:
    """A step count (float64, as torch keeps it) and both moments at zero."""
    state["step"] = torch.zeros((), dtype=torch.float64)
    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)


def step_count(state: dict) -> int:
    """The steps an AdamW state has taken (0 under the memory planner's fake tensors, which hold no count).

    >>> state = {}
    >>> init_adam_state(state, torch.ones(1))
    >>> step_count(state)
    0
    """
    return 0 if is_fake(state["step"]) else int(state["step"])


def adamw_update_(p: torch.Tensor, g: torch.Tensor, state: dict, group: dict, scale: float = 1.0) -> int:
    """torch.optim.AdamW's update of `p` by gradient `g`, in place: step count, both moments,
    decoupled weight decay, then the bias-corrected step times `scale` (the decay is not scaled).
    Returns the new step count.

    >>> p, state = torch.ones(2), {}
    >>> init_adam_state(state, p)
    >>> adamw_update_(p, torch.tensor([1.0, -1.0]), state, {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8,
    ...     "weight_decay": 0.0})
    1
    >>> [round(x, 3) for x in p.tolist()]
    [0.9, 1.1]
    """
    beta1, beta2 = group["betas"]
    state["step"] += 1
    t = max(1, step_count(state))
    state["exp_avg"].lerp_(g, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if group["weight_decay"]:
        p.mul_(1 - group["lr"] * group["weight_decay"])
    denom = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(group["eps"])
    p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] * scale / (1 - beta1**t))
    return t

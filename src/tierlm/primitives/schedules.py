"""Tier 1: learning-rate schedules: linear warmup, then cosine | linear | constant | warmdown.

One schedule drives every parameter group (of every optimizer in a container): each group's LR
is its own peak times the same multiplier; Muon's momentum warms up and its weight decay falls to
0 on the same step count, so the schedule's state is one number and resumes exactly.
"""

from __future__ import annotations

import functools
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from tierlm.errors import ConfigError
from tierlm.primitives.optim.muon import get_muon_momentum, get_weight_decay

DECAY_STYLES = ("cosine", "linear", "constant", "warmdown")


def lr_multiplier(
    step: int,
    num_warmup_steps: int,
    num_training_steps: int,
    decay_style: str = "cosine",
    min_lr_ratio: float = 0.1,
    warmdown_ratio: float = 0.2,
    warmup_start_factor: float = 0.1,
) -> float:
    """The factor applied to the base LR at `step` (0-based).

    Warmup rises linearly from `warmup_start_factor` to 1 over `num_warmup_steps`. Then:
    cosine and linear decay to `min_lr_ratio` at the last step; constant stays at 1; warmdown
    (nanochat) stays at 1 and decays linearly to `min_lr_ratio` over the final
    `warmdown_ratio` of training.

    >>> [round(lr_multiplier(s, 2, 10, "cosine"), 3) for s in (0, 1, 2, 6, 10)]
    [0.1, 0.55, 1.0, 0.55, 0.1]
    >>> [round(lr_multiplier(s, 0, 10, "warmdown", min_lr_ratio=0.0, warmdown_ratio=0.5), 2) for s in (0, 5, 8, 10)]
    [1.0, 1.0, 0.4, 0.0]
    """
    if step < num_warmup_steps:
        return warmup_start_factor + (1.0 - warmup_start_factor) * step / num_warmup_steps
    if decay_style == "constant":
        return 1.0
    if decay_style == "warmdown":
        decay_start = max(num_warmup_steps, round(num_training_steps * (1.0 - warmdown_ratio)))
    else:
        decay_start = num_warmup_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, num_training_steps - decay_start))
    if decay_style == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - (1.0 - min_lr_ratio) * progress  # linear, warmdown


def create_warmup_scheduler(
    optimizer: Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    decay_style: str = "cosine",
    min_lr_ratio: float = 0.1,
    warmdown_ratio: float = 0.2,
    warmup_start_factor: float = 0.1,
    momentum_warmup_steps: int = 300,
) -> LRScheduler:
    """A scheduler following `lr_multiplier`; call `.step()` once per optimizer step (a
    `TrainingSchedule`: Muon groups also get the momentum warm-up over `momentum_warmup_steps`
    and the weight-decay decay).

    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> sched = create_warmup_scheduler(opt, 0, 4, decay_style="linear", min_lr_ratio=0.0)
    >>> lrs = []
    >>> for _ in range(4):
    ...     lrs.append(opt.param_groups[0]["lr"]); opt.step(); sched.step()
    >>> lrs
    [1.0, 0.75, 0.5, 0.25]
    """
    if decay_style not in DECAY_STYLES:
        raise ConfigError(f"decay_style must be one of {list(DECAY_STYLES)}, got {decay_style!r}")
    if num_warmup_steps < 0:
        raise ConfigError(f"num_warmup_steps must be >= 0, got {num_warmup_steps}")
    if num_training_steps <= num_warmup_steps:
        raise ConfigError(f"num_training_steps ({num_training_steps}) must be > num_warmup_steps ({num_warmup_steps})")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ConfigError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if not 0.0 <= warmdown_ratio <= 1.0:
        raise ConfigError(f"warmdown_ratio must be in [0, 1], got {warmdown_ratio}")
    if not 0.0 <= warmup_start_factor <= 1.0:
        raise ConfigError(f"warmup_start_factor must be in [0, 1], got {warmup_start_factor}")
    if momentum_warmup_steps < 0:
        raise ConfigError(f"momentum_warmup_steps must be >= 0, got {momentum_warmup_steps}")
    schedule = functools.partial(
        lr_multiplier,
        num_warmup_steps=num_warmup_steps,
        num_training_steps=num_training_steps,
        decay_style=decay_style,
        min_lr_ratio=min_lr_ratio,
        warmdown_ratio=warmdown_ratio,
        warmup_start_factor=warmup_start_factor,
    )
    return TrainingSchedule(optimizer, schedule, num_training_steps, momentum_warmup_steps)


class TrainingSchedule(LambdaLR):
    """`LambdaLR` over every group, plus Muon's hyperparameters on the same step count: its momentum
    rises from `momentum_start` to the group's own over `momentum_warmup_steps`, and its weight
    decay falls linearly from the group's own to 0 at `num_training_steps` (nanochat). Groups of
    other optimizers keep theirs.

    >>> import torch
    >>> from tierlm.primitives.optim.muon import Muon
    >>> opt = Muon([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.02, momentum=0.95, weight_decay=0.1)
    >>> sched = TrainingSchedule(opt, lambda step: 1.0, num_training_steps=10, momentum_warmup_steps=4)
    >>> for _ in range(2): opt.step(); sched.step()
    >>> g = opt.param_groups[0]; round(g["momentum"], 3), round(g["weight_decay"], 3)
    (0.9, 0.08)
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_lambda,
        num_training_steps: int,
        momentum_warmup_steps: int = 300,
        momentum_start: float = 0.85,
    ):
        self.num_training_steps, self.momentum_warmup_steps, self.momentum_start = (
            num_training_steps,
            momentum_warmup_steps,
            momentum_start,
        )
        for group in optimizer.param_groups:
            if "ns_steps" in group:  # a Muon group: remember its peak momentum and weight decay
                group.setdefault("peak_momentum", group["momentum"])
                group.setdefault("initial_weight_decay", group["weight_decay"])
        super().__init__(optimizer, lr_lambda)

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        for group in self.optimizer.param_groups:
            if "ns_steps" in group:
                group["momentum"] = get_muon_momentum(
                    self.last_epoch, self.momentum_warmup_steps, self.momentum_start, group["peak_momentum"]
                )
                group["weight_decay"] = get_weight_decay(
                    self.last_epoch, self.num_training_steps, group["initial_weight_decay"]
                )


def create_warmup_cosine_scheduler(
    optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int, min_lr_ratio: float = 0.1
) -> LRScheduler:
    """Linear warmup from 0.1x to 1x of the base LR, then cosine decay to `min_lr_ratio`.

    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> sched = create_warmup_cosine_scheduler(opt, num_warmup_steps=10, num_training_steps=100)
    >>> opt.param_groups[0]["lr"]
    0.1
    """
    return create_warmup_scheduler(optimizer, num_warmup_steps, num_training_steps, "cosine", min_lr_ratio)

"""Tier 1: AdamWSPAM — AdamW with momentum reset and spike-aware clipping (SPAM, Huang et al.,
ICLR 2025, arXiv:2501.06842).

The variant implemented here (the paper's update as its authors' reference code computes it; the
GPT-2 research code base added a grad-norm z-score damping, which is not included):

- every `interval` steps (paper: 500) both Adam moments are zeroed; the bias-correction step
  count keeps running;
- after each reset (and at the start) the update is scaled by a cosine ramp from 0.01 to 1 over
  `warmup` steps (paper: 150); weight decay is not scaled;
- from `clip_delay` steps after a reset (20: before that the second moment is too young to judge),
  each gradient entry with g^2 > theta * v is replaced by sign(g) * sqrt(theta * v), v being the
  second moment before this step (paper: theta = 5000);
- otherwise the step is torch.optim.AdamW's: decoupled weight decay, then
  m / (1 - beta1^t) / (sqrt(v / (1 - beta2^t)) + eps).

With theta = inf, no reset and no warm-up it is AdamW exactly (tested against torch.optim.AdamW).
"""

from __future__ import annotations

import math

import torch
from torch.optim import Optimizer

from tierlm.errors import ConfigError
from tierlm.primitives.optim.adam import adamw_update_, init_adam_state, step_count


def spam_ramp(steps_since_reset: int, warmup: int) -> float:
    """The update's scale `steps_since_reset` steps after a reset: 0.01 rising to 1 along a half cosine.

    >>> [round(spam_ramp(r, 4), 3) for r in (0, 2, 4, 9)]
    [0.01, 0.505, 1.0, 1.0]
    """
    if warmup <= 0:
        return 1.0
    progress = min(steps_since_reset, warmup) / warmup
    return 1.0 - 0.99 * 0.5 * (1.0 + math.cos(math.pi * progress))


class AdamWSPAM(Optimizer):
    """AdamW with SPAM's momentum reset, post-reset warm-up and spike clipping (see the module docstring).

    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = AdamWSPAM([w], lr=0.1, warmup=0)
    >>> w.grad = torch.tensor([1.0, -1.0, 0.0]); opt.step()
    >>> [round(x, 3) for x in w.tolist()]    # the first step is AdamW's: lr * sign(g)
    [0.9, 1.1, 1.0]
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        theta: float = 5000.0,
        interval: int = 500,
        warmup: int = 150,
        clip_delay: int = 20,
    ):
        if not 0 < lr < 1:
            raise ConfigError(f"AdamWSPAM lr must be in (0, 1), got {lr}")
        if theta <= 0:
            raise ConfigError(f"training.spam_theta must be > 0, got {theta}")
        if interval < 0 or warmup < 0 or clip_delay < 0:
            raise ConfigError(f"training.spam_interval ({interval}) and spam_warmup ({warmup}) must be >= 0")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.theta, self.interval, self.warmup, self.clip_delay = theta, interval, warmup, clip_delay

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    init_adam_state(state, p)
                done = step_count(state)  # steps taken before this one
                since_reset = done % self.interval if self.interval else done
                if self.interval and done and since_reset == 0:  # momentum reset
                    state["exp_avg"].zero_()
                    state["exp_avg_sq"].zero_()
                g = p.grad
                if since_reset >= self.clip_delay and math.isfinite(self.theta):  # spike-aware clipping
                    limit_sq = self.theta * state["exp_avg_sq"]
                    g = torch.where(g * g > limit_sq, g.sign() * limit_sq.sqrt(), g)
                adamw_update_(p, g, state, group, scale=spam_ramp(since_reset, self.warmup))
        return loss

"""GPT-2 research variant: delayed activation ("coupling warm-up") of the reciprocal gates.

The reciprocal parts of Unified RA and R-MLP start switched off and come on later: the forward
multiplies every reciprocal gate w_rec by a scale in [0, 1] (upstream logged this scale but never
applied it; here it is applied). The scale follows one of three triggers, updated after each
optimizer step by the trainer (through the model family's `on_step`):

- `step`: 0 before `start_step`, 1 from it on (V11/V12: 75 steps);
- `ramp`: rises linearly from 0 at `start_step` to 1 at `start_step + ramp_steps`;
- `loss_stability`: switches to 1 once the training loss has settled, i.e. the coefficient of
  variation (std / mean) of the last `window` losses is below `cv_threshold`.

While the scale is 0 the reciprocal gates get no gradient (their effect is multiplied by 0), so
they stay at their initial values: "frozen". The state (scale, loss window, when it switched) is
kept in buffers, so it is part of every checkpoint and a resumed run continues it exactly.
"""

from __future__ import annotations

import torch
from torch import nn

MODES = ("none", "step", "ramp", "loss_stability")


class CouplingWarmup(nn.Module):
    def __init__(
        self, mode: str, start_step: int = 75, ramp_steps: int = 100, window: int = 50, cv_threshold: float = 0.05
    ):
        super().__init__()
        assert mode in MODES, f"delay mode must be one of {MODES}, got {mode!r}"
        self.mode, self.start_step, self.ramp_steps = mode, start_step, ramp_steps
        self.window, self.cv_threshold = window, cv_threshold
        self.register_buffer("scale", torch.empty(()))
        self.register_buffer("losses", torch.empty(window))  # a ring of the last `window` training losses
        self.register_buffer("seen", torch.empty((), dtype=torch.int64))
        self.register_buffer("switched_at", torch.empty((), dtype=torch.int64))

    @torch.no_grad()
    def init_weights(self) -> None:
        self.scale.fill_(1.0 if self.mode == "none" else 0.0)
        self.losses.zero_()
        self.seen.zero_()
        self.switched_at.fill_(-1)

    @torch.no_grad()
    def update(self, step: int, loss: float) -> None:
        """After optimizer step `step` (1-based) with training loss `loss`.

        >>> warmup = CouplingWarmup("ramp", start_step=10, ramp_steps=4); warmup.init_weights()
        >>> [(warmup.update(s, 1.0), round(float(warmup.scale), 2))[1] for s in (9, 11, 13, 20)]
        [0.0, 0.25, 0.75, 1.0]
        """
        if self.mode == "step":
            self.scale.fill_(1.0 if step >= self.start_step else 0.0)
        elif self.mode == "ramp":
            self.scale.fill_(min(1.0, max(0.0, (step - self.start_step) / self.ramp_steps)))
        elif self.mode == "loss_stability":
            self.losses[int(self.seen) % self.window] = loss
            self.seen += 1
            if self.switched_at < 0 and self.seen >= self.window:
                cv = self.losses.std() / self.losses.mean().abs().clamp(min=1e-12)
                if cv < self.cv_threshold:
                    self.switched_at.fill_(step)
            self.scale.fill_(1.0 if self.switched_at >= 0 else 0.0)

    def gate_stats(self) -> dict[str, torch.Tensor]:
        return {"coupling_scale": self.scale.detach().reshape(1)}

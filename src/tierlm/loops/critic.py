"""PPO's critic: a value model beside the policy, trained through its own tier-0 backend.

The value model starts as a copy of the policy with its output head replaced by one zero-initialised
column (so every value starts at 0 and the first advantages are the rewards): the same network reads
the same tokens, and its output at each position is the value of the state from which that position's
label was sampled (`ValueStrategy`). Its checkpoints sit beside the policy's, in `critic_checkpoints/`,
saved and resumed at the same steps.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tierlm.models import family_of, unwrap_model
from tierlm.strategies.rl import ValueStrategy


def value_model(policy: nn.Module) -> nn.Module:
    """A copy of `policy` whose output head is one zero-initialised column (B, T, 1) — for every family."""
    model = copy.deepcopy(unwrap_model(policy))
    family = family_of(model)
    head = family.output_head(model)
    value_head = nn.Linear(head.in_features, 1, bias=False, device=head.weight.device, dtype=head.weight.dtype)
    nn.init.zeros_(value_head.weight)
    return family.with_output_head(model, value_head)


@dataclass
class Critic:
    """The value model's backend and strategy."""

    backend: Any
    strategy: ValueStrategy

    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each trained position's value (B, T), 0 elsewhere."""
        return self.backend.forward(batch, self.strategy.compute_metrics).wait()["values"]

    def accumulate(self, batch: dict[str, torch.Tensor]) -> None:
        self.backend.forward_backward(
            {k: batch[k] for k in ("input_ids", "labels", "returns", "old_values")}, self.strategy.compute_loss
        )

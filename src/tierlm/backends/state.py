"""Tier 0: the functional trainer API's states, as the functional surface of the backends (`Trainer.train_step(batch,
model_state, optimizer_state) -> TrainingResult`).

On PyTorch a `ModelState` is a *view* of the backend's: its weights are the model's parameters and its
optimizer state the optimizer's, updated in place by the next step (the model is too large to copy
per step); keep an old one with `copy.deepcopy(state)`, and handing one back to `train_step` loads it.
On JAX the arrays never change, so a state is a value: an older one can be handed back and the step
runs from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass
class ModelState:
    """The weights, the optimizer state and the metadata of training (step, learning rates)."""

    weights: Mapping[str, Any]
    """Parameter name -> tensor (PyTorch: the parameters themselves) or JAX array."""
    optimizer_state: Any
    """PyTorch: the optimizer's `state_dict()` (its tensors shared); JAX: the optax state of each group."""
    step: int = 0
    """Optimizer steps taken."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """E.g. the learning rate of each parameter group for the next step."""


@dataclass
class GradientInfo:
    """What `forward_backward` left for the update: the gradients of the summed loss (not yet divided by
    the step's trained tokens), the loss sum and the token count."""

    gradients: Mapping[str, Any]
    loss_sum: float
    num_tokens: float
    reduced: bool = False
    """True once summed over data-parallel ranks (`all_reduce_gradients`)."""

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.num_tokens, 1.0)


def ring_all_reduce_bytes(gradient_bytes: int, world_size: int) -> int:
    """Bytes each rank sends to all-reduce `gradient_bytes` with a ring (reduce-scatter + all-gather).

    >>> ring_all_reduce_bytes(1000, 1), ring_all_reduce_bytes(1000, 4)
    (0, 1500)
    """
    return 2 * (world_size - 1) * gradient_bytes // world_size

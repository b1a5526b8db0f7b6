"""Tier 0: the training backend protocol.

Every backend (single device, DDP, FSDP2, later JAX) answers the same calls, so a training loop
written against it runs unchanged on all of them:

    future = backend.forward_backward(batch)   # returns at once; work may run ahead
    metrics = await future.result()            # {"loss": ..., "num_tokens": ...}
    await backend.optim_step().result()        # {"grad_norm": ..., "lr": ..., "loss": ...}

Several `forward_backward` calls before one `optim_step` accumulate gradients. The update is
normalised by the trained tokens of the whole optimizer step (all micro-batches, all ranks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Generic, Mapping, Protocol, TypeVar, runtime_checkable

import torch

T = TypeVar("T")
Batch = Mapping[str, torch.Tensor]


class TrainFuture(Generic[T]):
    """The pending result of a backend call.

    The work is already dispatched (on a GPU it runs ahead asynchronously); reading the result
    is what waits, so a loop that only reads once per optimizer step never stalls the device.
    Await `result()` in async code or call `wait()` in sync code; the value is computed once.

    >>> future = TrainFuture(lambda: {"loss": 1.5})
    >>> future.wait()
    {'loss': 1.5}
    >>> import asyncio
    >>> asyncio.run(future.result())
    {'loss': 1.5}
    """

    _UNSET = object()

    def __init__(self, compute: Callable[[], T]):
        self._compute = compute
        self._value: Any = self._UNSET

    @classmethod
    def ready(cls, value: T) -> "TrainFuture[T]":
        """A future whose value is already known."""
        return cls(lambda: value)

    def done(self) -> bool:
        return self._value is not self._UNSET

    def wait(self) -> T:
        if self._value is self._UNSET:
            self._value = self._compute()
            self._compute = None  # drop references to device tensors
        return self._value

    async def result(self) -> T:
        return self.wait()

    def __await__(self):
        return self.result().__await__()


@runtime_checkable
class TrainingBackend(Protocol):
    """What a trainer, strategy, RL loop or run may ask of a backend: every member its callers use.

    Backends subclass it (`PyTorchTrainingBackend`, `JaxTrainingBackend`), which gives them the defaults of a
    backend in one process that saves synchronously; any object with the same members is a backend too.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    checkpoint_dir: Path
    """Where `save_checkpoint` writes `step_<n>` folders (created by the first save)."""
    step: int
    """Optimizer steps taken."""
    last_step_metrics: dict[str, float]
    """The metrics of the last `apply_gradients`."""
    rank: int = 0
    world_size: int = 1

    # -- the protocol's calls --------------------------------------------------------------
    def forward_backward(self, batch: Batch, loss_fn: Callable | None = None) -> TrainFuture[dict[str, float]]:
        """Forward and backward one micro-batch; gradients accumulate until `optim_step`."""
        ...

    def forward(self, batch: Batch, fn: Callable | None = None) -> TrainFuture[dict[str, float]]:
        """Forward without gradients; `fn(logits, batch)` returns a dict of tensors. With a sampler's expert routes in
        the batch (`routes` replayed, `sampler_routes` compared), the dict also counts where the model routed alike
        (`ModelFamily.routing_agreement`)."""
        ...

    def optim_step(self) -> TrainFuture[dict[str, float]]:
        """Normalise, clip, step optimizer and scheduler, zero gradients."""
        ...

    def save_checkpoint(
        self,
        step: int,
        trainer_state: dict | None = None,
        write_extra: Callable[[Path], None] | None = None,
        metric: float | None = None,
    ) -> TrainFuture[Path]:
        """Write checkpoint `step_<step>`; `metric` (lower is better) marks the best one for retention."""
        ...

    def load_checkpoint(self, path: str | Path | None = None) -> TrainFuture[dict]:
        """Load `path` (default: the latest checkpoint); the result is the saved trainer state."""
        ...

    # -- where this process sits -----------------------------------------------------------
    @property
    def is_main(self) -> bool:
        """The rank that reports, prunes checkpoints and writes the final model."""
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """This rank's share of the data (the ranks of one model-parallel group read the same rows)."""
        return self.rank

    @property
    def data_world_size(self) -> int:
        """How many shares the data splits into."""
        return self.world_size

    def all_reduce_sums(self, values: dict[str, float]) -> dict[str, float]:
        """Sum metric totals over the ranks (one process: themselves)."""
        return values

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's `value` (picklable), in rank order, on every rank (one process: `[value]`)."""
        return [value]

    # -- models and saves ------------------------------------------------------------------
    @property
    def eval_model(self) -> torch.nn.Module:
        """The module evaluation samples from (unwrapped of what only training needs)."""
        return self.model

    @property
    def export_model(self) -> torch.nn.Module:
        """The module a final model folder is written from (its config; its weights unless `full_model_state` gives
        them)."""
        return self.model

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """Collective under torchrun: the whole model's weights on rank 0's CPU; None where the live weights are
        saved."""
        return None

    def sampler_state(self) -> dict[str, torch.Tensor] | None:
        """Collective where the weights are sharded: the whole model's weights on every rank, for a sampler that
        holds its own copy (RL's rollout engine under FSDP); None where a sampler reads the live weights."""
        return None

    def wait_for_save(self) -> None:
        """Block until a save running in the background has finished (saves here are synchronous)."""

    @classmethod
    def memory_per_rank(
        cls, parts: dict[str, float], model: torch.nn.Module, world_size: int, **layout: Any
    ) -> dict[str, float]:
        """The memory planner's one-process figures (`parts`: bytes by consumer, as `tierlm.plan.memory` traces
        them) as this backend holds `model` on each of `world_size` ranks. `layout`: `compute_bytes` (of the
        gathered weights), `sharding`, `local_world_size`, `tensor`, `pipeline`, `context`. One process: as traced."""
        return parts

    def memory_stats(self) -> dict[str, float]:
        """This rank's parameter and optimizer-state bytes, when the backend knows them."""
        return {}

    def frozen_reference(self) -> Any:
        """The model as it is now, frozen, behind `forward(batch, fn)` (DPO's reference where the backend makes it)."""
        raise NotImplementedError(
            f"{type(self).__name__} makes no frozen reference; use tierlm.backends.frozen_reference(model)"
        )

    # -- the functional surface (tierlm.backends.state; Trainer.train_step) -------------------
    def model_state(self) -> Any:
        """The current `ModelState` (weights, optimizer state, step, learning rates)."""
        ...

    def load_model_state(self, state: Any, optimizer_state: Any | None = None) -> None: ...

    def gradient_info(self) -> Any:
        """The accumulated gradients as a `GradientInfo`."""
        ...

    def all_reduce_gradients(self, gradients: Any) -> Any: ...

    def apply_gradients(self, model: Any, gradients: Any, optimizer: Any = None) -> Any:
        """Normalise, clip and update with `optimizer`: the backend's own (or None), or a functional optimizer
        (`use_optimizer`)."""
        ...

    def use_optimizer(self, optimizer: Any) -> None:
        """Update with a functional optimizer (`init` / `update`) from now on (the backend's own: None); the states
        `model_state` gives and `load_model_state` takes are then its states."""
        ...

    def communication_bytes(self) -> int:
        """Gradient bytes each rank sends per step."""
        return 0

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
    """What a trainer, strategy or RL loop may ask of a backend."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device

    def forward_backward(self, batch: Batch, loss_fn: Callable | None = None) -> TrainFuture[dict[str, float]]:
        """Forward and backward one micro-batch; gradients accumulate until `optim_step`."""
        ...

    def forward(self, batch: Batch, fn: Callable | None = None) -> TrainFuture[dict[str, float]]:
        """Forward without gradients; `fn(logits, batch)` returns a dict of scalar tensors."""
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

"""The models a loss compares the policy with, beside its backend: DPO's reference and RL's KL reference. A frozen
copy of the starting model (`FrozenReference`), a LoRA model's base with its adapters off (`AdapterFreeReference`),
or a copy that follows the policy (`SyncedReference`, TR-DPO's); `frozen_reference` picks one. Each has the `forward`
half of the protocol: `forward(batch, fn)` returns `fn(logits, batch)`."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from tierlm.backends.protocol import Batch, TrainFuture, TrainingBackend
from tierlm.backends.pytorch import to_host
from tierlm.models import forward_logits, unwrap_model
from tierlm.models.lora import adapters_disabled, has_lora
from tierlm.primitives.dtype_device import move_to


class FrozenReference:
    """A model that only evaluates (the `forward` half of the protocol): a DPO or KL reference.

    Its weights never change and take no gradients; `forward(batch, fn)` returns `fn(logits, batch)`.
    """

    def __init__(self, model: nn.Module, device: torch.device | str, autocast_dtype: torch.dtype | None = None):
        self.device, self.autocast_dtype = torch.device(device), autocast_dtype
        self.model = move_to(model, self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def forward(self, batch: Batch, fn: Callable) -> TrainFuture[dict]:
        batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        ctx = torch.autocast(self.device.type, self.autocast_dtype) if self.autocast_dtype else contextlib.nullcontext()
        with ctx:
            out = fn(forward_logits(self.model, batch), batch)
        return TrainFuture(lambda: {k: to_host(v) for k, v in out.items()})


class AdapterFreeReference(FrozenReference):
    """The reference of a LoRA model: the same model with its adapters switched off (the frozen base),
    in eval mode, so no second copy of the weights exists (TRL's and PEFT's way)."""

    def __init__(self, model: nn.Module, device: torch.device | str, autocast_dtype: torch.dtype | None = None):
        self.device, self.autocast_dtype, self.model = torch.device(device), autocast_dtype, model

    @torch.no_grad()
    def forward(self, batch: Batch, fn: Callable) -> TrainFuture[dict]:
        was_training = self.model.training
        self.model.eval()
        try:
            with adapters_disabled(self.model):
                return super().forward(batch, fn)
        finally:
            self.model.train(was_training)


class SyncedReference(FrozenReference):
    """A reference that follows the policy (TR-DPO, Gorbatovski et al., 2024): after every `every` optimizer steps
    of `backend` (the policy's, given by `follow`), ref <- alpha policy + (1 - alpha) ref, parameter by parameter
    as TRL's `SyncRefModelCallback` mixes them. The mix happens at the next use (the next step's scoring, an
    evaluation) or the next checkpoint, whichever comes first, and checkpoints carry the reference's weights
    (`snapshot` / `load`, a `tierlm.loops.cadence.Kept`) so a resumed run mixes from where it stopped. The policy's
    weights must be whole on each rank (one process, DDP)."""

    FILE = "reference.safetensors"

    def __init__(self, model: nn.Module, device, autocast_dtype=None, every: int = 512, alpha: float = 0.6):
        super().__init__(model, device, autocast_dtype)
        assert every > 0 and 0 < alpha <= 1, f"every={every}, alpha={alpha}"
        self.every, self.alpha, self.backend, self.synced = every, alpha, None, 0

    def follow(self, backend: TrainingBackend) -> None:
        """The policy's backend: its model and its count of optimizer steps."""
        self.backend = backend

    @torch.no_grad()
    def sync(self) -> None:
        """Mix in the policy once per `every` steps passed since the last mix."""
        assert self.backend is not None, "SyncedReference.follow(backend) first"
        due = self.backend.step // self.every * self.every
        if due <= self.synced:
            return
        policy = [p.to(self.device) for p in unwrap_model(self.backend.model).parameters()]
        mine = list(self.model.parameters())
        assert len(mine) == len(policy), "the reference and the policy have different parameters"
        torch._foreach_mul_(mine, 1.0 - self.alpha)
        torch._foreach_add_(mine, policy, alpha=self.alpha)
        self.synced = due

    def forward(self, batch: Batch, fn: Callable) -> TrainFuture[dict]:
        self.sync()
        return super().forward(batch, fn)

    def snapshot(self) -> Callable[[Path], None]:
        """The reference as it is now (mixed up to this step), written into a checkpoint folder by the result."""
        from safetensors.torch import save_file

        self.sync()
        weights = {name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters()}
        synced = self.synced
        return lambda folder: save_file(weights, str(Path(folder) / self.FILE), {"synced_step": str(synced)})

    @torch.no_grad()
    def load(self, folder: Path) -> None:
        """The reference a checkpoint carries; a checkpoint saved without it leaves the reference as it is, mixing
        from the next sync step on."""
        from safetensors import safe_open

        path = Path(folder) / self.FILE
        if not path.is_file():
            self.synced = self.backend.step // self.every * self.every if self.backend is not None else 0
            return
        with safe_open(str(path), framework="pt") as f:
            for name, p in self.model.named_parameters():
                p.copy_(f.get_tensor(name))
            self.synced = int(f.metadata()["synced_step"])


def follow_policy(reference, backend: TrainingBackend) -> list:
    """What a loop's checkpoints carry for its `reference` (`kept`): a `SyncedReference`, now following the policy of
    `backend`; nothing for any other."""
    if not isinstance(reference, SyncedReference):
        return []
    reference.follow(backend)
    return [reference]


def frozen_reference(
    model: nn.Module,
    device: torch.device | str,
    autocast_dtype: torch.dtype | None = None,
    sync_every: int | None = None,
    alpha: float | None = None,
) -> FrozenReference:
    """What DPO and RL's KL term compare against: the model as training starts (a copy), or for a LoRA
    model its base with the adapters off; with `sync_every`, a copy that follows the policy (`SyncedReference`)."""
    if sync_every is not None:
        assert not has_lora(model), "a LoRA model's reference is its base, no copy to mix the policy into"
        return SyncedReference(copy.deepcopy(model), device, autocast_dtype, sync_every, alpha)
    if has_lora(model):
        return AdapterFreeReference(model, device, autocast_dtype)
    return FrozenReference(copy.deepcopy(model), device, autocast_dtype)

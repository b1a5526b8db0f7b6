"""Tier 0: data-parallel backends on PyTorch's own engine (DDP and FSDP2), launched by torchrun.

Both keep `PyTorchTrainingBackend`'s arithmetic: each rank back-propagates the *sum* of its
micro-batches' losses; `optim_step` all-reduces [loss sum, trained tokens] once and divides the
(rank-averaged) gradients so that the update is the gradient of the global token-mean loss.
N ranks and one process on the same global batch therefore compute the same update.

Checkpoints are sharded (`torch.distributed.checkpoint`): every rank writes its shards, rank 0
seals the folder. They load at any world size, or in one process (see `tierlm.checkpoint`).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from tierlm import checkpoint
from tierlm.backends.options import BackendOptions
from tierlm.backends.parallelize import parallelize
from tierlm.backends.protocol import Batch, TrainFuture
from tierlm.backends.pytorch import PyTorchTrainingBackend
from tierlm.errors import ConfigError
from tierlm.models import family_of, unwrap_model
from tierlm.primitives.parallel import apply_ddp, apply_fsdp

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], object]


def prepare_model(
    model: nn.Module, device: torch.device, activation_checkpointing: bool, compile: bool | str, fp8: bool = False
) -> nn.Module:
    """The model on `device` with FP8, activation checkpointing and compile, in the one order (`parallelize`),
    before any wrapping."""
    return parallelize(model, device, fp8=fp8, activation_checkpointing=activation_checkpointing, compile=compile)


class DistributedTrainingBackend(PyTorchTrainingBackend):
    """What DDP and FSDP2 share: reductions across ranks and sharded checkpoints."""

    def __init__(
        self,
        model: nn.Module,
        optimizer_fn: OptimizerFactory,
        loss_fn: Callable | None,
        checkpoint_dir: str | Path,
        device: torch.device | str,
        scheduler_fn: SchedulerFactory | None = None,
        options: BackendOptions | None = None,
    ):
        """The model wrapped by the subclass (`_wrap`: DDP, FSDP2's shards, DeepSpeed's placement), then the optimizer
        over what the wrapping left (FSDP2's parameters are DTensor shards), then the subclass's `_after_init`. A
        subclass's `_refuse` says first, in one line, what it cannot do with these options."""
        options = options or BackendOptions()
        self._refuse(model, options)
        assert dist.is_initialized(), (
            "join the process group first (tierlm.primitives.parallel.init_distributed, under torchrun)"
        )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._pending_save, self._checkpoint_group = None, None
        device = torch.device(device)
        model, inner = self._wrap(model, device, options)
        optimizer = optimizer_fn(model)
        scheduler = scheduler_fn(optimizer) if scheduler_fn else None
        super().__init__(model, optimizer, loss_fn, checkpoint_dir, device, scheduler, inner)
        self._after_init()

    def _refuse(self, model: nn.Module, options: BackendOptions) -> None:
        """A `ConfigError` for what this backend cannot do with `options`, before any process group is needed."""

    def _wrap(
        self, model: nn.Module, device: torch.device, options: BackendOptions
    ) -> tuple[nn.Module, BackendOptions]:
        """(the model as this backend trains it, the options the single-process part keeps): as it is, here."""
        return model, options

    def _after_init(self) -> None:
        """What a backend does once the optimizer and schedule exist (DeepSpeed: its engine)."""

    def reduce_step_totals(self, totals: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(totals)
        return totals

    def all_reduce_sums(self, values: dict[str, float]) -> dict[str, float]:
        keys = sorted(values)
        summed = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(summed)
        return dict(zip(keys, summed.tolist()))

    def gather_objects(self, value) -> list:
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def _grad_divisor(self, num_tokens: torch.Tensor) -> torch.Tensor:
        # DDP and FSDP2 average gradients over ranks; ours are sums, so undo the 1/world_size.
        return num_tokens.clamp(min=1.0) / self.world_size

    def save_checkpoint(
        self,
        step: int,
        trainer_state: dict | None = None,
        write_extra: Callable[[Path], None] | None = None,
        metric: float | None = None,
    ) -> TrainFuture[Path]:
        """Every rank writes its shards; rank 0 adds config, tokenizer and trainer state and seals it. With
        `async_save`, the shards are staged to CPU memory now and written on a background thread (DCP's async save,
        coordinated over a gloo group of its own); the next save, `wait_for_save()` or the future seals it."""
        self.wait_for_save()
        state = {"backend_step": self.step, **(trainer_state or {})}
        if self.async_save and self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo")  # collective: every rank's first async save
        saved = checkpoint.save_sharded_checkpoint(
            self.checkpoint_dir,
            step,
            self.model,
            self.optimizer,
            self.scheduler,
            state,
            write_extra,
            metric,
            self.export_model,
            async_group=self._checkpoint_group if self.async_save else None,
        )
        if isinstance(saved, Path):
            return TrainFuture.ready(saved)
        self._pending_save = saved
        return TrainFuture(lambda: (self.wait_for_save(), saved.root / f"step_{step}")[1])

    def wait_for_save(self) -> None:
        """Finish an async save: this rank's shards written, and on rank 0 the checkpoint sealed."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.finish()


def unsaved_buffers(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(module, name, value) of every buffer no state dict carries (rotary tables: non-persistent), in module order
    (the same on every rank; the module objects survive the wrapping, their tensors do not survive `to_empty`)."""
    return [
        (module, name, module._buffers[name].detach().clone())
        for module in model.modules()
        for name in sorted(module._non_persistent_buffers_set)
        if module._buffers.get(name) is not None
    ]


def broadcast_full_state(
    model: nn.Module, full: dict[str, torch.Tensor], device: torch.device, unsaved: list | None = None
) -> None:
    """Fill a sharded `model` whose ranks other than 0 were built on the meta device: every rank's storage is
    allocated (`to_empty`), rank 0's `full` state (empty elsewhere) is broadcast into the shards
    (`set_model_state_dict(broadcast_from_rank0=True)`), and the buffers no state dict carries (rotary tables:
    `unsaved`, taken before the wrapping) are broadcast from rank 0 too — any family's, a transformers model's
    included."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    family_of(model).after_materialize(unwrap_model(model))
    for module, name, value in unsaved or []:
        buffer = module._buffers[name]
        if dist.get_rank() == 0:
            buffer.copy_(value)
        dist.broadcast(buffer, src=0)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)


class DDPTrainingBackend(DistributedTrainingBackend):
    """DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets during backward.

    With gradient accumulation, only the last of `gradient_accumulation_steps` micro-batches
    synchronises (the others run under `no_sync`), so a step costs one all-reduce.
    """

    def _wrap(self, model: nn.Module, device: torch.device, o: BackendOptions) -> tuple[nn.Module, BackendOptions]:
        self.gradient_accumulation_steps = steps = o.gradient_accumulation_steps
        assert steps >= 1, f"gradient_accumulation_steps must be >= 1, got {steps}"
        ddp = lambda m, block_list: apply_ddp(m, device)  # noqa: E731
        transforms = dict(fp8=o.fp8, activation_checkpointing=o.activation_checkpointing, compile=o.compile)
        return parallelize(model, device, data_parallel=ddp, **transforms), o

    @property
    def eval_model(self) -> nn.Module:
        return self.model.module  # evaluation needs no gradient synchronisation

    @classmethod
    def memory_per_rank(cls, parts: dict[str, float], model: nn.Module, world_size: int, **layout) -> dict[str, float]:
        """Each rank holds the whole model, and DDP's gradient buckets (fp32, one gradient's worth) beside it."""
        if world_size > 1:
            parts["DDP gradient buckets"] = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
        return parts

    def forward_backward(self, batch: Batch, loss_fn: Callable | None = None) -> TrainFuture[dict[str, float]]:
        sync = (self._num_micro_batches + 1) % self.gradient_accumulation_steps == 0
        with contextlib.nullcontext() if sync else self.model.no_sync():
            return super().forward_backward(batch, loss_fn)

    def optim_step(self) -> TrainFuture[dict[str, float]]:
        assert self._num_micro_batches == self.gradient_accumulation_steps, (
            f"DDP synchronises gradients on micro-batch {self.gradient_accumulation_steps} of each step; "
            f"got {self._num_micro_batches} before optim_step()"
        )
        return super().optim_step()


class FSDPTrainingBackend(DistributedTrainingBackend):
    """FSDP2: parameters, gradients and optimizer state sharded across ranks (`fully_shard` per block, then the root).

    `options.compute_dtype=torch.bfloat16` computes in bf16 while the fp32 shards and optimizer state stay
    fp32 and gradients are reduced in `reduce_dtype`. Activation checkpointing, per-block
    `torch.compile` and CPU offload are applied here, outside the model code.
    """

    def _refuse(self, model: nn.Module, options: BackendOptions) -> None:
        if options.compile == "model":  # infra.distributed_type=auto under torchrun (an explicit fsdp: the config's)
            raise ConfigError(
                "infra.compile=model compiles the whole forward in one process or under DDP, not under FSDP2 (which "
                "shards the blocks one by one; infra.distributed_type=auto is FSDP2 under torchrun): use "
                "infra.compile=true (each block), or infra.distributed_type=ddp"
            )

    def _wrap(self, model: nn.Module, device: torch.device, o: BackendOptions) -> tuple[nn.Module, BackendOptions]:
        """`o.broadcast_weights`: `model` holds its weights on rank 0 only (on the meta device elsewhere); the shards
        are filled from rank 0's full copy after sharding (the weights read once per job, not once per rank)."""
        world = dist.get_world_size()
        full = model.state_dict() if o.broadcast_weights and dist.get_rank() == 0 else {}
        unsaved = unsaved_buffers(model) if o.broadcast_weights else []

        def shard(m: nn.Module, block_list) -> None:
            dtypes = o.compute_dtype, o.reduce_dtype
            apply_fsdp(m, world, device.type, *dtypes, o.cpu_offload, block_list(), sharding=o.sharding)

        transforms = dict(fp8=o.fp8, activation_checkpointing=o.activation_checkpointing, compile=o.compile)
        model = parallelize(model, device, data_parallel=shard, **transforms)
        if o.broadcast_weights:
            broadcast_full_state(model, full, device, unsaved)
        self.cpu_offload = o.cpu_offload
        return model, replace(o, compute_dtype=None)  # FSDP2's mixed precision computes in its param dtype

    def _place(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard placed the shards (on the CPU, with offload)

    def sampler_state(self) -> dict[str, torch.Tensor]:
        """Every rank gathers the whole model (fp32, the master weights) for its sampler's copy."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))

    @classmethod
    def memory_per_rank(
        cls,
        parts: dict[str, float],
        model: nn.Module,
        world_size: int,
        compute_bytes: int = 4,
        sharding: str = "FULL_SHARD",
        local_world_size: int | None = None,
        **layout,
    ) -> dict[str, float]:
        """Each rank keeps 1/N of the weights, gradients and optimizer state (N: the ranks of a machine under
        HYBRID_SHARD); gathered in the compute dtype, one block at a time with the next prefetched, or (SHARD_GRAD_OP)
        every block from its forward to its backward."""
        if world_size == 1:
            return parts
        shards = (local_world_size or world_size) if sharding == "HYBRID_SHARD" else world_size
        for name in ("parameters", "gradients", "optimizer state"):
            parts[name] /= shards
        if sharding == "SHARD_GRAD_OP":
            parts["FSDP gathered blocks"] = (
                sum(p.numel() for p in model.parameters()) * compute_bytes * (1 - 1 / shards)
            )
        else:
            block = max((sum(p.numel() for p in b.parameters()) for b in family_of(model).blocks(model)), default=0)
            parts["FSDP gathered blocks"] = block * (2 * compute_bytes + 4) * (1 - 1 / shards)
        return parts

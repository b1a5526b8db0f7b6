"""Tier 2: one call builds a ready backend for the common case.

Each factory is a few tier-1 calls and one tier-0 constructor; drop to those whenever the
defaults do not fit.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from torch.optim.lr_scheduler import LRScheduler

from tierlm.backends.distributed import DDPTrainingBackend, FSDPTrainingBackend
from tierlm.backends.options import BackendOptions
from tierlm.backends.pytorch import PyTorchTrainingBackend
from tierlm.models import load_pretrained_model
from tierlm.primitives.dtype_device import parse_dtype, resolve_device
from tierlm.primitives.losses import create_cross_entropy_loss
from tierlm.primitives.optim import create_adamw_optimizer
from tierlm.primitives.parallel import init_distributed
from tierlm.primitives.schedules import create_warmup_scheduler


def create_pytorch_backend(
    model_name: str,
    checkpoint_dir: Path,
    device_type: str = "auto",
    dtype: str = "bfloat16",
    gpu_rank: int = 0,
    learning_rate: float = 1e-4,
    adam_betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.0,
    loss_fn: Callable | None = None,
    max_grad_norm: float = 1.0,
    trust_remote_code: bool = False,
) -> PyTorchTrainingBackend:
    """Load a model (hub id, transformers folder or tierlm model folder), AdamW, cross-entropy.

    `device_type` is "auto" | "cuda" | "cpu" | "mps"; asking for cuda without a GPU is a
    `DeviceError`, not a crash.

    >>> import tempfile; from pathlib import Path
    >>> from tierlm.models import GPTConfig, build_gpt, save_model_folder
    >>> gpt = build_gpt(GPTConfig(depth=1, aspect_ratio=32, head_dim=16, vocab_size=50, max_seq_len=16))
    >>> folder = save_model_folder(gpt, Path(tempfile.mkdtemp()) / "tiny")
    >>> backend = create_pytorch_backend(
    ...     model_name=str(folder), checkpoint_dir=Path(tempfile.mkdtemp()), device_type="cpu", dtype="float32")
    >>> batch = {"input_ids": torch.randint(0, 50, (2, 8)), "labels": torch.randint(0, 50, (2, 8))}
    >>> metrics = backend.forward_backward(batch).wait()
    >>> sorted(metrics), metrics["num_tokens"]
    (['loss', 'num_tokens'], 16.0)
    >>> sorted(backend.optim_step().wait())
    ['grad_norm', 'loss', 'lr', 'num_tokens', 'skipped']
    """
    torch_dtype = parse_dtype(dtype)
    device = resolve_device(device_type, gpu_rank)
    model = load_pretrained_model(model_name, device=device, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    optimizer = create_adamw_optimizer(model, lr=learning_rate, betas=adam_betas, weight_decay=weight_decay)
    options = BackendOptions(max_grad_norm=max_grad_norm)
    return PyTorchTrainingBackend(
        model, optimizer, loss_fn or create_cross_entropy_loss(), checkpoint_dir, device, None, options
    )


def create_backend_with_scheduler(
    model_name: str,
    checkpoint_dir: Path,
    num_training_steps: int,
    warmup_ratio: float = 0.03,
    device_type: str = "auto",
    dtype: str = "bfloat16",
    gpu_rank: int = 0,
    learning_rate: float = 1e-4,
    adam_betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.0,
    decay_style: str = "cosine",
    min_lr_ratio: float = 0.1,
) -> tuple[PyTorchTrainingBackend, LRScheduler]:
    """`create_pytorch_backend` plus a warmup-then-decay schedule attached to the backend.

    The backend owns the schedule: `backend.optim_step()` advances it once per optimizer step. The returned
    scheduler reads it (`get_last_lr()`, `last_epoch`, `state_dict()`), and its `step()` is a no-op, so a loop that
    also steps its scheduler after each `optim_step` (as the tiered API's own example does) steps it once, not twice.

    >>> import tempfile; from pathlib import Path
    >>> from tierlm.models import GPTConfig, build_gpt, save_model_folder
    >>> gpt = build_gpt(GPTConfig(depth=1, aspect_ratio=32, head_dim=16, vocab_size=50, max_seq_len=16))
    >>> folder = save_model_folder(gpt, Path(tempfile.mkdtemp()) / "tiny")
    >>> backend, scheduler = create_backend_with_scheduler(
    ...     model_name=str(folder), checkpoint_dir=Path(tempfile.mkdtemp()), num_training_steps=100,
    ...     warmup_ratio=0.1, device_type="cpu", dtype="float32", learning_rate=1e-3)
    >>> scheduler.last_epoch, round(backend.optimizer.param_groups[0]["lr"], 6)
    (0, 0.0001)
    """
    backend = create_pytorch_backend(
        model_name=model_name,
        checkpoint_dir=checkpoint_dir,
        device_type=device_type,
        dtype=dtype,
        gpu_rank=gpu_rank,
        learning_rate=learning_rate,
        adam_betas=adam_betas,
        weight_decay=weight_decay,
    )
    num_warmup_steps = max(1, int(num_training_steps * warmup_ratio))
    backend.scheduler = create_warmup_scheduler(
        backend.optimizer, num_warmup_steps, num_training_steps, decay_style=decay_style, min_lr_ratio=min_lr_ratio
    )
    return backend, BackendSchedule(backend.scheduler)


class BackendSchedule:
    """A backend-owned LR scheduler as its caller sees it: everything it reads, and a `step()` that does nothing
    (`optim_step` already stepped it)."""

    def __init__(self, scheduler: LRScheduler):
        self._scheduler = scheduler

    def step(self, *args, **kwargs) -> None:
        return None

    def __getattr__(self, name: str):
        return getattr(self._scheduler, name)


def _model_on_this_rank(
    model_name: str, device_type: str, trust_remote_code: bool
) -> tuple[torch.nn.Module, torch.device]:
    """Join torchrun's process group and load the (fp32) model onto this rank's device."""
    ctx = init_distributed(device_type)
    model = load_pretrained_model(
        model_name, device=ctx.device, dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    return model, ctx.device


def _adamw(learning_rate: float, betas: tuple[float, float], weight_decay: float):
    """AdamW built after wrapping (FSDP2's parameters are the shards)."""
    return lambda model: create_adamw_optimizer(model, lr=learning_rate, betas=betas, weight_decay=weight_decay)


def create_data_parallel_backend(
    model_name: str,
    checkpoint_dir: Path,
    kind: str = "fsdp",
    device_type: str = "auto",
    learning_rate: float = 1e-4,
    adam_betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.0,
    loss_fn: Callable | None = None,
    bf16: bool = True,
    options: BackendOptions | None = None,
    trust_remote_code: bool = False,
) -> FSDPTrainingBackend | DDPTrainingBackend:
    """`create_pytorch_backend` for a torchrun job: joins the process group, loads the model on every rank and trains
    it as `kind` says — "fsdp": sharded by FSDP2 (bf16 compute, fp32 master weights and reduction), AdamW over the
    shards; "ddp": replicated by DistributedDataParallel with bf16 autocast (call `forward_backward`
    `options.gradient_accumulation_steps` times per `optim_step`). `options` (`BackendOptions`): clipping,
    activation checkpointing, compile, CPU offload, ...; `bf16` sets its compute dtype. Run the script with
    `torchrun --nproc_per_node=N script.py`.

        backend = create_fsdp_backend("Qwen/Qwen3-0.6B", Path("ckpt"))
        backend.forward_backward(batch); backend.optim_step()   # batch: this rank's rows
    """
    backend_class = {"fsdp": FSDPTrainingBackend, "ddp": DDPTrainingBackend}[kind]
    model, device = _model_on_this_rank(model_name, device_type, trust_remote_code)
    options = replace(options or BackendOptions(), compute_dtype=torch.bfloat16 if bf16 else None)
    optimizer_fn, loss_fn = _adamw(learning_rate, adam_betas, weight_decay), loss_fn or create_cross_entropy_loss()
    return backend_class(model, optimizer_fn, loss_fn, checkpoint_dir, device, None, options)


def create_fsdp_backend(model_name: str, checkpoint_dir: Path, **settings) -> FSDPTrainingBackend:
    """`create_data_parallel_backend(..., kind="fsdp")`."""
    return create_data_parallel_backend(model_name, checkpoint_dir, "fsdp", **settings)


def create_ddp_backend(model_name: str, checkpoint_dir: Path, **settings) -> DDPTrainingBackend:
    """`create_data_parallel_backend(..., kind="ddp")`."""
    return create_data_parallel_backend(model_name, checkpoint_dir, "ddp", **settings)


def _new_model(model_config, seed: int) -> torch.nn.Module:
    """A fresh model of a native family's config (`GPTConfig`, `GPT2Config`, ...), initialised from `seed`."""
    from tierlm.models import FAMILIES

    family = next((f for f in FAMILIES.values() if getattr(f, "config_class", None) is type(model_config)), None)
    assert family is not None, f"no model family builds a {type(model_config).__name__}"
    torch.manual_seed(seed)
    return family.build_from_config(model_config, "cpu", torch.float32)


def JaxBackend(
    model_config,
    checkpoint_dir: str | Path = "checkpoints",
    learning_rate: float = 1e-3,
    adam_betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    seed: int = 0,
):
    """The trainer API's `JaxBackend(model_config)`: a fresh model of that config trained by JAX (AdamW).

    >>> from tierlm.models import GPTConfig
    >>> backend = JaxBackend(GPTConfig(depth=1, aspect_ratio=32, head_dim=16, vocab_size=50, max_seq_len=16))
    >>> batch = {"input_ids": torch.randint(0, 50, (2, 8)), "labels": torch.randint(0, 50, (2, 8))}
    >>> sorted(backend.forward_backward(batch).wait())
    ['loss', 'num_tokens']
    """
    from tierlm.backends.jax_backend import JaxTrainingBackend

    model = _new_model(model_config, seed)
    optimizer = create_adamw_optimizer(model, lr=learning_rate, betas=adam_betas, weight_decay=weight_decay)
    return JaxTrainingBackend(model, optimizer, checkpoint_dir, options=BackendOptions(max_grad_norm=max_grad_norm))


def PyTorchBackend(
    model_config,
    checkpoint_dir: str | Path = "checkpoints",
    learning_rate: float = 1e-3,
    adam_betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    device_type: str = "auto",
) -> PyTorchTrainingBackend:
    """`JaxBackend`'s twin: a fresh model of `model_config` trained by PyTorch (AdamW) on one device."""
    device = resolve_device(device_type)
    model = _new_model(model_config, seed).to(device)
    optimizer = create_adamw_optimizer(model, lr=learning_rate, betas=adam_betas, weight_decay=weight_decay)
    options = BackendOptions(max_grad_norm=max_grad_norm)
    return PyTorchTrainingBackend(model, optimizer, None, checkpoint_dir, device, None, options)


def MegatronBackend(
    model_config=None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    checkpoint_dir: str | Path = "checkpoints",
    learning_rate: float = 1e-3,
    adam_betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    device_type: str = "auto",
    pipeline_schedule: str = "1F1B",
    pipeline_microbatches: int | None = None,
    bf16: bool = False,
):
    """The trainer API's `MegatronBackend(model_config, tensor_parallel_size=4, pipeline_parallel_size=2)`: a fresh
    model
    of `model_config` (default: the native GPT's defaults) split over the ranks of a torchrun job — pipeline
    stages x tensor parallel x FSDP2 over the rest (`ModelParallelTrainingBackend`: PyTorch's DTensor and
    pipelining, no other runtime), AdamW. Run the script with `torchrun --nproc_per_node=N script.py`; every
    rank of a tensor- or pipeline-parallel group is given the same batch. Without torchrun and with both sizes 1:
    `PyTorchBackend` on one device.
    """
    from tierlm.backends.model_parallel import ModelParallelTrainingBackend
    from tierlm.errors import ConfigError
    from tierlm.models import GPTConfig
    from tierlm.primitives.model_parallel import ParallelDims
    from tierlm.primitives.parallel import launched_distributed

    model_config = model_config if model_config is not None else GPTConfig()
    if not launched_distributed():
        if max(tensor_parallel_size, pipeline_parallel_size) > 1:
            raise ConfigError(
                f"MegatronBackend(tensor_parallel_size={tensor_parallel_size}, "
                f"pipeline_parallel_size={pipeline_parallel_size}) "
                "splits the model over ranks: run the script under `torchrun --nproc_per_node=N`"
            )
        return PyTorchBackend(
            model_config, checkpoint_dir, learning_rate, adam_betas, weight_decay, max_grad_norm, seed, device_type
        )
    ctx = init_distributed(device_type)
    dims = ParallelDims.from_sizes(ctx.world_size, tensor=tensor_parallel_size, pipeline=pipeline_parallel_size)
    options = BackendOptions(
        max_grad_norm=max_grad_norm,
        compute_dtype=torch.bfloat16 if bf16 else None,
        pipeline_schedule=pipeline_schedule,
        pipeline_microbatches=pipeline_microbatches,
        dims=dims,
    )
    model, optimizer_fn = _new_model(model_config, seed), _adamw(learning_rate, adam_betas, weight_decay)
    return ModelParallelTrainingBackend(model, optimizer_fn, None, checkpoint_dir, ctx.device, None, options)

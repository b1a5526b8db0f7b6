"""The tier-0 backend a config asks for: one process, DDP, FSDP2, tensor / pipeline parallel or JAX, with
the optimizer and LR schedule of the config; what a backend cannot do is refused in one line each."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from tierlm.backends.distributed import DDPTrainingBackend, FSDPTrainingBackend, prepare_model
from tierlm.backends.options import BackendOptions
from tierlm.backends.pytorch import PyTorchTrainingBackend
from tierlm.builders.optimizer import model_width, optimizer_settings
from tierlm.builders.stage import Stage
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError
from tierlm.primitives import create_warmup_scheduler
from tierlm.primitives.optim import build_optimizer
from tierlm.primitives.parallel import DistributedContext, launched_distributed


def distributed_kind(config: TierlmConfig, ctx: DistributedContext | None) -> str:
    """ "none" | "ddp" | "fsdp" | "deepspeed" | "model_parallel" (tensor / pipeline / context parallel, FSDP2 for
    the rest) | "expert_parallel" (the experts shared out, DDP for the rest) | "expert_parallel_fsdp" (the experts
    shared out, FSDP2 for the rest)."""
    if ctx is None:
        return "none"
    infra = config.infra
    if infra.model_parallel:
        return "model_parallel"
    if infra.expert_parallel_size > 1:
        return "expert_parallel_fsdp" if infra.distributed_type == "fsdp" else "expert_parallel"
    if infra.distributed_type == "deepspeed":
        return "deepspeed"
    return "fsdp" if infra.distributed_type in ("auto", "fsdp") else "ddp"


SHARDED_KINDS = ("fsdp", "deepspeed", "model_parallel", "expert_parallel", "expert_parallel_fsdp")
"""The kinds whose ranks each hold part of the weights (no rank can sample or probe alone)."""


def backend_options(config: TierlmConfig, broadcast_weights: bool = False) -> BackendOptions:
    """What every backend's constructor takes beside the model, optimizer and schedule, from the config, once."""
    tr, infra = config.training, config.infra
    deepspeed_json = infra.deepspeed_config if infra.distributed_type == "deepspeed" else None
    overrides = read_deepspeed_config(deepspeed_json) if deepspeed_json else None
    return BackendOptions(
        max_grad_norm=tr.max_grad_norm,
        compute_dtype=torch.float16 if tr.fp16 else torch.bfloat16 if tr.bf16 else None,
        loss_scaling=tr.fp16,
        fused_cross_entropy=tr.fused_cross_entropy,
        flash_attention=config.model.use_flash_attention,
        activation_checkpointing=infra.activation_checkpointing,
        compile=infra.compile,
        fp8=tr.fp8,
        async_save=tr.async_save,
        gradient_accumulation_steps=tr.gradient_accumulation_steps,
        cpu_offload=infra.cpu_offload,
        sharding=infra.fsdp_sharding_strategy,
        broadcast_weights=broadcast_weights,
        zero_stage=infra.deepspeed_zero_stage,
        offload_optimizer=infra.deepspeed_offload_optimizer,
        offload_params=infra.deepspeed_offload_params,
        micro_batch_size=tr.per_device_train_batch_size,
        deepspeed_overrides=overrides,
        pipeline_schedule=infra.pipeline_schedule,
        pipeline_microbatches=infra.pipeline_pieces,
        stages_per_rank=infra.stages_per_rank,
        vocab_parallel=infra.vocab_parallel,
        sequence_parallel=infra.sequence_parallel,
        expert_parallel_size=infra.expert_parallel_size,
    )


@dataclass(frozen=True)
class Build:
    """What every backend builder of `BACKENDS` is handed beside the model."""

    config: TierlmConfig
    optimizer_fn: Callable  # model -> optimizer, after wrapping: FSDP2's parameters are the shards
    scheduler_fn: Callable  # optimizer -> LR schedule
    checkpoint_dir: Path
    device: torch.device
    ctx: DistributedContext | None
    options: BackendOptions


NOT_FSDP = "infra.cpu_offload is an FSDP option; set infra.distributed_type=fsdp (under torchrun) or turn it off"


def one_process(model: torch.nn.Module, b: Build):
    if b.options.cpu_offload:
        raise ConfigError(NOT_FSDP)
    o = b.options
    model = prepare_model(model, b.device, o.activation_checkpointing, o.compile, o.fp8)
    optimizer = b.optimizer_fn(model)
    return PyTorchTrainingBackend(model, optimizer, None, b.checkpoint_dir, b.device, b.scheduler_fn(optimizer), o)


def ddp(model: torch.nn.Module, b: Build):
    if b.options.cpu_offload:
        raise ConfigError(NOT_FSDP)
    return DDPTrainingBackend(model, b.optimizer_fn, None, b.checkpoint_dir, b.device, b.scheduler_fn, b.options)


def fsdp(model: torch.nn.Module, b: Build):
    if b.options.loss_scaling:
        raise ConfigError("training.fp16 is for one process or DDP; with FSDP use training.bf16=true")
    return FSDPTrainingBackend(model, b.optimizer_fn, None, b.checkpoint_dir, b.device, b.scheduler_fn, b.options)


def deepspeed(model: torch.nn.Module, b: Build):
    from tierlm.backends.zero import DeepSpeedTrainingBackend

    return DeepSpeedTrainingBackend(model, b.optimizer_fn, None, b.checkpoint_dir, b.device, b.scheduler_fn, b.options)


def expert_parallel(model: torch.nn.Module, b: Build):
    from tierlm.backends.expert_parallel import ExpertParallelTrainingBackend

    if b.options.cpu_offload:
        raise ConfigError(NOT_FSDP)
    return ExpertParallelTrainingBackend(
        model, b.optimizer_fn, None, b.checkpoint_dir, b.device, b.scheduler_fn, b.options
    )


def expert_parallel_fsdp(model: torch.nn.Module, b: Build):
    from tierlm.backends.expert_parallel import ExpertParallelFSDPTrainingBackend

    if b.options.loss_scaling:
        raise ConfigError("training.fp16 is for one process or DDP; with FSDP use training.bf16=true")
    return ExpertParallelFSDPTrainingBackend(
        model, b.optimizer_fn, None, b.checkpoint_dir, b.device, b.scheduler_fn, b.options
    )


def model_parallel(model: torch.nn.Module, b: Build):
    """Pipeline stages x tensor parallel (the family's plans) x FSDP2 over the data-parallel rest; what it does not
    do is refused in one line each."""
    from tierlm.backends.model_parallel import ModelParallelTrainingBackend
    from tierlm.primitives.model_parallel import ParallelDims

    tr, infra = b.config.training, b.config.infra
    dims = ParallelDims.from_sizes(
        b.ctx.world_size, infra.tensor_parallel_size, infra.pipeline_parallel_size, infra.context_parallel_size
    )
    interleaved = infra.pipeline_schedule == "interleaved_1F1B"
    refusals = {
        "infra.context_parallel_size > 1 (ring attention needs SDPA's CUDA flash / efficient kernels; not built)": (
            dims.cp > 1
        ),
        "infra.stages_per_rank > 1 without infra.pipeline_schedule=interleaved_1F1B": (
            infra.stages_per_rank > 1 and not interleaved
        ),
        "training.fp16 (use training.bf16)": tr.fp16,
        "training.fp8": tr.fp8,
        "infra.cpu_offload": infra.cpu_offload,
        f"training.optimizer={tr.optimizer} (AdamW and Muon: AdamWPrune ranks and SPAM clips whole matrices)": (
            tr.optimizer not in ("adamw", "muon")
        ),
        "infra.fsdp_sharding_strategy=HYBRID_SHARD": infra.fsdp_sharding_strategy == "HYBRID_SHARD",
    }
    for what, asked in refusals.items():
        if asked:
            raise ConfigError(
                f"model parallelism does not do {what}: drop it, or train data-parallel (tensor / pipeline sizes 1)"
            )
    options = replace(b.options, dims=dims)
    return ModelParallelTrainingBackend(
        model, b.optimizer_fn, None, b.checkpoint_dir, b.device, b.scheduler_fn, options
    )


BACKENDS: dict[str, Callable[[torch.nn.Module, Build], PyTorchTrainingBackend]] = {
    "none": one_process,
    "ddp": ddp,
    "fsdp": fsdp,
    "deepspeed": deepspeed,
    "model_parallel": model_parallel,
    "expert_parallel": expert_parallel,
    "expert_parallel_fsdp": expert_parallel_fsdp,
}
"""`distributed_kind` -> the builder of its tier-0 backend (infra.backend=jax: `jax_backend`): the one place a
backend is chosen."""


def build_backend(
    config: TierlmConfig,
    model: torch.nn.Module,
    checkpoint_dir: Path,
    device: torch.device,
    ctx: DistributedContext | None,
    broadcast_weights: bool = False,
) -> PyTorchTrainingBackend:
    """The tier-0 backend the config asks for (`BACKENDS`), with the optimizer, LR schedule and options
    (`backend_options`) of the config; `broadcast_weights`: under FSDP2, rank 0 alone holds `model`'s weights
    (`loads_on_rank0_only`)."""
    tr = config.training
    kind = distributed_kind(config, ctx)
    settings = optimizer_settings(config, model_width(model), distributed=kind != "none")  # the plan's values

    def optimizer_fn(m: torch.nn.Module) -> torch.optim.Optimizer:  # after wrapping: FSDP2's parameters are the shards
        return build_optimizer(tr.optimizer, m, settings)

    def scheduler_fn(optimizer: torch.optim.Optimizer):
        return create_warmup_scheduler(
            optimizer,
            tr.warmup_steps,
            tr.num_train_steps,
            tr.lr_scheduler_type,
            tr.min_lr_ratio,
            tr.warmdown_ratio,
            warmup_start_factor=tr.warmup_start_factor,
            momentum_warmup_steps=tr.muon_momentum_warmup_steps,
        )

    options = backend_options(config, broadcast_weights)
    if config.infra.backend == "jax":
        return jax_backend(config, model, checkpoint_dir, kind, optimizer_fn, scheduler_fn, options)
    if tr.fp16 and device.type != "cuda":
        raise ConfigError(
            "training.fp16 (fp16 autocast with loss scaling) needs a CUDA GPU; on CPU use training.bf16=true or neither"
        )
    build = Build(config, optimizer_fn, scheduler_fn, checkpoint_dir, device, ctx, options)
    return BACKENDS[kind](model, build)


def jax_backend(
    config: TierlmConfig,
    model: torch.nn.Module,
    checkpoint_dir: Path,
    kind: str,
    optimizer_fn,
    scheduler_fn,
    options: BackendOptions,
):
    """infra.backend=jax: what it does not do is refused in one line each."""
    from tierlm.backends.jax_backend import JaxTrainingBackend

    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("optax") is None:
        raise ConfigError(
            "infra.backend=jax needs jax and optax: pip install 'tierlm[jax]' (or use infra.backend=pytorch)"
        )

    tr, infra, m = config.training, config.infra, config.model
    refusals = {
        "torchrun (one JAX process uses its local devices)": kind != "none",
        "training.bf16 / fp16 (fp32 only)": tr.bf16 or tr.fp16,
        "training.fp8": tr.fp8,
        "infra.compile (jax.jit compiles)": infra.compile,
        "infra.activation_checkpointing": infra.activation_checkpointing,
        "model.lora": bool(m.lora.r),
        f"training.optimizer={tr.optimizer} (AdamW and Muon)": tr.optimizer not in ("adamw", "muon"),
        "training.muon_refinements (plain Muon)": bool(tr.muon_refinements),
        f"model.dtype={m.dtype} (fp32 only)": m.dtype != "float32",
    }
    for what, asked in refusals.items():
        if asked:
            raise ConfigError(f"infra.backend=jax does not do {what}: drop it or use infra.backend=pytorch")
    optimizer = optimizer_fn(model)
    return JaxTrainingBackend(model, optimizer, checkpoint_dir, scheduler_fn(optimizer), options)


def check_deepspeed(config: TierlmConfig, stage: Stage) -> None:
    """What infra.distributed_type=deepspeed needs, refused in one line: the stage, the launcher, the package,
    and the training settings DeepSpeed's engine does not take from tierlm."""
    tr = config.training
    if not stage.deepspeed:
        raise ConfigError(
            f"tierlm {stage.name} does not run under DeepSpeed (its frozen reference or sampler needs the whole "
            "model beside the partitioned one): use infra.distributed_type=fsdp"
        )
    if not launched_distributed():
        raise ConfigError(
            "infra.distributed_type=deepspeed runs under a launcher: `torchrun --nproc_per_node=N -m tierlm ...` "
            "(or `deepspeed` / `accelerate launch`)"
        )
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("infra.distributed_type=deepspeed needs DeepSpeed: pip install deepspeed")
    if tr.optimizer != "adamw":
        raise ConfigError(
            f"training.optimizer={tr.optimizer} does not partition under DeepSpeed's ZeRO here: use adamw, or FSDP2 "
            "(infra.distributed_type=fsdp) for it"
        )
    refused = [name for name in ("fp16", "fp8", "async_save") if getattr(tr, name)]
    if refused:
        raise ConfigError(
            f"training.{refused[0]} is not available under DeepSpeed: turn it off (bf16 is; saves are synchronous)"
        )
    if config.infra.deepspeed_config is not None:
        read_deepspeed_config(config.infra.deepspeed_config)


def read_deepspeed_config(path: str) -> dict:
    """A DeepSpeed JSON config file as a dict, or one line saying what is wrong with it."""
    try:
        value = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"infra.deepspeed_config: cannot read {path} ({e.strerror or e})") from None
    except ValueError as e:
        raise ConfigError(f"infra.deepspeed_config: {path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"infra.deepspeed_config: {path} must hold a JSON object (DeepSpeed's config)")
    return value

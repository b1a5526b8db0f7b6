"""The tier-0 backend a config asks for: one process, DDP, FSDP2, tensor / pipeline parallel or JAX, with
the optimizer and LR schedule of the config; what a backend cannot do is refused in one line each."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from tierlm.backends.distributed import DDPTrainingBackend, FSDPTrainingBackend, prepare_model
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
    the rest)."""
    if ctx is None:
        return "none"
    infra = config.infra
    if infra.model_parallel:
        return "model_parallel"
    if infra.distributed_type == "deepspeed":
        return "deepspeed"
    return "fsdp" if infra.distributed_type in ("auto", "fsdp") else "ddp"


SHARDED_KINDS = ("fsdp", "deepspeed", "model_parallel")
"""The kinds whose ranks each hold part of the weights (no rank can sample or probe alone)."""


def build_backend(
    config: TierlmConfig,
    model: torch.nn.Module,
    checkpoint_dir: Path,
    device: torch.device,
    ctx: DistributedContext | None,
    broadcast_weights: bool = False,
) -> PyTorchTrainingBackend:
    """The tier-0 backend the config asks for: one process, DDP or FSDP2 (with AC / compile / offload);
    `broadcast_weights`: under FSDP2, rank 0 alone holds `model`'s weights (`loads_on_rank0_only`)."""
    tr, infra = config.training, config.infra

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

    if infra.backend == "jax":
        return jax_backend(config, model, checkpoint_dir, kind, optimizer_fn, scheduler_fn)
    bf16 = torch.bfloat16 if tr.bf16 else None
    scaler = None
    if tr.fp16:
        if device.type != "cuda":
            raise ConfigError(
                "training.fp16 (fp16 autocast with loss scaling) needs a CUDA GPU; on CPU use training.bf16=true or "
                "neither"
            )
        if kind == "fsdp":
            raise ConfigError("training.fp16 is for one process or DDP; with FSDP use training.bf16=true")
        bf16, scaler = torch.float16, torch.amp.GradScaler(device.type)
    if kind == "model_parallel":
        return model_parallel_backend(config, model, checkpoint_dir, device, ctx, optimizer_fn, scheduler_fn, bf16)
    if kind == "deepspeed":
        from tierlm.backends.zero import DeepSpeedTrainingBackend

        return DeepSpeedTrainingBackend(
            model,
            optimizer_fn,
            None,
            checkpoint_dir,
            device,
            scheduler_fn,
            tr.max_grad_norm,
            zero_stage=infra.deepspeed_zero_stage,
            offload_optimizer=infra.deepspeed_offload_optimizer,
            offload_params=infra.deepspeed_offload_params,
            bf16=tr.bf16,
            micro_batch_size=tr.per_device_train_batch_size,
            config_overrides=read_deepspeed_config(infra.deepspeed_config) if infra.deepspeed_config else None,
            fused_cross_entropy=tr.fused_cross_entropy,
            flash_attention=config.model.use_flash_attention,
        )
    if kind == "fsdp":
        return FSDPTrainingBackend(
            model,
            optimizer_fn,
            None,
            checkpoint_dir,
            device,
            scheduler_fn,
            tr.max_grad_norm,
            param_dtype=bf16,
            activation_checkpointing=infra.activation_checkpointing,
            compile=infra.compile,
            cpu_offload=infra.cpu_offload,
            fused_cross_entropy=tr.fused_cross_entropy,
            fp8=tr.fp8,
            sharding=infra.fsdp_sharding_strategy,
            flash_attention=config.model.use_flash_attention,
            async_save=tr.async_save,
            broadcast_weights=broadcast_weights,
        )
    if infra.cpu_offload:
        raise ConfigError(
            "infra.cpu_offload is an FSDP option; set infra.distributed_type=fsdp (under torchrun) or turn it off"
        )
    if kind == "ddp":
        return DDPTrainingBackend(
            model,
            optimizer_fn,
            None,
            checkpoint_dir,
            device,
            scheduler_fn,
            tr.max_grad_norm,
            bf16,
            tr.gradient_accumulation_steps,
            infra.activation_checkpointing,
            infra.compile,
            tr.fused_cross_entropy,
            fp8=tr.fp8,
            grad_scaler=scaler,
            flash_attention=config.model.use_flash_attention,
            async_save=tr.async_save,
        )
    model = prepare_model(model, device, infra.activation_checkpointing, infra.compile, tr.fp8)
    optimizer = optimizer_fn(model)
    return PyTorchTrainingBackend(
        model,
        optimizer,
        None,
        checkpoint_dir,
        device,
        scheduler_fn(optimizer),
        tr.max_grad_norm,
        bf16,
        async_save=tr.async_save,
        fused_cross_entropy=tr.fused_cross_entropy,
        grad_scaler=scaler,
        flash_attention=config.model.use_flash_attention,
    )


def model_parallel_backend(
    config: TierlmConfig,
    model: torch.nn.Module,
    checkpoint_dir: Path,
    device: torch.device,
    ctx: DistributedContext,
    optimizer_fn,
    scheduler_fn,
    bf16: torch.dtype | None,
):
    """Pipeline stages x tensor parallel (the family's plans) x FSDP2 over the data-parallel rest; what it does not
    do is
    refused in one line each."""
    from tierlm.backends.model_parallel import ModelParallelTrainingBackend
    from tierlm.primitives.model_parallel import ParallelDims

    tr, infra = config.training, config.infra
    dims = ParallelDims.from_sizes(
        ctx.world_size, infra.tensor_parallel_size, infra.pipeline_parallel_size, infra.context_parallel_size
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
    return ModelParallelTrainingBackend(
        model,
        optimizer_fn,
        None,
        checkpoint_dir,
        device,
        dims,
        scheduler_fn,
        tr.max_grad_norm,
        param_dtype=bf16,
        activation_checkpointing=infra.activation_checkpointing,
        compile=infra.compile,
        fused_cross_entropy=tr.fused_cross_entropy,
        flash_attention=config.model.use_flash_attention,
        schedule=infra.pipeline_schedule,
        microbatches=infra.pipeline_pieces,
        stages_per_rank=infra.stages_per_rank,
        vocab_parallel=infra.vocab_parallel,
        sequence_parallel=infra.sequence_parallel,
    )


def jax_backend(
    config: TierlmConfig, model: torch.nn.Module, checkpoint_dir: Path, kind: str, optimizer_fn, scheduler_fn
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
        f"model.dtype={m.dtype} (fp32 only)": m.dtype != "float32",
    }
    for what, asked in refusals.items():
        if asked:
            raise ConfigError(f"infra.backend=jax does not do {what}: drop it or use infra.backend=pytorch")
    optimizer = optimizer_fn(model)
    return JaxTrainingBackend(model, optimizer, checkpoint_dir, scheduler_fn(optimizer), tr.max_grad_norm)


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

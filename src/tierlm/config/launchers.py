"""Launchers besides torchrun: `accelerate launch --config_file <accelerate yaml> -m tierlm pretrain ...`.

Accelerate starts the processes as torchrun does (RANK, WORLD_SIZE, MASTER_ADDR, ... in each one's
environment, which tierlm's distributed setup reads) and passes its config file's settings as
environment variables. `accelerate_overrides` turns those into tierlm's config: FSDP (version 2 only:
tierlm shards with FSDP2) with its sharding strategy (or reshard_after_forward), parameter offload, CPU-RAM-efficient
loading and activation checkpointing, its other settings checked against what tierlm does (`FSDP_AS_TIERLM_DOES`),
DeepSpeed with its ZeRO stage, offloads, config file and gradient clipping, and the mixed precision. A
setting the tierlm config also sets explicitly, to another value, is a conflict, refused in one line;
otherwise Accelerate's value is taken.
"""

from __future__ import annotations

from typing import Mapping

from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError

SHARDING = {
    "1": "FULL_SHARD",
    "2": "SHARD_GRAD_OP",
    "4": "HYBRID_SHARD",
    "FULL_SHARD": "FULL_SHARD",
    "SHARD_GRAD_OP": "SHARD_GRAD_OP",
    "HYBRID_SHARD": "HYBRID_SHARD",
}

FSDP_AS_TIERLM_DOES = {
    "FSDP_AUTO_WRAP_POLICY": (("TRANSFORMER_BASED_WRAP",), "tierlm shards each of the model's blocks on its own"),
    "FSDP_BACKWARD_PREFETCH": (("BACKWARD_PRE",), "FSDP2 prefetches the next block's parameters before its backward"),
    "FSDP_FORWARD_PREFETCH": (("false",), "FSDP2 all-gathers each block as the forward reaches it"),
    "FSDP_STATE_DICT_TYPE": (("SHARDED_STATE_DICT",), "checkpoints are DCP's sharded ones (the final model is whole)"),
    "FSDP_USE_ORIG_PARAMS": (("true",), "FSDP2 always trains the original parameters (DTensor shards)"),
    "FSDP_SYNC_MODULE_STATES": (("true", "false"), "every rank starts from the same weights either way"),
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": (("false",), "checkpointed activations stay on the device"),
    "ACCELERATE_DOWNCAST_BF16": (("no", "false"), "downcast_bf16 is for TPUs"),
}
"""Accelerate's other FSDP settings (the variables `accelerate launch` exports from an fsdp_config) -> (the values
tierlm honours, what it does): another value is refused in one line, never silently dropped. (The wrapped layer
classes, fsdp_transformer_layer_cls_to_wrap, need no value: the model's family names its blocks.)"""


def _check_fsdp_settings(env: Mapping[str, str]) -> None:
    for name, (honoured, does) in FSDP_AS_TIERLM_DOES.items():
        value = env.get(name)
        if value is not None and value.strip().lower() not in {h.lower() for h in honoured}:
            key = name.removeprefix("ACCELERATE_").removeprefix("FSDP_").lower()
            raise ConfigError(
                f"the Accelerate config's {'fsdp_' if name.startswith('FSDP_') else ''}{key}: {value} is not what "
                f"tierlm does ({does}): set it to {honoured[0]} or drop it"
            )


def _true(value: str | None) -> bool:
    return str(value).lower() in ("1", "true", "yes")


def accelerate_settings(env: Mapping[str, str]) -> dict[tuple[str, str], object]:
    """{(section, field): value} that an Accelerate launch asks for (empty when not launched by Accelerate).

    >>> settings = accelerate_settings({"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_FSDP": "true",
    ...     "FSDP_VERSION": "2", "FSDP_SHARDING_STRATEGY": "FULL_SHARD", "FSDP_ACTIVATION_CHECKPOINTING": "true"})
    >>> settings[("training", "bf16")]
    True
    """
    out: dict[tuple[str, str], object] = {}
    precision = env.get("ACCELERATE_MIXED_PRECISION")
    if precision is not None:
        if precision not in ("no", "bf16", "fp16"):
            raise ConfigError(
                f"the Accelerate config's mixed_precision {precision!r} is not one tierlm trains with: use no, bf16 or "
                f"fp16"
            )
        out[("training", "bf16")], out[("training", "fp16")] = precision == "bf16", precision == "fp16"
    if _true(env.get("ACCELERATE_USE_FSDP")):
        if env.get("FSDP_VERSION", "1") != "2":
            raise ConfigError(
                "the Accelerate config asks for FSDP version 1; tierlm shards with FSDP2: set fsdp_version: 2 in its "
                "fsdp_config"
            )
        strategy = env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
        if strategy not in SHARDING:
            raise ConfigError(
                f"the Accelerate config's fsdp_sharding_strategy {strategy!r} is not one tierlm's FSDP2 has: "
                "FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD"
            )
        _check_fsdp_settings(env)
        if strategy == "FULL_SHARD" and env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() == "false":
            strategy = "SHARD_GRAD_OP"  # FSDP2's name for it: the gathered parameters kept after the forward
        out[("infra", "distributed_type")] = "fsdp"
        out[("infra", "fsdp_sharding_strategy")] = SHARDING[strategy]
        out[("infra", "cpu_offload")] = _true(env.get("FSDP_OFFLOAD_PARAMS"))
        out[("infra", "cpu_ram_efficient_loading")] = _true(env.get("FSDP_CPU_RAM_EFFICIENT_LOADING"))
        out[("infra", "activation_checkpointing")] = _true(env.get("FSDP_ACTIVATION_CHECKPOINTING"))
    if _true(env.get("ACCELERATE_USE_DEEPSPEED")):
        out.update(deepspeed_settings(env))
    return out


def deepspeed_settings(env: Mapping[str, str]) -> dict[tuple[str, str], object]:
    """An Accelerate DeepSpeed launch's settings (its deepspeed_config section) as tierlm's. `zero3_init_flag` and
    `zero3_save_16bit_model` need no setting: tierlm builds the model before ZeRO partitions it, and always writes
    the whole final model (the fp32 master weights, gathered on rank 0).

    >>> settings = deepspeed_settings({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
    ...     "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_GRADIENT_CLIPPING": "1.0"})
    >>> settings[("infra", "deepspeed_zero_stage")], settings[("infra", "deepspeed_offload_optimizer")]
    (3, True)
    """
    out: dict[tuple[str, str], object] = {("infra", "distributed_type"): "deepspeed"}
    stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage is not None:
        if stage not in ("1", "2", "3"):
            raise ConfigError(
                f"the Accelerate config's zero_stage {stage} is not one tierlm runs under DeepSpeed: use 1, 2 or 3 "
                "(stage 0 is plain data parallelism: infra.distributed_type=ddp)"
            )
        out[("infra", "deepspeed_zero_stage")] = int(stage)
    for variable, field in (
        ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "deepspeed_offload_optimizer"),
        ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "deepspeed_offload_params"),
    ):
        device = env.get(variable, "none").lower()
        if device not in ("none", "cpu"):
            raise ConfigError(
                f"the Accelerate config offloads to {device!r}; tierlm offloads to cpu (or none), not to NVMe"
            )
        out[("infra", field)] = device == "cpu"
    if env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        out[("infra", "deepspeed_config")] = env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]
    for variable, field, kind in (
        ("ACCELERATE_GRADIENT_CLIPPING", "max_grad_norm", float),
        ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "gradient_accumulation_steps", int),
    ):
        if env.get(variable) not in (None, "", "none", "auto"):  # auto: what the tierlm config says
            try:
                out[("training", field)] = kind(env[variable])
            except ValueError:
                raise ConfigError(f"the Accelerate config's {field} {env[variable]!r} is not a number") from None
    return out


def accelerate_overrides(config: TierlmConfig, env: Mapping[str, str]) -> TierlmConfig:
    """`config` with an Accelerate launch's settings, or one line naming the first that conflicts."""
    settings = accelerate_settings(env)
    if not settings:
        return config
    updates: dict[str, dict] = {}
    for (section, field), value in settings.items():
        current = getattr(config, section)
        if field in current.model_fields_set and getattr(current, field) != value:
            raise ConfigError(
                f"the Accelerate config sets {section}.{field}={value} but the tierlm config says "
                f"{getattr(current, field)}: make them agree (or drop it from one of them)"
            )
        updates.setdefault(section, {})[field] = value
    # model_copy keeps which fields the user set (the plan reads that); the values are of the fields' types
    return config.model_copy(update={s: getattr(config, s).model_copy(update=u) for s, u in updates.items()})

"""Field names other configs use, read as tierlm's: Accelerate-style FSDP2 training scripts' (their
`TrainingConfig` / `InfraConfig` dataclasses), so a YAML written for such a script loads as it is, `rl.environment`
(prime-rl's name for the environment an RL run trains on: tierlm's data.dataset_name), and the engine's fields' names
from before the engine section (rl.engine, rl.vllm_url, rl.vllm_gpu_memory_utilization), so older configs and run
folders load.

Each name moves to the tierlm field that means the same; one that the config also sets under tierlm's own name, to
another value, is refused in one line.
"""

from __future__ import annotations

import copy
from typing import Any

from tierlm.errors import ConfigError

MOVED = {
    ("infra", "logging_dir"): ("training", "logging_dir"),
    ("infra", "fsdp_activation_checkpointing"): ("infra", "activation_checkpointing"),
    ("infra", "fsdp_cpu_offload"): ("infra", "cpu_offload"),
    ("rl", "environment"): ("data", "dataset_name"),
    ("rl", "engine"): ("engine", "kind"),  # the engine's fields' names before the engine section
    ("rl", "vllm_url"): ("engine", "vllm_url"),
    ("rl", "vllm_gpu_memory_utilization"): ("engine", "gpu_memory_utilization"),
}
"""(section, the other name) -> (section, tierlm's name)."""


def _put(raw: dict[str, Any], source: str, target: tuple[str, str], value: Any) -> None:
    section, name = target
    if not isinstance(raw.get(section), dict):
        raw[section] = {}
    if name in raw[section] and raw[section][name] != value:
        raise ConfigError(
            f"{source}={value} is tierlm's {section}.{name}, which the config also sets, to {raw[section][name]}: "
            "keep one"
        )
    raw[section][name] = value


def alias_overrides(overrides: list[str] | tuple[str, ...]) -> list[str]:
    """`section.key=value` overrides with the other names renamed to tierlm's.

    >>> alias_overrides(["infra.fsdp_cpu_offload=true", "training.seed=1"])
    ['infra.cpu_offload=true', 'training.seed=1']
    """
    named = []
    for item in overrides:
        key, _, value = item.partition("=")
        moved = MOVED.get(tuple(key.split(".", 1)))
        named.append(f"{'.'.join(moved)}={value}" if moved else item)
    return named


def translate_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` (a config as read) with the other names moved to tierlm's (`training.eval_samples` is a field of its
    own, turned into eval batches by `TrainingConfig`).

    >>> translate_aliases({"infra": {"logging_dir": "./logs", "fsdp_activation_checkpointing": True}})
    {'infra': {'activation_checkpointing': True}, 'training': {'logging_dir': './logs'}}
    """
    if not isinstance(raw, dict):
        return raw
    raw = copy.deepcopy(raw)
    for (section, name), target in MOVED.items():
        if isinstance(raw.get(section), dict) and name in raw[section]:
            _put(raw, f"{section}.{name}", target, raw[section].pop(name))
    return raw

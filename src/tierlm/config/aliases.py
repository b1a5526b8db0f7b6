"""Field names other configs use, read as tierlm's: Accelerate-style FSDP2 training scripts' (their
`TrainingConfig` / `InfraConfig` dataclasses), so a YAML written for such a script loads as it is, `rl.environment`
(prime-rl's name for the environment an RL run trains on: tierlm's data.dataset_name), and the engine's fields' names
from before the engine section (rl.engine, rl.vllm_url, rl.vllm_gpu_memory_utilization), so older configs and run
folders load.

Each name moves to the tierlm field that means the same; one that the config also sets under tierlm's own name, to
another value, is refused in one line. TRL's and Axolotl's names are not read, but named in the line that refuses
them (`OTHER_NAMES`).
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


OTHER_NAMES: dict[str, tuple[str, tuple[str, ...]]] = {
    # TRL (its configs are transformers' TrainingArguments and more): docs/from-trl-axolotl has the whole map
    "max_steps": ("TRL", ("training.num_train_steps",)),
    "optim": ("TRL", ("training.optimizer",)),
    "gradient_checkpointing": ("TRL", ("infra.activation_checkpointing",)),
    "torch_compile": ("TRL", ("infra.compile",)),
    "max_length": ("TRL", ("data.max_seq_length",)),
    "max_seq_length": ("TRL", ("data.max_seq_length",)),
    "truncation_mode": ("TRL", ("data.long_conversations",)),
    "dataset_text_field": ("TRL", ("data.text_column",)),
    "dataset_num_proc": ("TRL", ("data.preprocessing_num_workers",)),
    "assistant_only_loss": ("TRL", ("data.train_on",)),
    "completion_only_loss": ("TRL", ("data.train_on",)),
    "beta": ("TRL", ("dpo.beta", "rl.kl_coef")),
    "loss_type": ("TRL", ("dpo.loss_type", "rl.loss", "training.sft_loss")),
    "num_generations": ("TRL", ("rl.group_size",)),
    "max_completion_length": ("TRL", ("rl.max_new_tokens",)),
    "num_iterations": ("TRL", ("rl.ppo_epochs",)),
    "scale_rewards": ("TRL", ("rl.normalize_std",)),  # group, batch, none: true, batch, false
    "epsilon": ("TRL", ("rl.clip_range",)),
    "epsilon_high": ("TRL", ("rl.clip_high",)),
    "use_vllm": ("TRL", ("engine.kind",)),
    "mask_truncated_completions": ("TRL", ("rl.mask_truncated",)),
    "delta": ("TRL", ("rl.two_sided_clip",)),
    "use_bias_correction_kl": ("TRL", ("rl.unbiased_kl",)),
    "sync_ref_model": ("TRL", ("dpo.reference_sync_steps", "rl.reference_sync_steps")),
    "ref_model_sync_steps": ("TRL", ("dpo.reference_sync_steps", "rl.reference_sync_steps")),
    "ref_model_mixup_alpha": ("TRL", ("dpo.reference_mixup_alpha", "rl.reference_mixup_alpha")),
    # Axolotl
    "base_model": ("Axolotl", ("model.model_name_or_path",)),
    "sequence_len": ("Axolotl", ("data.max_seq_length",)),
    "micro_batch_size": ("Axolotl", ("training.per_device_train_batch_size",)),
    "num_epochs": ("Axolotl", ("training.num_train_epochs",)),
    "lr_scheduler": ("Axolotl", ("training.lr_scheduler_type",)),
    "val_set_size": ("Axolotl", ("data.val_fraction",)),
    "train_on_inputs": ("Axolotl", ("data.train_on",)),
    "lora_r": ("Axolotl", ("model.lora.r",)),
    "lora_alpha": ("Axolotl", ("model.lora.alpha",)),
    "lora_dropout": ("Axolotl", ("model.lora.dropout",)),
    "lora_target_modules": ("Axolotl", ("model.lora.target_modules",)),
    "dpo_beta": ("Axolotl", ("dpo.beta",)),
}
"""Names TRL's and Axolotl's configs give fields that tierlm names otherwise -> (whose, tierlm's keys): not read
as aliases (TRL's `beta` is DPO's beta or GRPO's KL coefficient, and tierlm's sections differ), but named in the
line that refuses the unknown key."""


def other_name_hint(key: str) -> str | None:
    """What an unknown `key` is called in tierlm where its last part is TRL's or Axolotl's name for a field; the key
    in the typed key's own section where the name means one thing there.

    >>> other_name_hint("training.max_steps")
    "TRL's max_steps is training.num_train_steps in tierlm"
    >>> other_name_hint("rl.beta"), other_name_hint("beta")
    ("TRL's beta is rl.kl_coef in tierlm", "TRL's beta is dpo.beta or rl.kl_coef in tierlm")
    """
    section, _, name = key.rpartition(".")
    if name not in OTHER_NAMES:
        return None
    whose, targets = OTHER_NAMES[name]
    here = [t for t in targets if section and t.startswith(f"{section}.")]
    return f"{whose}'s {name} is {' or '.join(here or targets)} in tierlm"


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

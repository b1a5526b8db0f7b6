"""Overrides a command cannot honour are refused in one line, never dropped on the floor.

Every command takes `section.key=value` overrides on top of its config, and each reads only part of the
config: a stage reads the shared sections (model, tokenizer, data, training, infra) and its own (`rl`, `dpo`);
`tierlm eval` reads the tasks and their sampling; a run that starts from model.model_name_or_path keeps the
shape of that model; a command that places or seeds its runs itself (ablate, speedrun) takes
those from its own flags. An override outside what the command reads would change nothing, silently — so it
is refused, naming who reads it or the flag that sets it.

>>> check_overrides("pretrain", ["training.learning_rate=3e-4"], SHARED)
>>> check_overrides("sft", ["dpo.beta=0.2"], SHARED)
Traceback (most recent call last):
...
tierlm.errors.ConfigError: dpo.beta has no effect on `tierlm sft`: dpo.* is read by tierlm dpo; drop it
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tierlm.config import TierlmConfig
from tierlm.config.model import FROM_SCRATCH_FIELDS
from tierlm.errors import ConfigError

SHARED = ("model", "tokenizer", "data", "training", "infra")
"""The sections every stage reads."""
EVAL_KEYS = ("training.seed", "infra.device_type", "infra.gpu_rank", "model.trust_remote_code")
"""What `tierlm eval` reads besides the tasks (data.*) and how it samples them (rl.*, engine.*)."""
READERS = {
    "rl": "tierlm rl and tierlm eval",
    "engine": "tierlm rl and tierlm eval (tierlm chat and serve: --engine)",
    "dpo": "tierlm dpo",
    "rm": "tierlm rm",
    "ablation": "tierlm ablate",
}


def stage_sections(stage) -> tuple[str, ...]:
    """The sections a stage (`tierlm.builders.stage.Stage`) reads: the shared ones and its own."""
    return SHARED + ((stage.section,) if stage.section else ()) + tuple(stage.also_reads)


def override_key(override: str) -> str:
    """>>> override_key(" training.seed = 3")
    'training.seed'
    """
    return override.split("=", 1)[0].strip()


def check_overrides(
    command: str,
    overrides: Iterable[str],
    sections: Iterable[str],
    keys: Iterable[str] = (),
    placed: Mapping[str, str] | None = None,
) -> None:
    """Refuse an override `tierlm <command>` would not read: one it takes from a flag instead (`placed`: key -> what
    to use), or one outside `sections` and the single `keys` it also reads."""
    sections, keys, placed = tuple(sections), tuple(keys), placed or {}
    for key in map(override_key, overrides):
        if key in placed:
            raise ConfigError(f"`tierlm {command}` does not take {key}: {placed[key]}")
        section = key.split(".", 1)[0]
        if section in sections or key in keys:
            continue
        if section in READERS:
            raise ConfigError(
                f"{key} has no effect on `tierlm {command}`: {section}.* is read by {READERS[section]}; drop it"
            )
        reads = ", ".join([f"{s}.*" for s in sections] + list(keys))
        raise ConfigError(f"{key} has no effect on `tierlm {command}`, which reads {reads}; drop it")


def check_starting_model(command: str, config: TierlmConfig, overrides: Iterable[str]) -> None:
    """Refuse an override of a model setting the architecture does not read (model.variant for gpt), or one
    that shapes a model built from scratch when the run starts from a model (model.model_name_or_path) that
    it does not describe: the run trains the model as it is. An override that agrees with the model (one list
    of overrides shared by every stage of a pipeline) is honoured."""
    shaping = [key for key in map(override_key, overrides) if _shapes(key)]
    if not shaping:
        return
    from pathlib import Path

    from tierlm.builders.tokenizer import pretrained_location
    from tierlm.models import family_for_folder, family_named, is_native_folder
    from tierlm.models.transformers.family import check_causal_lm

    start, location = config.model.model_name_or_path, pretrained_location(config)
    native = isinstance(location, Path) and is_native_folder(location)
    family = family_for_folder(location) if native else family_named(config.model.architecture)
    if start is None and not family.native:  # an architecture transformers cannot train is the first thing to say
        check_causal_lm(config.model.architecture, "model.architecture")
    for key in shaping:  # also from scratch: a setting the family does not read changes nothing
        if family.model_fields is not None and key.split(".")[1] not in family.model_fields:
            raise ConfigError(
                f"{key} has no effect on a {family.name} model, which reads "
                f"{', '.join(f'model.{f}' for f in family.model_fields)}; drop it"
            )
    if start is None:
        return
    if family.name == "gpt2" and not native and all(_variant(key) for key in shaping):
        if not isinstance(location, Path):
            raise ConfigError(
                f"{shaping[0]} makes a research variant of a local GPT-2 folder; download {start} first "
                f"(huggingface-cli download {start} --local-dir <folder>) and start from the folder"
            )
        return  # the import makes the variant of the pretrained weights, starting as they are (GPT-2's family)
    if not (native and _describes(config, family, location)):  # tierlm's settings do not describe a transformers model
        raise ConfigError(
            f"{shaping[0]} shapes a model built from scratch, but `tierlm {command}` starts from {start} "
            "(model.model_name_or_path), whose shape is its own and differs: drop it, or drop "
            "model.model_name_or_path to train a new model"
        )


def _variant(key: str) -> bool:
    from tierlm.models.gpt2.family import VARIANT_KEYS

    return key.split(".")[1] in VARIANT_KEYS


def _shapes(key: str) -> bool:
    section, _, field = key.partition(".")
    return section == "model" and field.split(".", 1)[0] in FROM_SCRATCH_FIELDS


def _describes(config: TierlmConfig, family, folder) -> bool:
    """Would `config`'s settings build the model in the tierlm `folder` (of `family`)?"""
    import dataclasses

    sizes = {"vocab_size", "max_seq_len", "block_size", "short_window"}  # the data's and tokenizer's, not the shape's

    def settings(described) -> dict:
        return {k: v for k, v in dataclasses.asdict(described).items() if k not in sizes}

    return settings(family.build(config.model, 8, 8, device="meta").config) == settings(
        family.config_from_folder(folder)
    )


def check_stage_overrides(
    command: str,
    stage,
    config: TierlmConfig,
    overrides: Iterable[str],
    sections: Iterable[str] = (),
    placed: Mapping[str, str] | None = None,
) -> None:
    """Both checks, for a command that runs or plans `stage` with `config` (`sections`: read besides the stage's;
    `placed`: as `check_overrides`)."""
    check_overrides(command, overrides, stage_sections(stage) + tuple(sections), placed=placed)
    check_starting_model(command, config, overrides)

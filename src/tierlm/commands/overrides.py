"""Overrides a command cannot honour are refused in one line, never dropped on the floor.

Every command takes `section.key=value` overrides on top of its config, and each reads only part of the
config: a stage reads the shared sections (model, tokenizer, data, training, infra) and its own (`rl`, `dpo`);
`tierlm eval` reads the tasks and their sampling; a run that starts from model.model_name_or_path keeps the
shape and tokenizer of that model; a command that places or seeds its runs itself (ablate, speedrun) takes
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
"""What `tierlm eval` reads besides the tasks (data.*) and how it samples them (rl.*)."""
READERS = {
    "rl": "tierlm rl and tierlm eval",
    "dpo": "tierlm dpo",
    "ablation": "tierlm ablate",
}


def stage_sections(stage) -> tuple[str, ...]:
    """The sections a stage (`tierlm.build.stage.Stage`) reads: the shared ones and its own."""
    return SHARED + ((stage.section,) if stage.section else ())


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
    """Refuse an override that shapes a model or trains a tokenizer from scratch when the run starts from a
    model (model.model_name_or_path), or uses a given tokenizer (model.tokenizer_name_or_path): those keep their
    own shape and vocabulary."""
    start, tokenizer = config.model.model_name_or_path, config.model.tokenizer_name_or_path
    for key in map(override_key, overrides):
        section, _, field = key.partition(".")
        field = field.split(".", 1)[0]
        if start is not None and section == "model" and field in FROM_SCRATCH_FIELDS:
            raise ConfigError(
                f"{key} shapes a model built from scratch, but `tierlm {command}` starts from {start} "
                "(model.model_name_or_path), which keeps its own shape: drop it, or drop model.model_name_or_path "
                "to train a new model"
            )
        if (start is not None or tokenizer is not None) and section == "tokenizer":
            source = tokenizer or start
            raise ConfigError(
                f"{key} configures a tokenizer trained for the run, but this run uses {source}'s tokenizer: drop it"
            )


def check_stage_overrides(command: str, stage, config: TierlmConfig, overrides: Iterable[str], **extra) -> None:
    """Both checks, for a command that runs or plans `stage` with `config` (`extra`: more sections or `placed`)."""
    sections = stage_sections(stage) + tuple(extra.pop("sections", ()))
    check_overrides(command, overrides, sections, **extra)
    check_starting_model(command, config, overrides)

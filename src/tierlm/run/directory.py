"""Tier 3: what a run directory records and what may continue in it — `run.json`'s fingerprint (stage, model
shape, tokenizer, data), the checks that refuse another run's directory in one line, and the checkpoint a run
resumes from (`training.resume_from_checkpoint`, checked against the run that wrote it)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from tierlm.checkpoint import CHECKPOINTS_DIRNAME, find_latest_checkpoint
from tierlm.checkpoint.verify import MODEL_META_FILE
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError
from tierlm.models import family_named

RUN_FILE = "run.json"


# -- what a run directory records -----------------------------------------------------------
def fingerprint(config: TierlmConfig, stage: str) -> dict[str, Any]:
    """What must stay the same for a run to continue in its directory, keyed by config key.

    >>> fp = fingerprint(TierlmConfig.load(None, ["model.depth=2"]), "pretrain")
    >>> fp["stage"], fp["model.depth"], fp["data.dataset_name"]
    ('pretrain', 2, 'synthetic:arithmetic')
    """
    m, t, d = config.model, config.tokenizer, config.data
    out: dict[str, Any] = {
        "stage": stage,
        "model.model_name_or_path": m.model_name_or_path,
        "model.tokenizer_name_or_path": m.tokenizer_name_or_path,
    }
    if m.model_name_or_path is None:  # from scratch: the shape comes from the config, as the family reads it
        out["model.architecture"] = m.architecture
        out.update(family_named(m.architecture).config_fields(m))
        if m.tokenizer_name_or_path is None:  # a tokenizer trained for this run
            out.update({"tokenizer.kind": t.kind, "tokenizer.vocab_size": t.vocab_size})
    if d.mixture:
        out["data.mixture"] = [  # a component's own split / config only where it names one (older runs match)
            [c.dataset_name, c.weight] + ([c.split, c.dataset_config] if c.split or c.dataset_config else [])
            for c in d.mixture
        ]
    else:
        out["data.dataset_name"] = d.dataset_name
    return out


def recorded_run(output_dir: Path) -> dict[str, Any] | None:
    """The fingerprint a run directory records: its run.json, or (runs from before run.json) the one
    its latest checkpoint's config implies; None for a folder that holds no tierlm run."""
    try:
        recorded = json.loads((output_dir / RUN_FILE).read_text())
        return recorded["fingerprint"]
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{output_dir / RUN_FILE} is not readable ({e}); restore it or choose a new infra.output_dir"
        ) from None
    latest = find_latest_checkpoint(output_dir / CHECKPOINTS_DIRNAME)
    if latest is None:
        return None
    try:
        stage = json.loads((latest / "model" / MODEL_META_FILE).read_text())["stage"]
        return fingerprint(TierlmConfig.from_yaml(latest / "config.yaml"), stage)
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # a run whose checkpoint does not say what it was: nothing to compare


def check_writable(folder: Path) -> None:
    """Refuse a folder this process cannot create files in (probed by making and removing one)."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tierlm-probe-", dir=existing))
    except OSError as e:
        raise ConfigError(f"cannot write in {existing} (for infra.output_dir {folder}): {e.strerror or e}") from None


def check_run_directory(config: TierlmConfig, stage: str) -> Path | None:
    """Refuse an output directory this run must not use; return the checkpoint to resume, if any."""
    out = Path(config.infra.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"infra.output_dir {out} is a file; give a folder for the run")
    check_writable(out.absolute())
    chosen = chosen_checkpoint(config, stage)
    if not out.exists() or not any(out.iterdir()):
        return chosen
    recorded = recorded_run(out)
    if recorded is None:
        raise ConfigError(f"infra.output_dir {out} is not empty and holds no tierlm run; choose a new or empty folder")
    check_same_run(config, stage, recorded, out, "use a new infra.output_dir")
    if chosen is not None:
        return chosen
    latest = find_latest_checkpoint(out / CHECKPOINTS_DIRNAME)
    if latest is not None and config.training.resume == "never":
        raise ConfigError(
            f"{out} already holds checkpoints; use a new infra.output_dir or training.resume=auto to continue"
        )
    return latest


def check_same_run(config: TierlmConfig, stage: str, recorded: dict[str, Any], where: Path, otherwise: str) -> None:
    """Refuse, in one line, a run that would continue one recorded with another stage or shape."""
    mine = fingerprint(config, stage) if recorded else {}
    if recorded and recorded.get("stage") != stage:
        raise ConfigError(
            f"{where} holds a {recorded.get('stage')} run, not {stage}: {otherwise} "
            f"(and model.model_name_or_path={where} to start from it)"
        )
    for key in sorted(set(mine) | set(recorded)):
        if mine.get(key) != recorded.get(key):
            raise ConfigError(
                f"{where} was run with {key}={recorded.get(key)!r}, this command has {mine.get(key)!r}; "
                f"resume with the same value or {otherwise}"
            )


def chosen_checkpoint(config: TierlmConfig, stage: str) -> Path | None:
    """training.resume_from_checkpoint, checked: a sealed checkpoint of a run of this stage and shape."""
    chosen = config.training.resume_from_checkpoint
    if chosen is None:
        return None
    path = Path(chosen)
    if not (path / "meta.json").is_file():
        raise ConfigError(
            f"training.resume_from_checkpoint {path} is not a checkpoint folder (a run's checkpoints/step_N)"
        )
    run = path.parent.parent
    recorded = recorded_run(run) if path.parent.name == CHECKPOINTS_DIRNAME else None
    if recorded is None:
        raise ConfigError(f"training.resume_from_checkpoint {path} is not inside a tierlm run's checkpoints folder")
    check_same_run(config, stage, recorded, run, "start from its model with model.model_name_or_path")
    return path

"""Finding and loading checkpoints: the list of a run's checkpoints and the one to resume (the newest whole one,
falling back past a damaged one), the best by its metric, retention, loading a checkpoint (one file, or sharded
through DCP into any layout of ranks) and the folder a model name means."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from tierlm.checkpoint.core import (
    _STEP_DIR,
    CHECKPOINTS_DIRNAME,
    DEEPSPEED_DIRNAME,
    LATEST_FILE,
    STATE_DIRNAME,
    restore_rng_state,
)
from tierlm.checkpoint.verify import META_FILE, verify_checkpoint
from tierlm.errors import CheckpointError, first_line
from tierlm.models.io import WEIGHTS_FILE, is_native_folder, read_model_state
from tierlm.primitives.expert_parallel import as_dtensors, as_local, expert_shards
from tierlm.primitives.model_parallel import dcp_storable
from tierlm.primitives.optim import inner_optimizers


def list_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """Complete checkpoints (those with meta.json), oldest first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / META_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def resume_candidates(checkpoint_dir: str | Path) -> list[Path]:
    """Checkpoints to resume from, best first: the one `latest` names, then the others newest first."""
    root = Path(checkpoint_dir)
    complete = list_checkpoints(root)[::-1]
    pointer = root / LATEST_FILE
    named = root / pointer.read_text().strip() if pointer.is_file() else None
    return sorted(complete, key=lambda p: p != named)


def find_latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names if it is complete, else the newest complete one, else None."""
    candidates = resume_candidates(checkpoint_dir)
    return candidates[0] if candidates else None


def checkpoint_to_load(path: str | Path | None, checkpoint_dir: str | Path) -> Path:
    """`path`, or (None) the latest complete checkpoint under `checkpoint_dir`; none there is a `CheckpointError`."""
    if path is not None:
        return Path(path)
    latest = find_latest_checkpoint(checkpoint_dir)
    if latest is None:
        raise CheckpointError(f"no complete checkpoint under {checkpoint_dir}")
    return latest


def checkpoint_metric(path: Path) -> float | None:
    try:
        return json.loads((path / META_FILE).read_text()).get("metric")
    except (OSError, ValueError):
        return None


def find_best_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The complete checkpoint with the lowest recorded metric (e.g. val loss), if any has one."""
    scored = [(m, p) for p in list_checkpoints(checkpoint_dir) if (m := checkpoint_metric(p)) is not None]
    return min(scored, key=lambda mp: mp[0])[1] if scored else None


def prune_checkpoints(checkpoint_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints; `latest` and the best are always kept."""
    if keep <= 0:
        return []
    protected = {find_latest_checkpoint(checkpoint_dir), find_best_checkpoint(checkpoint_dir)}
    doomed = [p for p in list_checkpoints(checkpoint_dir)[:-keep] if p not in protected]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into `model` (and optimizer, scheduler, RNG); return its trainer state.

    `model` may be plain, DDP-wrapped or FSDP2-sharded, and the checkpoint full or sharded from
    any number of ranks: torch.distributed.checkpoint's state-dict API places every tensor (in
    a job, every rank calls this).
    """
    path = Path(path)
    problem = verify_checkpoint(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    if (path / DEEPSPEED_DIRNAME).is_dir():
        raise CheckpointError(
            f"{path} was written by DeepSpeed: resume it with infra.distributed_type=deepspeed on as many ranks as "
            "wrote it, or export it (tierlm export) and start from its model"
        )
    try:
        state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)
        trainer_state = json.loads((path / "trainer_state.json").read_text())
        if (path / STATE_DIRNAME).is_dir():
            load_sharded_state(path / STATE_DIRNAME, model, optimizer)
        else:
            load_full_state(path, model, optimizer, state["optimizer"])
    except (OSError, RuntimeError, ValueError, KeyError, TypeError, pickle.UnpicklingError, SafetensorError) as e:
        # weights_only refuses any pickle that is not plain tensors and containers: nothing executes.
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {first_line(e)}") from e
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        restore_rng_state(state["rng"])
    return trainer_state


def load_full_state(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, optimizer_state: dict | None
) -> None:
    """Load a full checkpoint's weights (model/) and optimizer state; a sharded `model` takes its shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from tierlm.models import unwrap_model

    full = StateDictOptions(full_state_dict=True)
    weights = read_model_state(unwrap_model(model), path / "model")
    stage = getattr(unwrap_model(model), "is_pipeline_stage", False)  # one stage's slice of the whole model
    if stage:
        own = set(model.state_dict())
        weights = {name: value for name, value in weights.items() if name in own}
    set_model_state_dict(model, weights, options=full)
    if optimizer is None:
        return
    if all(isinstance(k, int) for k in optimizer_state["state"]):  # written by tierlm <= 0.1: keyed by position
        optimizer.load_state_dict(optimizer_state)
    elif stage:  # the stage's parameters' entries, in its own groups (a subset of the whole model's)
        own = get_optimizer_state_dict(model, inner_optimizers(optimizer))
        set_optimizer_state_dict(
            model, inner_optimizers(optimizer), optimizer_state_slice(optimizer_state, own), options=full
        )
    else:
        set_optimizer_state_dict(model, inner_optimizers(optimizer), optimizer_state, options=full)


def optimizer_state_slice(whole: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """`whole`'s optimizer state (keyed by parameter name) for the parameters of `own` (this model's state
    dict: its groups), each group with `whole`'s hyperparameters for its parameters.

    >>> whole = {"state": {"w": {"step": 1}, "b": {"step": 1}}, "param_groups": [{"lr": 0.1, "params": ["w", "b"]}]}
    >>> optimizer_state_slice(whole, {"state": {}, "param_groups": [{"lr": 0.0, "params": ["w"]}]})
    {'state': {'w': {'step': 1}}, 'param_groups': [{'lr': 0.1, 'params': ['w']}]}
    """
    group_of = {name: group for group in whole["param_groups"] for name in group["params"]}
    groups = [
        {
            **({k: v for k, v in group_of[g["params"][0]].items() if k != "params"} if g["params"] else g),
            "params": g["params"],
        }
        for g in own["param_groups"]
    ]
    return {
        "state": {name: whole["state"][name] for g in groups for name in g["params"] if name in whole["state"]},
        "param_groups": groups,
    }


def load_sharded_state(state_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load torch.distributed.checkpoint shards, resharding to this job's ranks (or one process)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from tierlm.checkpoint.safe_dcp import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata

    metadata = read_dcp_metadata(state_dir)  # refuse a bad index here, in one line, before DCP's own logging of it
    # Flattened optimizer state (hyperparameters per parameter name: tierlm >= 0.3), or the nested form before it.
    flat = StateDictOptions(
        flatten_optimizer_state_dict=any(
            key.startswith("optim.param_groups.") and not key.split(".")[2].isdigit()
            for key in metadata.state_dict_metadata
        )
    )
    shards = expert_shards(model)  # a rank's experts (expert parallelism): read as shards of the whole
    wanted = {"model": as_dtensors(get_model_state_dict(model), shards)}
    if optimizer is not None:
        wanted["optim"] = as_dtensors(
            get_optimizer_state_dict(model, inner_optimizers(optimizer), options=flat), shards
        )
    try:
        with warnings.catch_warnings():  # "loading in a single process" is what we mean without a job
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            storable, restore = dcp_storable(wanted)
            sharded = any(hasattr(v, "device_mesh") for v in wanted["model"].values())  # FSDP's DTensors: a job's load
            reader, planner = SafeFileSystemReader(state_dir), SafeLoadPlanner()
            dcp.load(storable, storage_reader=reader, planner=planner, no_dist=not sharded)
            restore()
    except CheckpointException as e:  # DCP wraps each rank's error (a BaseException): hand on the first as what it is
        failure = next(iter(e.failures.values()))[0] if e.failures else RuntimeError(str(e))
        raise (
            failure
            if isinstance(failure, (OSError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError))
            else RuntimeError(first_line(failure))
        ) from None
    set_model_state_dict(model, as_local(wanted["model"]) if shards else wanted["model"])
    if optimizer is not None:
        optim = as_local(wanted["optim"]) if shards else wanted["optim"]
        set_optimizer_state_dict(model, inner_optimizers(optimizer), optim, options=flat)


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Its weights are in shards (torch.distributed.checkpoint's, or DeepSpeed's partitions), not a model folder."""
    return (Path(path) / STATE_DIRNAME).is_dir() or (Path(path) / DEEPSPEED_DIRNAME).is_dir()


def resolve_model_location(name: str) -> Path | str:
    """A local run, checkpoint or model folder resolved to its model folder, or a hub id as it is.

    A name that is clearly a local path but does not exist is an error, not a hub download: one
    that starts with /, ./, ../ or ~, or whose first component is a local folder (`runs/x` when
    `runs/` exists).
    """
    if Path(name).expanduser().exists():
        return resolve_model_folder(Path(name).expanduser())
    if name.startswith(("/", "./", "../", "~")) or Path(Path(name).parts[0]).is_dir():
        raise CheckpointError(f"{name} does not exist (train that stage first, or fix the path)")
    return name


def resolve_model_folder(path: str | Path) -> Path:
    """The model folder inside a run directory, a checkpoints directory or a checkpoint.

    A model folder is returned as it is; a run directory resolves to its final `model/`, or else
    to the model of its latest checkpoint.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / "config.json").is_file() or is_native_folder(path):
        if not (path / WEIGHTS_FILE).is_file() and is_sharded_checkpoint(path.parent):
            raise CheckpointError(
                f"{path.parent} is a sharded checkpoint: run `tierlm export {path.parent} OUT_DIR` for a model folder"
            )
        return path
    if (path / "model").is_dir():
        return resolve_model_folder(path / "model")
    for checkpoints in (path / CHECKPOINTS_DIRNAME, path):
        latest = find_latest_checkpoint(checkpoints)
        if latest is not None:
            return latest / "model"
    raise CheckpointError(f"{path} holds no model: expected a model folder, a run directory or a checkpoint")


def clean_stale_temporaries(checkpoint_dir: str | Path) -> list[Path]:
    """Remove the hidden folders interrupted saves left behind (`.tmp_step_*`, `.old_step_*`)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    stale = [
        p
        for p in root.iterdir()
        if p.name.startswith((".tmp_step_", ".old_step_")) and p.is_dir() and not p.is_symlink()
    ]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale

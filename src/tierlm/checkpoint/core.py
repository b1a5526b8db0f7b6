"""Checkpoint layout and atomic writes.

    <checkpoint_dir>/
      latest                  the name of the newest complete checkpoint ("step_200")
      step_200/
        model/                a model folder (transformers-loadable; tokenizer beside the weights)
        train_state.pt        optimizer, scheduler and RNG states (tensors and plain types only)
        state/                (sharded checkpoints, from distributed runs) weights and optimizer
                            state as torch.distributed.checkpoint shards; model/ then holds only
                            the config and tokenizer
        trainer_state.json    loop and data-loader state
        meta.json             written last: its presence marks the checkpoint complete; it records
                            every file's size and SHA-256 (a truncated or altered file is caught)
                            and the eval metric

A checkpoint is written into a hidden temporary folder, flushed to disk, renamed into place,
and only then does `latest` move (itself replaced atomically). A crash leaves the old
checkpoint or the new one whole, never a `latest` that points at a partial folder.

Nothing read from a checkpoint can run code: weights are safetensors, `train_state.pt` is read
with `torch.load(weights_only=True)`, sharded state through `safe_dcp` (DCP's pickled index read
with an allow-list), and a checkpoint holding a symbolic link is refused (nothing is followed out
of it). The recorded hashes are an integrity check, not a signature: safety comes from the readers.

Optimizer state is keyed by parameter name (torch.distributed.checkpoint's state-dict API), so
either kind of checkpoint loads into a plain, DDP or FSDP2 model at any world size.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors import SafetensorError
from torch import nn

from tierlm.checkpoint.verify import META_FILE, file_manifest, verify_checkpoint
from tierlm.errors import CheckpointError, first_line
from tierlm.models.io import WEIGHTS_FILE, is_native_folder, read_model_state, save_model_folder
from tierlm.primitives.model_parallel import dcp_storable
from tierlm.primitives.optim import inner_optimizers

CHECKPOINTS_DIRNAME = "checkpoints"
STATE_DIRNAME = "state"
DEEPSPEED_DIRNAME = "deepspeed"  # a DeepSpeed backend's checkpoint: its own partitioned files (tierlm.checkpoint.zero)
LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def capture_rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def replace_folder(tmp: Path, final: Path, old: Path) -> None:
    """Move the finished folder `tmp` to `final`. An existing `final` is first renamed to `old` and
    removed only once the new one is in place: the only good copy is never deleted first."""
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


@dataclass
class Snapshot:
    """Everything a checkpoint holds, as CPU tensors and plain values: safe to write from another thread."""

    model: nn.Module
    model_state: dict[str, torch.Tensor]
    train_state: dict[str, Any]


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def train_state(optimizer_state: dict | None, scheduler: Any | None) -> dict[str, Any]:
    return {
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": capture_rng_state(),
    }


def take_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any | None = None) -> Snapshot:
    """A CPU copy of the model, optimizer (keyed by parameter name), scheduler and RNG states, taken now."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return Snapshot(
        model=model,
        model_state=_to_cpu(model.state_dict()),
        train_state=train_state(_to_cpu(get_optimizer_state_dict(model, inner_optimizers(optimizer))), scheduler),
    )


def save_checkpoint(
    checkpoint_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,
    trainer_state: dict[str, Any] | None = None,
    write_extra: Callable[[Path], None] | None = None,
    metric: float | None = None,
) -> Path:
    """Write `step_<step>` atomically and point `latest` at it. Returns the checkpoint path.

    `write_extra(folder)` adds files (tokenizer, resolved config) before the folder is sealed;
    `metric` (lower is better, e.g. the val loss) lets retention keep the best checkpoint.
    """
    return write_snapshot(
        checkpoint_dir, step, take_snapshot(model, optimizer, scheduler), trainer_state, write_extra, metric
    )


def write_snapshot(
    checkpoint_dir: str | Path,
    step: int,
    snapshot: Snapshot,
    trainer_state: dict[str, Any] | None = None,
    write_extra: Callable[[Path], None] | None = None,
    metric: float | None = None,
) -> Path:
    root = Path(checkpoint_dir)
    tmp = root / f".tmp_step_{step}_{os.getpid()}_{threading.get_ident()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_model_folder(snapshot.model, tmp / "model", state_dict=snapshot.model_state)
        torch.save(snapshot.train_state, tmp / "train_state.pt")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"could not write checkpoint {root / f'step_{step}'}: {e.strerror or e}; older checkpoints are untouched"
        ) from e
    return seal_checkpoint(tmp, root, step, trainer_state, write_extra, metric)


def save_sharded_checkpoint(
    checkpoint_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,
    trainer_state: dict[str, Any] | None = None,
    write_extra: Callable[[Path], None] | None = None,
    metric: float | None = None,
    whole_model: nn.Module | None = None,
    async_group: Any | None = None,
) -> Path | PendingSave:
    """Collective: every rank writes its shards of the weights and optimizer state into `state/`;
    rank 0 writes the model config, scheduler, trainer state and extras and seals the folder
    atomically, as `write_snapshot` does. The checkpoint directory must be shared by all ranks.

    The optimizer state is flattened (its hyperparameters kept per parameter name), so ranks that hold
    different parameters — pipeline stages — write one consistent checkpoint that loads at any layout.
    `whole_model`: the model whose config describes the checkpoint, when `model` is one stage of it.
    `async_group` (a process group of its own, for the background writes' coordination): DCP's async save —
    the shards are staged to CPU memory now and written on a background thread; the returned `PendingSave`
    seals the folder when `finish()`ed (before the next save)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    root, is_main = Path(checkpoint_dir), dist.get_rank() == 0
    tmp = begin_collective_checkpoint(root, step, "sharded", STATE_DIRNAME)
    model_state, optim_state = get_state_dict(
        model, inner_optimizers(optimizer), options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    storable = dcp_storable({"model": model_state, "optim": optim_state})[0]
    described = whole_model if whole_model is not None else model
    extras = train_state(None, scheduler) if is_main else None  # the scheduler and RNG as they are now
    pending = PendingSave(root, step, tmp, described, extras, trainer_state, write_extra, metric, is_main)
    if async_group is not None:
        pending.future = dcp.async_save(storable, checkpoint_id=str(tmp / STATE_DIRNAME), process_group=async_group)
        return pending
    dcp.save(storable, checkpoint_id=str(tmp / STATE_DIRNAME))
    final = pending.finish()
    dist.barrier()
    return final


def begin_collective_checkpoint(root: Path, step: int, kind: str, inner: str | None = None) -> Path:
    """Collective: the hidden folder every rank writes checkpoint `step_<step>` into (with `inner` in it), made
    afresh by rank 0 before any rank writes."""
    import torch.distributed as dist

    tmp = root / f".tmp_step_{step}_{kind}"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / inner if inner else tmp).mkdir(parents=True)
    dist.barrier()
    return tmp


@dataclass
class PendingSave:
    """A sharded checkpoint whose shards are written (or being written, `future`); `finish()` waits for them and, on
    rank 0, writes the config, scheduler, RNG and trainer state and seals it."""

    root: Path
    step: int
    tmp: Path
    model: nn.Module
    extras: dict[str, Any] | None
    trainer_state: dict[str, Any] | None
    write_extra: Callable[[Path], None] | None
    metric: float | None
    is_main: bool
    future: Any = None

    def finish(self) -> Path:
        from tierlm.models import unwrap_model
        from tierlm.models.io import save_model_config

        if self.future is not None:
            self.future.result()  # this rank's shards (rank 0: and the index, once every rank's are written)
        final = self.root / f"step_{self.step}"
        if self.is_main:
            try:
                save_model_config(unwrap_model(self.model), self.tmp / "model")
                torch.save(self.extras, self.tmp / "train_state.pt")
            except OSError as e:
                shutil.rmtree(self.tmp, ignore_errors=True)
                raise CheckpointError(
                    f"could not write checkpoint {final}: {e.strerror or e}; older checkpoints are untouched"
                ) from e
            seal_checkpoint(self.tmp, self.root, self.step, self.trainer_state, self.write_extra, self.metric)
        return final


def seal_checkpoint(
    tmp: Path,
    checkpoint_dir: Path,
    step: int,
    trainer_state: dict[str, Any] | None,
    write_extra: Callable[[Path], None] | None,
    metric: float | None,
) -> Path:
    """Finish a checkpoint written into `tmp`: trainer state, extras, meta.json, fsync, rename, `latest`."""
    root, final = Path(checkpoint_dir), Path(checkpoint_dir) / f"step_{step}"
    try:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state or {}, indent=1) + "\n")
        if write_extra is not None:
            write_extra(tmp)
        meta = {
            "step": step,
            "saved_at": time.time(),
            "metric": metric,
            "native": is_native_folder(tmp / "model"),
            "sharded": (tmp / STATE_DIRNAME).is_dir() or (tmp / DEEPSPEED_DIRNAME).is_dir(),
            **file_manifest(tmp),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        _fsync_tree(tmp)
        replace_folder(tmp, final, root / f".old_step_{step}_{os.getpid()}")  # re-saving the same step swaps
        _write_text_atomic(root / LATEST_FILE, final.name + "\n")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"could not write checkpoint {final}: {e.strerror or e}; older checkpoints are untouched"
        ) from e
    return final


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
    wanted = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        wanted["optim"] = get_optimizer_state_dict(model, inner_optimizers(optimizer), options=flat)
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
    set_model_state_dict(model, wanted["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, inner_optimizers(optimizer), wanted["optim"], options=flat)


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

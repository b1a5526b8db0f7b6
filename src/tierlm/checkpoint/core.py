"""Checkpoint layout and atomic writes.

    <checkpoint_dir>/
      latest                  the name of the newest complete checkpoint ("step_200")
      step_200/
        model/                a model folder (transformers-loadable; tokenizer beside the weights)
        train_state.pt        optimizer, scheduler and RNG states (tensors and plain types only)
        trainer_state.json    loop and data-loader state
        meta.json             written last: its presence marks the checkpoint complete; it records
                            every file's size (a truncated file is caught) and the eval metric

A checkpoint is written into a hidden temporary folder, flushed to disk, renamed into place,
and only then does `latest` move (itself replaced atomically). A crash leaves the old
checkpoint or the new one whole, never a `latest` that points at a partial folder.
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
from torch import nn

from tierlm.errors import CheckpointError, first_line
from tierlm.models.io import is_native_folder, load_model_state, save_model_folder

CHECKPOINTS_DIRNAME = "checkpoints"
LATEST_FILE = "latest"
META_FILE = "meta.json"
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


def take_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any | None = None) -> Snapshot:
    """A CPU copy of the model, optimizer, scheduler and RNG states, taken now."""
    return Snapshot(
        model=model,
        model_state=_to_cpu(model.state_dict()),
        train_state={
            "optimizer": _to_cpu(optimizer.state_dict()),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": capture_rng_state(),
        },
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
    return write_snapshot(checkpoint_dir, step, take_snapshot(model, optimizer, scheduler), trainer_state, write_extra, metric)


def write_snapshot(
    checkpoint_dir: str | Path,
    step: int,
    snapshot: Snapshot,
    trainer_state: dict[str, Any] | None = None,
    write_extra: Callable[[Path], None] | None = None,
    metric: float | None = None,
) -> Path:
    root = Path(checkpoint_dir)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}_{os.getpid()}_{threading.get_ident()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_model_folder(snapshot.model, tmp / "model", state_dict=snapshot.model_state)
        torch.save(snapshot.train_state, tmp / "train_state.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state or {}, indent=1) + "\n")
        if write_extra is not None:
            write_extra(tmp)
        sizes = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        meta = {"step": step, "saved_at": time.time(), "metric": metric, "native": is_native_folder(tmp / "model"), "files": sizes}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step: swap, never delete the only good copy first
            old = root / f".old_step_{step}_{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        _write_text_atomic(root / LATEST_FILE, final.name + "\n")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {final}: {e.strerror or e}; older checkpoints are untouched") from e
    return final


def verify_checkpoint(path: str | Path) -> str | None:
    """None when the checkpoint is complete and every file has the size it was written with, else why not."""
    path = Path(path)
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return f"{path.name} has no readable {META_FILE}"
    for name, size in meta.get("files", {}).items():
        actual = (path / name).stat().st_size if (path / name).is_file() else None
        if actual != size:
            return f"{path.name}/{name} is {'missing' if actual is None else f'{actual} bytes, expected {size}'}"
    return None


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
    """Load a checkpoint into `model` (and optimizer, scheduler, RNG); return its trainer state."""
    path = Path(path)
    problem = verify_checkpoint(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    try:
        load_model_state(model, path / "model")
        state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)
        trainer_state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as e:
        # weights_only refuses any pickle that is not plain tensors and containers: nothing executes.
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {first_line(e)}") from e
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        restore_rng_state(state["rng"])
    return trainer_state


def resolve_model_folder(path: str | Path) -> Path:
    """The model folder inside a run directory, a checkpoints directory or a checkpoint.

    A model folder is returned as it is; a run directory resolves to its final `model/`, or else
    to the model of its latest checkpoint.
    """
    path = Path(path)
    if (path / "config.json").is_file() or is_native_folder(path):
        return path
    if (path / "model").is_dir():
        return resolve_model_folder(path / "model")
    for checkpoints in (path / CHECKPOINTS_DIRNAME, path):
        latest = find_latest_checkpoint(checkpoints)
        if latest is not None:
            return latest / "model"
    raise CheckpointError(f"{path} holds no model: expected a model folder, a run directory or a checkpoint")


def average_checkpoints(paths: list[str | Path], out_dir: str | Path) -> Path:
    """Average the model weights of several checkpoints (or model folders) into a new model folder.

    Tokenizer, config and the native description are taken from the last one; every weight must
    have the same name and shape in all of them.
    """
    from safetensors.torch import load_file, save_file

    if len(paths) < 2:
        raise CheckpointError(f"averaging needs at least 2 checkpoints, got {len(paths)}")
    folders = [resolve_model_folder(p) for p in paths]
    states = []
    for folder in folders:
        try:
            states.append(load_file(folder / "model.safetensors"))
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"cannot read {folder / 'model.safetensors'}: {first_line(e)}") from e
    keys = states[0].keys()
    for folder, state in zip(folders[1:], states[1:]):
        if state.keys() != keys or any(state[k].shape != states[0][k].shape for k in keys):
            raise CheckpointError(f"{folder} does not have the same weights as {folders[0]}; only the same model can be averaged")
    average = {k: (sum(s[k].double() for s in states) / len(states)).to(states[0][k].dtype) for k in keys}
    out = Path(out_dir)
    shutil.copytree(folders[-1], out, dirs_exist_ok=True)
    save_file(average, out / "model.safetensors", metadata={"format": "pt", "averaged_from": ",".join(str(f) for f in folders)})
    return out


def export_checkpoint(path: str | Path, out_dir: str | Path) -> Path:
    """Copy a checkpoint's model folder (weights, config, tokenizer) to `out_dir`.

    The folder loads with `transformers.AutoModelForCausalLM.from_pretrained` and
    `AutoTokenizer.from_pretrained`; a native GPT is written as the equivalent Qwen3 model.
    """
    folder = resolve_model_folder(path)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty; choose a new folder")
    shutil.copytree(folder, out, dirs_exist_ok=True)
    return out

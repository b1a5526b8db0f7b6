"""Checkpoint layout and atomic writes.

    <checkpoint_dir>/
      latest                  the name of the newest complete checkpoint ("step_200")
      step_200/
        model/                a model folder (transformers-loadable; tokenizer beside the weights)
        train_state.pt        optimizer, scheduler and RNG states (tensors and plain types only)
        trainer_state.json    loop and data-loader state
        meta.json             written last: its presence marks the checkpoint complete

A checkpoint is written into a hidden temporary folder, flushed to disk, renamed into place,
and only then does `latest` move (itself replaced atomically). A crash leaves the old
checkpoint or the new one whole, never a `latest` that points at a partial folder.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
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


def save_checkpoint(
    checkpoint_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None = None,
    trainer_state: dict[str, Any] | None = None,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write `step_<step>` atomically and point `latest` at it. Returns the checkpoint path.

    `write_extra(folder)` adds files (tokenizer, resolved config) before the folder is sealed.
    """
    root = Path(checkpoint_dir)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}_{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_model_folder(model, tmp / "model")
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": capture_rng_state(),
            },
            tmp / "train_state.pt",
        )
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state or {}, indent=1) + "\n")
        if write_extra is not None:
            write_extra(tmp)
        meta = {"step": step, "saved_at": time.time(), "native": is_native_folder(tmp / "model")}
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


def find_latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names if it is complete, else the newest complete one, else None."""
    root = Path(checkpoint_dir)
    pointer = root / LATEST_FILE
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / META_FILE).is_file():
            return candidate
    complete = list_checkpoints(root)
    return complete[-1] if complete else None


def prune_checkpoints(checkpoint_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (never the one `latest` names)."""
    if keep <= 0:
        return []
    latest = find_latest_checkpoint(checkpoint_dir)
    doomed = [p for p in list_checkpoints(checkpoint_dir)[:-keep] if p != latest]
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
    if not (path / META_FILE).is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {META_FILE}); pick another or start fresh")
    try:
        load_model_state(model, path / "model")
        state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)
        trainer_state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, RuntimeError, ValueError, KeyError) as e:
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

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

from tierlm.checkpoint.verify import META_FILE, file_manifest
from tierlm.errors import CheckpointError
from tierlm.models.io import is_native_folder, save_model_folder
from tierlm.primitives.expert_parallel import as_dtensors, expert_shards
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
    shards = expert_shards(model)  # a rank's experts (expert parallelism): written as shards of the whole
    model_state, optim_state = as_dtensors(model_state, shards), as_dtensors(optim_state, shards)
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

"""DeepSpeed checkpoints in tierlm's folder: DeepSpeed's own partitioned files under `deepspeed/`, sealed like
every other checkpoint, read back only after each pickle opened safely.

DeepSpeed reads its files with `torch.load(weights_only=False)`, which would run a pickle's code; so before it
does, every `.pt` file is opened with `weights_only=True` and only DeepSpeed's own few classes allowed. Export
consolidates the partitions in one process with DeepSpeed's `zero_to_fp32` (no process group needed).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable

import torch

from tierlm.checkpoint.core import (
    DEEPSPEED_DIRNAME,
    PendingSave,
    begin_collective_checkpoint,
    restore_rng_state,
    train_state,
)
from tierlm.checkpoint.load import checkpoint_to_load
from tierlm.checkpoint.verify import verify_checkpoint
from tierlm.errors import CheckpointError, first_line

TAG = "state"  # DeepSpeed's tag inside deepspeed/ (the step is the checkpoint folder's name)


def save_deepspeed_checkpoint(
    checkpoint_dir: Path,
    step: int,
    engine: Any,
    scheduler: Any | None,
    trainer_state: dict[str, Any],
    write_extra: Callable[[Path], None] | None = None,
    metric: float | None = None,
) -> Path:
    """Collective: every rank writes its ZeRO partitions through `engine.save_checkpoint`; rank 0 adds the model
    config, scheduler, RNG and trainer state and seals the folder atomically. The directory is shared by all ranks."""
    import torch.distributed as dist

    root, is_main = Path(checkpoint_dir), dist.get_rank() == 0
    tmp = begin_collective_checkpoint(root, step, "deepspeed")
    extras = train_state(None, scheduler) if is_main else None  # the scheduler and RNG as they are now
    engine.save_checkpoint(str(tmp / DEEPSPEED_DIRNAME), tag=TAG, save_latest=False)
    final = PendingSave(root, step, tmp, engine.module, extras, trainer_state, write_extra, metric, is_main).finish()
    dist.barrier()
    return final


def load_deepspeed_checkpoint(
    path: str | Path | None, checkpoint_dir: Path, engine: Any, scheduler: Any | None, world_size: int
) -> dict[str, Any]:
    """Load a DeepSpeed checkpoint into `engine` (weights and optimizer partitions), the scheduler and the RNG;
    return its trainer state. The same number of ranks must read it as wrote it."""
    path = checkpoint_to_load(path, checkpoint_dir)
    problem = verify_checkpoint(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    folder = path / DEEPSPEED_DIRNAME
    if not folder.is_dir():
        raise CheckpointError(
            f"{path} was not written by the DeepSpeed backend (no {DEEPSPEED_DIRNAME}/); resume it with the backend "
            "that wrote it, or export it (tierlm export) and start from its model"
        )
    check_deepspeed_pickles(folder)
    saved = len(list((folder / TAG).glob("*optim_states.pt")))
    if saved != world_size:
        raise CheckpointError(
            f"{path} was written by {saved} DeepSpeed ranks and this job has {world_size}; resume with "
            f"--nproc_per_node={saved}, or export it (tierlm export) and start from its model"
        )
    try:
        loaded, _ = engine.load_checkpoint(str(folder), tag=TAG, load_lr_scheduler_states=False)
        state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)
        trainer_state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {first_line(e)}") from e
    if loaded is None:
        raise CheckpointError(f"checkpoint {path} cannot be loaded: DeepSpeed found no state in it")
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    restore_rng_state(state["rng"])
    return trainer_state


@contextlib.contextmanager
def _deepspeed_classes():
    """The classes DeepSpeed's checkpoint pickles hold beside tensors and containers, allowed for one read."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum]):
        yield


def check_deepspeed_pickles(folder: Path) -> None:
    """Open every pickle DeepSpeed will read with `weights_only=True` (its own classes allowed): a file that needs
    anything else to unpickle is refused before DeepSpeed's `weights_only=False` load could run it."""
    for file in sorted(folder.rglob("*.pt")):
        try:
            with _deepspeed_classes():
                torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # whatever stops a safe read is a refusal, never a fallback to an unsafe one
            raise CheckpointError(f"checkpoint file {file} cannot be loaded safely: {first_line(e)}") from e


def consolidated_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights of a DeepSpeed checkpoint, gathered in this one process."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = Path(path) / DEEPSPEED_DIRNAME
    check_deepspeed_pickles(folder)
    return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=TAG)

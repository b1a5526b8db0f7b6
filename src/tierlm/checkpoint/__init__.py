"""Checkpoints: atomic saves, a `latest` pointer, verified resume, retention, averaging, export."""

from tierlm.checkpoint.core import (
    CHECKPOINTS_DIRNAME,
    Snapshot,
    average_checkpoints,
    export_checkpoint,
    find_best_checkpoint,
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    resolve_model_folder,
    resume_candidates,
    save_checkpoint,
    take_snapshot,
    verify_checkpoint,
    write_snapshot,
)

__all__ = [
    "CHECKPOINTS_DIRNAME",
    "Snapshot",
    "average_checkpoints",
    "export_checkpoint",
    "find_best_checkpoint",
    "find_latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "resolve_model_folder",
    "resume_candidates",
    "save_checkpoint",
    "take_snapshot",
    "verify_checkpoint",
    "write_snapshot",
]

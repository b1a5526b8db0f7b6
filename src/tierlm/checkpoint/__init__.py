"""Checkpoints: atomic saves, a `latest` pointer, resume, retention."""

from tierlm.checkpoint.core import (
    CHECKPOINTS_DIRNAME,
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    resolve_model_folder,
    save_checkpoint,
)

__all__ = [
    "CHECKPOINTS_DIRNAME",
    "find_latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "resolve_model_folder",
    "save_checkpoint",
]

"""Checkpoints: atomic saves, a `latest` pointer, verified resume, retention, averaging, export."""

from tierlm.checkpoint.core import (
    CHECKPOINTS_DIRNAME,
    Snapshot,
    save_checkpoint,
    save_sharded_checkpoint,
    take_snapshot,
    write_snapshot,
)
from tierlm.checkpoint.folders import average_checkpoints, export_checkpoint, verified_model_folder
from tierlm.checkpoint.load import (
    checkpoint_to_load,
    clean_stale_temporaries,
    find_best_checkpoint,
    find_latest_checkpoint,
    is_sharded_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    resolve_model_folder,
    resolve_model_location,
    resume_candidates,
)
from tierlm.checkpoint.verify import MODEL_META_FILE, file_manifest, verify_checkpoint

__all__ = [
    "CHECKPOINTS_DIRNAME",
    "MODEL_META_FILE",
    "clean_stale_temporaries",
    "file_manifest",
    "verified_model_folder",
    "Snapshot",
    "is_sharded_checkpoint",
    "average_checkpoints",
    "export_checkpoint",
    "find_best_checkpoint",
    "checkpoint_to_load",
    "find_latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "resolve_model_folder",
    "resolve_model_location",
    "resume_candidates",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "take_snapshot",
    "verify_checkpoint",
    "write_snapshot",
]

"""Reading torch.distributed.checkpoint (DCP) folders without running code from them.

DCP writes its index (`state/.metadata`) with `pickle.dump` and reads it back with `pickle.load`,
and its default planner reads non-tensor items (optimizer hyperparameters) with
`torch.load(weights_only=False)`: a crafted `.metadata` or shard would run any code it names the
moment a checkpoint is resumed or exported. tierlm keeps DCP's format (so its resharding still
works) but reads it through two replacements:

- `SafeFileSystemReader.read_metadata` unpickles with an allow-list: only DCP's own metadata
  dataclasses, `torch.Size`, dtypes, layouts and paths can be constructed, nothing can be called
  (a payload fails with `UnpicklingError` before any of it runs). Every shard the index names
  must be a plain file directly inside the folder, and no storage transform may be requested.
- `SafeLoadPlanner.load_bytes` reads non-tensor items with `torch.load(weights_only=True)`.

Tensor data is read by DCP itself with `torch.load(weights_only=True)` already.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_METADATA, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that can build DCP metadata and nothing else."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def read_dcp_metadata(path: str | Path) -> Metadata:
    """The `Metadata` of a DCP folder's `.metadata`, read with the allow-list above.

    >>> import pickle, tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / ".metadata").write_bytes(pickle.dumps(print))  # anything callable is refused
    >>> read_dcp_metadata(folder)
    Traceback (most recent call last):
    ...
    _pickle.UnpicklingError: builtins.print is not allowed in checkpoint metadata
    """
    folder = Path(path)
    with open(folder / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(
            f"{folder / '.metadata'} does not hold DCP metadata (got {type(metadata).__name__})"
        )
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or Path(relative).name != relative or relative in ("", ".", ".."):
            raise pickle.UnpicklingError(f"{folder / '.metadata'} names a shard outside its folder: {relative!r}")
        shard = folder / relative
        if shard.is_symlink() or not shard.is_file():
            raise pickle.UnpicklingError(
                f"shard {relative} named by {folder / '.metadata'} is not a plain file of the checkpoint"
            )
        if getattr(info, "transform_descriptors", None):
            raise pickle.UnpicklingError(
                f"{folder / '.metadata'} asks for storage transforms {info.transform_descriptors}; tierlm writes none"
            )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read by `read_dcp_metadata` (no arbitrary unpickling)."""

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then never falls back to per-rank metadata files
        metadata = read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items with `weights_only=True`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # DCP's own helper, as its planner uses

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

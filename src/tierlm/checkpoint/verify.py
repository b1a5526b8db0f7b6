"""What tierlm checks before it uses a checkpoint or a model folder it wrote.

`meta.json` (a checkpoint) and the `manifest` in a final model folder's `training_meta.json`
record every file's size and SHA-256. Before a folder is used: every listed file has its size and
content, no symbolic link hides in it (nothing is followed out of it), the weights open as
safetensors and the JSON files parse. The hashes catch damage, not an attacker who can rewrite them
too: safety rests on readers that never run code (see `tierlm.checkpoint.core` and `safe_dcp`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from safetensors import SafetensorError

from tierlm.errors import first_line
from tierlm.models.io import is_native_folder

META_FILE = "meta.json"
MODEL_META_FILE = "training_meta.json"  # in a model folder: the stage that wrote it (and, when final, its manifest)


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_manifest(folder: Path, exclude: tuple[str, ...] = ()) -> dict[str, dict[str, str | int]]:
    """{relative path: size and SHA-256} of every file under `folder` (but `exclude`), for meta.json."""
    files = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_file() and name not in exclude:
            files[name] = path.stat().st_size
    return {"files": files, "sha256": {name: file_sha256(folder / name) for name in files}}


def find_links(folder: Path) -> list[Path]:
    """Symbolic links anywhere under `folder` (never followed)."""
    links = []
    for root, dirs, files in os.walk(folder):
        links += [Path(root) / n for n in dirs + files if (Path(root) / n).is_symlink()]
    return links


def check_manifest(folder: Path, meta: dict) -> str | None:
    """None when every file `meta` lists has its recorded size and hash, and no link hides in `folder`; else why not."""
    links = find_links(folder)
    if links:
        return f"{links[0].relative_to(folder)} is a symbolic link; tierlm never writes links into a checkpoint"
    for name, size in meta.get("files", {}).items():
        actual = (folder / name).stat().st_size if (folder / name).is_file() else None
        if actual != size:
            return f"{name} is {'missing' if actual is None else f'{actual} bytes, expected {size}'}"
    for name, digest in meta.get("sha256", {}).items():
        if file_sha256(folder / name) != digest:
            return f"{name} does not have the content it was saved with (SHA-256 differs)"
    return None


def verify_checkpoint(path: str | Path) -> str | None:
    """None when the checkpoint is complete and every file has the size and content it was written
    with (and no symbolic link hides in it), else why not."""
    path = Path(path)
    try:
        meta = json.loads((path / META_FILE).read_text())
        assert isinstance(meta, dict), "meta.json must hold an object"
        problem = check_manifest(path, meta)
    except (OSError, ValueError, AssertionError, AttributeError, TypeError):
        return f"{path.name} has no readable {META_FILE}"
    return f"{path.name}/{problem}" if problem else None


def check_file_formats(folder: Path) -> str | None:
    """None when the weights open as safetensors and every JSON file parses (read, never executed); else why not."""
    from safetensors import safe_open

    for weights in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(weights, framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            return f"{weights.name} is not a safetensors file ({first_line(e)})"
    for name in sorted(folder.glob("*.json")):
        try:
            json.loads(name.read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:
            return f"{name.name} is not valid JSON ({first_line(e)})"
    return None


def verify_model_folder(folder: Path) -> str | None:
    """For a model folder tierlm finished (training_meta.json with a manifest): its files and links checked."""
    meta_file = folder / MODEL_META_FILE
    if not meta_file.is_file():
        links = find_links(folder)
        return None if not links or not is_tierlm_folder(folder) else f"{links[0].name} is a symbolic link"
    try:
        meta = json.loads(meta_file.read_text())
        assert isinstance(meta, dict), "training_meta.json must hold an object"
        return check_manifest(folder, meta.get("manifest", {}))
    except (OSError, ValueError, AssertionError, AttributeError, TypeError):
        return f"{MODEL_META_FILE} is not readable"


def is_tierlm_folder(folder: Path) -> bool:
    return (folder / MODEL_META_FILE).is_file() or is_native_folder(folder)

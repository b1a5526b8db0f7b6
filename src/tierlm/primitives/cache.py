"""Where tierlm keeps what it computed once and reads back: `TIERLM_CACHE_DIR`, else `$XDG_CACHE_HOME/tierlm`, else
~/.cache/tierlm, one folder a use; `TIERLM_CACHE_DIR=off` keeps nothing. The uses: the memory planner's traced steps
(`tierlm.plan.memory.traces`, `memory-traces/`), the evaluation harness's task index (`tierlm.commands.harness`,
`harness-tasks/`) and the JAX backend's compiled programs (`tierlm.backends.jax_backend`, `jax-compilation/`). A kept
file is a copy of something tierlm can compute again: one that cannot be read or written is passed over, never an
error."""

from __future__ import annotations

import os
from pathlib import Path


def cache_folder(use: str, environ=os.environ) -> Path | None:
    """The folder of one use of the cache (module docstring); None when `TIERLM_CACHE_DIR=off`.

    >>> cache_folder("x", {"TIERLM_CACHE_DIR": "off"}) is None, str(cache_folder("x", {"TIERLM_CACHE_DIR": "/tmp/c"}))
    (True, '/tmp/c/x')
    >>> str(cache_folder("x", {"XDG_CACHE_HOME": "/h"})), str(cache_folder("x", {"HOME": "/u"})).endswith("tierlm/x")
    ('/h/tierlm/x', True)
    """
    chosen = environ.get("TIERLM_CACHE_DIR")
    if chosen is not None and chosen.lower() in ("off", "0", "none", ""):
        return None
    root = Path(chosen) if chosen else Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierlm"
    return root / use


def keep(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all (another process may be reading or writing the same file); a
    folder that cannot be written to is passed over.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> keep(folder / "a" / "b.bin", b"kept"); (folder / "a" / "b.bin").read_bytes(), sorted(os.listdir(folder / "a"))
    (b'kept', ['b.bin'])
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_bytes(data)
        os.replace(partial, path)
    except OSError:
        pass

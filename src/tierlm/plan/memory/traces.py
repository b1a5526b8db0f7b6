"""Traced steps kept on disk. `trace_step` runs every op of a training step through PyTorch's `MemTracker` on fake
tensors: seconds at every run's start (its per-op bookkeeping, not the model's size, is the cost). The same config
at the same shapes, traced by the same tierlm, torch and transformers, gives the same bytes, so a trace made once is
read back: a resumed or repeated run, the other ranks of a machine, the auto batch size's search over row counts.

The key holds everything the trace reads — the whole config but its output folder, the stage, the shapes, a model
folder's JSON files (its architecture; the weights are never read) — and the versions of what computes it (tierlm's
own source, hashed, torch and transformers), so a changed line of tierlm traces afresh. Where: `TIERLM_CACHE_DIR`,
else `$XDG_CACHE_HOME/tierlm`, else ~/.cache/tierlm, under `memory-traces/`, one small JSON file a trace;
`TIERLM_CACHE_DIR=off` turns it off. A file that cannot be read or written is passed over, never an error.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch


def cache_folder(environ=os.environ) -> Path | None:
    """Where traces are kept (module docstring); None when `TIERLM_CACHE_DIR=off`.

    >>> cache_folder({"TIERLM_CACHE_DIR": "off"}) is None, str(cache_folder({"TIERLM_CACHE_DIR": "/tmp/c"}))
    (True, '/tmp/c/memory-traces')
    >>> str(cache_folder({"XDG_CACHE_HOME": "/x"}))
    '/x/tierlm/memory-traces'
    """
    chosen = environ.get("TIERLM_CACHE_DIR")
    if chosen is not None and chosen.lower() in ("off", "0", "none", ""):
        return None
    root = Path(chosen) if chosen else Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierlm"
    return root / "memory-traces"


@functools.cache
def code_version() -> str:
    """tierlm's source (every .py file of the package, hashed), torch's and transformers' versions."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[2]  # tierlm/
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    try:
        import transformers

        theirs = transformers.__version__
    except ImportError:
        theirs = "none"
    return f"{digest.hexdigest()[:16]}/torch {torch.__version__}/transformers {theirs}"


def trace_key(config, stage, vocab_size: int, rows: int, tokens: int, pretrained, generation) -> str:
    """The trace's inputs, hashed (module docstring).

    >>> from tierlm.config import TierlmConfig
    >>> a = TierlmConfig.model_validate({"infra": {"output_dir": "runs/a"}})
    >>> b = TierlmConfig.model_validate({"infra": {"output_dir": "runs/b"}})
    >>> trace_key(a, None, 64, 2, 16, None, None) == trace_key(b, None, 64, 2, 16, None, None)
    True
    >>> trace_key(a, None, 64, 2, 16, None, None) == trace_key(a, None, 64, 4, 16, None, None)
    False
    """
    settings = config.model_dump(mode="json")
    settings["infra"].pop("output_dir", None)
    model_files = {}
    if isinstance(pretrained, Path):
        for path in sorted([*pretrained.glob("*.json"), *pretrained.glob("*/*.json")]):
            model_files[str(path.relative_to(pretrained))] = hashlib.sha256(path.read_bytes()).hexdigest()
    inputs = {
        "config": settings,
        "stage": None if stage is None else f"{type(stage).__module__}.{type(stage).__qualname__}:{stage.name}",
        "shape": [vocab_size, rows, tokens, list(generation) if generation else None],
        "pretrained": model_files if isinstance(pretrained, Path) else pretrained,
        "code": code_version(),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def cached_trace(key: str, trace: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The trace kept under `key`, else `trace()`'s result, kept (written whole or not at all)."""
    folder = cache_folder()
    path = None if folder is None else folder / f"{key}.json"
    if path is not None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    result = trace()
    if path is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
            partial.write_text(json.dumps(result))
            os.replace(partial, path)
        except OSError:
            pass
    return result


def kept_on_disk(trace: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """`trace_step` (its arguments: config, stage, vocab_size, rows, tokens, pretrained, generation, fake) made to
    keep its fake traces and read them back (`cached_trace`); a real one (fake=False) always runs."""
    signature = inspect.signature(trace)

    @functools.wraps(trace)
    def kept(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if not a["fake"]:
            return trace(*args, **kwargs)
        key = trace_key(
            a["config"], a["stage"], a["vocab_size"], a["rows"], a["tokens"], a["pretrained"], a["generation"]
        )
        return cached_trace(key, lambda: trace(*args, **kwargs))

    return kept

"""Traced steps kept on disk. `trace_step` runs every op of a training step through PyTorch's `MemTracker` on fake
tensors: seconds at every run's start (its per-op bookkeeping, not the model's size, is the cost). The same config
at the same shapes, traced by the same tierlm, torch and transformers, gives the same bytes, so a trace made once is
read back: a resumed or repeated run, the other ranks of a machine, the auto batch size's search over row counts.

The key holds everything the trace reads — the config but what never reaches the traced step (`UNTRACED`: how long
the run trains, when it saves, evaluates and logs, its seeds and learning rates, how much data it reads, where it
writes), the stage, the shapes, a model folder's JSON files (its architecture; the weights are never read) — and
the versions of what computes it (tierlm's own source, hashed, torch and transformers), so a changed line of tierlm
traces afresh, while the same run with another seed, learning rate or length reads its trace back. Where:
`TIERLM_CACHE_DIR`, else `$XDG_CACHE_HOME/tierlm`, else ~/.cache/tierlm, under `memory-traces/`, one small JSON file
a trace; `TIERLM_CACHE_DIR=off` turns it off. A file that cannot be read or written is passed over, never an error.
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

from tierlm.primitives import cache


def cache_folder(environ=os.environ) -> Path | None:
    """Where traces are kept (module docstring); None when `TIERLM_CACHE_DIR=off`.

    >>> cache_folder({"TIERLM_CACHE_DIR": "off"}) is None, str(cache_folder({"TIERLM_CACHE_DIR": "/tmp/c"}))
    (True, '/tmp/c/memory-traces')
    """
    return cache.cache_folder("memory-traces", environ)


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


# Settings the traced step never reads, by config section: the schedule, saving, evaluation and logging, seeds,
# learning rates (scalars in the update: the same bytes), data amounts (the trace's shapes come as rows and tokens),
# sampling and evaluation settings, the ablation's list, where the run writes and how it reports progress.
UNTRACED = {
    "training": (
        "learning_rate", "matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "num_train_steps",
        "num_train_epochs", "warmup_steps", "warmup_ratio", "warmup_start_factor", "lr_scheduler_type", "min_lr_ratio",
        "warmdown_ratio", "muon_momentum_warmup_steps", "save_steps", "save_total_limit", "save_best",
        "average_last_n", "max_consecutive_nonfinite", "eval_steps", "eval_batches", "eval_samples",
        "per_device_eval_batch_size", "sample_prompts", "sample_max_new_tokens", "core_bundle", "core_steps",
        "core_max_per_task", "logging_steps", "report_to", "logging_dir", "seed", "resume", "resume_from_checkpoint",
    ),
    "infra": (
        "output_dir", "progress_bar", "peak_tflops", "num_threads", "dist_timeout_s", "hang_timeout", "max_memory_gb",
        "wandb_project", "wandb_run_name", "wandb_entity",
    ),
    "data": ("num_synthetic_examples", "num_synthetic_eval_examples", "val_fraction", "eval_stream_examples"),
    "rl": ("eval_problems", "eval_k", "eval_temperature", "sandbox_workers"),
    "ablation": ("variants", "seeds"),
}  # fmt: skip


def trace_key(config, stage, vocab_size: int, rows: int, tokens: int, pretrained, generation) -> str:
    """The trace's inputs, hashed (module docstring).

    >>> from tierlm.config import TierlmConfig
    >>> a = TierlmConfig.model_validate({"infra": {"output_dir": "runs/a"}})
    >>> b = TierlmConfig.model_validate({"infra": {"output_dir": "runs/b"}})
    >>> trace_key(a, None, 64, 2, 16, None, None) == trace_key(b, None, 64, 2, 16, None, None)
    True
    >>> trace_key(a, None, 64, 2, 16, None, None) == trace_key(a, None, 64, 4, 16, None, None)
    False
    >>> c = TierlmConfig.model_validate({"training": {"seed": 7, "learning_rate": 0.1, "num_train_steps": 9}})
    >>> trace_key(a, None, 64, 2, 16, None, None) == trace_key(c, None, 64, 2, 16, None, None)
    True
    """
    settings = config.model_dump(mode="json")
    for section, names in UNTRACED.items():
        for name in names:
            settings[section].pop(name)  # a KeyError here: a field renamed, to be renamed here too
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
        cache.keep(path, json.dumps(result).encode())
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

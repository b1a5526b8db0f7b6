"""Memory readings and the memory utilities: resident set size and device memory
(`get_memory_stats`, `log_memory_stats`, `clear_memory`), a quick formula for a transformer's
training memory (`estimate_model_memory`; `tierlm.plan.memory.estimate_run_memory` traces a
config's own step instead), and `auto_find_batch_size`.
"""

from __future__ import annotations

import ctypes
import gc
import logging
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

CPU_FRAMEWORK_BYTES = 48 * 2**20
"""On CPU, what a run adds beyond its tensors once everything is imported (autograd engine, OpenMP
pools, kernel workspaces, Python objects): measured, a one-layer model's run grows by 46 MB (53 MB
for an FSDP rank) over the import baseline (bench/memory.py's probe)."""
CPU_RETENTION = 0.4
"""On CPU, glibc's heap keeps freed activation memory resident (its mmap threshold rises to the
largest freed block, so later activations come from the heap and leave holes): measured over the
configs of bench/memory.py, the peak RSS exceeds the live tensors by 0.23 (GPT-2, Qwen3) to 0.5
(the native GPT, one process or an FSDP rank) of one micro-batch's activations; 0.4 centres the
estimates (run to run, the same config varies by about 5%; docs/benchmarks.md)."""
CPU_RETENTION_RECOMPUTE = 0.55
"""The same under activation checkpointing, as a share of the activations without it: the blocks
recomputed in the backward cycle that volume through the heap a second time (measured likewise)."""


def rss_mb() -> float:
    """This process's resident memory in MB (Linux /proc; 0 where unavailable).

    >>> rss_mb() > 0
    True
    """
    return _status_mb("VmRSS")


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB (the kernel's high-water mark; 0 where unavailable).

    >>> peak_rss_mb() >= rss_mb() > 0
    True
    """
    return _status_mb("VmHWM")


def _status_mb(field: str) -> float:
    """A "kB" field of Linux's /proc/self/status, in MB (0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def get_memory_stats() -> dict[str, Any]:
    """Memory now, in GB (1e9 bytes): on CUDA the seed's allocated / reserved / max_allocated;
    everywhere this process's RSS, its peak, and what the machine (or cgroup) still has.

    >>> stats = get_memory_stats()
    >>> stats["rss_gb"] > 0, "gpu_available" in stats
    (True, True)
    """
    stats: dict[str, Any] = {
        "gpu_available": torch.cuda.is_available(),
        "rss_gb": rss_mb() * 2**20 / 1e9,
        "peak_rss_gb": peak_rss_mb() * 2**20 / 1e9,
    }
    available = available_memory_bytes(torch.device("cpu"))
    if available is not None:
        stats["available_gb"] = available / 1e9
    if torch.cuda.is_available():
        stats.update(
            allocated_gb=torch.cuda.memory_allocated() / 1e9,
            reserved_gb=torch.cuda.memory_reserved() / 1e9,
            max_allocated_gb=torch.cuda.max_memory_allocated() / 1e9,
        )
    return stats


def log_memory_stats(prefix: str = "") -> dict[str, Any]:
    """Log `get_memory_stats()` in one line (logger "tierlm.metrics.memory", level INFO); returns them."""
    stats = get_memory_stats()
    parts = [f"rss={stats['rss_gb']:.2f}GB", f"peak_rss={stats['peak_rss_gb']:.2f}GB"]
    if stats["gpu_available"]:
        parts = [
            f"allocated={stats['allocated_gb']:.2f}GB",
            f"reserved={stats['reserved_gb']:.2f}GB",
            f"max={stats['max_allocated_gb']:.2f}GB",
            *parts,
        ]
    logger.info(f"{prefix}Memory: {', '.join(parts)}")
    return stats


def clear_memory() -> None:
    """Collect garbage; on CUDA empty the cache and reset the peak; on Linux CPU return the heap's
    free pages to the system (glibc's malloc_trim), which glibc otherwise keeps resident."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def auto_find_batch_size(
    model: torch.nn.Module,
    sample_batch_fn: Callable[[int], dict],
    start_batch_size: int = 32,
    min_batch_size: int = 1,
    loss_of: Callable[[Any], torch.Tensor] | None = None,
    available: int | None = None,
    margin: float = 0.2,
    predict_on_cpu: bool = True,
) -> int:
    """The largest batch size from `start_batch_size` down (halving) whose forward and backward
    run (Accelerate's `find_executable_batch_size`, started at the planner's size). `sample_batch_fn(n)` makes a
    batch of n; `loss_of(outputs)` reads the
    loss (default: `outputs.loss`, a tensor, or the first element of a tuple).

    On CUDA a size that runs out of memory is halved and retried, as in the seed. On CPU running
    out of memory kills the process instead of raising, so the size is predicted first: the peak
    tensor memory of one step at the smallest size and at twice it (PyTorch's MemTracker) gives
    a per-sample cost, glibc's retained heap is added (`CPU_RETENTION`), and the largest halving
    of `start_batch_size` that fits `available` bytes (default: free RAM) less `margin` is run once
    (`predict_on_cpu=False`: `start_batch_size` was predicted already, by the memory planner).

    >>> model = torch.nn.Linear(8, 1)
    >>> def batch(n): return {"input": torch.randn(n, 8)}
    >>> auto_find_batch_size(model, batch, start_batch_size=64, loss_of=lambda out: out.sum())
    64
    """
    read_loss = loss_of or _loss_of
    device = next(model.parameters()).device

    def run(n: int) -> None:
        batch = sample_batch_fn(n)
        outputs = model(**batch)
        read_loss(outputs).backward()
        model.zero_grad(set_to_none=True)

    size = start_batch_size
    if device.type == "cpu" and predict_on_cpu:
        size = _predicted_cpu_batch(run, start_batch_size, min_batch_size, available, margin)
    while size >= min_batch_size:
        try:
            clear_memory()
            with torch.random.fork_rng(
                devices=[device] if device.type == "cuda" else []
            ):  # the search draws no training randomness
                run(size)
            clear_memory()
            logger.info(f"Batch size {size} works!")
            return size
        except torch.cuda.OutOfMemoryError:
            logger.warning(f"Batch size {size} OOM, trying smaller...")
            model.zero_grad(set_to_none=True)
            size //= 2
            clear_memory()
    raise RuntimeError(f"Could not find working batch size >= {min_batch_size}")


def _loss_of(outputs: Any) -> torch.Tensor:
    if hasattr(outputs, "loss"):
        return outputs.loss
    if isinstance(outputs, tuple):
        return outputs[0]
    return outputs


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def tracked_peak(fns: list[Callable[[], Any]], *tracked) -> dict[str, int]:
    """Run `fns` in turn under one PyTorch `MemTracker`: the bytes at their peak by category
    ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other", "Total"), summed
    over devices. `tracked`: modules and optimizers whose existing tensors count too (others that
    exist before are not counted).

    >>> layer = torch.nn.Linear(256, 256)
    >>> peak = tracked_peak([lambda: layer(torch.randn(64, 256)).sum().backward()], layer)
    >>> peak["Parameter"] == (256 * 256 + 256) * 4, peak["Total"] > peak["Parameter"] + 64 * 256 * 4
    (True, True)
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    if tracked:
        tracker.track_external(*tracked)
    # MemTracker hooks the gradient of each parameter when its module first runs, and a frozen one (LoRA's
    # base) refuses hooks: it is marked as hooked already. The trainable ones are hooked up front, since a
    # LoRA reference pass (adapters off) freezes the adapters for its duration.
    modules = [t for t in tracked if isinstance(t, torch.nn.Module)]
    for param in (p for module in modules for p in module.parameters() if not p.requires_grad):
        tracker._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
    with tracker:
        for module in modules:
            tracker._track_module_params_and_buffers(module)
        for i, fn in enumerate(fns):
            if i:
                tracker.reset_mod_stats()  # the same modules run again: a new pass for the tracker
            fn()
    out: dict[str, int] = {}
    for per_device in tracker.get_tracker_snapshot("peak").values():
        for kind, b in per_device.items():
            key = getattr(kind, "value", kind)
            out[key] = out.get(key, 0) + int(b)
    return out


def _predicted_cpu_batch(
    run: Callable[[int], None], start: int, minimum: int, available: int | None, margin: float
) -> int:
    """The largest halving of `start` (not below `minimum`) predicted to fit in `available` bytes
    (the model's weights are resident already: only what a step allocates counts)."""
    available = available if available is not None else available_memory_bytes(torch.device("cpu"))
    if available is None:
        return start

    def peak(n: int) -> float:
        with torch.random.fork_rng(devices=[]):
            return float(tracked_peak([lambda: run(n)])["Total"])

    small, double = peak(minimum), peak(2 * minimum)
    per_sample = max(0.0, double - small) / minimum
    fixed = small - per_sample * minimum
    budget = available * (1 - margin) - CPU_FRAMEWORK_BYTES
    size = start
    while size > minimum and fixed + per_sample * size * (1 + CPU_RETENTION) > budget:
        size //= 2
    return max(size, minimum)


def memory_record(device: torch.device) -> dict[str, float]:
    record = {"rss_mb": rss_mb()}
    if device.type == "cuda":
        record["gpu_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return record


def available_memory_bytes(device: torch.device) -> int | None:
    """Memory a run on `device` may still take: free GPU memory, or on CPU the smaller of the
    kernel's MemAvailable and what the cgroup limit leaves (None when neither can be read)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    limits = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = open(limit_file).read().strip()
            if limit != "max" and int(limit) < 1 << 60:
                limits.append(int(limit) - int(open(usage_file).read().strip()))
            break
        except (OSError, ValueError):
            continue
    return min(limits) if limits else None


def format_bytes(n: float) -> str:
    """>>> format_bytes(3.5 * 2**30)
    '3.5 GiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"

"""Memory readings: resident set size and device memory (`get_memory_stats`, `log_memory_stats`,
`clear_memory`, `memory_record`), what a machine has free (`available_memory_bytes`), and the peak of
traced steps by PyTorch's MemTracker (`tracked_peak`). Estimates live in `tierlm.plan.memory`; the batch
size search `auto_find_batch_size` in `tierlm.plan.batch`.
"""

from __future__ import annotations

import ctypes
import gc
import logging
from pathlib import Path
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)


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


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def whole_peak_tracker():
    """PyTorch's `MemTracker`, keeping only the peak of everything it tracks: after every op MemTracker also walks
    each module seen so far to keep that module's own peak (copying its snapshot when it rises), which
    `tracked_peak` never reads. Without that walk the planner's traces take 38% less time (8 configs, pretraining
    to RL, the same bytes: tests/test_memory_plan.py compares the two). A torch whose MemTracker has other
    internals gets MemTracker as it is."""
    from copy import deepcopy

    from torch.distributed._tools import mem_tracker

    class WholePeakTracker(mem_tracker.MemTracker):
        def _update_peak_stats(self, peak_state) -> None:  # MemTracker's own, less its per-module part
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[mem_tracker._TOTAL_KEY]:
                    self._peak_mem[dev] = snap[mem_tracker._TOTAL_KEY]
                    self._peak_mem_snap[dev] = deepcopy(snap)

    tracker = WholePeakTracker()
    internals = ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap")
    if hasattr(mem_tracker, "_TOTAL_KEY") and all(hasattr(tracker, name) for name in internals):
        return tracker
    return mem_tracker.MemTracker()


def tracked_peak(fns: list[Callable[[], Any]], *tracked) -> dict[str, int]:
    """Run `fns` in turn under one PyTorch `MemTracker` (`whole_peak_tracker`): the bytes at their peak by category
    ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other", "Total"), summed
    over devices. `tracked`: modules and optimizers whose existing tensors count too (others that
    exist before are not counted).

    >>> layer = torch.nn.Linear(256, 256)
    >>> peak = tracked_peak([lambda: layer(torch.randn(64, 256)).sum().backward()], layer)
    >>> peak["Parameter"] == (256 * 256 + 256) * 4, peak["Total"] > peak["Parameter"] + 64 * 256 * 4
    (True, True)
    """
    tracker = whole_peak_tracker()
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
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:
                limits.append(int(limit) - int(Path(usage_file).read_text().strip()))
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

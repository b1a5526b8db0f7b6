"""Memory readings for the logs: resident set size, and peak GPU memory on CUDA."""

from __future__ import annotations

import torch


def rss_mb() -> float:
    """This process's resident memory in MB (Linux /proc; 0 where unavailable).

    >>> rss_mb() > 0
    True
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


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
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
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


def check_fits(needs: dict[str, tuple[float, str]], device: torch.device, available: int | None = None) -> None:
    """Refuse, before anything is allocated, a run whose lower-bound memory need exceeds what the
    device has: one line naming the largest consumer and the cheapest fix.

    `needs` maps a consumer ("activations of one micro-batch (8 x 512 tokens)") to (bytes, fix).

    >>> check_fits({"weights": (10 * 2**30, "use a smaller model")}, torch.device("cpu"), available=2**30)
    Traceback (most recent call last):
    ...
    tierlm.errors.ConfigError: this run needs at least 10.0 GiB but 1.0 GiB is available; the largest part is weights (10.0 GiB): use a smaller model
    """
    from tierlm.errors import ConfigError

    available = available_memory_bytes(device) if available is None else available
    total = sum(b for b, _ in needs.values())
    if available is None or total <= available:
        return
    name, (largest, fix) = max(needs.items(), key=lambda item: item[1][0])
    raise ConfigError(f"this run needs at least {format_bytes(total)} but {format_bytes(available)} is available; "
                      f"the largest part is {name} ({format_bytes(largest)}): {fix}")

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

"""The one home of memory estimation: a run's memory per rank from its traced step (`estimate`), the instant lower
bounds checked before it (`bounds`) and model-parallel layouts on paper (`layouts`)."""

from tierlm.plan.memory.estimate import (  # noqa: F401
    BACKENDS,
    BYTES_PER_DOCUMENT,
    CPU_FRAMEWORK_BYTES,
    CPU_RETENTION,
    CPU_RETENTION_RECOMPUTE,
    CUDA_MARGIN,
    PARTS,
    MemoryEstimate,
    check_memory,
    estimate_run_memory,
    memory_budget,
    trace_step,
)

__all__ = [
    "BACKENDS",
    "BYTES_PER_DOCUMENT",
    "CPU_FRAMEWORK_BYTES",
    "CPU_RETENTION",
    "CPU_RETENTION_RECOMPUTE",
    "CUDA_MARGIN",
    "MemoryEstimate",
    "PARTS",
    "check_memory",
    "estimate_run_memory",
    "memory_budget",
    "trace_step",
]

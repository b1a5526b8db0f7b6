"""The micro-batch size: training.per_device_train_batch_size=auto (the largest the memory planner,
`tierlm.plan.memory`, predicts to fit, a power of two that divides training.total_batch_size when that is
fixed), and `auto_find_batch_size`, which confirms a size by running it (halving after an out-of-memory)."""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch

from tierlm.builders.stage import Stage
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError
from tierlm.metrics.memory import available_memory_bytes, clear_memory, format_bytes, tracked_peak
from tierlm.plan.memory import CPU_FRAMEWORK_BYTES, CPU_RETENTION, MemoryEstimate, estimate_run_memory

logger = logging.getLogger(__name__)


def with_batch_size(config: TierlmConfig, rows: int) -> TierlmConfig:
    """`config` with training.per_device_train_batch_size = `rows`."""
    return config.model_copy(
        update={"training": config.training.model_copy(update={"per_device_train_batch_size": rows})}
    )


def check_auto_batch_stage(stage: Stage) -> None:
    """training.per_device_train_batch_size=auto sizes micro-batches of rows: not every stage's (RL's rollouts)."""
    if stage.micro_batch_key != "training.per_device_train_batch_size":
        raise ConfigError(
            f"training.per_device_train_batch_size=auto sizes pretraining, SFT and DPO micro-batches; "
            f"{stage.name.upper()}'s is {stage.micro_batch_key}: set a number"
        )


def auto_batch_size(
    config: TierlmConfig, stage: Stage, budget: float | None, world_size: int = 1, **kwargs
) -> tuple[int, str]:
    """training.per_device_train_batch_size=auto: (rows, why). The largest power of two predicted
    to fit `budget` with a 20% margin (`largest_fitting_batch`); with training.total_batch_size
    fixed, also one that divides it (the accumulation takes up the rest, so the optimisation is
    the same). Without a budget (nothing says how much memory there is) the default, 8."""
    check_auto_batch_stage(stage)
    tr, T = config.training, config.data.max_seq_length
    if budget is None:
        return 8, "no memory limit is known here (set infra.max_memory_gb)"
    rows, estimate = largest_fitting_batch(config, budget, stage, world_size=world_size, **kwargs)
    why = f"predicted {format_bytes(estimate.total)} per rank of {format_bytes(budget)}, with a 20% margin"
    if isinstance(tr.total_batch_size, int):
        fitting = rows
        while rows > 1 and tr.total_batch_size % (rows * T * world_size):
            rows //= 2
        if rows != fitting:
            why += f"; {fitting} rows fit but do not divide training.total_batch_size={tr.total_batch_size:,}"
    return rows, why


def largest_fitting_batch(
    config: TierlmConfig, available: float, stage: Stage | None = None, margin: float = 0.2, **kwargs
) -> tuple[int, MemoryEstimate]:
    """The largest per-device micro-batch (rows) whose estimate, plus `margin` of it, fits in
    `available` bytes: two traces give the per-row cost (the estimate is affine in the rows), a
    third confirms the choice. Raises ConfigError when not even one row fits."""

    def at(rows: int) -> MemoryEstimate:
        return estimate_run_memory(with_batch_size(config, rows), stage=stage, **kwargs)

    one, two = at(1), at(2)
    per_row, fixed = two.total - one.total, 2 * one.total - two.total
    budget = available / (1 + margin)
    if one.total > budget:
        name, largest = one.largest()
        raise ConfigError(
            f"not even one row of data.max_seq_length={config.data.max_seq_length} fits: one row needs about "
            f"{format_bytes(one.total * (1 + margin))} with the margin, {format_bytes(available)} is available; "
            f"the largest part is {name} ({format_bytes(largest)}): {one.fixes.get(name, 'use a smaller run')}"
        )
    rows = max(1, int((budget - fixed) // per_row)) if per_row > 0 else 1
    rows = 2 ** int(math.log2(rows))  # a power of two: batches divide evenly into accumulation
    estimate = at(rows)
    while rows > 1 and estimate.total > budget:  # the affine model is a guide; the trace decides
        rows //= 2
        estimate = at(rows)
    return rows, estimate


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

    On CUDA a size that runs out of memory is halved and retried (as Accelerate's `find_executable_batch_size`
    does). On CPU running out of memory kills the process instead of raising, so the size is predicted first: the peak
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


def throughput_knee(
    seconds_for: Callable[[int], float | None], largest: int, tolerance: float = 0.05
) -> tuple[int, dict]:
    """(rows, {rows: rows/s}): the smallest power of two up to `largest` whose measured rate is within `tolerance`
    of the best, trying 1, 2, 4, ... and stopping two doublings after the rate last rose by more than `tolerance`
    (on a CPU tokens/s stops rising after a few rows; on a GPU it climbs to the memory bound). `seconds_for(n)`
    times a step of n rows, or is None when n rows do not fit (the search stops there).

    >>> knee, rates = throughput_knee(lambda n: n / min(n, 8), 1024)  # the rate saturates at 8 rows
    >>> knee, sorted(rates)
    (8, [1, 2, 4, 8, 16, 32])
    """
    rates: dict[int, float] = {}
    best, stalled, rows = 0.0, 0, 1
    while rows <= largest and stalled < 2:
        seconds = seconds_for(rows)
        if seconds is None:
            if not rates:
                raise RuntimeError("not even 1 row fits in memory")
            break
        rates[rows] = rows / max(seconds, 1e-9)
        best, stalled = (rates[rows], 0) if rates[rows] > best * (1 + tolerance) else (best, stalled + 1)
        rows *= 2
    top = max(rates.values())
    return min(n for n, rate in rates.items() if rate >= (1 - tolerance) * top), rates


def _loss_of(outputs: Any) -> torch.Tensor:
    if hasattr(outputs, "loss"):
        return outputs.loss
    if isinstance(outputs, tuple):
        return outputs[0]
    return outputs


def _loss_of(outputs: Any) -> torch.Tensor:
    if hasattr(outputs, "loss"):
        return outputs.loss
    if isinstance(outputs, tuple):
        return outputs[0]
    return outputs


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

"""training.per_device_train_batch_size=auto: the largest micro-batch the memory planner predicts to fit
(`tierlm.plan.memory`), a power of two that divides training.total_batch_size when that is fixed."""

from __future__ import annotations

import math

from tierlm.build.stage import Stage
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError
from tierlm.metrics.memory import format_bytes
from tierlm.plan.memory import MemoryEstimate, estimate_run_memory


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

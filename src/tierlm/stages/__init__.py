"""The training stages, one file each, and `STAGES`: the only place a stage's name maps to its code.

A stage is a `tierlm.builders.stage.Stage`: what it declares (the kind of example it reads, how rows are
packed, what it starts from, what its micro-batch and memory hold) and its `run`, which builds the
model, data, strategy, backend and loop on the run skeleton (`tierlm.run`). Adding a stage is one file
here and one line in `STAGES`; the CLI, `tierlm.train`, the planner and the run skeleton pick it up.

>>> list(STAGES)
['pretrain', 'sft', 'dpo', 'rm', 'rl']
"""

from __future__ import annotations

from tierlm.builders.stage import Stage
from tierlm.config import TierlmConfig
from tierlm.primitives.parallel import shutdown_distributed
from tierlm.run import prepare_run
from tierlm.stages.dpo import DPO
from tierlm.stages.pretrain import Pretrain
from tierlm.stages.rl import RL
from tierlm.stages.rm import RewardModel
from tierlm.stages.sft import SFT

STAGES: dict[str, Stage] = {stage.name: stage for stage in (Pretrain(), SFT(), DPO(), RewardModel(), RL())}


def run_stage(
    config: TierlmConfig,
    stage: str | Stage,
    callbacks: list | None = None,
    leave_group: bool = True,
    preflight: bool = False,
) -> dict:
    """Train one stage (a name of `STAGES` or a `Stage`) as the config says; returns the run summary.

    Under torchrun every rank calls this; rank 0 writes the logs and the final model. The ranks then leave
    the process group, unless `leave_group` is False (several runs in one job, an ablation's variants, share it:
    joining a new one after leaving hangs). A `preflight` run builds everything and runs the stage's pre-flight
    check instead of training (RL: the sampler / trainer log-prob parity), writing nothing.
    """
    stage = STAGES[stage] if isinstance(stage, str) else stage
    run = prepare_run(config, stage)
    run.preflight = preflight  # build and check, train nothing (tierlm rl --check-parity)
    try:
        summary = stage.run(run, callbacks)
    finally:
        for folder in run.scratch:
            folder.cleanup()
    if (
        leave_group
    ):  # only after success (a no-op in one process): a failed rank just exits, and torchrun stops the others
        shutdown_distributed()
    return summary


def run_rl(config: TierlmConfig) -> dict:
    """Reinforcement learning from a trained chat model (`run_stage(config, "rl")`)."""
    return run_stage(config, "rl")


__all__ = ["DPO", "RL", "SFT", "RewardModel", "STAGES", "Pretrain", "Stage", "run_rl", "run_stage"]

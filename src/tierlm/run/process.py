"""The process a run starts in: its seeds, and the process group torchrun's environment and the config ask for (checked
before anything is written: a size that does not split the world, model parallelism or expert parallelism without
torchrun, and the like, is one line)."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError
from tierlm.primitives.model_parallel import ParallelDims
from tierlm.primitives.parallel import DistributedContext, init_distributed, launched_distributed


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def distributed_context(config: TierlmConfig) -> DistributedContext | None:
    """Join torchrun's process group when the config asks for data parallelism (or "auto" finds >1 rank)."""
    infra, tr = config.infra, config.training
    world = int(os.environ["WORLD_SIZE"]) if launched_distributed() else 1
    if infra.num_gpus is not None and infra.num_gpus != world:
        raise ConfigError(
            f"infra.num_gpus={infra.num_gpus} but {world} rank(s) were started: launch {infra.num_gpus} (torchrun "
            f"--nproc_per_node / accelerate launch --num_processes), or set infra.num_gpus={world} or null"
        )
    kind = infra.distributed_type
    if infra.model_parallel:
        sizes = (
            f"tensor {infra.tensor_parallel_size} x pipeline {infra.pipeline_parallel_size} "
            f"x context {infra.context_parallel_size}"
        )
        if not launched_distributed():
            raise ConfigError(
                f"model parallelism ({sizes}) splits the model over ranks: run under `torchrun --nproc_per_node=N -m "
                f"tierlm ...`"
            )
        if kind in ("ddp", "none"):
            raise ConfigError(
                f"model parallelism ({sizes}) composes with FSDP2 for the data-parallel rest, not with "
                f"infra.distributed_type={kind}: use fsdp (or auto)"
            )
        ParallelDims.from_sizes(
            int(os.environ["WORLD_SIZE"]),
            infra.tensor_parallel_size,
            infra.pipeline_parallel_size,
            infra.context_parallel_size,
        )  # the world splits into whole groups, or a ConfigError
        kind = "fsdp"
    if infra.expert_parallel_size > 1 and not launched_distributed():
        raise ConfigError(
            f"infra.expert_parallel_size={infra.expert_parallel_size} shares out the experts over that many ranks: "
            "run under `torchrun --nproc_per_node=N -m tierlm ...`, or drop it"
        )
    if kind == "auto":
        kind = "fsdp" if launched_distributed() and int(os.environ["WORLD_SIZE"]) > 1 else "none"
    if kind == "none":
        if launched_distributed() and int(os.environ["WORLD_SIZE"]) > 1:
            raise ConfigError(
                f"torchrun started {os.environ['WORLD_SIZE']} ranks but infra.distributed_type=none; use fsdp or ddp"
            )
        return None
    if tr.async_save and infra.model_parallel:
        raise ConfigError(
            "training.async_save is for one process, DDP and FSDP2; tensor / pipeline parallel runs save synchronously"
        )
    return init_distributed(infra.device_type, infra.dist_timeout_s)

"""`tierlm plan`: what a run would do and need — the model, tokens, batch, learning rates, optimizer groups, memory
per rank, the time at a speed — without training."""

from __future__ import annotations

import argparse
import os

from tierlm.commands.cli import STAGE_COMMANDS
from tierlm.commands.options import Command, add_config_args, positive_float, positive_int
from tierlm.commands.overrides import check_stage_overrides


def arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--stage", choices=STAGE_COMMANDS, default="pretrain")
    add_config_args(plan, required=False)
    plan.add_argument(
        "--world-size", type=positive_int, default=None, help="ranks the run will have (default: $WORLD_SIZE or 1)"
    )
    plan.add_argument(
        "--layouts",
        action="store_true",
        help="also the per-rank memory of every tensor x pipeline x data-parallel split of --world-size ranks",
    )
    plan.add_argument(
        "--vocab-size",
        type=positive_int,
        default=None,
        help="size a model from scratch for this vocabulary instead of training the run's tokenizer here",
    )
    speed = plan.add_mutually_exclusive_group()
    speed.add_argument(
        "--tokens-per-sec", type=positive_float, default=None, help="estimate the time at this training speed"
    )
    speed.add_argument(
        "--measure", action="store_true", help="time a few training steps of the model here to estimate the time"
    )


def run(args: argparse.Namespace) -> None:
    from tierlm.builders.tokenizer import pretrained_location
    from tierlm.config import TierlmConfig
    from tierlm.plan import plan_run
    from tierlm.plan.scaling import measure_tokens_per_sec
    from tierlm.stages import STAGES

    config = TierlmConfig.load(args.config, args.overrides)
    check_stage_overrides("plan", STAGES[args.stage], config, args.overrides)
    world_size = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    resolved, plan, model = plan_run(config, STAGES[args.stage], world_size, args.vocab_size)
    speed = args.tokens_per_sec
    if args.measure:  # one process measured; the ranks of a data-parallel run add up
        speed = measure_tokens_per_sec(resolved, model.config.vocab_size, pretrained_location(config)) * world_size
    print(plan.table(speed))
    print(plan.memory.table())
    if args.layouts:
        from tierlm.models import unwrap_model
        from tierlm.plan.memory.layouts import ModelShape, layouts_table

        tr, infra = resolved.training, resolved.infra
        budget = infra.max_memory_gb * 1e9 if infra.max_memory_gb else None
        print(
            layouts_table(
                ModelShape.of(unwrap_model(model)),
                world_size,
                tr.per_device_train_batch_size,
                resolved.data.max_seq_length,
                budget,
                compute_bytes=2 if tr.bf16 or tr.fp16 else 4,
                activation_checkpointing=infra.activation_checkpointing,
                fused_cross_entropy=tr.fused_cross_entropy,
                vocab_parallel=infra.vocab_parallel,
                sequence_parallel=infra.sequence_parallel,
            )
        )


COMMAND = Command(arguments, run)

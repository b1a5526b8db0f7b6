r"""The `tierlm` command line: `COMMANDS`, one row per command, each declared by its own module (its arguments and
its `run`); the parser is built from the table and a command's `run` is called with its arguments.

    tierlm pretrain | sft | dpo | rm | rl --config FILE_OR_PRESET [section.key=value ...]   (tierlm.commands.train)
    tierlm eval --checkpoint RUN [--config RL_CONFIG | --harness TASKS | --core BUNDLE | --chat-core NAME=SOURCE]
    tierlm sample --checkpoint RUN --prompt "What is 12 + 7?"        tierlm chat | serve --checkpoint RUN
    tierlm plan --config FILE [--stage S] [--world-size N] [--measure]   tierlm speedrun [--depth D]
    tierlm ablate --config PRESET [--variants V0,V1] [--seeds 0,1,2]   tierlm launch --slurm | --torchx STAGE ...
    tierlm export CHECKPOINT OUT_DIR      tierlm average CHECKPOINT ... --out DIR      tierlm push RUN --repo ORG/NAME
    tierlm report RUN [RUN ... --out DIR]  tierlm tokenizer train --data SOURCE --out DIR  tierlm config show | list

A problem with the input (config, data, checkpoint, arguments) prints one line and exits with 2. Adding a command
is one module with `arguments(parser)`, `run(args)` and a `Command` row, and one entry here.
"""

from __future__ import annotations

import os
import sys

from tierlm.commands import (
    ablate,
    chat,
    checkpoints,
    config,
    evaluate,
    launch,
    plan,
    push,
    report,
    sample,
    serve,
    speedrun,
    tokenizer,
    train,
)
from tierlm.commands.options import Command, Parser
from tierlm.errors import TierlmError
from tierlm.loops.signals import RunInterrupted

COMMANDS: dict[str, Command] = {
    command.name: command
    for command in (
        *train.COMMANDS,
        launch.COMMAND,
        plan.COMMAND,
        ablate.COMMAND,
        speedrun.COMMAND,
        checkpoints.EXPORT,
        checkpoints.AVERAGE,
        push.COMMAND,
        report.COMMAND,
        evaluate.COMMAND,
        chat.COMMAND,
        serve.COMMAND,
        sample.COMMAND,
        tokenizer.COMMAND,
        config.COMMAND,
    )
}
"""`tierlm NAME` -> its command: the one place a command is named."""


def build_parser() -> Parser:
    parser = Parser(prog="tierlm", description="Train language models: tokenizer, pretrain, SFT, DPO, RL.")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.arguments(commands.add_parser(command.name, help=command.about, description=command.about))
    return parser


def _rank_prefix() -> str:
    """ "[rank N] " inside a multi-rank torchrun job, so an error says which rank raised it."""
    return (
        f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ else ""
    )


def _say(line: str) -> None:
    """One line to stderr in one write, so the lines of several ranks sharing it never interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    # Loading a local folder needs no download bars; errors stay one line. (HF_HUB_DISABLE_PROGRESS_BARS=0 brings them
    # back.)
    if os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1") == "1" and "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides += extra  # overrides after an option (`--variants V0 training.seed=1`) are overrides too
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        COMMANDS[args.command].run(args)
    except TierlmError as e:
        _say(f"tierlm: error: {_rank_prefix()}{e}")
        return getattr(e, "exit_code", 2)  # 2: bad input; 1: runs that failed (an ablation's)
    except RunInterrupted as stop:
        _say(f"tierlm: {_rank_prefix()}{stop}")
        return stop.exit_code
    except KeyboardInterrupt:
        print("tierlm: interrupted; the latest checkpoint is intact", file=sys.stderr)
        return 130
    return 0

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
is one module with `arguments(parser)`, `run(args)` and a `Command`, and one row here; a stage's command is its row
here, pointing at `STAGE`. A command's module is imported only when it runs: `tierlm --help` imports no torch.
"""

from __future__ import annotations

import argparse
import os
import sys

from tierlm.commands.options import Listing, Parser
from tierlm.errors import TierlmError
from tierlm.loops.signals import RunInterrupted, held_until_exit, ignore_repeats

STAGE = "tierlm.commands.train:stage_command"
"""Where a stage's command is made (`tierlm.commands.train`): one per row of `tierlm.stages.STAGES`."""

COMMANDS: dict[str, Listing] = {
    "pretrain": Listing("pretrain on text (next-token prediction)", STAGE),
    "sft": Listing("fine-tune on conversations (assistant tokens only)", STAGE),
    "dpo": Listing("preference-optimise a chat model on chosen/rejected pairs", STAGE),
    "rm": Listing("train a reward model (a scalar head) on chosen/rejected pairs", STAGE),
    "rl": Listing("reinforcement learning on rewarded tasks (REINFORCE / GRPO / PPO), with pass@k evals", STAGE),
    "launch": Listing(
        "write a cluster launch file for a run (a Slurm script, or a TorchX component)",
        "tierlm.commands.launch:COMMAND",
    ),
    "plan": Listing(
        "print what a run would do (model, tokens, batch, optimizer groups, time) without training",
        "tierlm.commands.plan:COMMAND",
    ),
    "ablate": Listing(
        "run variants x seeds of one config at equal tokens; results, summary.md, plots",
        "tierlm.commands.ablate:COMMAND",
    ),
    "speedrun": Listing(
        "tokenizer -> pretrain (sized from --depth) -> SFT -> RL -> report card",
        "tierlm.commands.speedrun:COMMAND",
    ),
    "export": Listing("write a checkpoint as a transformers model folder", "tierlm.commands.checkpoints:EXPORT"),
    "average": Listing("average the weights of several checkpoints", "tierlm.commands.checkpoints:AVERAGE"),
    "push": Listing(
        "upload a run's model to the Hugging Face Hub with a model card from the run",
        "tierlm.commands.push:COMMAND",
    ),
    "report": Listing(
        "rebuild a run's report.md and plots, or overlay several runs' curves",
        "tierlm.commands.report:COMMAND",
    ),
    "eval": Listing(
        "pass@1 / pass@k of a chat model on held-out problems (the rl section's settings), or lm-evaluation-harness "
        "tasks (--harness)",
        "tierlm.commands.evaluate:COMMAND",
    ),
    "chat": Listing(
        "a multi-turn chat with a trained chat model in the terminal (streamed, with the calculator)",
        "tierlm.commands.chat:COMMAND",
    ),
    "serve": Listing(
        "the OpenAI API (/v1/completions, /v1/chat/completions) and a chat page for a trained model",
        "tierlm.commands.serve:COMMAND",
    ),
    "sample": Listing("generate from a trained model", "tierlm.commands.sample:COMMAND"),
    "tokenizer": Listing("tokenizer tools", "tierlm.commands.tokenizer:COMMAND"),
    "config": Listing("config tools", "tierlm.commands.config:COMMAND"),
}
"""`tierlm NAME` -> its help line and its code: the one place a command is named. Nothing here imports a command's
module until that command runs (or shows its own help), so `tierlm --help` answers at once."""

STAGE_COMMANDS = tuple(name for name, listing in COMMANDS.items() if listing.command == STAGE)
"""The training stages' commands (the names of `tierlm.stages.STAGES`, known here without importing them)."""


def build_parser(chosen: str | None = None) -> Parser:
    """The parser of every command; the options of `chosen` alone (the others' modules are not imported). None:
    every command's."""
    parser = Parser(prog="tierlm", description="Train language models: tokenizer, pretrain, SFT, DPO, RL.")
    parser.add_argument("--version", action=_Version, help="tierlm's version and commit, torch's, transformers'")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, listing in COMMANDS.items():
        sub = commands.add_parser(name, help=listing.about, description=listing.about)
        if chosen is None or name == chosen:
            listing.load(name).arguments(sub)
    return parser


class _Version(argparse.Action):
    """`tierlm --version`: the line is made when asked (it runs git), not each time the parser is built."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from tierlm.version import version_line

        print(version_line())
        parser.exit()


def _chosen(argv: list[str]) -> str | None:
    """The command named on the command line (its first word that is one), before anything is imported for it."""
    return next((word for word in argv if not word.startswith("-")), None)


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
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_chosen(argv) or "")
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides += extra  # overrides after an option (`--variants V0 training.seed=1`) are overrides too
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        with held_until_exit():
            COMMANDS[args.command].load(args.command).run(args)
    except TierlmError as e:
        _say(f"tierlm: error: {_rank_prefix()}{e}")
        return getattr(e, "exit_code", 2)  # 2: bad input; 1: runs that failed (an ablation's)
    except RunInterrupted as stop:
        _say(f"tierlm: {_rank_prefix()}{stop}")
        ignore_repeats()
        return stop.exit_code
    except KeyboardInterrupt:
        print("tierlm: interrupted; the latest checkpoint is intact", file=sys.stderr)
        return 130
    return 0

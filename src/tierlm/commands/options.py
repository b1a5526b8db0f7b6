"""What every command of the `tierlm` command line is built from: `Listing` (one row of `tierlm.commands.cli.COMMANDS`:
the command's help line and where its code is), `Command` (what a command module declares: its arguments and its
`run`), the parser whose usage mistakes are the one line every tierlm error is (exit 2), and the argument types the
commands share. Nothing here imports torch."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Command:
    """What a command module declares: the options it adds to its parser, and what runs it."""

    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]


@dataclass(frozen=True)
class Listing:
    """One row of `tierlm.commands.cli.COMMANDS`: a command's one-line help and where its `Command` is
    ("module:NAME"), imported only when that command runs or shows its own help (so `tierlm --help` imports no
    torch). NAME is a `Command`, or a function of the command's name that makes one (the stages' commands)."""

    about: str
    command: str

    def load(self, name: str) -> Command:
        """The command `tierlm NAME` runs.

        >>> Listing("config tools", "tierlm.commands.config:COMMAND").load("config").run.__name__
        'run'
        """
        import importlib

        module, _, attribute = self.command.partition(":")
        found = getattr(importlib.import_module(module), attribute)
        return found if isinstance(found, Command) else found(name)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported as the one line every tierlm error is (exit 2)."""

    def error(self, message: str):
        self.exit(2, f"tierlm: error: {message} (see `{self.prog} --help`)\n")


def _engine_kinds() -> tuple[str, ...]:
    from typing import get_args

    from tierlm.config import EngineConfig

    return get_args(EngineConfig.model_fields["kind"].annotation)


ENGINE_KINDS = _engine_kinds()
"""What --engine takes: the engine section's kinds (`tierlm.builders.engine.ENGINES` builds each)."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number > 0, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_float(text: str) -> float:
    value = number(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def int_list(text: str) -> list[int]:
    """Comma-separated whole numbers.

    >>> int_list("0,1, 2")
    [0, 1, 2]
    """
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated whole numbers, got {text!r}") from None


def named_sources(value: str) -> dict[str, str]:
    """NAME=SOURCE pairs, comma-separated."""
    pairs = [part.partition("=") for part in value.split(",") if part.strip()]
    if not pairs or any(not name.strip() or not eq or not source.strip() for name, eq, source in pairs):
        raise argparse.ArgumentTypeError(f"give NAME=SOURCE pairs separated by commas, got {value!r}")
    return {name.strip(): source.strip() for name, _, source in pairs}


def task_list(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise argparse.ArgumentTypeError("give task names separated by commas, e.g. hellaswag,arc_easy")
    return tasks


def temperature(text: str) -> float:
    value = number(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 is greedy), got {text}")
    return value


def repetition_penalty(text: str) -> float:
    value = number(text)
    if not 0 < value <= 2:  # vLLM's range
        raise argparse.ArgumentTypeError(f"must be in (0, 2] (1 is off; above 1 discourages repeats), got {text}")
    return value


def probability(text: str) -> float:
    value = number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def sampling_filters(parser: argparse.ArgumentParser) -> None:
    """`--top-p`, `--min-p` and `--repetition-penalty`, as `tierlm sample` and `tierlm chat` take them."""
    parser.add_argument("--top-p", type=probability, default=None, help="nucleus sampling: the smallest set reaching P")
    parser.add_argument(
        "--min-p",
        type=probability,
        default=None,
        help="min-p sampling: tokens at least this share of the most likely one's probability",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=repetition_penalty,
        default=1.0,
        help="CTRL's penalty on the prompt's and the generated tokens (1: off; above 1 discourages repeats)",
    )


def add_config_args(
    parser: argparse.ArgumentParser, required: bool = True, omitted: str = "the embedded defaults"
) -> None:
    parser.add_argument("--config", required=required, help=f"YAML config file (see configs/); omitted: {omitted}")
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="overrides, e.g. training.learning_rate=3e-4"
    )


DEVICE_TYPES = ["auto", "cpu", "cuda", "mps"]
COMPILE_HELP = (
    "torch.compile the decode step (engine.compile; native GPT): on a GPU it is then captured as CUDA graphs; the "
    "first reply waits for the compile (tens of seconds)"
)

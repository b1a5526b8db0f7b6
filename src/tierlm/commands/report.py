"""`tierlm report`: rebuild a run's report.md and plots, or overlay several runs' curves."""

from __future__ import annotations

import argparse
from pathlib import Path

from tierlm.commands.options import Command
from tierlm.errors import ConfigError


def arguments(report: argparse.ArgumentParser) -> None:
    report.add_argument("run_dirs", nargs="+", help="run directories (their metrics.jsonl)")
    report.add_argument("--out", default=None, help="with several runs: the folder for the overlaid report (required)")


def run(args: argparse.Namespace) -> None:
    from tierlm.metrics.report import overlay_report, write_run_report

    if len(args.run_dirs) == 1 and args.out is None:
        print(f"wrote {write_run_report(Path(args.run_dirs[0]))}")
        return
    if args.out is None:
        raise ConfigError("several runs overlay into a new folder: give --out DIR")
    print(f"wrote {overlay_report([Path(d) for d in args.run_dirs], Path(args.out))}")


COMMAND = Command(arguments, run)

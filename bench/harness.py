"""Run benchmark contenders each in its own process, interleaved and repeated; report medians.

A bench script defines `CONTENDERS = {name: function(args) -> dict of figures}` and calls
`main(CONTENDERS, ...)`. The parent runs `python SCRIPT --contender NAME ...` for every
(repeat, contender) pair in turn (contender order rotates each repeat), each child pinned to the
same thread count, and prints a table of medians and ratios against the reference contender,
with each contender's peak resident memory (its whole process: Python, torch, model, data).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from typing import Callable


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="runs of each contender (median reported)")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads in every contender")
    p.add_argument("--only", default=None, help="comma-separated contenders to run")
    p.add_argument("--contender", default=None, help=argparse.SUPPRESS)  # set in the child processes
    p.add_argument("--json", default=None, help="also write the raw results here")
    return p


def run(
    contenders: dict[str, Callable[[argparse.Namespace], dict]],
    args: argparse.Namespace,
    argv: list[str],
    metric: str,
    reference: str,
) -> dict[str, list[dict]]:
    """In a child: run one contender and print its JSON. In the parent: run them all and print the table."""
    if args.contender is not None:
        import torch

        torch.set_num_threads(args.threads)
        figures = contenders[args.contender](args)
        figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        print("RESULT " + json.dumps(figures), flush=True)
        return {}
    names = args.only.split(",") if args.only else list(contenders)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "PYTHONWARNINGS": "ignore",
        "TOKENIZERS_PARALLELISM": "false",
    }
    results: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in order:
            out = subprocess.run(
                [sys.executable, sys.argv[0], *argv, "--contender", name], env=env, capture_output=True, text=True
            )
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                raise SystemExit(f"{name} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
            results[name].append(json.loads(lines[-1][len("RESULT ") :]))
            print(
                f"  repeat {repeat + 1}/{args.repeats} {name}: {results[name][-1][metric]:,.1f} {metric}",
                file=sys.stderr,
                flush=True,
            )
    table(results, metric, reference)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def table(results: dict[str, list[dict]], metric: str, reference: str) -> None:
    medians = {name: statistics.median(r[metric] for r in runs) for name, runs in results.items()}
    keys = sorted(
        {k for runs in results.values() for r in runs for k in r if k != metric and isinstance(r[k], (int, float))}
    )
    print(f"| contender | {metric} (median) | vs {reference} | " + " | ".join(keys) + " |")
    print("|---|---|---|" + "---|" * len(keys))
    for name, runs in results.items():
        ratio = medians[name] / medians[reference] if reference in medians else float("nan")
        extra = " | ".join(
            _number(statistics.median(r[k] for r in runs if k in r)) if any(k in r for r in runs) else "" for k in keys
        )
        print(f"| {name} | {_number(medians[name])} | {ratio:.2f}x | {extra} |")


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"

"""A tierlm command in its own process, started in a fraction of a second (what `tierlm ablate` runs each run in).

A fresh `python -m tierlm ...` spends seconds before its first step: importing torch (~2.3 s on a 2-core machine),
tierlm (~2.8 s), torch's dynamo at the first optimizer step (~1.7 s) and transformers (~0.9 s). An ablation of
short runs pays that for every variant x seed. Here the runs are forked from one server process that imported all
that once (multiprocessing's forkserver; nothing in it touches a GPU, so each run sets up CUDA itself), and each
run is still a process of its own: a crash, a leak or a device context ends with it, as with a fresh interpreter.
Where the platform has no forkserver (Windows), the run is a fresh interpreter.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

PRELOAD = ["torch", "torch._dynamo", "transformers", "tierlm.commands.cli", "tierlm.stages"]


def run_command(argv: list[str], log: Path) -> int:
    """`python -m tierlm ARGV` in its own process, its output (stdout and stderr) appended to LOG; its exit code
    (minus the signal's number when a signal ended it)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        with open(log, "a") as out:
            command = [sys.executable, "-m", "tierlm", *argv]
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    process = context.Process(target=_main, args=(list(argv), dict(os.environ), str(log)))
    process.start()
    process.join()
    return process.exitcode


def _main(argv: list[str], environ: dict[str, str], log: str) -> None:
    """The child: the parent's environment as it is now (the server's is from its start), output to LOG, exit
    handlers as a fresh interpreter's (the server's dropped, the run's own run at its end)."""
    os.environ.clear()
    os.environ.update(environ)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    atexit._clear()
    try:
        from tierlm.commands.cli import main

        code = main(argv)
    finally:
        atexit._run_exitfuncs()
    sys.exit(code)

"""Ranks for the tests that compare N ranks with one process, forked from a process that imported torch once.

torchrun starts its agent and every rank as a fresh interpreter: `import torch` (~2.3 s on this 2-core machine),
tierlm's modules (~2.8 s), torch's dynamo at the first optimizer step (~1.7 s) and transformers (~0.9 s) run in
each before a tiny test's first step — most of what a two-rank tiny job costs. The tests whose subject is what
the ranks compute (the steps one process takes, a resume, an export) start their ranks here instead, as PyTorch's
own distributed tests do (`MultiProcessTestCase` forks or spawns its ranks, no torchrun): multiprocessing's
forkserver imports those modules once per pytest worker and each rank is a fork of it, given the environment
torchrun gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT,
TORCHELASTIC_RUN_ID) and the command line torchrun would run (`-m MODULE ARGS` or `SCRIPT ARGS`). What torchrun
itself does — its agent's rendezvous across machines, restarts, ending the job when a rank fails or is killed,
passing on signals — stays tested through real torchrun (`conftest.torchrun`: test_launch, test_distributed's
failure and signal tests, the two-node RL restart).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What every rank imports before its first step: imported once in the forkserver, inherited by each fork.
PRELOAD = [
    "torch",
    "torch._dynamo",  # torch.optim's step imports it (its graph_break), sympy with it
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "tierlm.commands.cli",
    "tierlm.run.skeleton",
    "tests.distributed_worker",
]


def _context():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(command: list[str], env: dict[str, str], log: str) -> None:
    """One rank: torchrun's environment, its output in LOG, then `python COMMAND` as the forked interpreter."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    faulthandler.enable()
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    if command[0] == "-m":
        sys.argv = [command[1], *command[2:]]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(command)
        runpy.run_path(command[0], run_name="__main__")


def ranks(*args, nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """What `torchrun --standalone --nproc_per_node NPROC ARGS` runs, its ranks forked (one thread each); ARGS is
    `-m MODULE ...` or `SCRIPT ...` (torchrun's own flags need `conftest.torchrun`). The ranks' outputs are joined in
    rank order as stdout and stderr; when a rank fails the others are stopped and its exit code is the job's, as
    torchrun ends a job. Raises subprocess.TimeoutExpired after TIMEOUT seconds, the ranks killed."""
    command = [str(a) for a in args]
    assert command[0] == "-m" or not command[0].startswith("-"), f"torchrun's flags need conftest.torchrun: {command}"
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])  # as conftest.torchrun
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    job = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port(), TORCHELASTIC_RUN_ID=f"ranks-{time.time_ns()}")
    context = _context()
    with tempfile.TemporaryDirectory() as folder:
        logs = [os.path.join(folder, f"rank{r}.log") for r in range(nproc)]
        processes = []
        for r in range(nproc):
            place = dict(RANK=r, LOCAL_RANK=r, GROUP_RANK=0, WORLD_SIZE=nproc, LOCAL_WORLD_SIZE=nproc)
            env = {k: str(v) for k, v in {**base, **job, **place}.items()}
            processes.append(context.Process(target=_rank, args=(command, env, logs[r]), daemon=True))
            processes[-1].start()
        code = _wait(processes, time.monotonic() + timeout)
        text = "".join(Path(log).read_text(errors="replace") for log in logs if os.path.exists(log))
    if code is None:
        raise subprocess.TimeoutExpired(["torchrun", *command], timeout, text)
    return subprocess.CompletedProcess(["torchrun", *command], code, text, text)


def _wait(processes, deadline: float) -> int | None:
    """The job's exit code once every rank has ended (a failed rank's, the others stopped), or None at DEADLINE."""
    while time.monotonic() < deadline:
        codes = [p.exitcode for p in processes]
        failed = [c for c in codes if c not in (None, 0)]
        if failed or all(c == 0 for c in codes):
            _stop(processes)
            return failed[0] if failed else 0
        time.sleep(0.02)
    _stop(processes)
    return None


def _stop(processes) -> None:
    """SIGTERM the ranks still running (tierlm's runs stop at a step boundary on it), SIGKILL after 10 s."""
    for p in processes:
        if p.exitcode is None:
            p.terminate()
    for p in processes:
        p.join(10)
        if p.exitcode is None:
            p.kill()
            p.join()

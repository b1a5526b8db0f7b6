"""Processes for the tests, forked from one that imported torch, transformers and tierlm once.

A fresh `python -m tierlm ...` spends seconds before a tiny test's first step: `import torch` (~2.3 s on this
2-core machine), tierlm's modules (~2.8 s), torch's dynamo at the first optimizer step (~1.7 s), transformers
(~0.9 s) — and torchrun pays it again in its agent and in every rank. Where a test's subject is what the process
does (the steps it takes, what it writes when killed or signalled, a resume) rather than the interpreter's start,
it starts the process here: multiprocessing's forkserver imports those modules once per pytest worker, and each
process is a fork of it given the command line, environment, working folder and output streams it would have had.
PyTorch's own distributed tests start their ranks the same way (`MultiProcessTestCase` forks or spawns them).

- `start(...)`: one `python -m MODULE ...` / `python -c CODE ...` / `python SCRIPT ...` as a `subprocess.Popen` would
  run it (pid, stdout/stderr pipes, poll, wait, send_signal, kill, returncode).
- `ranks(...)`: what `torchrun --standalone --nproc_per_node N ...` runs, the ranks given the environment torchrun
  gives them (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID).

What the interpreter's start or torchrun itself does — its agents' rendezvous across machines, restarts, ending a
job whose rank failed or was killed, passing on signals, `tierlm launch`'s scripts, an installed wheel — stays
tested through real processes (`conftest.torchrun`, `conftest.run_cli`).
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import runpy
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What a run imports before its first step: imported once in the forkserver, inherited by each fork.
PRELOAD = [
    "torch",
    "torch._dynamo",  # torch.optim's step imports it (its graph_break), sympy with it
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.modeling_utils",  # `import transformers` is lazy: its models, losses and quantizers load here
    "peft",  # LoRA's adapters (tierlm.models.lora): ~1.5 s a process, a quarter of a forked LoRA rank's run
    "tierlm.commands.cli",
    "tierlm.run.skeleton",
    "tierlm.stages",  # every stage, its loops and the generation engine
    "tierlm.plan.memory.estimate",  # the pre-flight's trace (MemTracker, FakeTensorMode)
    "tests.distributed_worker",
]


def _context():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _child(command: list[str], env: dict[str, str], cwd: str, streams) -> None:
    """`python COMMAND` as far as COMMAND can tell: ENV, CWD, PYTHONPATH on sys.path, stdout and stderr on STREAMS
    (connections wrapping the descriptors the parent opened), PYTHONWARNINGS and PYTHONFAULTHANDLER applied, exit
    handlers run at its end (`tierlm.commands.child` starts `tierlm ablate`'s runs the same way)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    for target, stream in zip((1, 2), streams):
        os.dup2(stream.fileno(), target)
    for stream in streams:
        stream.close()  # stderr=STDOUT: the same connection twice (closing is idempotent)
    if env.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(line_buffering=True)
    warnings.resetwarnings()
    warnings._processoptions([o for o in env.get("PYTHONWARNINGS", "").split(",") if o])  # as the interpreter does
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    atexit._clear()  # exit handlers as a fresh interpreter's: the server's dropped, the command's own run at its end
    try:
        if command[0] == "-m":
            sys.argv = [command[1], *command[2:]]
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        elif command[0] == "-c":
            sys.argv = ["-c", *command[2:]]
            exec(compile(command[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(command)
            runpy.run_path(command[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()


def _stream(target) -> tuple[multiprocessing.connection.Connection, object]:
    """A descriptor for the child (wrapped in a connection, which the forkserver passes over its socket) and what
    the parent keeps: a text pipe to read for PIPE, None otherwise."""
    if target == subprocess.PIPE:
        read, write = os.pipe()
        return multiprocessing.connection.Connection(write, readable=False), open(read, errors="replace")
    if target in (None, subprocess.DEVNULL):
        return multiprocessing.connection.Connection(os.open(os.devnull, os.O_WRONLY), readable=False), None
    fd = os.dup(target if isinstance(target, int) else target.fileno())
    return multiprocessing.connection.Connection(fd, readable=False), None


class Forked:
    """`subprocess.Popen([sys.executable, *COMMAND], ...)`, forked: `pid`, `args`, `stdout`/`stderr` (text pipes
    where asked for with subprocess.PIPE; None or DEVNULL discard; stderr=subprocess.STDOUT joins stdout), `poll`,
    `wait`, `send_signal`, `terminate`, `kill`, `returncode` (minus the signal's number when one ended it)."""

    def __init__(self, command, env=None, cwd=REPO, stdout=None, stderr=None):
        self.args = [sys.executable, *map(str, command)]
        env = {k: str(v) for k, v in (os.environ if env is None else env).items()}
        out, self.stdout = _stream(stdout)
        err, self.stderr = (out, None) if stderr == subprocess.STDOUT else _stream(stderr)
        self._process = _context().Process(target=_child, args=(self.args[1:], env, str(cwd), (out, err)))
        self._process.start()  # not a daemon: a run may start processes of its own (DataLoader workers)
        _running.add(self)
        for connection in {out, err}:
            connection.close()  # the child has its own copies
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended and the forkserver, its parent, reaped it since (as Popen does)
                pass

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()


_running: weakref.WeakSet[Forked] = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    """A test that failed before ending its process: kill it, or multiprocessing's exit would wait for it."""
    for process in list(_running):
        if process.poll() is None:
            process.kill()


def start(*args, env=None, stdout=None, stderr=None) -> Forked:
    """`subprocess.Popen([sys.executable, *ARGS], cwd=REPO, env=ENV, stdout=STDOUT, stderr=STDERR)`, forked (ENV:
    this process's environment when None)."""
    return Forked(args, env, REPO, stdout, stderr)


def ranks(*args, nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """What `torchrun --standalone --nproc_per_node NPROC ARGS` runs, its ranks forked (one thread each); ARGS is
    `-m MODULE ...` or `SCRIPT ...` (torchrun's own flags need `conftest.torchrun`). The ranks' outputs are joined in
    rank order as stdout and stderr; when a rank fails the others are stopped and its exit code is the job's, as
    torchrun ends a job. Raises subprocess.TimeoutExpired after TIMEOUT seconds, the ranks killed."""
    from conftest import free_port

    command = [str(a) for a in args]
    assert command[0] == "-m" or not command[0].startswith("-"), f"torchrun's flags need conftest.torchrun: {command}"
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])  # as conftest.torchrun
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    job = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), TORCHELASTIC_RUN_ID=f"ranks-{time.time_ns()}")
    with tempfile.TemporaryDirectory() as folder:
        logs = [Path(folder) / f"rank{r}.log" for r in range(nproc)]
        processes = []
        for r, log in enumerate(logs):
            place = dict(RANK=r, LOCAL_RANK=r, GROUP_RANK=0, WORLD_SIZE=nproc, LOCAL_WORLD_SIZE=nproc)
            with open(log, "w") as out:
                processes.append(Forked(command, {**base, **job, **place}, REPO, out, subprocess.STDOUT))
        code = _wait(processes, time.monotonic() + timeout)
        text = "".join(log.read_text(errors="replace") for log in logs)
    if code is None:
        raise subprocess.TimeoutExpired(["torchrun", *command], timeout, text)
    return subprocess.CompletedProcess(["torchrun", *command], code, text, text)


def _wait(processes: list[Forked], deadline: float) -> int | None:
    """The job's exit code once every rank has ended (a failed rank's, the others stopped), or None at DEADLINE."""
    while time.monotonic() < deadline:
        codes = [p.poll() for p in processes]
        failed = [c for c in codes if c not in (None, 0)]
        if failed or all(c == 0 for c in codes):
            _stop(processes)
            return failed[0] if failed else 0
        time.sleep(0.02)
    _stop(processes)
    return None


def _stop(processes: list[Forked]) -> None:
    """SIGTERM the ranks still running (tierlm's runs stop at a step boundary on it), SIGKILL after 10 s."""
    for p in processes:
        if p.poll() is None:
            p.terminate()
    for p in processes:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

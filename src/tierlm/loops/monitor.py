"""What a run says about itself while it runs, for whoever is not watching its log: a watchdog that turns a hang into
an exit with the stacks written, and a progress file a scheduler, a dashboard or a human reads.

- **Hangs** (`infra.hang_timeout`): the loop names each phase as it enters it (a step, an evaluation, a save); a
  thread on every rank waits for the next. A phase that lasts longer than the timeout (a rank stuck in a collective
  whose peer died or diverged, a data read that never returns) makes that rank write the Python stack of every
  thread to `hang-rank<R>.txt` in the run directory and to its log, print one line naming the rank, the phase and
  where its main thread waits, and exit (code 124, like `timeout`). Every rank waits on the same collectives, so all
  of them exit within the timeout instead of waiting forever; torchrun then ends the job (or restarts it, which
  resumes from the newest complete checkpoint).
- **Progress** (`progress.json`, rank 0): step, total steps, tokens, elapsed and estimated remaining seconds, the
  last complete checkpoint, the phase, the ranks' hosts and process ids, and the status (running, finished,
  interrupted, failed), replaced atomically at most once a second and at every phase change.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

PROGRESS_FILE = "progress.json"
HANG_EXIT = 124
FIRST_STEP_ALLOWANCE = 3
"""Until a step has completed, phases may last this many timeouts: the first step compiles and warms up."""
FAULT_HANG = "TIERLM_FAULT_HANG"
"""For tests: `RANK:STEP` makes that rank sleep forever as it begins that step (a hung rank, injected)."""
FAULT_KILL = "TIERLM_FAULT_KILL"
"""For tests: `RANK:STEP` makes that rank SIGKILL itself as it begins that step, in torchrun's first attempt only (a
machine lost, injected; the restarted group runs on)."""


def write_json_atomically(path: Path, record: dict[str, Any]) -> None:
    """`record` as `path`, replaced in one rename: a reader sees the old file or the new one, never half of one.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> write_json_atomically(folder / "p.json", {"step": 3}); json.loads((folder / "p.json").read_text())
    {'step': 3}
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def where_waiting(thread_id: int) -> str:
    """The innermost frame of a thread as `function (file:line)`: where it waits."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "unknown"
    return f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})"


class RunMonitor:
    """The watchdog and the progress file of one rank (`is_main` writes the file). `hosts`: every rank's
    {rank, host, pid} (`gather_hosts`). `hang_timeout` None: no watchdog."""

    def __init__(
        self,
        folder: Path,
        rank: int,
        is_main: bool,
        stage: str,
        total_steps: int,
        hang_timeout: float | None,
        hosts: list[dict[str, Any]] | None = None,
        checkpoint_dir: Path | None = None,
    ):
        self.folder, self.rank, self.is_main, self.stage, self.total_steps = folder, rank, is_main, stage, total_steps
        self.hang_timeout, self.hosts, self.checkpoint_dir = hang_timeout, hosts or [host_record(rank)], checkpoint_dir
        self.what, self.since, self.first_step = "start", time.monotonic(), True
        self.step, self.tokens, self.elapsed = 0, None, 0.0
        self._written, self._done, self._hung = 0.0, threading.Event(), False
        self._main = threading.get_ident()
        self._thread = None
        if hang_timeout is not None:
            self._thread = threading.Thread(target=self._watch, name="tierlm-watchdog", daemon=True)
            self._thread.start()

    # -- what the loop says -----------------------------------------------------------------
    def phase(self, what: str, state: Any = None) -> None:
        """The loop enters `what` ("step 12", "evaluation at step 12", "saving step 12"); `state`: its counters."""
        self.what, self.since = what, time.monotonic()
        if state is not None:
            self.step, self.elapsed = state.step, state.elapsed_s
            self.tokens = getattr(state, "tokens_seen", None)
        self._write("running", force=not what.startswith("step"))

    def close(self, status: str) -> None:
        """The loop ended: finished, interrupted or failed. After the watchdog fired the status stays "hung": the loop
        fails then only because the watchdog is taking the ranks out (a peer's exit breaks this rank's collective
        while this watchdog waits to leave), and the hang is what a supervisor must see."""
        self._done.set()
        self._write("hung" if self._hung else status, force=True)

    # -- the watchdog -----------------------------------------------------------------------
    @property
    def _every(self) -> float:
        """Seconds between the watchdog's checks."""
        assert self.hang_timeout is not None
        return min(1.0, self.hang_timeout / 4)

    def _watch(self) -> None:
        assert self.hang_timeout is not None
        while not self._done.wait(self._every):
            stalled = time.monotonic() - self.since
            if stalled > self.hang_timeout * (FIRST_STEP_ALLOWANCE if self.first_step else 1):
                self._hang(stalled)

    def _hang(self, stalled: float) -> None:
        import tempfile

        where = where_waiting(self._main)
        path = self.folder / f"hang-rank{self.rank}.txt"
        with tempfile.TemporaryFile("w+") as scratch:  # the stacks once, then to the run directory and the log
            who = f"rank {self.rank} ({socket.gethostname()}, pid {os.getpid()})"
            scratch.write(f"{who}: {self.what}, {stalled:.0f} s\n")
            scratch.flush()
            faulthandler.dump_traceback(file=scratch, all_threads=True)
            scratch.seek(0)
            stacks = scratch.read()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            path.write_text(stacks)
        except OSError:
            path = Path("(not written: the run directory is not writable)")
        hint = " (the first: raise infra.hang_timeout above one step's time)" if self.first_step else ""
        line = (
            f"tierlm: rank {self.rank} made no progress for {stalled:.0f} s in {self.what}{hint}, waiting in {where}; "
            f"stacks in {path} (infra.hang_timeout={self.hang_timeout:g})"
        )
        # Each its own write: the ranks share the log, and one write of a line is not cut by another rank's output.
        os.write(2, stacks.encode())
        os.write(2, f"\n{line}\n".encode())
        self._hung = True
        self._write("hung", force=True)
        # The other ranks' watchdogs fire within one check of this one (their phases began together): wait two checks
        # before leaving, or this rank's exit would end theirs (a collective's error) before they wrote their stacks.
        time.sleep(2 * self._every)
        os._exit(HANG_EXIT)

    # -- the progress file ------------------------------------------------------------------
    def _write(self, status: str, force: bool = False) -> None:
        if not self.is_main or (not force and time.monotonic() - self._written < 1.0):
            return
        self._written = time.monotonic()
        done = self.step / self.total_steps if self.total_steps else 0.0
        record = {
            "status": status,
            "stage": self.stage,
            "phase": self.what,
            "step": self.step,
            "total_steps": self.total_steps,
            "tokens_seen": self.tokens,
            "elapsed_s": round(self.elapsed, 1),
            "eta_s": round(self.elapsed * (1 - done) / done, 1) if 0 < done < 1 else (0.0 if done >= 1 else None),
            "last_checkpoint": self._latest(),
            "updated": time.time(),
            "updated_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "hosts": self.hosts,
        }
        try:
            write_json_atomically(self.folder / PROGRESS_FILE, record)
        except OSError:  # a full or vanished disk must not stop training: the log still says it all
            pass

    def _latest(self) -> str | None:
        """The newest complete checkpoint: what its folder's `latest` names once the save is sealed."""
        pointer = self.checkpoint_dir / "latest" if self.checkpoint_dir is not None else None
        try:
            return str(self.checkpoint_dir / pointer.read_text().strip()) if pointer is not None else None
        except OSError:
            return None


def host_record(rank: int) -> dict[str, Any]:
    return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid()}


def gather_hosts(rank: int, distributed: bool) -> list[dict[str, Any]]:
    """Every rank's {rank, host, pid}, on every rank (one process: its own)."""
    if not distributed:
        return [host_record(rank)]
    import torch.distributed as dist

    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host_record(rank))
    return hosts


def injected_fault(rank: int, step: int) -> None:
    """Tests' faults as a rank begins a step: `TIERLM_FAULT_HANG=RANK:STEP` hangs it; `TIERLM_FAULT_KILL=RANK:STEP`
    kills it (SIGKILL) unless torchrun has restarted the group already."""
    here = f"{rank}:{step}"
    if os.environ.get(FAULT_KILL) == here and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(FAULT_HANG) == here:
        while True:
            time.sleep(3600)

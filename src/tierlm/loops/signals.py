"""Stopping on a signal without losing work: SIGTERM (Slurm pre-emption, `kill`), SIGINT (Ctrl-C)
and SIGUSR1 (Slurm's `--signal=USR1@120` warning) finish the current optimizer step, write a
checkpoint and exit with 128 + the signal's number, so the same command resumes exactly there.

Under torchrun the loops ask every rank once per step (`agreed_signal`), so all ranks stop after
the same step even when the signal reached them at different moments. A second Ctrl-C interrupts
at once (the previous checkpoint stays whole).

In the CLI (`held_until_exit`) a stop under way keeps its handlers for the rest of the process: when one
rank exits, torchrun's agent sends SIGTERM to the others, which may still be closing their logs and
engines; that signal must not kill them before they say where they stopped. Called as a library (a
notebook), the handlers that were there before come back when the loop ends.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class RunInterrupted(Exception):
    """A run stopped on a signal after saving; `exit_code` is 128 + the signal's number."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint (no step had finished)"
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}; {where}; run the same command to resume"
        )

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_held = False


@contextmanager
def held_until_exit() -> Iterator[None]:
    """For a process that ends with its run (the CLI): a stop signal's handlers stay once the stop is under way."""
    global _held
    before, _held = _held, True
    try:
        yield
    finally:
        _held = before


def ignore_repeats() -> None:
    """The stop has been reported: until the process has exited, SIGTERM and SIGUSR1 change nothing. (Python
    puts the default handlers back while it shuts down, and torch's shutdown takes a moment.)"""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)


class GracefulStop:
    """While entered (in the main thread), the stop signals only set `signum`; the loop reads it.

    >>> import os
    >>> with GracefulStop() as stop:
    ...     os.kill(os.getpid(), signal.SIGUSR1)
    ...     stop.agreed_signal() == signal.SIGUSR1
    True
    """

    def __init__(self):
        self.signum = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.signum and _held:  # stopping on a signal in a process that ends with its run: a repeat (torchrun's
            return  # agent, Slurm, `kill`) is the same stop and must not cut short the closing, the report, the exit
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = self.signum or signum

    def agreed_signal(self, all_reduce_sums: Callable[[dict[str, float]], dict[str, float]] | None = None) -> int:
        """The signal to stop for (0: go on). With `all_reduce_sums` (a multi-rank job), every rank
        gets the same answer: stop if any rank received a signal, for the first of STOP_SIGNALS seen.

        >>> stop = GracefulStop()  # this rank saw nothing; another rank got SIGTERM
        >>> other_rank = lambda mine: {**mine, "SIGTERM": mine["SIGTERM"] + 1.0}
        >>> stop.agreed_signal(other_rank) == signal.SIGTERM == stop.signum
        True
        """
        if all_reduce_sums is None:
            return self.signum
        seen = all_reduce_sums({sig.name: float(self.signum == sig) for sig in STOP_SIGNALS})
        agreed = next((int(sig) for sig in STOP_SIGNALS if seen[sig.name] > 0), 0)
        # A rank stopping for another rank's signal is stopping too: its handlers stay (`__exit__`), so the SIGTERM
        # torchrun's agent sends when the first rank exits cannot kill it before it reports where it stopped.
        self.signum = self.signum or agreed
        return agreed

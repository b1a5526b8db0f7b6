"""training.profile_steps: a run's steps traced by torch.profiler, as torchtitan's `--profiling.enable_profiling`
does, written where the run is: `profile/trace_rank{R}.json.gz` (each rank's timeline: chrome://tracing or
https://ui.perfetto.dev open it) and `profile/summary_rank{R}.txt` (its operators by time, the device's on a GPU).

The step before the first traced one warms the profiler up (its first step carries its own start-up); each traced
step is a `step N` range in the timeline. A run resumed inside the range traces from where it resumed; one that stops
before the range ends writes what it traced.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

PROFILE_DIRNAME = "profile"


class StepProfiler:
    """torch.profiler over training steps `first`..`last` (1-based, inclusive) of a loop (`tierlm.loops.cadence`).

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> profiler = StepProfiler(2, 3, folder, rank=0)
    >>> for n in range(1, 5):
    ...     with profiler.step(n):
    ...         _ = torch.ones(64, 64) @ torch.ones(64, 64)
    >>> sorted(p.name for p in folder.iterdir()), profiler.traced
    (['summary_rank0.txt', 'trace_rank0.json.gz'], [2, 3])
    """

    def __init__(self, first: int, last: int, folder: Path, rank: int, announce: bool = False):
        self.first, self.last, self.folder, self.rank, self.announce = first, last, Path(folder), rank, announce
        self.traced: list[int] = []
        self._profiler: profile | None = None

    @contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Around training step `n`: starts the profiler a step before the range (at once where the run resumes
        inside it), records the step, and writes the files after the range's last."""
        if self._profiler is None and not self.traced and self.first - 1 <= n <= self.last:
            warmup = 1 if n < self.first else 0
            with warnings.catch_warnings():  # no step to warm up on (step 1, or resumed inside the range): known
                warnings.filterwarnings("ignore", "Profiler won't be using warmup")
                steps = schedule(wait=0, warmup=warmup, active=self.last - max(n, self.first) + 1, repeat=1)
            self._profiler = profile(
                activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])],
                schedule=steps,
                on_trace_ready=self._write,
            )
            self._profiler.start()
        if self._profiler is None:
            yield
            return
        with record_function(f"step {n}"):
            yield
        if n >= self.first:
            self.traced.append(n)
        self._profiler.step()
        if n >= self.last:
            self.close()

    def close(self) -> None:
        """Stop, writing what was traced (a run that ended before the range did)."""
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()

    def _write(self, profiler: profile) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"trace_rank{self.rank}.json.gz"
        profiler.export_chrome_trace(str(trace))
        on_device = torch.cuda.is_available()
        table = profiler.key_averages().table(
            sort_by="self_device_time_total" if on_device else "self_cpu_time_total", row_limit=40
        )
        steps = f"{self.traced[0]}-{self.traced[-1]}" if self.traced else "none"
        summary = self.folder / f"summary_rank{self.rank}.txt"
        clock = "device" if on_device else "CPU"
        summary.write_text(f"steps {steps} (torch.profiler, operators by self {clock} time)\n\n{table}\n")
        if self.announce:
            print(f"profile: steps {steps} traced to {trace} (https://ui.perfetto.dev opens it); by time: {summary}")

"""The one cadence of every training loop: when it logs, evaluates, saves and keeps checkpoints, how it
stops on a signal and how it resumes.

A loop (`tierlm.loops.trainer.Trainer` for pretraining, SFT and DPO; `tierlm.loops.rl.RLTrainer`) supplies
one step, one evaluation and what its checkpoints hold (`Loop`); `run_loop` decides the rest, the same way
for both:

- evaluate before the first step (when the loop evaluates), every training.eval_steps and at the end;
- log every training.logging_steps and at the end;
- save every training.save_steps and at the end; a checkpoint records the metric of an evaluation made at
  its step (lower is better) for retention, which keeps training.save_total_limit of them (and the best);
- after a step, a stop signal that reached any rank saves (unless just saved) and ends the run with
  `RunInterrupted`, which names the checkpoint to resume from;
- `resume` loads the newest loadable checkpoint (a damaged one is reported and the previous one tried),
  into the loop's backend and into its companions (PPO's critic: saved first at the same steps, so a
  checkpoint on disk always has its companions').
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from tierlm.backends.protocol import TrainingBackend
from tierlm.checkpoint import find_best_checkpoint, prune_checkpoints, resume_candidates
from tierlm.checkpoint.load import checkpoint_metric
from tierlm.config import TrainingConfig
from tierlm.errors import CheckpointError
from tierlm.loops.monitor import RunMonitor, injected_fault
from tierlm.loops.profiling import StepProfiler
from tierlm.loops.signals import GracefulStop, RunInterrupted
from tierlm.metrics import MetricsLogger


@dataclass(frozen=True)
class Watch:
    """What a run watches its loop with, handed to the loop's `train(watch)` once the run has begun (after the
    resume, so the logger knows the step it continues from).

    >>> Watch().stop is None, Watch().logger.sinks
    (True, [])
    """

    logger: MetricsLogger = field(default_factory=lambda: MetricsLogger([]))
    """Where each train / eval / sample record goes (metrics.jsonl, TensorBoard, W&B, MLflow, the report)."""
    stop: GracefulStop | None = None
    """The caught stop signals: one ends the loop after a saved step."""
    monitor: RunMonitor | None = None
    """Told each phase as it begins (the hang watchdog, the progress file; `tierlm.loops.monitor`)."""
    profiler: StepProfiler | None = None
    """Traces the steps training.profile_steps names (`tierlm.loops.profiling`)."""


class Kept(Protocol):
    """Something a checkpoint carries beside the loop's model and state (a reference that follows the policy:
    `tierlm.backends.references.SyncedReference`)."""

    def snapshot(self) -> Callable[[Path], None]:
        """Its state now (copied: the save may be written on another thread), as a writer of its files into a
        checkpoint folder."""
        ...

    def load(self, folder: Path) -> None:
        """Its state from a checkpoint folder its `snapshot` wrote into."""
        ...


class Loop(Protocol):
    """What `run_loop` asks of a training loop."""

    backend: TrainingBackend
    config: TrainingConfig
    state: Any
    """The loop's counters, with at least `step` and `elapsed_s` (saved with every checkpoint)."""
    watch: Watch
    """The logger, the stop signals and the monitor of the run (`Watch`)."""
    write_extra: Callable[[Path], None] | None
    """What a checkpoint carries besides weights (tokenizer, config; `tierlm.run.extras_writer`)."""
    kept: list[Kept]
    """What else its checkpoints carry, and its resumes restore."""
    evaluates: bool
    """Whether it has anything to evaluate."""

    def loop_step(self) -> dict[str, float]:
        """One optimizer step (RL: one step of rollouts and updates); its metrics."""
        ...

    def after_step(self, metrics: dict[str, float], log: bool) -> None:
        """Account for the step just counted in `state.step`; write its log line when `log`."""
        ...

    def evaluate(self) -> dict[str, float]: ...

    def log_eval(self, metrics: dict[str, float]) -> None:
        """Show an evaluation made during training (its progress line)."""
        ...

    def checkpoint_metric(self) -> float | None:
        """The metric of the evaluation made at this step (lower is better), else None."""
        ...

    def trainer_state(self) -> dict:
        """What a checkpoint stores besides the backend's: the counters, the data position."""
        ...

    def load_trainer_state(self, state: dict) -> None: ...

    def companions(self) -> list[TrainingBackend]:
        """Backends saved and resumed with the loop's at the same steps (PPO's critic)."""
        ...

    def on_save(self, path: Path) -> None: ...


def due(every: int, step: int) -> bool:
    """Is `step` one of every `every` steps (0: never)?

    >>> due(10, 20), due(10, 21), due(0, 20)
    (True, False, False)
    """
    return every > 0 and step % every == 0


def run_loop(loop: Loop) -> None:
    """Train `loop` from its state's step to training.num_train_steps."""
    cfg, state, monitor, profiler = loop.config, loop.state, loop.watch.monitor, loop.watch.profiler

    def enter(what: str) -> None:
        if monitor is not None:
            monitor.phase(what, state)

    if loop.evaluates and state.step == 0:
        enter("the evaluation before step 1")
        loop.evaluate()
    start = time.perf_counter() - state.elapsed_s
    best = best_saved_metric(loop)  # training.save_best: the metric to beat, as the checkpoints on disk record it
    while state.step < cfg.num_train_steps:
        enter(f"step {state.step + 1}")
        if monitor is not None:
            injected_fault(monitor.rank, state.step + 1)
        with profiler.step(state.step + 1) if profiler is not None else nullcontext():
            metrics = loop.loop_step()
        state.step += 1
        state.elapsed_s = time.perf_counter() - start
        last = state.step == cfg.num_train_steps
        loop.after_step(metrics, log=due(cfg.logging_steps, state.step) or last)
        if monitor is not None:
            monitor.first_step = False
        if loop.evaluates and (due(cfg.eval_steps, state.step) or last):
            enter(f"the evaluation at step {state.step}")
            loop.log_eval(loop.evaluate())
        metric = loop.checkpoint_metric()  # None unless evaluated at this step
        better = cfg.save_best and metric is not None and (best is None or metric < best)
        saved = due(cfg.save_steps, state.step) or last or better
        if saved:
            enter(f"saving step {state.step}")
            save(loop)
            best = metric if better else best
        if not last:
            enter(f"the stop check after step {state.step}")
            stop_if_signalled(loop, saved)
    enter("waiting for the last save")
    wait_for_saves(loop)


def best_saved_metric(loop: Loop) -> float | None:
    """The lowest metric a checkpoint of the loop records (None: none, or training.save_best is off)."""
    if not loop.config.save_best:
        return None
    best = find_best_checkpoint(loop.backend.checkpoint_dir)
    return checkpoint_metric(best) if best is not None else None


def save(loop: Loop) -> Path:
    """A checkpoint of the loop at its step (companions first), then retention."""
    step, trainer_state, metric = loop.state.step, loop.trainer_state(), loop.checkpoint_metric()
    main = loop.backend.is_main
    for (
        companion
    ) in loop.companions():  # complete before the loop's own: a checkpoint on disk always has its companions'
        companion.save_checkpoint(step, trainer_state, None, metric)
        companion.wait_for_save()
        if main:
            prune_checkpoints(companion.checkpoint_dir, loop.config.save_total_limit)
    path = loop.backend.checkpoint_dir / f"step_{step}"
    writers = [w for w in (loop.write_extra, *(kept.snapshot() for kept in loop.kept)) if w is not None]
    write_extra = (lambda folder: [write(folder) for write in writers]) if writers else None
    loop.backend.save_checkpoint(step, trainer_state, write_extra, metric)
    if main:  # retention only ever sees complete checkpoints: a save still being written is not counted yet
        prune_checkpoints(path.parent, loop.config.save_total_limit)
        loop.on_save(path)
    return path


def wait_for_saves(loop: Loop) -> None:
    """Wait for a checkpoint still being written, then apply retention to it too."""
    loop.backend.wait_for_save()
    if loop.backend.is_main:
        prune_checkpoints(loop.backend.checkpoint_dir, loop.config.save_total_limit)


def stop_if_signalled(loop: Loop, saved: bool) -> None:
    """After a step: when a stop signal arrived on any rank, save unless just saved, then raise `RunInterrupted`."""
    stop, backend = loop.watch.stop, loop.backend
    if stop is None:
        return
    signum = stop.agreed_signal(backend.all_reduce_sums if backend.world_size > 1 else None)
    if signum:
        path = backend.checkpoint_dir / f"step_{loop.state.step}" if saved else save(loop)
        backend.wait_for_save()
        raise RunInterrupted(signum, loop.state.step, path)


def resume_backend(backend: TrainingBackend, warn: bool = True) -> tuple[Path, dict] | None:
    """Load the newest loadable checkpoint into `backend`: (its path, its trainer state), or None
    when there is none. A damaged checkpoint is reported in one line and the previous one tried."""
    candidates = resume_candidates(backend.checkpoint_dir)
    for path in candidates:
        try:
            return path, backend.load_checkpoint(path).wait()
        except CheckpointError as error:
            if warn:
                print(f"tierlm: warning: {error}; trying the previous checkpoint", file=sys.stderr)
    if candidates:
        raise CheckpointError(f"no checkpoint in {backend.checkpoint_dir} can be loaded; move them away to start fresh")
    return None


def resume(loop: Loop, chosen: Path | None = None) -> Path | None:
    """Continue `loop` from its newest loadable checkpoint, or from `chosen` (any run's; its failure to load is an
    error, not a reason to try another), and its companions from the same step of the same run."""
    if chosen is not None:
        found = chosen, loop.backend.load_checkpoint(chosen).wait()
    else:
        found = resume_backend(loop.backend, warn=loop.backend.is_main)
    if found is None:
        return None
    path, trainer_state = found
    loop.load_trainer_state(trainer_state)
    for kept in loop.kept:
        kept.load(path)
    for companion in loop.companions():  # the same step's, beside it (a missing one is a CheckpointError)
        companion.load_checkpoint(path.parent.parent / companion.checkpoint_dir.name / path.name).wait()
    return path

"""The loop: loader -> strategy.prepare_batch -> backend.forward_backward -> backend.optim_step.

`Trainer(backend, strategy)` decides when to evaluate, log, checkpoint and stop; the backend
does the math and the strategy says what is optimised. It speaks only the tier-0 protocol, so
it drives every backend the same way.

Seed 001's functional surface is a thin layer over the same calls, not a second loop:

    trainer = Trainer(backend, strategy)
    model_state = backend.model_state()
    for batch in loader:
        result = trainer.train_step(batch, model_state, model_state.optimizer_state)   # a TrainingResult
        model_state = result.model_state
    model_state = trainer.train_epoch(loader, model_state)                            # one pass

(`tierlm.backends.state`: on PyTorch a state is a view of the backend's, on JAX a value.)
"""

from __future__ import annotations

import gc
import math
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from tqdm.auto import tqdm

from tierlm.backends.protocol import TrainingBackend
from tierlm.backends.state import GradientInfo, ModelState
from tierlm.checkpoint import find_latest_checkpoint, prune_checkpoints, resume_candidates
from tierlm.config import TrainingConfig
from tierlm.data.packing import eval_batches
from tierlm.errors import CheckpointError, TrainingDiverged
from tierlm.metrics import MetricsLogger
from tierlm.metrics.memory import memory_record
from tierlm.models import family_of, unwrap_model
from tierlm.primitives.fp8 import disable_fp8
from tierlm.loops.signals import GracefulStop, RunInterrupted
from tierlm.strategies.base import TrainingStrategy


@dataclass
class TrainingResult:
    """Seed 001's result of one `train_step`."""

    model_state: ModelState
    """The state after the update."""
    metrics: dict[str, float]
    """loss, grad_norm, lr (and each role's), num_tokens, skipped."""
    diagnostics: dict[str, float]
    """step_s (timing), param_bytes / optimizer_bytes / rss_mb (memory), communication_bytes (gradient
    bytes each rank sends per step)."""
    gradients: GradientInfo | None = None


@dataclass
class LoopState:
    step: int = 0
    tokens_seen: int = 0
    trained_tokens: int = 0
    best_val_loss: float | None = None
    elapsed_s: float = 0.0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    loss_ema: float = 0.0  # exponential moving average of the training loss, not yet debiased
    loss_ema_steps: int = 0  # the finite losses it has seen


EMA_BETA = 0.9  # the progress line's smoothed loss (nanochat's)
GC_COLLECT_STEPS = 5000  # with the collector off after the first step, a full collection this often


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


class Trainer:
    def __init__(
        self,
        backend: TrainingBackend,
        strategy: TrainingStrategy,
        *,
        train_loader=None,
        config: TrainingConfig | None = None,
        eval_loader=None,
        logger: MetricsLogger | None = None,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        write_extra: Callable[[Path], None] | None = None,
        progress_bar: bool = True,
        sampler: Callable[[Any], list[dict[str, str]]] | None = None,
        callbacks: list | None = None,
    ):
        """`callbacks`: objects with any of `on_log(record)` (each train line logged), `on_eval(metrics)`
        and `on_save(path)`, called on the main rank (Hugging Face's TrainerCallback, in three methods)."""
        self.backend, self.strategy, self.config = backend, strategy, config or TrainingConfig()
        config = self.config
        self.train_loader, self.logger = train_loader, logger or MetricsLogger([])
        self.eval_set = eval_batches(eval_loader, config.eval_batches) if eval_loader is not None else []
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.write_extra, self.progress_bar = write_extra, progress_bar
        self.sampler = sampler  # model -> [{"prompt", "completion"}], run by rank 0 at each evaluation
        self.callbacks = list(callbacks or [])
        self.state = LoopState()
        self.stop: GracefulStop | None = None  # set by the run: a signal then ends the loop after a saved step
        self.last_eval: dict[str, float] = {}
        self.last_eval_step = -1
        # Data-parallel backends say where this process sits; rank 0 reports and prunes.
        self.rank, self.world_size = getattr(backend, "rank", 0), getattr(backend, "world_size", 1)
        self.is_main = self.rank == 0
        # Evaluation shards its batches over the data-parallel ranks (a model-parallel group shares its rows).
        self.data_rank, self.data_world_size = getattr(backend, "data_rank", self.rank), getattr(backend, "data_world_size", self.world_size)

    # -- one step, one eval, one save ------------------------------------------------------
    def step(self, micro_batches: Iterable[dict]) -> dict[str, float]:
        """Accumulate gradients over `micro_batches`, then one optimizer step. Returns its metrics."""
        input_tokens = 0
        for batch in micro_batches:
            prepared = self.strategy.prepare_batch(batch)
            input_tokens += prepared["input_ids"].numel()
            self.backend.forward_backward(prepared, loss_fn=self.strategy.compute_loss)
        return {**self.backend.optim_step().wait(), "input_tokens": input_tokens}

    # -- seed 001's functional surface -----------------------------------------------------
    def train_step(self, batch: dict, model_state: ModelState | None = None, optimizer_state: Any = None) -> TrainingResult:
        """One update from (`model_state`, `optimizer_state`) on `batch`: prepare_batch, forward_backward,
        all_reduce_gradients, apply_gradients. Without states it steps from the backend's current one."""
        start = time.perf_counter()
        if model_state is not None:
            self.backend.load_model_state(model_state, optimizer_state)
        self.backend.forward_backward(self.strategy.prepare_batch(batch), loss_fn=self.strategy.compute_loss)
        gradients = self.backend.all_reduce_gradients(self.backend.gradient_info())
        self.backend.apply_gradients(self.backend.model, gradients, self.backend.optimizer)
        diagnostics = {"step_s": time.perf_counter() - start, **self.backend.memory_stats(), **memory_record(self.backend.device),
                       "communication_bytes": float(self.backend.communication_bytes())}
        return TrainingResult(self.backend.model_state(), dict(self.backend.last_step_metrics), diagnostics, gradients)

    def train_epoch(self, dataloader, model_state: ModelState | None = None) -> ModelState:
        """One pass over `dataloader` (a tierlm loader: one epoch, however it is set to repeat; or any
        iterable of batches), a `train_step` per batch, each logged; returns the final state."""
        repeat = getattr(dataloader, "repeat", None)
        if repeat is not None:
            dataloader.repeat = False
        try:
            for batch in dataloader:
                result = self.train_step(batch, model_state)
                model_state = result.model_state
                self.logger.log({"type": "train", "step": model_state.step, **result.metrics, **result.diagnostics})
        finally:
            if repeat is not None:
                dataloader.repeat = repeat
        return model_state if model_state is not None else self.backend.model_state()

    def evaluate(self) -> dict[str, float]:
        """Metrics over the fixed eval set. Ranks share its batches and sum their totals, so the
        result does not depend on the world size; every rank runs the same number of forwards
        (a rank short of batches repeats one with weight 0), as FSDP's collectives require."""
        totals: dict[str, float] = defaultdict(float)
        mine = self.eval_set[self.data_rank :: self.data_world_size]
        rounds = -(-len(self.eval_set) // self.data_world_size)
        with disable_fp8(self.backend.model):  # FP8 trains; evaluation sees the unquantised model (seed 004)
            for i in range(rounds):
                batch, weight = (mine[i], 1.0) if i < len(mine) else (self.eval_set[0], 0.0)
                out = self.backend.forward(self.strategy.prepare_batch(batch), self.strategy.compute_metrics).wait()
                for key, value in out.items():
                    totals[key] += weight * value
            samples = self.sampler(self.backend.eval_model) if self.sampler is not None and self.is_main else []
        if self.world_size > 1:
            totals = self.backend.all_reduce_sums(dict(totals))
        self.last_eval, self.last_eval_step = self.strategy.summarize(totals), self.state.step
        val_loss = self.last_eval["val_loss"]
        if self.state.best_val_loss is None or val_loss < self.state.best_val_loss:
            self.state.best_val_loss = val_loss
        self.logger.log({"type": "eval", "step": self.state.step, "tokens_seen": self.state.tokens_seen, **self.last_eval,
                         **self._model_figures()})
        for sample in samples:
            self.logger.log({"type": "sample", "step": self.state.step, **sample})
        self._callback("on_eval", dict(self.last_eval))
        return self.last_eval

    def _callback(self, event: str, argument: Any) -> None:
        if self.is_main:
            for callback in self.callbacks:
                if hasattr(callback, event):
                    getattr(callback, event)(argument)

    def save(self) -> Path:
        trainer_state = {"loop": asdict(self.state), "loader": self.train_loader.state_dict()}
        metric = self.last_eval.get("val_loss") if self.last_eval_step == self.state.step else None
        path = self.backend.checkpoint_dir / f"step_{self.state.step}"
        self.backend.save_checkpoint(self.state.step, trainer_state, self.write_extra, metric)
        # Retention only ever sees complete checkpoints, so a save still being written in the
        # background is simply not counted yet.
        if self.is_main:
            prune_checkpoints(path.parent, self.config.save_total_limit)
        self._callback("on_save", path)
        return path

    def resume(self) -> Path | None:
        """Continue from the newest loadable checkpoint; a damaged one is reported in one line and skipped."""
        found = resume_backend(self.backend, warn=self.is_main)
        if found is None:
            return None
        path, trainer_state = found
        self.state = LoopState(**trainer_state["loop"])
        self.train_loader.load_state_dict(trainer_state["loader"])
        return path

    def check_stop(self, saved: bool) -> None:
        """After a step: when a stop signal arrived (on any rank), save unless just saved, then raise `RunInterrupted`."""
        if self.stop is None:
            return
        signum = self.stop.agreed_signal(self.backend.all_reduce_sums if self.world_size > 1 else None)
        if signum:
            path = self.backend.checkpoint_dir / f"step_{self.state.step}" if saved else self.save()
            if hasattr(self.backend, "wait_for_save"):
                self.backend.wait_for_save()
            raise RunInterrupted(signum, self.state.step, path)

    def _check_finite(self, metrics: dict[str, float]) -> None:
        if not metrics.get("skipped"):
            self.state.consecutive_skips = 0
            return
        self.state.skipped_steps += 1
        self.state.consecutive_skips += 1
        if self.is_main:
            print(f"tierlm: warning: step {self.state.step}: loss {metrics['loss']} / grad norm {metrics['grad_norm']}"
                  " is not finite; the update was skipped", file=sys.stderr)
        if self.state.consecutive_skips >= self.config.max_consecutive_nonfinite:
            latest = find_latest_checkpoint(self.backend.checkpoint_dir)
            raise TrainingDiverged(
                f"loss or gradients were NaN/Inf for {self.state.consecutive_skips} consecutive steps (up to step "
                f"{self.state.step}); stopped. Last good checkpoint: {latest or 'none'}. Lower training.learning_rate "
                "or check the data"
            )

    # -- the loop --------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        cfg, state = self.config, self.state
        due = lambda every: every > 0 and state.step % every == 0  # noqa: E731
        shown = sys.stderr.isatty() or "ipykernel" in sys.modules  # a terminal, or a notebook (tqdm.auto draws a widget there)
        bar = tqdm(total=cfg.num_train_steps, initial=state.step, disable=not (self.progress_bar and self.is_main and shown),
                   dynamic_ncols=True, desc="train")
        if self.eval_set and state.step == 0:
            self.evaluate()
        start = time.perf_counter() - state.elapsed_s
        gc_frozen = False
        window = [0, 0.0, 0.0]  # input tokens, trained tokens, seconds since the last logged line
        try:
            while state.step < cfg.num_train_steps:
                step_start = time.perf_counter()
                metrics = self.step(self.train_loader.next_batch() for _ in range(cfg.gradient_accumulation_steps))
                step_s = time.perf_counter() - step_start
                state.step += 1
                family_of(self.backend.model).on_step(unwrap_model(self.backend.model), state.step, metrics["loss"])
                if not gc_frozen:  # after the first step, everything alive stays: no more GC passes over it (seed 004)
                    gc.collect()
                    gc.freeze()
                    gc.disable()
                    gc_frozen = True
                elif state.step % GC_COLLECT_STEPS == 0:  # what reference cycles build up, collected now and then
                    gc.collect()
                state.tokens_seen += metrics["input_tokens"]
                state.trained_tokens += int(metrics["num_tokens"])
                state.elapsed_s = time.perf_counter() - start
                self._check_finite(metrics)
                record = self._train_record(metrics, step_s)
                bar.update(1)
                bar.set_postfix_str(self._postfix(record), refresh=False)
                window = [window[0] + metrics["input_tokens"], window[1] + metrics["num_tokens"], window[2] + step_s]
                if due(cfg.logging_steps) or state.step == cfg.num_train_steps:
                    record.update(self._rates(*window), **self._slow_stats())  # rates over every step since the last line
                    window = [0, 0.0, 0.0]
                    self.logger.log(record)
                    self._callback("on_log", dict(record))
                    if bar.disable and self.is_main:
                        print(self._log_line(record), file=sys.stderr, flush=True)
                if self.eval_set and (due(cfg.eval_steps) or state.step == cfg.num_train_steps):
                    self.evaluate()
                    if self.is_main:
                        bar.write(f"step {state.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in self.last_eval.items()))
                saved = due(cfg.save_steps) or state.step == cfg.num_train_steps
                if saved:
                    self.save()
                if state.step < cfg.num_train_steps:
                    self.check_stop(saved)
        finally:
            bar.close()
            if gc_frozen:  # the run's objects may be collected again (a process group held by a cycle must go before exit)
                gc.enable()
                gc.unfreeze()
        if hasattr(self.backend, "wait_for_save"):
            self.backend.wait_for_save()
            if self.is_main:
                prune_checkpoints(self.backend.checkpoint_dir, self.config.save_total_limit)
        if self.eval_set and not self.last_eval:  # resumed at the last step: report where it stands
            self.evaluate()
        return {"step": state.step, "tokens_seen": state.tokens_seen, "elapsed_s": state.elapsed_s, **self.last_eval}

    # -- reporting -------------------------------------------------------------------------
    def _rates(self, input_tokens: float, trained_tokens: float, seconds: float) -> dict[str, float]:
        """Tokens/s (input and trained) and MFU over `seconds` of training steps."""
        rates = {"tokens_per_sec": input_tokens / seconds, "trained_tokens_per_sec": trained_tokens / seconds}
        if self.flops_per_token and self.peak_flops:
            rates["mfu"] = self.flops_per_token * rates["tokens_per_sec"] / self.peak_flops
        return rates

    def _train_record(self, metrics: dict[str, float], step_s: float) -> dict[str, Any]:
        if math.isfinite(metrics["loss"]):
            self.state.loss_ema = EMA_BETA * self.state.loss_ema + (1 - EMA_BETA) * metrics["loss"]
            self.state.loss_ema_steps += 1
        record = {
            "type": "train",
            "step": self.state.step,
            "loss": metrics["loss"],
            "loss_ema": self.state.loss_ema / (1 - EMA_BETA**self.state.loss_ema_steps) if self.state.loss_ema_steps else metrics["loss"],
            "lr": metrics["lr"],
            "grad_norm": metrics["grad_norm"],
            **self._rates(metrics["input_tokens"], metrics["num_tokens"], step_s),  # this step's (the progress line's)
            "tokens_seen": self.state.tokens_seen,
            "trained_tokens": self.state.trained_tokens,
            "elapsed_s": self.state.elapsed_s,
            "skipped_steps": self.state.skipped_steps,
        }
        record.update({k: v for k, v in metrics.items() if k.startswith("lr_") or k == "sparsity"})
        return record

    def _slow_stats(self) -> dict[str, float]:
        """Data and memory figures, read only for logged steps."""
        stats = self.train_loader.stats() if hasattr(self.train_loader, "stats") else {}
        model_bytes = self.backend.memory_stats() if hasattr(self.backend, "memory_stats") else {}
        return {**stats, **model_bytes, **memory_record(self.backend.device), **self._model_figures()}

    def _model_figures(self) -> dict[str, float]:
        """What the model's family reports about the model itself (e.g. the GPT-2 variants' gates)."""
        model = self.backend.model
        return family_of(model).diagnostics(unwrap_model(model))

    def _eta_s(self) -> float:
        done = max(self.state.step, 1)
        return self.state.elapsed_s / done * (self.config.num_train_steps - self.state.step)

    @staticmethod
    def _postfix(r: dict[str, Any]) -> str:
        mfu = f" mfu {100 * r['mfu']:.1f}%" if "mfu" in r else ""
        return f"loss {r['loss_ema']:.4f} (ema) lr {r['lr']:.2e} {r['tokens_per_sec']:,.0f} tok/s{mfu}"

    def _log_line(self, r: dict[str, Any]) -> str:
        return f"step {r['step']}/{self.config.num_train_steps} | {self._postfix(r)} | eta {self._eta_s():.0f}s"

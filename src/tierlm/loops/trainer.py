"""The loop: loader -> strategy.prepare_batch -> backend.forward_backward -> backend.optim_step.

`Trainer(backend, strategy)` runs pretraining, SFT and DPO: the backend does the math, the strategy
says what is optimised, and the one cadence of `tierlm.loops.cadence` decides when to evaluate, log,
checkpoint, stop and resume (as it does for RL's loop). It speaks only the tier-0 protocol, so it
drives every backend the same way.

The functional trainer API is a thin layer over the same calls, not a second loop:

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from tqdm.auto import tqdm

from tierlm.backends.protocol import TrainingBackend
from tierlm.backends.state import GradientInfo, ModelState
from tierlm.checkpoint import find_latest_checkpoint
from tierlm.config import TrainingConfig
from tierlm.data.windows import eval_batches
from tierlm.errors import TrainingDiverged
from tierlm.loops import cadence
from tierlm.loops.cadence import Watch, resume_backend  # noqa: F401  (also this module's name)
from tierlm.loops.evaluation import CoreSchedule, validation_totals
from tierlm.metrics import MetricsLogger
from tierlm.metrics.flops import PeakFlops
from tierlm.metrics.memory import memory_record
from tierlm.models import family_of, unwrap_model
from tierlm.primitives.fp8 import disable_fp8
from tierlm.strategies.base import TrainingStrategy


@dataclass
class TrainingResult:
    """The result of one `train_step` (the functional trainer API)."""

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
    epoch: float | None = None  # passes over the training data (None: a loader that does not say)


EMA_BETA = 0.9  # the progress line's smoothed loss (nanochat's)
GC_COLLECT_STEPS = 5000  # with the collector off after the first step, a full collection this often


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
        peak_flops: PeakFlops | None = None,
        write_extra: Callable[[Path], None] | None = None,
        progress_bar: bool = True,
        sampler: Callable[[Any], list[dict[str, str]]] | None = None,
        callbacks: list | None = None,
        batches_per_epoch: int | None = None,
        optimizer: Any = None,
        core: CoreSchedule | None = None,
        kept: list | None = None,
    ):
        """`optimizer`: a functional optimizer (`init(params)`, `update(grads, state, params)`: PyTorchAdam,
        FunctionalMuon, JaxAdam, JaxMuon, an optax transformation) that `train_step` updates with in place of the
        backend's own; its state is then `train_step`'s `optimizer_state` and the result's
        `model_state.optimizer_state`. `callbacks`: objects with any of `on_log(record)` (each train line logged),
        `on_eval(metrics)` and `on_save(path)`, called on the main rank (Hugging Face's TrainerCallback, in three
        methods).
        `batches_per_epoch` (the global micro-batches of one pass over the data, when known) puts the epoch reached
        in every train line and the summary. `core`: CORE measured at its steps ("core" lines; the summary's `core`).
        `kept`: what else checkpoints carry and resumes restore (`tierlm.loops.cadence.Kept`)."""
        self.backend, self.strategy, self.config = backend, strategy, config or TrainingConfig()
        self.optimizer = optimizer
        if optimizer is not None:
            backend.use_optimizer(optimizer)
        config = self.config
        self.train_loader, self.watch = train_loader, Watch(logger or MetricsLogger([]))
        count = None if config.eval_batches == "all" else config.eval_batches
        self.eval_set = eval_batches(eval_loader, count) if eval_loader is not None else []
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.write_extra, self.progress_bar = write_extra, progress_bar
        self.sampler = sampler  # model -> [{"prompt", "completion"}], run by rank 0 at each evaluation
        self.callbacks = list(callbacks or [])
        self.batches_per_epoch = batches_per_epoch
        self.core, self.kept = core, list(kept or [])
        self.state = LoopState()
        self.last_eval: dict[str, float] = {}
        self.last_eval_step = -1
        self.last_core: float | None = None
        # Data-parallel backends say where this process sits; rank 0 reports and prunes. Evaluation shards its
        # batches over the data-parallel ranks (a model-parallel group shares its rows).
        self.is_main, self.world_size = backend.is_main, backend.world_size
        self.data_rank, self.data_world_size = backend.data_rank, backend.data_world_size
        self.bar: tqdm | None = None
        self._gc_frozen = False
        self.window = [0, 0.0, 0.0]  # input tokens, trained tokens, seconds since the last logged line

    # -- one step, one eval, one save ------------------------------------------------------
    def step(self, micro_batches: Iterable[dict]) -> dict[str, float]:
        """Accumulate gradients over `micro_batches`, then one optimizer step. Returns its metrics, with
        `input_tokens`: the rows' tokens (tokens_seen, tokens/s); an encoder-decoder's are its decoder's, the
        tokens its plan, its FLOPs per token and its target counts are counted in (the encoder's are read)."""
        input_tokens = 0
        for batch in micro_batches:
            prepared = self.strategy.prepare_batch(batch)
            input_tokens += prepared.get("decoder_input_ids", prepared["input_ids"]).numel()
            self.backend.forward_backward(prepared, loss_fn=self.strategy.compute_loss)
        return {**self.backend.optim_step().wait(), "input_tokens": input_tokens}

    # -- the functional trainer API -----------------------------------------------------
    def train_step(
        self, batch: dict, model_state: ModelState | None = None, optimizer_state: Any = None
    ) -> TrainingResult:
        """One update from (`model_state`, `optimizer_state`) on `batch`: prepare_batch, forward_backward,
        all_reduce_gradients, apply_gradients. Without states it steps from the backend's current one."""
        start = time.perf_counter()
        if model_state is not None:
            self.backend.load_model_state(model_state, optimizer_state)
        self.backend.forward_backward(self.strategy.prepare_batch(batch), loss_fn=self.strategy.compute_loss)
        gradients = self.backend.all_reduce_gradients(self.backend.gradient_info())
        self.backend.apply_gradients(self.backend.model, gradients, self.optimizer or self.backend.optimizer)
        diagnostics = {
            "step_s": time.perf_counter() - start,
            **self.backend.memory_stats(),
            **memory_record(self.backend.device),
            "communication_bytes": float(self.backend.communication_bytes()),
        }
        return TrainingResult(self.backend.model_state(), dict(self.backend.last_step_metrics), diagnostics, gradients)

    def train_epoch(self, dataloader, model_state: ModelState | None = None) -> ModelState:
        """One pass over `dataloader` (a tierlm loader: one epoch, however it is set to repeat; or any
        iterable of batches), a `train_step` per batch, each logged; evaluated (when the trainer has an eval set)
        every `config.eval_steps` steps and at the end, and checkpointed every `config.save_steps` steps and at the
        end (with `save_steps` > 0; a tierlm loader's position goes in, so a resume continues mid-epoch). Returns
        the final state."""
        repeat = getattr(dataloader, "repeat", None)  # a tierlm loader set to repeat; any iterable of batches
        if repeat is not None:
            dataloader.repeat = False
        if hasattr(dataloader, "state_dict"):
            self.train_loader = dataloader  # what a checkpoint records of the data
        try:
            for batch in dataloader:
                result = self.train_step(batch, model_state)
                model_state = result.model_state
                self.state.step = model_state.step
                self.state.trained_tokens += int(result.metrics.get("num_tokens", 0))
                self.logger.log({"type": "train", "step": model_state.step, **result.metrics, **result.diagnostics})
                if self.evaluates and cadence.due(self.config.eval_steps, self.state.step):
                    self.evaluate()
                if cadence.due(self.config.save_steps, self.state.step):
                    self.save()
        finally:
            if repeat is not None:
                dataloader.repeat = repeat
        if self.evaluates and self.last_eval_step != self.state.step:
            self.evaluate()
        if self.config.save_steps and not (self.backend.checkpoint_dir / f"step_{self.state.step}").exists():
            self.save()
        cadence.wait_for_saves(self)
        return model_state if model_state is not None else self.backend.model_state()

    def evaluate(self) -> dict[str, float]:
        """Metrics over the fixed eval set (`tierlm.loops.evaluation.validation_totals`: the same whatever the world
        size), logged with the samples of training.sample_prompts. The eval line carries the loop's wall time so far
        (`elapsed_s`, earlier evaluations included) and this evaluation's own seconds (`eval_s`), so a time to a target
        loss can leave the evaluations out."""
        start = time.perf_counter()
        with disable_fp8(self.backend.model):  # FP8 trains; evaluation sees the unquantised model (as nanochat does)
            shares = self.data_rank, self.data_world_size
            totals = validation_totals(self.backend, self.strategy, self.eval_set, *shares)
            samples = self.sampler(self.backend.eval_model) if self.sampler is not None and self.is_main else []
        self.last_eval, self.last_eval_step = self.strategy.summarize(totals), self.state.step
        val_loss = self.last_eval["val_loss"]
        if self.state.best_val_loss is None or val_loss < self.state.best_val_loss:
            self.state.best_val_loss = val_loss
        self.logger.log(
            {
                "type": "eval",
                "step": self.state.step,
                "tokens_seen": self.state.tokens_seen,
                **self.last_eval,
                **self._model_figures(),
                "elapsed_s": round(self.state.elapsed_s, 3),
                "eval_s": round(time.perf_counter() - start, 3),
            }
        )
        for sample in samples:
            self.logger.log({"type": "sample", "step": self.state.step, **sample})
        self._callback("on_eval", dict(self.last_eval))
        return self.last_eval

    def _callback(self, event: str, argument: Any) -> None:
        if self.is_main:
            for callback in self.callbacks:
                if hasattr(callback, event):
                    getattr(callback, event)(argument)

    # -- what the cadence (tierlm.loops.cadence) asks -------------------------------------
    @property
    def evaluates(self) -> bool:
        return bool(self.eval_set)

    def checkpoint_metric(self) -> float | None:
        return self.last_eval.get("val_loss") if self.last_eval_step == self.state.step else None

    def trainer_state(self) -> dict:
        loader = {"loader": self.train_loader.state_dict()} if hasattr(self.train_loader, "state_dict") else {}
        return {"loop": asdict(self.state), **loader}

    def load_trainer_state(self, state: dict) -> None:
        self.state = LoopState(**state["loop"])
        if "loader" in state:
            self.train_loader.load_state_dict(state["loader"])

    def companions(self) -> list:
        return []

    def on_save(self, path: Path) -> None:
        self._callback("on_save", path)

    def measure_core(self) -> dict:
        """CORE now (`tierlm.loops.evaluation.CoreSchedule`), logged as a "core" line and on the progress output."""
        assert self.core is not None
        with disable_fp8(self.backend.model):
            result = self.core.measure(self.backend, self.data_rank, self.data_world_size)
        self.last_core = result["core"]
        step = self.state.step
        self.logger.log({"type": "core", "step": step, "tokens_seen": self.state.tokens_seen, **result})
        if self.is_main:
            self.bar.write(f"step {step}: CORE {result['core']:.4f}")
        return result

    def log_eval(self, metrics: dict[str, float]) -> None:
        if self.is_main:
            self.bar.write(f"step {self.state.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def save(self) -> Path:
        """A checkpoint of the run at this step (with retention)."""
        return cadence.save(self)

    def resume(self, chosen: Path | None = None) -> Path | None:
        """Continue from the newest loadable checkpoint (a damaged one is reported in one line and skipped), or from
        `chosen`."""
        return cadence.resume(self, chosen)

    def _check_finite(self, metrics: dict[str, float]) -> None:
        if not metrics.get("skipped"):
            self.state.consecutive_skips = 0
            return
        self.state.skipped_steps += 1
        self.state.consecutive_skips += 1
        if self.is_main:
            print(
                f"tierlm: warning: step {self.state.step}: loss {metrics['loss']} / grad norm {metrics['grad_norm']}"
                " is not finite; the update was skipped",
                file=sys.stderr,
            )
        if self.state.consecutive_skips >= self.config.max_consecutive_nonfinite:
            latest = find_latest_checkpoint(self.backend.checkpoint_dir)
            raise TrainingDiverged(
                f"loss or gradients were NaN/Inf for {self.state.consecutive_skips} consecutive steps (up to step "
                f"{self.state.step}); stopped. Last good checkpoint: {latest or 'none'}. Lower training.learning_rate "
                "or check the data"
            )

    # -- the loop --------------------------------------------------------------------------
    def loop_step(self) -> dict[str, float]:
        """One optimizer step over training.gradient_accumulation_steps micro-batches, timed."""
        start = time.perf_counter()
        metrics = self.step(self.train_loader.next_batch() for _ in range(self.config.gradient_accumulation_steps))
        return {**metrics, "step_s": time.perf_counter() - start}

    def after_step(self, metrics: dict[str, float], log: bool) -> None:
        state = self.state
        family_of(self.backend.model).on_step(unwrap_model(self.backend.model), state.step, metrics["loss"])
        self._collect_garbage()
        state.tokens_seen += metrics["input_tokens"]
        state.trained_tokens += int(metrics["num_tokens"])
        self._check_finite(metrics)
        record = self._train_record(metrics, metrics["step_s"])
        self.bar.update(1)
        self.bar.set_postfix_str(self._postfix(record), refresh=False)
        self.window = [
            self.window[0] + metrics["input_tokens"],
            self.window[1] + metrics["num_tokens"],
            self.window[2] + metrics["step_s"],
        ]
        if self.core is not None and self.core.due(state.step):
            self.measure_core()
        if log:
            record.update(self._rates(*self.window), **self._slow_stats())  # rates over every step since the last line
            self.window = [0, 0.0, 0.0]
            self.logger.log(record)
            self._callback("on_log", dict(record))
            if self.bar.disable and self.is_main:
                print(self._log_line(record), file=sys.stderr, flush=True)

    def _collect_garbage(self) -> None:
        """Collect once after the first step and freeze what survives (no GC passes over it again); later, a
        full collection every GC_COLLECT_STEPS steps for what reference cycles build up."""
        if not self._gc_frozen:
            gc.collect()
            gc.freeze()
            gc.disable()
            self._gc_frozen = True
        elif self.state.step % GC_COLLECT_STEPS == 0:
            gc.collect()

    @property
    def logger(self) -> MetricsLogger:
        return self.watch.logger

    def train(self, watch: Watch | None = None) -> dict[str, Any]:
        """Train to training.num_train_steps on the one cadence of `tierlm.loops.cadence`, watched by `watch` (the
        run's logger, stop signals and monitor; by default the constructor's logger alone); the run summary."""
        self.watch = watch or self.watch
        cfg, state = self.config, self.state
        shown = (
            sys.stderr.isatty() or "ipykernel" in sys.modules
        )  # a terminal, or a notebook (tqdm.auto draws a widget there)
        self.bar = tqdm(
            total=cfg.num_train_steps,
            initial=state.step,
            disable=not (self.progress_bar and self.is_main and shown),
            dynamic_ncols=True,
            desc="train",
        )
        try:
            cadence.run_loop(self)
        finally:
            self.bar.close()
            if (
                self._gc_frozen
            ):  # the run's objects may be collected again (a process group held by a cycle must go before exit)
                gc.enable()
                gc.unfreeze()
                self._gc_frozen = False
        if self.eval_set and not self.last_eval:  # resumed at the last step: report where it stands
            self.evaluate()
        return {
            "step": state.step,
            "tokens_seen": state.tokens_seen,
            "elapsed_s": state.elapsed_s,
            **self._epoch(),
            **self.last_eval,
            **({"core": self.last_core} if self.last_core is not None else {}),
        }

    # -- reporting -------------------------------------------------------------------------
    def _rates(self, input_tokens: float, trained_tokens: float, seconds: float) -> dict[str, float]:
        """Tokens/s (input and trained) and MFU over `seconds` of training steps."""
        rates = {"tokens_per_sec": input_tokens / seconds, "trained_tokens_per_sec": trained_tokens / seconds}
        if self.flops_per_token and self.peak_flops is not None:
            mfu = self.peak_flops.utilisation(self.flops_per_token * rates["tokens_per_sec"])
            if mfu is not None:  # never over 100%: a step beating the peak re-measures it, or makes it unknown
                rates["mfu"] = mfu
        return rates

    def _train_record(self, metrics: dict[str, float], step_s: float) -> dict[str, Any]:
        if math.isfinite(metrics["loss"]):
            self.state.loss_ema = EMA_BETA * self.state.loss_ema + (1 - EMA_BETA) * metrics["loss"]
            self.state.loss_ema_steps += 1
        record = {
            "type": "train",
            "step": self.state.step,
            "loss": metrics["loss"],
            "loss_ema": self.state.loss_ema / (1 - EMA_BETA**self.state.loss_ema_steps)
            if self.state.loss_ema_steps
            else metrics["loss"],
            "lr": metrics["lr"],
            "grad_norm": metrics["grad_norm"],
            **self._rates(metrics["input_tokens"], metrics["num_tokens"], step_s),  # this step's (the progress line's)
            "tokens_seen": self.state.tokens_seen,
            "trained_tokens": self.state.trained_tokens,
            "elapsed_s": self.state.elapsed_s,
            "skipped_steps": self.state.skipped_steps,
        }
        passed = ("sparsity", "expert_imbalance")  # AdamWPrune's, a mixture of experts'
        record.update({k: v for k, v in metrics.items() if k.startswith("lr_") or k in passed})
        record.update(self._epoch())
        return record

    def _epoch(self) -> dict[str, float]:
        """The passes over the training data made so far, kept in the state: counted in batches when one pass's
        are known (training.num_train_epochs), else as the loader reports them (documents read; a stream's whole
        passes), so step-limited and streamed runs log it too."""
        if self.batches_per_epoch:
            self.state.epoch = self.state.step * self.config.gradient_accumulation_steps / self.batches_per_epoch
        elif hasattr(self.train_loader, "stats"):  # tierlm's loaders; a Prefetcher's are the batches handed out's
            self.state.epoch = self.train_loader.stats().get("epoch", self.state.epoch)
        return {} if self.state.epoch is None else {"epoch": self.state.epoch}

    def _slow_stats(self) -> dict[str, float]:
        """Data and memory figures, read only for logged steps."""
        stats = dict(self.train_loader.stats()) if hasattr(self.train_loader, "stats") else {}
        stats.pop("epoch", None)  # the line's epoch is the state's (`_epoch`)
        model_bytes = self.backend.memory_stats()
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

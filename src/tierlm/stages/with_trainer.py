"""What pretraining, SFT and DPO share once their model, data and strategy are built: the backend, the
`Trainer` with its evaluation samples, the run's begin / train / finish, and what a finished run writes
beside its model (the pruning results of `adamw_prune`, the average of its last checkpoints)."""

from __future__ import annotations

import json
import math
import resource
import shutil
import time
from pathlib import Path

import torch

from tierlm.builders.backend import SHARDED_KINDS, build_backend
from tierlm.builders.stage import Stage
from tierlm.checkpoint import average_checkpoints, list_checkpoints
from tierlm.config import TierlmConfig
from tierlm.data import Prefetcher, Tokenizer
from tierlm.data.packing import PackedLoader
from tierlm.data.windows import eval_protocol
from tierlm.loops.evaluation import CoreSchedule
from tierlm.loops.trainer import Trainer
from tierlm.metrics.flops import PeakFlops
from tierlm.metrics.memory import clear_memory
from tierlm.metrics.report import model_figures
from tierlm.models import forward_cross_entropy
from tierlm.plan.batch import auto_find_batch_size, throughput_knee
from tierlm.primitives.optim import optimizer_metrics
from tierlm.rollout.engine import Engine
from tierlm.rollout.sampling import GREEDY
from tierlm.rollout.text import prompt_tokens, readable_text
from tierlm.run import Run, extras_writer


def train_with_trainer(
    run: Run,
    model: torch.nn.Module,
    strategy,
    train_loader,
    eval_loader,
    callbacks: list,
    on_backend=None,
    broadcast_weights: bool = False,
    kept: list | None = None,
) -> dict:
    """Put `model` on the config's backend and train it with `strategy` through the `Trainer`; returns the
    summary. `on_backend(backend)` runs once the backend exists (DPO's JAX reference comes from it);
    `broadcast_weights`: rank 0 alone holds the weights (infra.cpu_ram_efficient_loading); `kept`: what else its
    checkpoints carry (`tierlm.loops.cadence.Kept`)."""
    config, tokenizer = run.config, run.tokenizer
    backend = build_backend(config, model, run.checkpoint_dir, run.device, run.ctx, broadcast_weights)
    if on_backend is not None:
        on_backend(backend)
    trainer = Trainer(
        backend,
        strategy,
        train_loader=train_loader,
        eval_loader=eval_loader,
        config=config.training,
        flops_per_token=run.plan.flops_per_token if run.plan is not None else None,  # the plan's: per token seen
        peak_flops=PeakFlops(
            run.device, config.infra.peak_tflops, torch.bfloat16 if config.training.bf16 else torch.float32
        ),
        write_extra=extras_writer(config, tokenizer, run.stage.name),
        progress_bar=config.infra.progress_bar,
        sampler=None if run.seq2seq else eval_sampler(config, tokenizer, run.stage, run.kind),
        callbacks=callbacks,
        batches_per_epoch=run.plan.batches_per_epoch if run.plan is not None else None,
        core=CoreSchedule.of(config.training, tokenizer),
        kept=kept,
    )
    protocol = eval_protocol(eval_loader, trainer.eval_set) if isinstance(eval_loader, PackedLoader) else None
    if protocol is not None:
        run.note(f"validation: {protocol}")
    run.begin(trainer)
    prefetch = (
        config.data.prefetch_batches
        if config.data.prefetch_batches is not None
        else (2 if run.device.type != "cpu" else 0)
    )
    if prefetch and run.stage.packing is not None:  # started after resuming, so it starts from the resumed position
        trainer.train_loader = Prefetcher(trainer.train_loader, prefetch)
    try:
        summary = run.train(trainer)
    finally:
        if isinstance(trainer.train_loader, Prefetcher):
            trainer.train_loader.close()
    if protocol is not None and "val_loss" in summary:
        summary["val_protocol"] = protocol
    run.finish(backend.model, summary, backend)
    tr = config.training
    if run.is_main and tr.optimizer == "adamw_prune":  # the pruning evaluation, beside the run's model
        write_pruning_results(run.output_dir, summary, backend.optimizer)
    if run.is_main and tr.average_last_n:
        recent = list_checkpoints(run.checkpoint_dir)[-tr.average_last_n :]
        if len(recent) >= 2:
            averaged = run.output_dir / "model_averaged"
            shutil.rmtree(averaged, ignore_errors=True)  # this run's own output, rewritten at each finish
            summary["averaged_model_dir"] = str(average_checkpoints(recent, averaged))
    return summary


def eval_sampler(config: TierlmConfig, tokenizer: Tokenizer, stage: Stage, kind: str):
    """model -> greedy completions of training.sample_prompts (user turns for chat stages), or None
    when there is nothing to sample or the model is sharded (FSDP ranks would have to generate together)."""
    tr = config.training
    if not tr.sample_prompts or not stage.generates or kind in SHARDED_KINDS:
        return None
    chat = stage.chat and tokenizer.has_chat_template
    prompts = [(p, prompt_tokens(tokenizer, p, chat)) for p in tr.sample_prompts]

    def sample(model: torch.nn.Module) -> list[dict[str, str]]:
        engine = Engine(model, tokenizer.stop_ids, tokenizer)
        room = engine.max_len()
        return [
            {
                "prompt": text,
                "completion": readable_text(
                    tokenizer,
                    engine.generate(ids, 1, min(tr.sample_max_new_tokens, room - len(ids)), GREEDY)[0].tokens,
                ),
            }
            for text, ids in prompts
            if len(ids) < room
        ]

    return sample


def write_pruning_results(output_dir: Path, summary: dict, optimizer) -> None:
    """results.json of a pruned run: val loss and perplexity at the reached sparsity, the best val loss,
    parameters and the share of zero weights, CPU inference latency p50/p95 at two lengths, peak RSS."""
    results = {"sparsity": optimizer_metrics(optimizer).get("sparsity", 0.0), "steps": summary.get("step")}
    if "val_loss" in summary:
        results.update(val_loss=summary["val_loss"], perplexity=math.exp(min(summary["val_loss"], 50)))
    results.update(model_figures(output_dir / "model"))
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    if torch.cuda.is_available():
        results["gpu_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    (output_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")


class _TrainingLoss(torch.nn.Module):
    """The model's training loss on a batch of token ids, through the family's (fused) head."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return forward_cross_entropy(self.model, {"input_ids": input_ids, "labels": input_ids})[0]


def confirm_batch_size(run: Run, model: torch.nn.Module) -> bool:
    """training.per_device_train_batch_size=auto, confirmed by real forward/backward passes: the planned micro-batch
    runs (`auto_find_batch_size`: on CUDA an out-of-memory halves it and tries again), then, for a new run, the
    smallest power of two within 5% of the best tokens/s measured up to it (`throughput_knee`: on a CPU a few rows
    train as fast as thousands), agreed by every rank as rank 0 measured it. The run's config takes the size.
    True when it changed (the loaders must be rebuilt). Not under FSDP, DeepSpeed or model parallelism: before
    sharding, each rank holds the whole model, which the sharded run does not."""
    tr, T = run.config.training, run.config.data.max_seq_length
    if run.kind in SHARDED_KINDS:
        return False

    def sample(n: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.zeros(n * run.stage.rows_per_example, T, dtype=torch.long, device=run.device)}

    loss = _TrainingLoss(model)
    planned = tr.per_device_train_batch_size
    if run.latest is not None:  # a resumed run keeps the size its data position counts, if it still fits
        rows = auto_find_batch_size(loss, sample, start_batch_size=planned, predict_on_cpu=False)
        why = f"ran out of memory at {planned}"
    else:  # every size tried ran: the one chosen is confirmed
        rows, rates = throughput_knee(lambda n: _step_seconds(loss, sample(n), run.device), planned)
        rows = run.agreed(rows)
        shown = ", ".join(f"{n}: {rate * T:,.0f}" for n, rate in rates.items())
        why = f"the smallest within 5% of the best tokens/s measured ({shown}) of the {planned} memory allows"
    if rows == planned:
        return False
    run.note(f"training.per_device_train_batch_size=auto: {rows} rows ({why})")
    run.set_batch_size(rows)
    return True


def _step_seconds(loss: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> float | None:
    """A forward and backward of `batch`, timed: the faster of two after a warm-up (None: out of CUDA memory); its
    gradients are dropped, and no training randomness is drawn."""
    times = []
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for _ in range(3):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                loss(**batch).backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
                loss.zero_grad(set_to_none=True)
    except torch.cuda.OutOfMemoryError:
        loss.zero_grad(set_to_none=True)
        clear_memory()
        return None
    return min(times[1:])

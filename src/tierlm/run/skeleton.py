"""Tier 3: the one run skeleton every stage (pretrain, SFT, DPO, RL) goes through.

    run = prepare_run(config, stage)     # check, then set up; nothing is written yet
    ...the stage builds its model, data, strategy, backend and loop from run...
    run.begin(trainer)                   # run directory, run.json, resume, logging
    summary = run.train(trainer)         # the loop, stopping cleanly on SIGTERM/SIGINT/SIGUSR1
    run.finish(model, summary)           # the final model/ folder, written atomically

The guarantees live here once, for every stage:

- **A run directory belongs to one run.** `run.json` records the stage and a fingerprint of what
  must not change on resume (model shape, tokenizer, data source). Another stage or another
  fingerprint in the same `infra.output_dir` is refused with one line naming the difference; so is
  an output path that is a file, or a non-empty folder that is not a tierlm run.
- **Nothing is written before every input is checked**; a resumed run takes its tokenizer from the
  checkpoint; a fresh start in a run directory never appends to the old `metrics.jsonl` (it is
  kept beside, renamed); hidden folders of interrupted saves are removed at the next start.
- **Final model folders appear whole**: written into a hidden folder, flushed, renamed into place,
  with the tokenizer, a `generation_config.json` that stops at the end-of-turn token, and a
  manifest (sizes and SHA-256) that `export`, `average` and `sample` verify.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierlm.builders.backend import check_deepspeed, distributed_kind
from tierlm.builders.stage import Stage, resolve_config
from tierlm.builders.tokenizer import is_seq2seq, pretrained_location, run_tokenizer
from tierlm.checkpoint import CHECKPOINTS_DIRNAME, find_best_checkpoint
from tierlm.checkpoint.core import _fsync_tree, replace_folder
from tierlm.checkpoint.load import clean_stale_temporaries
from tierlm.checkpoint.verify import MODEL_META_FILE, file_manifest
from tierlm.config import TierlmConfig
from tierlm.data import Tokenizer
from tierlm.errors import ConfigError, DataError
from tierlm.loops.cadence import Watch
from tierlm.loops.monitor import RunMonitor, gather_hosts
from tierlm.loops.profiling import PROFILE_DIRNAME, StepProfiler
from tierlm.loops.signals import GracefulStop, RunInterrupted
from tierlm.metrics import JSONLSink, MetricsLogger, MLflowSink, TensorBoardSink, WandbSink
from tierlm.models import save_model_folder, unwrap_model
from tierlm.primitives import resolve_device
from tierlm.primitives.model_parallel import ParallelDims
from tierlm.primitives.parallel import DistributedContext, launched_distributed
from tierlm.run.directory import RUN_FILE, check_run_directory, fingerprint
from tierlm.run.process import distributed_context, seed_everything


# -- the pieces every stage sets up ---------------------------------------------------------
def tracking_project(config: TierlmConfig, env=os.environ) -> str:
    """The W&B project (and MLflow experiment) of a run: infra.wandb_project, else the environment's WANDB_PROJECT
    (what W&B itself reads, and `scripts/launch_training.sh` exports), else tierlm.

    >>> tracking_project(TierlmConfig(), {"WANDB_PROJECT": "story"}), tracking_project(TierlmConfig(), {})
    ('story', 'tierlm')
    """
    return config.infra.wandb_project or env.get("WANDB_PROJECT") or "tierlm"


def build_logger(config: TierlmConfig, output_dir: Path, resume_step: int | None) -> MetricsLogger:
    project = tracking_project(config)
    sinks = [JSONLSink(output_dir / "metrics.jsonl", resume_from_step=resume_step)]
    if "tensorboard" in config.training.report_to:
        sinks.append(TensorBoardSink(config.training.logging_dir or output_dir / "tensorboard", resume_step))
    if "mlflow" in config.training.report_to:
        sinks.append(MLflowSink(output_dir, project, config.infra.wandb_run_name, config.model_dump(mode="json")))
    if "wandb" in config.training.report_to:
        sinks.append(
            WandbSink(
                project,
                config.infra.wandb_run_name,
                config.model_dump(mode="json"),
                output_dir,
                entity=config.infra.wandb_entity,
            )
        )
    from tierlm.metrics.report import ReportSink, reports_on  # after the JSONL sink: it reads the lines just written

    return MetricsLogger([*sinks, *([ReportSink(output_dir)] if reports_on() else [])])


def warn_restarts(config: TierlmConfig) -> None:
    """Under `torchrun --max-restarts N`: what would keep a restart from resuming, said at the start."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts and not config.training.save_steps:
        print(
            f"tierlm: warning: torchrun may restart this job {restarts} time(s) and a restart resumes from the newest "
            "checkpoint, but training.save_steps=0 saves only at the end: a restart starts over (set save_steps)",
            file=sys.stderr,
        )
    if restarts and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        print(
            "tierlm: warning: torchrun shares one TCP store across its restarts, which can hang a restarted group in "
            "its set-up; launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (tierlm launch --slurm does)",
            file=sys.stderr,
        )


def write_model_extras(folder: Path, tokenizer: Tokenizer, meta: dict[str, Any], manifest: bool = False) -> None:
    """Beside a model's weights: its tokenizer, a generation config that stops where tierlm stops
    (the end-of-turn token), and training_meta.json (with `manifest`, also the sizes and hashes of
    every other file of the folder, which `verified_model_folder` checks)."""
    from transformers import GenerationConfig

    tokenizer.save(folder)
    stops = tokenizer.stop_ids
    GenerationConfig(
        eos_token_id=stops if len(stops) > 1 else stops[0], bos_token_id=tokenizer.bos_id, pad_token_id=tokenizer.pad_id
    ).save_pretrained(folder)
    if manifest:
        meta = {**meta, "manifest": file_manifest(folder, exclude=(MODEL_META_FILE,))}
    (folder / MODEL_META_FILE).write_text(json.dumps(meta, indent=1) + "\n")


def extras_writer(config: TierlmConfig, tokenizer: Tokenizer, stage: str):
    """What every checkpoint carries besides weights: tokenizer, generation config, config, stage."""

    def write_extra(folder: Path) -> None:
        write_model_extras(folder / "model", tokenizer, {"stage": stage})
        config.to_yaml(folder / "config.yaml")

    return write_extra


def _move_aside(path: Path) -> Path:
    """Rename `path` to a free `<stem>.<UTC time>[.<n>]<suffix>` beside it, so a new file starts empty."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target, n = path.with_name(f"{path.stem}.{stamp}{path.suffix}"), 1
    while target.exists():
        target, n = path.with_name(f"{path.stem}.{stamp}.{n}{path.suffix}"), n + 1
    path.rename(target)
    return target


# -- the skeleton ---------------------------------------------------------------------------
@contextlib.contextmanager
def _first_rank_of_each_machine_first():
    """Under torchrun, the block runs on each machine's first rank (LOCAL_RANK 0), then on its others: the memory
    estimate's traced step (`tierlm.plan.memory.traces`) is kept on disk by the first and read back by the rest,
    instead of every rank tracing the same step at once. The first rank lets the others go even if it fails. With
    the cache off (`TIERLM_CACHE_DIR=off`) there is nothing to read back: every rank traces at once, as before."""
    from tierlm.plan.memory.traces import cache_folder

    alone = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    if alone or cache_folder() is None:
        yield
        return
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if not first:
        torch.distributed.barrier()
    try:
        yield
    finally:
        if first:
            torch.distributed.barrier()


@dataclass
class Run:
    """A prepared run: everything a stage needs to build its model, data and loop."""

    config: TierlmConfig
    stage: Stage
    ctx: DistributedContext | None
    device: torch.device
    pretrained: Path | str | None
    latest: Path | None  # the checkpoint this run resumes from
    kind: str = "none"  # "none" | "ddp" | "fsdp" | "model_parallel"
    tokenizer: Tokenizer | None = None
    stop: GracefulStop = field(default_factory=GracefulStop)
    resumed: Path | None = None
    plan: Any = None  # a tierlm.plan.scaling.Plan, once resolve() has run
    memory: Any = None  # a tierlm.plan.memory.MemoryEstimate, once check_memory() has run
    notes: list[str] = field(default_factory=list)  # the plan, printed by begin(): nothing before every check
    preflight: bool = False  # build and check everything, train nothing, write nothing (tierlm rl --check-parity)
    scratch: list = field(default_factory=list)  # a pre-flight's temporary folders

    def scratch_dir(self, name: str) -> Path:
        """A folder of the run's own for a helper (e.g. the vLLM sampler's weights): in the run directory, or a
        temporary folder when the run is a pre-flight that must leave nothing behind."""
        if self.preflight:
            import tempfile

            self.scratch.append(tempfile.TemporaryDirectory(prefix=f"tierlm-{name}-"))  # removed by run_stage
            return Path(self.scratch[-1].name)
        return self.output_dir / name

    def agreed(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (one process: `value`), for a choice each rank could make differently
        (a timing's)."""
        if self.ctx is None:
            return value
        import torch.distributed as dist

        shared = [value]
        dist.broadcast_object_list(shared, src=0)
        return shared[0]

    def note(self, text: str) -> None:
        """Say `text` (stdout, rank 0) once the run begins: a refusal before that is the only line printed."""
        if self.is_main:
            self.notes.append(text)

    @property
    def seq2seq(self) -> bool:
        """An encoder-decoder run (UL2 batches, the Seq2Seq strategy)."""
        return is_seq2seq(self.config, self.pretrained)

    @property
    def output_dir(self) -> Path:
        return Path(self.config.infra.output_dir)

    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / CHECKPOINTS_DIRNAME

    @property
    def is_main(self) -> bool:
        return self.ctx is None or self.ctx.is_main

    @property
    def world_size(self) -> int:
        return self.ctx.world_size if self.ctx is not None else 1

    @property
    def dims(self) -> ParallelDims:
        """How the ranks split (pipeline x data x context x tensor parallel)."""
        i = self.config.infra
        return ParallelDims.from_sizes(
            self.world_size, i.tensor_parallel_size, i.pipeline_parallel_size, i.context_parallel_size
        )

    @property
    def data_parallel_size(self) -> int:
        """How many shares each global batch splits into (the ranks of a model-parallel group share one)."""
        return self.dims.dp

    @property
    def data_rank(self) -> int:
        """This rank's share: its coordinate on the mesh's data-parallel dimension."""
        return self.dims.data_rank(self.ctx.rank if self.ctx is not None else 0)

    def resolve(self, model: torch.nn.Module, train_loader=None) -> TierlmConfig:
        """Fill in what the config derives from the model (steps, batch, learning rates: `tierlm.plan.scaling`;
        with training.num_train_epochs, the steps of that many passes of `train_loader`, the global loader), note
        the plan (printed when the run begins), and return the resolved config (the one config.yaml records)."""
        from tierlm.plan.scaling import resolve

        batches = None
        if self.config.training.num_train_epochs is not None:
            if not hasattr(train_loader, "batches_per_pass") or getattr(train_loader, "documents", ()) is None:
                raise ConfigError(
                    f"training.num_train_epochs counts passes over a dataset of known size; {self.stage.name} here "
                    "reads a stream or UL2 examples: set training.num_train_steps"
                )
            batches = train_loader.batches_per_pass()
        config, self.plan = resolve(self.config, self.stage, model, self.data_parallel_size, batches)
        self.config = config.frozen()
        self.note(self.plan.table())  # stdout, with the run summary: stderr stays for problems and progress
        return self.config

    def check_memory(
        self,
        num_documents: int,
        rows: int | None = None,
        row_tokens: int | None = None,
        least_tokens: int | None = None,
    ) -> None:
        """Before the model is allocated: refuse at once a run whose lower bounds cannot fit (`memory_needs`,
        with rows of at least `least_tokens`), then estimate its memory per rank (`tierlm.plan.memory`),
        refuse it in one line if it cannot fit, and note the estimate (printed when the run begins). On CPU the ranks
        of one machine share its memory. A hub id is sized only after its download (not here)."""
        from tierlm.plan.memory import check_memory, estimate_run_memory
        from tierlm.plan.memory.bounds import check_fits, memory_needs

        config, vocab, world, pretrained = self.config, self.tokenizer.vocab_size, self.world_size, self.pretrained
        copies = 1 if self.stage.reference_model(config) is None else 2
        check_fits(
            memory_needs(config, vocab, pretrained, num_documents, world, copies, rows, least_tokens), self.device
        )
        if isinstance(pretrained, str):
            return
        stage, device, kind = self.stage, self.device.type, self.kind
        with _first_rank_of_each_machine_first():  # it traces the step; the others read its trace back
            self.memory = estimate_run_memory(
                config, world, stage, vocab, pretrained, num_documents, device, rows, row_tokens, kind
            )
        check_memory(self.memory, self.memory_budget())
        self.note(self.memory.table())

    def memory_budget(self) -> float | None:
        """Bytes this rank may use (`tierlm.plan.memory.memory_budget`; on CPU the ranks of one machine share it)."""
        from tierlm.plan.memory import memory_budget

        sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if self.device.type == "cpu" else 1
        return memory_budget(self.device, self.config.infra.max_memory_gb, sharing)

    def choose_batch_size(self, num_documents: int | None = None) -> TierlmConfig:
        """Resolve training.per_device_train_batch_size=auto (a no-op otherwise): the size the run
        being resumed chose (its data position counts its rows), else the memory planner's; logged."""
        from tierlm.plan.batch import auto_batch_size, check_auto_batch_stage

        tr = self.config.training
        if tr.per_device_train_batch_size != "auto":
            return self.config
        check_auto_batch_stage(self.stage)  # before the run being resumed is asked
        recorded = None
        if self.latest is not None and (self.output_dir / "config.yaml").is_file():
            recorded = TierlmConfig.from_yaml(self.output_dir / "config.yaml").training.per_device_train_batch_size
        if isinstance(recorded, int):
            rows, why = recorded, "as the run being resumed chose"
        else:
            pretrained = self.pretrained if isinstance(self.pretrained, Path) else None
            rows, why = auto_batch_size(
                self.config,
                self.stage,
                self.memory_budget(),
                self.world_size,
                vocab_size=self.tokenizer.vocab_size,
                pretrained=pretrained,
                num_documents=num_documents,
                device_type=self.device.type,
                distributed=self.kind,
            )
        self.set_batch_size(rows)
        self.note(f"training.per_device_train_batch_size=auto: {rows} rows ({why})")
        return self.config

    def set_batch_size(self, rows: int) -> None:
        from tierlm.plan.batch import with_batch_size

        self.config = with_batch_size(self.config, rows).frozen()

    def begin(self, trainer) -> Path | None:
        """Everything is checked: say the plan, create the run directory, record the run, resume."""
        if self.is_main:
            if self.notes:
                print("\n".join(self.notes), flush=True)
                self.notes.clear()
            self.output_dir.mkdir(parents=True, exist_ok=True)
            stale = clean_stale_temporaries(self.checkpoint_dir)
            if stale:
                print(
                    f"tierlm: warning: removed {len(stale)} unfinished save(s) of an interrupted run", file=sys.stderr
                )
            shutil.rmtree(self.output_dir / ".model.tmp", ignore_errors=True)
            warn_restarts(self.config)
            run_file = {"stage": self.stage.name, "fingerprint": fingerprint(self.config, self.stage.name)}
            (self.output_dir / RUN_FILE).write_text(json.dumps(run_file, indent=1) + "\n")
            self.config.to_yaml(self.output_dir / "config.yaml")
            if self.memory is not None:  # what the planner expected, beside the measured rss_mb of metrics.jsonl
                (self.output_dir / "memory_estimate.json").write_text(json.dumps(self.memory.record(), indent=1) + "\n")
        chosen = self.latest if self.config.training.resume_from_checkpoint is not None else None
        self.resumed = trainer.resume(chosen) if self.latest is not None else None
        if self.is_main:
            if self.resumed is not None:  # a run that continues says so, and from where
                print(
                    f"resuming from {self.resumed} (step {trainer.state.step} of "
                    f"{self.config.training.num_train_steps})",
                    flush=True,
                )
            metrics = self.output_dir / "metrics.jsonl"
            if self.resumed is None and metrics.exists():  # a fresh start never appends to an old run's lines
                print(
                    f"tierlm: warning: no checkpoint to resume; the earlier metrics are kept as "
                    f"{_move_aside(metrics).name}",
                    file=sys.stderr,
                )
        return self.resumed

    def profiler(self, rank: int) -> StepProfiler | None:
        """training.profile_steps' profiler for this rank (each rank writes its own trace), or None."""
        steps = self.config.training.profile_steps
        if steps is None:
            return None
        return StepProfiler(*steps, self.output_dir / PROFILE_DIRNAME, rank, announce=self.is_main)

    def train(self, trainer) -> dict[str, Any]:
        """The stage's loop (after `begin`), logging from the step it resumed at, with the stop signals caught (they
        end it after a saved step), watched for hangs and reporting its progress (`tierlm.loops.monitor`)."""
        rank = self.ctx.rank if self.ctx is not None else 0
        hosts = gather_hosts(rank, self.ctx is not None)
        resumed_at = trainer.state.step if self.resumed else None
        logger = build_logger(self.config, self.output_dir, resumed_at) if self.is_main else MetricsLogger([])
        monitor = RunMonitor(
            self.output_dir,
            rank,
            self.is_main,
            self.stage.name,
            self.config.training.num_train_steps,
            self.config.infra.hang_timeout,
            hosts,
            self.checkpoint_dir,
        )
        profiler = self.profiler(rank)
        status = "failed"
        try:
            with self.stop:
                summary = trainer.train(Watch(logger, self.stop, monitor, profiler))
            status = "finished"
            return summary
        except RunInterrupted:
            status = "interrupted"
            raise
        finally:
            if profiler is not None:  # stopped, or its range past a derived end: what it traced is written
                profiler.close()
            monitor.close(status)
            logger.close()

    def finish(self, model: torch.nn.Module, summary: dict[str, Any], backend=None) -> dict[str, Any]:
        """Write the final model folder atomically (gathered to rank 0 under FSDP, tensor and pipeline
        parallelism: `backend.full_model_state`); returns the summary."""
        final = self.output_dir / "model"
        summary.update(
            stage=self.stage.name,
            output_dir=str(self.output_dir),
            model_dir=str(final),
            resumed_from=str(self.resumed) if self.resumed else None,
            world_size=self.world_size,
            distributed_type=self.kind,
        )
        if self.config.training.save_best:
            best = find_best_checkpoint(self.checkpoint_dir)
            summary["best_checkpoint"] = str(best) if best is not None else None
        state = None
        if backend is not None:
            model, state = backend.export_model, backend.full_model_state()
        elif self.ctx is not None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return summary
        tmp = self.output_dir / ".model.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_model_folder(
            unwrap_model(model), tmp, state_dict=state, merge_lora=True
        )  # a LoRA model: merged, adapter/ beside
        assert self.tokenizer is not None, "a run's tokenizer is set in prepare_run"
        write_model_extras(tmp, self.tokenizer, summary, manifest=True)
        _fsync_tree(tmp)
        replace_folder(tmp, final, self.output_dir / ".model.old")  # a finished run re-run swaps its model
        return summary


def prepare_run(config: TierlmConfig, stage: Stage) -> Run:
    """Resolve the config (once: `resolve_config`), check the run directory and the starting model, join
    torchrun's group, seed, pick the device, get the tokenizer. Writes nothing (but a new tokenizer shared across
    ranks)."""
    config = resolve_config(config, stage, launched_distributed())
    latest = check_run_directory(config, stage.name)
    pretrained = pretrained_location(config)
    if stage.starts_from_trained and pretrained is None:
        raise ConfigError(
            f"{stage.name} starts from a trained chat model: set model.model_name_or_path (e.g. runs/tiny_sft)"
        )
    if not stage.encoder_decoder and is_seq2seq(config, pretrained):
        raise ConfigError(
            f"an encoder-decoder model trains with `tierlm pretrain` (UL2); `tierlm {stage.name}` is for decoder-only "
            f"models"
        )
    infra = config.infra
    if infra.num_threads:
        torch.set_num_threads(infra.num_threads)
    if infra.distributed_type == "deepspeed":
        check_deepspeed(config, stage)
    ctx = distributed_context(config)
    seed_everything(config.training.seed)  # the same on every rank: identical initial weights
    device = ctx.device if ctx is not None else resolve_device(infra.device_type, infra.gpu_rank)
    run = Run(config, stage, ctx, device, pretrained, latest, kind=distributed_kind(config, ctx))
    run.tokenizer = run_tokenizer(config, stage.example_kind, pretrained, ctx, latest)
    if stage.needs_chat_template and not run.tokenizer.has_chat_template:
        raise DataError(f"{pretrained} has no chat template: {stage.name} needs a chat model (run tierlm sft first)")
    return run

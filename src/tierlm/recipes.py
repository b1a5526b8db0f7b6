"""Tier 3: assemble a run (tokenizer, model, loaders, backend, strategy, trainer) from a config."""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path

import numpy as np
import torch

from tierlm.backends.distributed import DDPTrainingBackend, FSDPTrainingBackend
from tierlm.backends.pytorch import FrozenReference, PyTorchTrainingBackend
from tierlm.checkpoint import (
    CHECKPOINTS_DIRNAME,
    average_checkpoints,
    find_latest_checkpoint,
    list_checkpoints,
    resolve_model_location,
)
from tierlm.config import TierlmConfig
from tierlm.data import (
    Documents,
    Examples,
    Fields,
    Mixture,
    PackedLoader,
    Prefetcher,
    RankSlice,
    SourceOptions,
    Tokenizer,
    chat_documents,
    holdout_split,
    load_tokenizer,
    open_examples,
    text_documents,
    train_bpe_tokenizer,
    train_char_tokenizer,
)
from tierlm.errors import ConfigError, DataError
from tierlm.metrics import JSONLSink, MetricsLogger, TensorBoardSink, WandbSink, flops_per_token, peak_flops
from tierlm.models import GPTConfig, build_gpt, load_pretrained_model, model_max_seq_len, save_model_folder
from tierlm.primitives import create_adamw_optimizer, create_hf_model_from_config, create_warmup_scheduler, parse_dtype, resolve_device
from tierlm.primitives.parallel import (
    DistributedContext,
    apply_activation_checkpointing,
    apply_compile,
    init_distributed,
    launched_distributed,
    shutdown_distributed,
)
from tierlm.data.preferences import PairLoader, open_preferences
from tierlm.strategies import PretrainStrategy, SFTStrategy
from tierlm.strategies.dpo import DPOStrategy
from tierlm.trainer import Trainer

STAGES = ("pretrain", "sft", "dpo")
TRAINING_META_FILE = "training_meta.json"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _fields(config: TierlmConfig) -> Fields:
    d = config.data
    return Fields(text=d.text_column, messages=d.messages_column, prompt=d.prompt_column, completion=d.completion_column)


def _options(config: TierlmConfig, stage: str, split: str, tokenizer: Tokenizer | None) -> SourceOptions:
    d = config.data
    return SourceOptions(
        split=split, kind="text" if stage == "pretrain" else "chat", seed=config.training.seed,
        synthetic_count=d.num_synthetic_examples if split == "train" else d.num_synthetic_eval_examples,
        fields=_fields(config), on_bad_line=d.on_bad_line, token_dtype=d.token_dtype,
        separator_id=tokenizer.document_separator_id if tokenizer else None, vocab_size=tokenizer.vocab_size if tokenizer else None,
    )


def _components(config: TierlmConfig) -> list[tuple[str, float]]:
    return [(c.dataset_name, c.weight) for c in config.data.mixture] or [(config.data.dataset_name, 1.0)]


def open_splits(config: TierlmConfig, stage: str, tokenizer: Tokenizer | None) -> tuple[list[tuple[Examples, float]], list[Examples]]:
    """([(train, weight)] for each data source, [val sets]).

    Validation is data.eval_dataset_name when set (one set for the whole mixture); otherwise each
    source's own val split (synthetic tasks) or held-out tail.
    """
    d, trains, vals = config.data, [], []
    for name, weight in _components(config):
        train = open_examples(name, _options(config, stage, "train", tokenizer))
        if d.eval_dataset_name:
            pass  # one shared eval set, opened below
        elif name.startswith("synthetic:"):
            vals.append(open_examples(name, _options(config, stage, "val", tokenizer)))
        else:
            train, val = holdout_split(train, d.val_fraction)
            vals.append(val)
        trains.append((train, weight))
    if d.eval_dataset_name:
        vals = [open_examples(d.eval_dataset_name, _options(config, stage, "val", tokenizer))]
    return trains, vals


def existing_tokenizer(config: TierlmConfig, pretrained: Path | str | None) -> Tokenizer | None:
    m = config.model
    if m.tokenizer_name_or_path:
        return load_tokenizer(m.tokenizer_name_or_path, m.trust_remote_code)
    if pretrained is not None:
        return load_tokenizer(pretrained, m.trust_remote_code)
    return None


def train_tokenizer(config: TierlmConfig, stage: str) -> Tokenizer:
    """A new tokenizer, trained on the first tokenizer.num_train_docs examples of each source."""
    t, texts = config.tokenizer, []
    for name, _ in _components(config):
        if Path(name).suffix in (".bin", ".npy"):
            raise DataError(f"{name} is already tokenized: set model.tokenizer_name_or_path to the tokenizer that made it")
        examples = open_examples(name, _options(config, stage, "train", None))
        for example in examples.fetch(range(min(len(examples), t.num_train_docs))):
            texts.extend([example] if isinstance(example, str) else [m["content"] for m in example])
    return train_char_tokenizer(texts) if t.kind == "char" else train_bpe_tokenizer(texts, t.vocab_size)


def pretrained_location(config: TierlmConfig) -> Path | str | None:
    """A local model folder (resolved from a run or checkpoint folder), a hub id, or None (from scratch)."""
    name = config.model.model_name_or_path
    if name is None:
        return None
    return resolve_model_location(name)


def build_model(config: TierlmConfig, tokenizer: Tokenizer, device: torch.device, pretrained) -> torch.nn.Module:
    m, dtype = config.model, parse_dtype(config.model.dtype)
    if pretrained is not None:
        model = load_pretrained_model(pretrained, device=device, dtype=dtype, trust_remote_code=m.trust_remote_code)
    elif m.architecture == "gpt":
        gpt_config = GPTConfig(
            depth=m.depth, aspect_ratio=m.aspect_ratio, head_dim=m.head_dim, n_kv_head=m.n_kv_head,
            vocab_size=tokenizer.vocab_size, max_seq_len=max(2048, config.data.max_seq_length), mlp_ratio=m.mlp_ratio,
            rope_theta=m.rope_theta, tie_embeddings=m.tie_embeddings,
        )
        problems = gpt_config.validate()
        if problems:
            raise ConfigError(f"model.{problems[0]}")
        model = build_gpt(gpt_config, device=device, dtype=dtype)
    else:
        hf_kwargs = {"vocab_size": tokenizer.vocab_size, **m.hf_config}
        model = create_hf_model_from_config(m.architecture, torch_dtype=dtype, **hf_kwargs).to(device)
    vocab = model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings") else model.config.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary has {vocab}; use a matching tokenizer")
    max_len = model_max_seq_len(model)
    if max_len is not None and config.data.max_seq_length > max_len:
        raise ConfigError(f"data.max_seq_length ({config.data.max_seq_length}) exceeds the model's maximum ({max_len})")
    return model


def build_loaders(config: TierlmConfig, stage: str, tokenizer: Tokenizer, world_size: int = 1) -> tuple[PackedLoader, PackedLoader]:
    """Best-fit packed train and eval loaders: pretraining crops, SFT pads (and isolates documents).

    The train loader packs the global batch (world_size x per-device rows); see `RankSlice`.
    """
    d, tr = config.data, config.training
    convert = text_documents(tokenizer) if stage == "pretrain" else chat_documents(tokenizer, d.train_on)
    trains, vals = open_splits(config, stage, tokenizer)
    if len(trains) == 1 and trains[0][1] == 1.0:
        train = Documents(trains[0][0], convert)
    else:
        train = Mixture([(Documents(t, convert), w) for t, w in trains], seed=tr.seed)
    val = Documents(vals[0], convert) if len(vals) == 1 else Mixture([(Documents(v, convert), 1.0) for v in vals], seed=tr.seed)
    isolate = d.isolate_documents if d.isolate_documents is not None else stage == "sft"
    common = dict(
        mode="crop" if stage == "pretrain" else "pad", pad_id=tokenizer.pad_id, buffer_docs=d.packing_buffer,
        long_documents=d.long_conversations, document_positions=isolate,
    )
    return (
        PackedLoader(train, tr.per_device_train_batch_size * world_size, d.max_seq_length, seed=tr.seed, **common),
        PackedLoader(val, tr.per_device_eval_batch_size, d.max_seq_length, shuffle=False, **common),
    )


def build_pair_loaders(config: TierlmConfig, tokenizer: Tokenizer, ctx: DistributedContext | None = None) -> tuple[PairLoader, PairLoader]:
    """Preference pairs: data.dataset_name for training; data.eval_dataset_name, the synthetic val
    split, or a held-out data.val_fraction tail for evaluation."""
    d, tr = config.data, config.training
    train = open_preferences(d.dataset_name, "train", d.num_synthetic_examples, tr.seed)
    if d.eval_dataset_name:
        val = open_preferences(d.eval_dataset_name, "val", d.num_synthetic_eval_examples, tr.seed)
    elif d.dataset_name.startswith("synthetic:"):
        val = open_preferences(d.dataset_name, "val", d.num_synthetic_eval_examples, tr.seed)
    else:
        n_val = max(1, int(len(train) * d.val_fraction))
        if n_val >= len(train):
            raise DataError(f"{d.dataset_name} has {len(train)} pairs: too few to hold out {n_val} for evaluation")
        train, val = train[:-n_val], train[-n_val:]
    world = ctx.world_size if ctx else 1
    if len(train) < tr.per_device_train_batch_size * world:
        raise DataError(f"{len(train)} training pairs cannot fill one batch of {tr.per_device_train_batch_size} pairs x {world} "
                        "ranks; lower training.per_device_train_batch_size")
    return (
        PairLoader(train, tokenizer, tr.per_device_train_batch_size, d.max_seq_length, seed=tr.seed,
                   rank=ctx.rank if ctx else 0, world_size=world),
        PairLoader(val, tokenizer, tr.per_device_eval_batch_size, d.max_seq_length, shuffle=False),
    )


def build_logger(config: TierlmConfig, output_dir: Path, resume_step: int | None) -> MetricsLogger:
    sinks = [JSONLSink(output_dir / "metrics.jsonl", resume_from_step=resume_step)]
    if "tensorboard" in config.training.report_to:
        sinks.append(TensorBoardSink(output_dir / "tensorboard"))
    if "wandb" in config.training.report_to:
        sinks.append(WandbSink(config.infra.wandb_project, config.infra.wandb_run_name, config.model_dump(mode="json"), output_dir))
    return MetricsLogger(sinks)


def existing_checkpoint(config: TierlmConfig) -> Path | None:
    """The checkpoint a run would resume from; an error when training.resume=never forbids reusing the directory."""
    output_dir = Path(config.infra.output_dir)
    latest = find_latest_checkpoint(output_dir / CHECKPOINTS_DIRNAME)
    if latest is not None and config.training.resume == "never":
        raise ConfigError(f"{output_dir} already holds checkpoints; use a new infra.output_dir or training.resume=auto to continue")
    return latest


def extras_writer(config: TierlmConfig, tokenizer: Tokenizer, stage: str):
    """What every checkpoint and the run directory carry besides weights: tokenizer, config, stage."""

    def write_extra(folder: Path) -> None:
        tokenizer.save(folder / "model")
        config.to_yaml(folder / "config.yaml")
        (folder / "model" / TRAINING_META_FILE).write_text(json.dumps({"stage": stage}) + "\n")

    return write_extra


def distributed_context(config: TierlmConfig) -> DistributedContext | None:
    """Join torchrun's process group when the config asks for data parallelism (or "auto" finds >1 rank)."""
    infra, tr = config.infra, config.training
    kind = infra.distributed_type
    if kind == "auto":
        kind = "fsdp" if launched_distributed() and int(os.environ["WORLD_SIZE"]) > 1 else "none"
    if kind == "none":
        if launched_distributed() and int(os.environ["WORLD_SIZE"]) > 1:
            raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} ranks but infra.distributed_type=none; use fsdp or ddp")
        return None
    if tr.async_save:
        raise ConfigError("training.async_save is for one process; distributed runs save sharded checkpoints synchronously")
    if tr.average_last_n:
        raise ConfigError("training.average_last_n needs full checkpoints; under torchrun, `tierlm export` them and `tierlm average`")
    return init_distributed(infra.device_type, infra.dist_timeout_s)


def distributed_kind(config: TierlmConfig, ctx: DistributedContext | None) -> str:
    if ctx is None:
        return "none"
    return "fsdp" if config.infra.distributed_type in ("auto", "fsdp") else "ddp"


def build_backend(config: TierlmConfig, model: torch.nn.Module, checkpoint_dir: Path, device: torch.device,
                  ctx: DistributedContext | None) -> PyTorchTrainingBackend:
    """The tier-0 backend the config asks for: one process, DDP or FSDP2 (with AC / compile / offload)."""
    tr, infra = config.training, config.infra

    def optimizer_fn(m: torch.nn.Module) -> torch.optim.Optimizer:
        return create_adamw_optimizer(
            m, tr.learning_rate, (tr.adam_beta1, tr.adam_beta2), tr.adam_epsilon, tr.weight_decay,
            exclude_norms_biases_embeddings=not tr.decay_norms_and_embeddings,
        )

    def scheduler_fn(optimizer: torch.optim.Optimizer):
        return create_warmup_scheduler(optimizer, tr.warmup_steps, tr.num_train_steps, tr.lr_scheduler_type, tr.min_lr_ratio, tr.warmdown_ratio)

    bf16 = torch.bfloat16 if tr.bf16 else None
    kind = distributed_kind(config, ctx)
    if kind == "fsdp":
        return FSDPTrainingBackend(
            model, optimizer_fn, None, checkpoint_dir, device, scheduler_fn, tr.max_grad_norm, param_dtype=bf16,
            activation_checkpointing=infra.activation_checkpointing, compile=infra.compile, cpu_offload=infra.cpu_offload,
            fused_cross_entropy=tr.fused_cross_entropy,
        )
    if infra.cpu_offload:
        raise ConfigError("infra.cpu_offload is an FSDP option; set infra.distributed_type=fsdp (under torchrun) or turn it off")
    if kind == "ddp":
        return DDPTrainingBackend(
            model, optimizer_fn, None, checkpoint_dir, device, scheduler_fn, tr.max_grad_norm, bf16,
            tr.gradient_accumulation_steps, infra.activation_checkpointing, infra.compile, tr.fused_cross_entropy,
        )
    if infra.activation_checkpointing:
        apply_activation_checkpointing(model)
    if infra.compile:
        apply_compile(model)
    optimizer = optimizer_fn(model)
    return PyTorchTrainingBackend(
        model, optimizer, None, checkpoint_dir, device, scheduler_fn(optimizer), tr.max_grad_norm, bf16, async_save=tr.async_save,
        fused_cross_entropy=tr.fused_cross_entropy,
    )


def shared_tokenizer(config: TierlmConfig, stage: str, pretrained, ctx: DistributedContext | None) -> Tokenizer:
    """The existing tokenizer, or a new one: trained by rank 0 and read by the others from the run directory."""
    tokenizer = existing_tokenizer(config, pretrained)
    if tokenizer is not None:
        return tokenizer
    if ctx is None:
        return train_tokenizer(config, stage)
    folder = Path(config.infra.output_dir) / "tokenizer"
    if ctx.is_main:
        train_tokenizer(config, stage).save(folder)
    torch.distributed.barrier()
    return load_tokenizer(folder)


def save_final_model(model: torch.nn.Module, folder: Path, ctx: DistributedContext | None) -> None:
    """Write the trained weights as one model folder (under FSDP, gathered to rank 0 first)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tierlm.models import unwrap_model

    if ctx is None:
        save_model_folder(model, folder)
        return
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_main:
        save_model_folder(unwrap_model(model), folder, state_dict=state)


def run_stage(config: TierlmConfig, stage: str) -> dict:
    """Train one stage ("pretrain" | "sft" | "dpo") as the config says; returns the run summary.

    Under torchrun every rank calls this; rank 0 writes the logs and the final model.
    """
    assert stage in STAGES, f"stage must be one of {STAGES}, got {stage!r}"
    infra = config.infra
    latest = existing_checkpoint(config)
    if infra.num_threads:
        torch.set_num_threads(infra.num_threads)
    ctx = distributed_context(config)
    summary = _run_stage(config, stage, ctx, latest)
    if ctx is not None:  # only after success: a failed rank just exits, and torchrun stops the others
        shutdown_distributed()
    return summary


def _run_stage(config: TierlmConfig, stage: str, ctx: DistributedContext | None, latest: Path | None) -> dict:
    tr, infra = config.training, config.infra
    output_dir = Path(infra.output_dir)
    is_main = ctx is None or ctx.is_main
    seed_everything(tr.seed)  # the same on every rank: identical initial weights
    device = ctx.device if ctx is not None else resolve_device(infra.device_type, infra.gpu_rank)
    pretrained = pretrained_location(config)
    if stage == "dpo" and pretrained is None:
        raise ConfigError("dpo starts from a trained model: set model.model_name_or_path (e.g. runs/tiny_sft)")
    tokenizer = shared_tokenizer(config, stage, pretrained, ctx)
    model = build_model(config, tokenizer, device, pretrained)
    flops = flops_per_token(model, config.data.max_seq_length)
    world_size = ctx.world_size if ctx is not None else 1
    if stage == "dpo":
        reference = FrozenReference(copy.deepcopy(model), device) if config.dpo.reference == "frozen" else None
        train_loader, eval_loader = build_pair_loaders(config, tokenizer, ctx)  # rank-aware: pairs stay whole
        strategy = DPOStrategy(config.dpo.beta, reference)
    else:
        train_loader, eval_loader = build_loaders(config, stage, tokenizer, world_size)
        strategy = (PretrainStrategy if stage == "pretrain" else SFTStrategy)(tokenizer.token_bytes())
    backend = build_backend(config, model, output_dir / CHECKPOINTS_DIRNAME, device, ctx)
    if is_main:  # the first write: every input is known good by now
        output_dir.mkdir(parents=True, exist_ok=True)
        config.to_yaml(output_dir / "config.yaml")

    write_extra = extras_writer(config, tokenizer, stage)
    trainer = Trainer(
        backend, strategy, train_loader=RankSlice(train_loader, ctx.rank, world_size) if ctx and stage != "dpo" else train_loader,
        eval_loader=eval_loader, config=tr, flops_per_token=flops,
        peak_flops=peak_flops(device, infra.peak_tflops), write_extra=write_extra, progress_bar=infra.progress_bar,
    )
    resumed = trainer.resume() if latest is not None else None
    if is_main:
        trainer.logger = build_logger(config, output_dir, trainer.state.step if resumed else None)
    prefetch = config.data.prefetch_batches if config.data.prefetch_batches is not None else (2 if device.type != "cpu" else 0)
    if prefetch and stage != "dpo":  # started after resuming, so it starts from the resumed position
        trainer.train_loader = Prefetcher(trainer.train_loader, prefetch)
    try:
        summary = trainer.train()
    finally:
        trainer.logger.close()
        if isinstance(trainer.train_loader, Prefetcher):
            trainer.train_loader.close()
    final = output_dir / "model"
    save_final_model(backend.model, final, ctx)
    summary.update(stage=stage, output_dir=str(output_dir), model_dir=str(final), resumed_from=str(resumed) if resumed else None,
                   world_size=world_size, distributed_type=distributed_kind(config, ctx))
    if not is_main:
        return summary
    write_extra(output_dir)
    if tr.average_last_n:
        recent = list_checkpoints(output_dir / CHECKPOINTS_DIRNAME)[-tr.average_last_n :]
        if len(recent) >= 2:
            summary["averaged_model_dir"] = str(average_checkpoints(recent, output_dir / "model_averaged"))
    (final / TRAINING_META_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary

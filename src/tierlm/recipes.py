"""Tier 3: assemble a run (tokenizer, model, loaders, backend, strategy, trainer) from a config."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from tierlm.backends.pytorch import PyTorchTrainingBackend
from tierlm.checkpoint import (
    CHECKPOINTS_DIRNAME,
    average_checkpoints,
    find_latest_checkpoint,
    list_checkpoints,
    resolve_model_folder,
)
from tierlm.config import TierlmConfig
from tierlm.data import (
    Documents,
    Examples,
    Fields,
    Mixture,
    PackedLoader,
    Prefetcher,
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
from tierlm.strategies import PretrainStrategy, SFTStrategy
from tierlm.trainer import Trainer

STAGES = ("pretrain", "sft")
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
    return resolve_model_folder(name) if Path(name).exists() else name


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


def build_loaders(config: TierlmConfig, stage: str, tokenizer: Tokenizer) -> tuple[PackedLoader, PackedLoader]:
    """Best-fit packed train and eval loaders: pretraining crops, SFT pads (and isolates documents)."""
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
        PackedLoader(train, tr.per_device_train_batch_size, d.max_seq_length, seed=tr.seed, **common),
        PackedLoader(val, tr.per_device_eval_batch_size, d.max_seq_length, shuffle=False, **common),
    )


def build_logger(config: TierlmConfig, output_dir: Path, resume_step: int | None) -> MetricsLogger:
    sinks = [JSONLSink(output_dir / "metrics.jsonl", resume_from_step=resume_step)]
    if "tensorboard" in config.training.report_to:
        sinks.append(TensorBoardSink(output_dir / "tensorboard"))
    if "wandb" in config.training.report_to:
        sinks.append(WandbSink(config.infra.wandb_project, config.infra.wandb_run_name, config.model_dump(mode="json"), output_dir))
    return MetricsLogger(sinks)


def run_stage(config: TierlmConfig, stage: str) -> dict:
    """Train one stage ("pretrain" | "sft") as the config says; returns the run summary."""
    assert stage in STAGES, f"stage must be one of {STAGES}, got {stage!r}"
    tr, infra = config.training, config.infra
    output_dir = Path(infra.output_dir)
    checkpoint_dir = output_dir / CHECKPOINTS_DIRNAME
    latest = find_latest_checkpoint(checkpoint_dir)
    if latest is not None and tr.resume == "never":
        raise ConfigError(f"{output_dir} already holds checkpoints; use a new infra.output_dir or training.resume=auto to continue")
    if infra.num_threads:
        torch.set_num_threads(infra.num_threads)
    seed_everything(tr.seed)
    device = resolve_device(infra.device_type, infra.gpu_rank)

    pretrained = pretrained_location(config)
    tokenizer = existing_tokenizer(config, pretrained) or train_tokenizer(config, stage)
    model = build_model(config, tokenizer, device, pretrained)
    train_loader, eval_loader = build_loaders(config, stage, tokenizer)
    optimizer = create_adamw_optimizer(
        model, tr.learning_rate, (tr.adam_beta1, tr.adam_beta2), tr.adam_epsilon, tr.weight_decay,
        exclude_norms_biases_embeddings=not tr.decay_norms_and_embeddings,
    )
    scheduler = create_warmup_scheduler(
        optimizer, tr.warmup_steps, tr.num_train_steps, tr.lr_scheduler_type, tr.min_lr_ratio, tr.warmdown_ratio
    )
    backend = PyTorchTrainingBackend(
        model, optimizer, None, checkpoint_dir, device, scheduler, tr.max_grad_norm, torch.bfloat16 if tr.bf16 else None,
        async_save=tr.async_save,
    )
    strategy = (PretrainStrategy if stage == "pretrain" else SFTStrategy)(tokenizer.token_bytes())

    output_dir.mkdir(parents=True, exist_ok=True)
    config.to_yaml(output_dir / "config.yaml")

    def write_extra(folder: Path) -> None:
        tokenizer.save(folder / "model")
        config.to_yaml(folder / "config.yaml")
        (folder / "model" / TRAINING_META_FILE).write_text(json.dumps({"stage": stage}) + "\n")

    trainer = Trainer(
        backend, strategy, train_loader=train_loader, eval_loader=eval_loader, config=tr,
        flops_per_token=flops_per_token(model, config.data.max_seq_length),
        peak_flops=peak_flops(device, infra.peak_tflops), write_extra=write_extra, progress_bar=infra.progress_bar,
    )
    resumed = trainer.resume() if latest is not None else None
    trainer.logger = build_logger(config, output_dir, trainer.state.step if resumed else None)
    if config.data.prefetch_batches:  # started after resuming, so it starts from the resumed position
        trainer.train_loader = Prefetcher(train_loader, config.data.prefetch_batches)
    try:
        summary = trainer.train()
    finally:
        trainer.logger.close()
        if isinstance(trainer.train_loader, Prefetcher):
            trainer.train_loader.close()
    final = output_dir / "model"
    save_model_folder(model, final)
    write_extra(output_dir)
    if tr.average_last_n:
        recent = list_checkpoints(checkpoint_dir)[-tr.average_last_n :]
        if len(recent) >= 2:
            summary["averaged_model_dir"] = str(average_checkpoints(recent, output_dir / "model_averaged"))
    summary.update(stage=stage, output_dir=str(output_dir), model_dir=str(final), resumed_from=str(resumed) if resumed else None)
    (final / TRAINING_META_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary

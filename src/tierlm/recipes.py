"""Tier 3: assemble a run (tokenizer, model, loaders, backend, strategy, trainer) from a config."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from tierlm.backends.pytorch import PyTorchTrainingBackend
from tierlm.checkpoint import CHECKPOINTS_DIRNAME, find_latest_checkpoint, resolve_model_folder
from tierlm.config import TierlmConfig
from tierlm.data import (
    Fields,
    PretrainLoader,
    SFTLoader,
    Tokenizer,
    load_conversations,
    load_documents,
    load_tokenizer,
    split_holdout,
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


def load_examples(config: TierlmConfig, stage: str) -> tuple[list, list]:
    """(train, val) documents (pretrain) or conversations (sft)."""
    d, seed = config.data, config.training.seed
    load = load_documents if stage == "pretrain" else load_conversations
    train = load(d.dataset_name, "train", d.num_synthetic_examples, seed, _fields(config))
    if d.eval_dataset_name:
        return train, load(d.eval_dataset_name, "val", d.num_synthetic_eval_examples, seed, _fields(config))
    if d.dataset_name.startswith("synthetic:"):
        return train, load(d.dataset_name, "val", d.num_synthetic_eval_examples, seed, _fields(config))
    return split_holdout(train, d.val_fraction)


def build_tokenizer(config: TierlmConfig, train_examples: list, stage: str, pretrained: Path | str | None) -> Tokenizer:
    m, t = config.model, config.tokenizer
    if m.tokenizer_name_or_path:
        return load_tokenizer(m.tokenizer_name_or_path, m.trust_remote_code)
    if pretrained is not None:
        return load_tokenizer(pretrained, m.trust_remote_code)
    texts = train_examples[: t.num_train_docs]
    if stage == "sft":  # train on the conversations' words
        texts = [msg["content"] for conv in texts for msg in conv]
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


def build_loaders(config: TierlmConfig, stage: str, tokenizer: Tokenizer, train: list, val: list):
    d, tr = config.data, config.training
    if stage == "pretrain":
        sep = tokenizer.document_separator_id
        encode = lambda docs: [[sep] + ids for ids in tokenizer.encode_batch(docs)]  # noqa: E731
        train_docs, val_docs = encode(train), encode(val)
        too_big = max((max(ids) for ids in train_docs + val_docs if ids), default=0)
        if too_big >= tokenizer.vocab_size:
            raise DataError(f"token id {too_big} >= vocab size {tokenizer.vocab_size}: the data was not made by this tokenizer")
        return (
            PretrainLoader(train_docs, tr.per_device_train_batch_size, d.max_seq_length, seed=tr.seed),
            PretrainLoader(val_docs, tr.per_device_eval_batch_size, d.max_seq_length, shuffle=False),
        )
    common = dict(tokenizer=tokenizer, max_seq_len=d.max_seq_length, train_on=d.train_on, long_conversations=d.long_conversations)
    return (
        SFTLoader(train, batch_size=tr.per_device_train_batch_size, seed=tr.seed, **common),
        SFTLoader(val, batch_size=tr.per_device_eval_batch_size, shuffle=False, **common),
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

    train, val = load_examples(config, stage)
    pretrained = pretrained_location(config)
    tokenizer = build_tokenizer(config, train, stage, pretrained)
    model = build_model(config, tokenizer, device, pretrained)
    train_loader, eval_loader = build_loaders(config, stage, tokenizer, train, val)
    optimizer = create_adamw_optimizer(
        model, tr.learning_rate, (tr.adam_beta1, tr.adam_beta2), tr.adam_epsilon, tr.weight_decay,
        exclude_norms_biases_embeddings=not tr.decay_norms_and_embeddings,
    )
    scheduler = create_warmup_scheduler(
        optimizer, tr.warmup_steps, tr.num_train_steps, tr.lr_scheduler_type, tr.min_lr_ratio, tr.warmdown_ratio
    )
    backend = PyTorchTrainingBackend(
        model, optimizer, None, checkpoint_dir, device, scheduler, tr.max_grad_norm, torch.bfloat16 if tr.bf16 else None
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
    try:
        summary = trainer.train()
    finally:
        trainer.logger.close()
    final = output_dir / "model"
    save_model_folder(model, final)
    write_extra(output_dir)
    summary.update(stage=stage, output_dir=str(output_dir), model_dir=str(final), resumed_from=str(resumed) if resumed else None)
    (final / TRAINING_META_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary

"""Tier 3 for RL: assemble an RL run (policy, engine, tasks, reference, backend) from a config,
and pass@k evaluation of a checkpoint. The shared pieces (model, tokenizer, backend, logger) come
from `tierlm.recipes`."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from tierlm.backends.pytorch import FrozenReference
from tierlm.checkpoint import CHECKPOINTS_DIRNAME, resolve_model_location
from tierlm.config import TierlmConfig
from tierlm.data import load_tokenizer
from tierlm.errors import ConfigError
from tierlm.models import load_pretrained_model, save_model_folder
from tierlm.primitives import resolve_device
from tierlm.primitives.parallel import launched_distributed, shutdown_distributed
from tierlm.recipes import (
    TRAINING_META_FILE,
    build_backend,
    build_logger,
    build_model,
    distributed_context,
    existing_checkpoint,
    existing_tokenizer,
    extras_writer,
    pretrained_location,
    seed_everything,
)
from tierlm.rl.loop import RLTrainer
from tierlm.rl.tasks import open_task, split_task
from tierlm.rollout.engine import Engine
from tierlm.rollout.tools import Calculator
from tierlm.strategies.rl import GRPOStrategy, PPOStrategy, ReinforceStrategy


def _eval_task(config: TierlmConfig):
    d, tr = config.data, config.training
    if d.eval_dataset_name:
        return open_task(d.eval_dataset_name, "val", d.num_synthetic_eval_examples, tr.seed)
    if d.dataset_name.startswith("synthetic:"):
        return open_task(d.dataset_name, "val", d.num_synthetic_eval_examples, tr.seed)
    return split_task(open_task(d.dataset_name, "train", d.num_synthetic_examples, tr.seed), d.val_fraction)[1]


def run_eval(config: TierlmConfig, checkpoint: str) -> dict:
    """pass@1 / pass@k of a chat model on the held-out problems the RL config names (no training)."""
    location = resolve_model_location(checkpoint)
    tokenizer = load_tokenizer(location, config.model.trust_remote_code)
    if not tokenizer.has_chat_template:
        raise ConfigError(f"{checkpoint} has no chat template: pass@k evaluates chat models")
    torch.manual_seed(config.training.seed)
    model = load_pretrained_model(location, device=resolve_device(config.infra.device_type, config.infra.gpu_rank))
    engine = Engine(model, tokenizer.stop_ids, tokenizer, [Calculator()] if "calculator" in config.rl.tools else [])
    trainer = RLTrainer(None, None, engine, tokenizer, None, _eval_task(config), config.rl, config.training)
    return trainer.evaluate()


def run_rl(config: TierlmConfig) -> dict:
    """Reinforcement learning from a trained chat model: sample groups, reward, policy-gradient updates."""
    summary = _run_rl(config)
    shutdown_distributed()  # after the models are out of scope (a no-op in one process); a failed rank just exits
    return summary


def _run_rl(config: TierlmConfig) -> dict:
    tr, infra, rl, d = config.training, config.infra, config.rl, config.data
    if infra.distributed_type == "fsdp":
        raise ConfigError("tierlm rl shards data, not the model: use infra.distributed_type=ddp (or auto) under torchrun")
    output_dir = Path(infra.output_dir)
    checkpoint_dir = output_dir / CHECKPOINTS_DIRNAME
    latest = existing_checkpoint(config)
    pretrained = pretrained_location(config)
    if pretrained is None:
        raise ConfigError("rl starts from a trained chat model: set model.model_name_or_path (e.g. runs/tiny_sft)")
    train_task = open_task(d.dataset_name, "train", d.num_synthetic_examples, tr.seed)
    if not d.eval_dataset_name and not d.dataset_name.startswith("synthetic:"):
        train_task = split_task(train_task, d.val_fraction)[0]  # the held-out tail is _eval_task's
    eval_task = _eval_task(config)
    if infra.num_threads:
        torch.set_num_threads(infra.num_threads)
    # Under torchrun: DDP, each rank sampling its share of the step's prompts.
    ddp = config.model_copy(update={"infra": infra.model_copy(update={"distributed_type": "ddp"})})
    if infra.distributed_type == "none":
        ctx = distributed_context(config)  # None, or the one-line error for a multi-rank launch
    else:
        ctx = distributed_context(ddp) if infra.distributed_type == "ddp" or launched_distributed() else None
    world = ctx.world_size if ctx is not None else 1
    if rl.prompts_per_step % world:
        raise ConfigError(f"rl.prompts_per_step ({rl.prompts_per_step}) must be divisible by the {world} ranks")
    seed_everything(tr.seed)
    device = ctx.device if ctx is not None else resolve_device(infra.device_type, infra.gpu_rank)
    tokenizer = existing_tokenizer(config, pretrained)
    if not tokenizer.has_chat_template:
        raise ConfigError(f"{pretrained} has no chat template: rl needs a chat model (run tierlm sft first)")
    model = build_model(config, tokenizer, device, pretrained)
    reference = FrozenReference(copy.deepcopy(model), device) if rl.kl_coef > 0 else None
    # Each RL step makes rl.ppo_epochs optimizer steps (the LR schedule counts optimizer steps), each
    # over this rank's rollouts in micro-batches (DDP synchronises on the last of them).
    rows = rl.prompts_per_step // world * rl.group_size
    schedule = tr.model_copy(update={
        "num_train_steps": tr.num_train_steps * rl.ppo_epochs, "warmup_steps": tr.warmup_steps * rl.ppo_epochs,
        "gradient_accumulation_steps": -(-rows // rl.micro_batch_size),
    })
    backend = build_backend(ddp.model_copy(update={"training": schedule}), model, checkpoint_dir, device, ctx)
    normalize = rl.normalize_std if rl.normalize_std is not None else rl.algorithm == "grpo"
    strategy = {
        "reinforce": lambda: ReinforceStrategy(rl.temperature, rl.kl_coef),
        "grpo": lambda: GRPOStrategy(rl.clip_range, rl.kl_coef, normalize, rl.temperature),
        "ppo": lambda: PPOStrategy(rl.kl_coef, rl.clip_range, normalize, rl.temperature),
    }[rl.algorithm]()
    engine = Engine(model, tokenizer.stop_ids, tokenizer, [Calculator()] if "calculator" in rl.tools else [])

    is_main = ctx is None or ctx.is_main
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        config.to_yaml(output_dir / "config.yaml")

    write_extra = extras_writer(config, tokenizer, "rl")
    trainer = RLTrainer(backend, strategy, engine, tokenizer, train_task, eval_task, rl, tr, reference=reference, write_extra=write_extra)
    resumed = trainer.resume() if latest is not None else None
    if is_main:
        trainer.logger = build_logger(config, output_dir, trainer.state.step if resumed else None)
    try:
        summary = trainer.train()
    finally:
        trainer.logger.close()
    final = output_dir / "model"
    summary.update(stage="rl", output_dir=str(output_dir), model_dir=str(final), resumed_from=str(resumed) if resumed else None,
                   world_size=world)
    if is_main:
        save_model_folder(model, final)
        write_extra(output_dir)
        (final / TRAINING_META_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary

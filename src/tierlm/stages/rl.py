"""Tier 3 for RL: assemble an RL run (policy, engine, tasks, reference, backend) from a config,
and pass@k evaluation of a checkpoint. The shared pieces (model, tokenizer, backend, logger) come
from `tierlm.build.model`."""

from __future__ import annotations

import torch

from tierlm.backends.pytorch import frozen_reference
from tierlm.checkpoint.folders import verified_model_location
from tierlm.config import TierlmConfig
from tierlm.data import load_tokenizer
from tierlm.errors import ConfigError, DataError
from tierlm.build.loaders import open_splits
from tierlm.metrics.memory import check_fits
from tierlm.models import load_pretrained_model, model_max_seq_len
from tierlm.primitives import resolve_device
from tierlm.primitives.parallel import shutdown_distributed
from tierlm.build.model import build_backend, build_model, memory_needs
from tierlm.run import Run, extras_writer, prepare_run, rl_parallelism
from tierlm.loops.critic import Critic, value_model
from tierlm.loops.rl import RLTrainer
from tierlm.build.tasks import open_tasks
from tierlm.tasks import is_environment, synthetic_name
from tierlm.rollout.engine import Engine
from tierlm.rollout.tools import Calculator
from tierlm.strategies.rl import GRPOStrategy, PPOStrategy, ReinforceStrategy, ValueStrategy


def run_eval(config: TierlmConfig, checkpoint: str) -> dict:
    """pass@1 / pass@k of a chat model on the held-out problems the RL config names (no training)."""
    location = verified_model_location(checkpoint)
    tokenizer = load_tokenizer(location, config.model.trust_remote_code)
    if not tokenizer.has_chat_template:
        raise ConfigError(f"{checkpoint} has no chat template: pass@k evaluates chat models")
    torch.manual_seed(config.training.seed)
    model = load_pretrained_model(location, device=resolve_device(config.infra.device_type, config.infra.gpu_rank))
    engine = Engine(model, tokenizer.stop_ids, tokenizer, [Calculator()] if "calculator" in config.rl.tools else [])
    trainer = RLTrainer(None, None, engine, tokenizer, None, open_tasks(config)[1], config.rl, config.training)
    return trainer.evaluate()


def check_prompt_lengths(train_task, eval_task, tokenizer, max_len: int | None, name: str) -> None:
    """Every prompt of a file task must leave room to answer (synthetic prompts are short by construction)."""
    if max_len is None or synthetic_name(name) is not None or is_environment(train_task):
        return
    for task in (train_task, eval_task):
        for i in range(len(task)):
            length = len(tokenizer.render_for_completion(task.example(i).messages))
            if length + 1 > max_len:
                raise DataError(f"{name}: example {i}'s prompt is {length} tokens, longer than the model's context of {max_len} "
                                "leaves room to answer; shorten or drop it")


def _longest_rollout(task, tokenizer, max_new_tokens: int, max_seq_length: int, sample: int = 256) -> int:
    """Prompt + completion tokens of the longest rollout, from the prompts of the first `sample`
    examples, at most data.max_seq_length (an environment's prompts are not known ahead: that bound;
    a prompt too long for the model is refused once the model is built)."""
    if is_environment(task):
        return max_seq_length
    prompts = (len(tokenizer.render_for_completion(task.example(i).messages)) for i in range(min(sample, len(task))))
    return min(max(prompts, default=0) + max_new_tokens, max_seq_length)


def run_rl(config: TierlmConfig) -> dict:
    """Reinforcement learning from a trained chat model: sample groups, reward, policy-gradient updates."""
    summary = _run_rl(prepare_run(config, "rl"))
    shutdown_distributed()  # after the models are out of scope (a no-op in one process); a failed rank just exits
    return summary


def _run_rl(run: Run) -> dict:
    run.choose_batch_size()  # refuses auto: RL's micro-batch is rl.micro_batch_size
    config, tokenizer = run.config, run.tokenizer
    tr, rl, d = config.training, config.rl, config.data
    train_task, eval_task = open_tasks(config)
    if rl.prompts_per_step % run.world_size:
        raise ConfigError(f"rl.prompts_per_step ({rl.prompts_per_step}) must be divisible by the {run.world_size} ranks")
    rows = min(rl.micro_batch_size, rl.prompts_per_step // run.world_size * rl.group_size)  # rollouts per forward/backward
    check_fits(memory_needs(config, tokenizer.vocab_size, run.pretrained, len(train_task), run.world_size, 2 if rl.kl_coef > 0 else 1,
                            rows=rows, row_tokens=rl.max_new_tokens), run.device)
    run.check_memory(len(train_task), rows, _longest_rollout(train_task, tokenizer, rl.max_new_tokens, d.max_seq_length))
    model = build_model(config, tokenizer, run.device, run.pretrained)
    config = run.resolve(model)
    tr = config.training
    check_prompt_lengths(train_task, eval_task, tokenizer, model_max_seq_len(model), d.dataset_name)
    reference = frozen_reference(model, run.device) if rl.kl_coef > 0 else None
    # Each RL step makes rl.ppo_epochs optimizer steps (the LR schedule counts optimizer steps), each
    # over this rank's rollouts in micro-batches (DDP synchronises on the last of them).
    rows = rl.prompts_per_step // run.world_size * rl.group_size
    schedule = tr.model_copy(update={
        "num_train_steps": tr.num_train_steps * rl.ppo_epochs, "warmup_steps": tr.warmup_steps * rl.ppo_epochs,
        "gradient_accumulation_steps": -(-rows // rl.micro_batch_size),
    })
    parallel = rl_parallelism(config).model_copy(update={"training": schedule})
    if rl.critic and rl.algorithm != "ppo":
        raise ConfigError(f"rl.critic trains PPO's value model: set rl.algorithm=ppo (or drop rl.critic; {rl.algorithm} uses group baselines)")
    critic = Critic(build_backend(parallel, value_model(model), run.output_dir / "critic_checkpoints", run.device, run.ctx),
                    ValueStrategy(rl.value_clip_range)) if rl.critic else None  # copied before the policy is wrapped
    backend = build_backend(parallel, model, run.checkpoint_dir, run.device, run.ctx)
    normalize = rl.normalize_std if rl.normalize_std is not None else rl.algorithm == "grpo"
    strategy = {
        "reinforce": lambda: ReinforceStrategy(rl.temperature, rl.kl_coef),
        "grpo": lambda: GRPOStrategy(rl.clip_range, rl.kl_coef, normalize, rl.temperature),
        "ppo": lambda: PPOStrategy(rl.kl_coef, rl.clip_range, normalize, rl.temperature, rl.critic, rl.gae_gamma, rl.gae_lambda,
                                   rl.value_clip_range),
    }[rl.algorithm]()
    engine = Engine(model, tokenizer.stop_ids, tokenizer, [Calculator()] if "calculator" in rl.tools else [])
    trainer = RLTrainer(backend, strategy, engine, tokenizer, train_task, eval_task, rl, tr, reference=reference, critic=critic,
                        write_extra=extras_writer(config, tokenizer, "rl"))
    run.begin(trainer)
    return run.finish(model, run.train(trainer))

"""What an RL run holds beside its policy, built before the policy is wrapped and handed to the `RLTrainer` whole:
the frozen reference (a KL penalty), the teacher (on-policy distillation), PPO's critic and a reward model."""

from __future__ import annotations

from pathlib import Path

import torch

from tierlm.backends.pytorch import frozen_reference
from tierlm.builders.backend import build_backend
from tierlm.builders.model import load_reward_model, load_teacher
from tierlm.config import TierlmConfig
from tierlm.data.tokenizer import Tokenizer
from tierlm.loops.critic import Critic, value_model
from tierlm.primitives.parallel import DistributedContext
from tierlm.strategies.rl import ValueStrategy


def beside_policy(
    config: TierlmConfig,
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    device: torch.device,
    ctx: DistributedContext | None,
    critic_dir: Path,
) -> dict:
    """The `RLTrainer` arguments of the models beside `model` (the policy, not yet wrapped): `reference`
    (rl.kl_coef > 0), `teacher` (rl.teacher), `critic` (rl.critic: a copy of the policy with a value head, its own
    backend checkpointing into `critic_dir`) and `reward_model` (rl.reward_model); None where the config has none."""
    rl = config.rl
    critic = None
    if rl.critic:  # a copy of the policy, made before the policy is wrapped
        backend = build_backend(config, value_model(model), critic_dir, device, ctx)
        critic = Critic(backend, ValueStrategy(rl.value_clip_range))
    return {
        "reference": frozen_reference(model, device) if rl.kl_coef > 0 else None,
        "teacher": load_teacher(rl.teacher, tokenizer, device) if rl.teacher else None,
        "critic": critic,
        "reward_model": load_reward_model(rl, tokenizer, device),
    }

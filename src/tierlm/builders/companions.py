"""What an RL run holds beside its policy, built before the policy is wrapped and handed to the `RLTrainer` whole:
the frozen reference (a KL penalty), the teacher (on-policy distillation), PPO's critic and a reward model; and
DPO's reference log-probs, scored once before training (`precompute_reference`)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tierlm.backends.references import AdapterFreeReference, frozen_reference
from tierlm.builders.backend import build_backend
from tierlm.builders.model import load_reward_model, load_teacher
from tierlm.builders.tasks import reward_terms
from tierlm.config import TierlmConfig
from tierlm.data.tokenizer import Tokenizer
from tierlm.loops.critic import Critic, value_model
from tierlm.loops.teachers import Teachers
from tierlm.primitives.parallel import DistributedContext
from tierlm.strategies.rl import ValueStrategy
from tierlm.strategies.rl_losses import RL_LOSSES


def beside_policy(
    config: TierlmConfig,
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    device: torch.device,
    ctx: DistributedContext | None,
    critic_dir: Path,
) -> dict:
    """The `RLTrainer` arguments of the models beside `model` (the policy, not yet wrapped): `reference`
    (rl.kl_coef > 0), `teacher` (rl.teacher / rl.teachers: `load_teachers`), `critic` (rl.critic: a copy of the
    policy with a value head, its own backend checkpointing into `critic_dir`), `reward_model` (rl.reward_model)
    and the added reward functions (rl.reward_terms: `tierlm.builders.tasks.reward_terms`); None where the config
    has none."""
    rl = config.rl
    critic = None
    if rl.critic:  # a copy of the policy, made before the policy is wrapped
        backend = build_backend(config, value_model(model), critic_dir, device, ctx)
        critic = Critic(backend, ValueStrategy(rl.value_clip_range))
    return {
        "reference": frozen_reference(model, device, sync_every=rl.reference_sync_steps, alpha=rl.reference_mixup_alpha)
        if rl.kl_coef > 0
        else None,
        "teacher": load_teachers(rl, tokenizer, device),
        "critic": critic,
        "reward_model": load_reward_model(rl, tokenizer, device),
        "reward_terms": reward_terms(rl) or None,
    }


def load_teachers(rl, tokenizer: Tokenizer, device: torch.device) -> Teachers | None:
    """On-policy distillation's teachers (None without rl.teacher / rl.teachers): each distinct folder loaded once
    (`load_teacher`: frozen, the student's tokenizer or refused), rl.teachers' domains routed to theirs, every
    other domain to rl.teacher; a loss that reads rl.distill_top_k (distill_topk) gets the teacher's likeliest
    tokens too."""
    if not (rl.teacher or rl.teachers):
        return None
    folders = list(dict.fromkeys([*([rl.teacher] if rl.teacher else []), *rl.teachers.values()]))
    labels = []
    for folder in folders:
        domains = [domain for domain, f in rl.teachers.items() if f == folder]
        labels.append("+".join(domains + (["rest"] if folder == rl.teacher else [])))
    return Teachers(
        [load_teacher(folder, tokenizer, device) for folder in folders],
        routes={domain: folders.index(folder) for domain, folder in rl.teachers.items()},
        default=0 if rl.teacher else None,
        labels=labels,
        top_k=rl.distill_top_k if "distill_top_k" in RL_LOSSES[rl.loss].reads else None,
        temperature=rl.temperature,
    )


def precompute_reference(model: torch.nn.Module, loaders: list, strategy, device: torch.device) -> int:
    """dpo.reference=precomputed where the pairs' data carry no reference log-probs (TRL's precompute_ref_log_probs):
    the starting model (a LoRA model's base: its adapters off) scores each loader's pairs once, before training, as a
    frozen reference would score them in each step, so that training holds no second model. The ranks score a share
    each and gather the rest; the count of pairs scored is returned (0: the data carried them all)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    reference = AdapterFreeReference(model, device)  # the model itself, in eval mode for the pass: no copy
    scored = 0
    for loader in loaders:
        missing = loader.unscored()
        mine, logps = missing[rank::world], {}
        for start in range(0, len(mine), loader.batch_size):
            chunk = mine[start : start + loader.batch_size]
            sums = reference.forward(loader.pairs(chunk), strategy.reference_logps).wait()["logps"].tolist()
            logps.update({i: (sums[k], sums[len(chunk) + k]) for k, i in enumerate(chunk)})
        if world > 1:
            shares = [None] * world
            dist.all_gather_object(shares, logps)
            logps = {i: refs for share in shares for i, refs in share.items()}
        loader.set_reference(logps)
        scored += len(missing)
    return scored

"""Tier 3: a run's plan — the hyperparameters a config implies, derived once, printed before training.

nanochat's "one number sets everything": from the model (its depth) follow

1. the token horizon, D = training.target_param_data_ratio x scaling parameters (the hidden
   matrices and the output head: nanochat found these give the cleanest scaling laws);
2. the batch, B = 524,288 x (D / D_ref)^0.383 rounded to a power of two (Power Lines), where
   D_ref is the horizon of the same model at depth 12, and the gradient accumulation it takes at
   the device batch and world size;
3. the learning rates x sqrt(B / 524,288), and the weight decay x sqrt(B / 524,288) x (D_ref / D);
4. num_train_steps = D // B.

Explicit values win (a config that sets num_train_steps keeps it). The resolved values replace the
config's, so the run's config.yaml says what was trained (and re-derives to itself).
`tierlm plan` prints the same table every training command logs at start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tierlm.builders.model import new_model
from tierlm.builders.optimizer import model_width, positions_only, role_learning_rates
from tierlm.builders.stage import Stage
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError
from tierlm.models import family_named, family_of, unwrap_model
from tierlm.models.moe import MoE
from tierlm.primitives.optim import ROLES, parameter_roles

B_REF = 2**19  # tokens per step found best at the d12 reference (nanochat, measured)
REFERENCE_DEPTH = 12
BATCH_EXPONENT = 0.383  # B_opt ~ D^0.383 (Power Lines, arXiv:2505.13738)


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Trainable parameters by role, their total, and the scaling parameters (matrices + head).

    >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    >>> parameter_counts(model)
    {'matrix': 16, 'embedding': 40, 'unembedding': 0, 'scalar': 12, 'total': 68, 'scaling': 16}
    """
    roles = parameter_roles(unwrap_model(model))
    counts = {role: sum(p.numel() for p in params) for role, params in roles.items()}
    counts["total"] = sum(counts[r] for r in ROLES)
    counts["scaling"] = counts["matrix"] + counts["unembedding"]
    idle = sum(m.idle_params() for m in model.modules() if isinstance(m, MoE))
    if idle:  # a mixture of experts: what one token goes through
        counts["active"] = counts["total"] - idle
    return counts


def optimal_batch_tokens(target_tokens: float, reference_tokens: float) -> int:
    """B_opt = 524,288 x (D / D_ref)^0.383, to the nearest power of two.

    >>> optimal_batch_tokens(1e9, 1e9), optimal_batch_tokens(8e9, 1e9)   # 8x the data: 2.2x the batch -> 2^20
    (524288, 1048576)
    """
    predicted = B_REF * (target_tokens / reference_tokens) ** BATCH_EXPONENT
    return 2 ** round(math.log2(predicted))


@dataclass
class Plan:
    """What a run will do, as derived from its config and model."""

    stage: str
    counts: dict[str, int] | None
    flops_per_token: float | None
    micro_batch_tokens: int
    world_size: int
    accumulation: int
    num_train_steps: int
    target_tokens: int | None = None
    reference_tokens: int | None = None
    predicted_batch: int | None = None
    lr_scale: float = 1.0
    weight_decay_scale: float = 1.0
    epochs: float | None = None
    batches_per_epoch: int | None = None
    """With training.num_train_epochs: the global micro-batches of one pass over the data."""
    groups: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    memory: Any = None
    """The memory estimate per rank (`tierlm.plan.memory.MemoryEstimate`), when `tierlm plan` made one."""

    @property
    def batch_tokens(self) -> int:
        return self.micro_batch_tokens * self.world_size * self.accumulation

    @property
    def total_tokens(self) -> int:
        return self.batch_tokens * self.num_train_steps

    def estimated_seconds(self, tokens_per_sec: float) -> float:
        return self.total_tokens / tokens_per_sec

    def table(self, tokens_per_sec: float | None = None) -> str:
        """The plan as aligned text lines (what `tierlm plan` prints and every run logs)."""
        rows: list[tuple[str, str]] = []
        if self.counts:
            c = self.counts
            rows.append(
                (
                    "parameters",
                    f"{c['total']:,} (scaling {c['scaling']:,}: matrices {c['matrix']:,} + head "
                    f"{c['unembedding']:,}; embeddings {c['embedding']:,}; scalars {c['scalar']:,})"
                    + (f"; active per token {c['active']:,}" if "active" in c else ""),
                )
            )
        if self.flops_per_token:
            rows.append(("FLOPs per token", f"{self.flops_per_token:.4g} (training: forward + backward)"))
        if self.target_tokens is not None:
            rows.append(
                (
                    "token horizon",
                    f"{self.target_tokens:,} (ratio x scaling parameters; d{REFERENCE_DEPTH} reference "
                    f"{self.reference_tokens:,})",
                )
            )
        if self.predicted_batch is not None:
            rows.append(
                ("predicted batch", f"{self.predicted_batch:,} tokens (B_ref {B_REF:,} x (D/D_ref)^{BATCH_EXPONENT})")
            )
        rows.append(
            (
                "batch",
                f"{self.batch_tokens:,} tokens/step = {self.micro_batch_tokens:,} per micro-batch x "
                f"{self.world_size} rank(s) x {self.accumulation} accumulation",
            )
        )
        rows.append(("steps", f"{self.num_train_steps:,} ({self.total_tokens:,} tokens)"))
        if self.epochs is not None:
            rows.append(("epochs", f"{self.epochs:g} of {self.batches_per_epoch:,} batches"))
        if self.counts and self.counts["scaling"]:
            rows.append(("tokens per scaling parameter", f"{self.total_tokens / self.counts['scaling']:.2f}"))
        if self.lr_scale != 1.0 or self.weight_decay_scale != 1.0:
            rows.append(
                ("batch scaling", f"learning rates x {self.lr_scale:.4f}, weight decay x {self.weight_decay_scale:.4f}")
            )
        for g in self.groups:
            rows.append(
                (
                    f"  {g['role']}",
                    f"{g['optimizer']}, {g['params']:,} parameters, lr {g['lr']:.4g}, weight decay "
                    f"{g['weight_decay']:.4g}",
                )
            )
        if tokens_per_sec:
            rows.append(
                (
                    "estimated time",
                    f"{self.estimated_seconds(tokens_per_sec) / 60:.1f} min at {tokens_per_sec:,.0f} tokens/s",
                )
            )
        width = max(len(k) for k, _ in rows)
        lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
        return "\n".join(
            [f"plan ({self.stage}):", *("  " + line for line in lines), *(f"  note: {n}" for n in self.notes)]
        )


def _horizon(config: TierlmConfig, stage: Stage, model: nn.Module, plan: Plan) -> None:
    """Step 1 of nanochat's rule: D = ratio x scaling parameters, and D_ref for the same model at depth 12."""
    tr, m = config.training, config.model
    if not stage.scales_from_depth or m.model_name_or_path is not None:
        raise ConfigError(
            "training.target_param_data_ratio sets a pretraining horizon from the model's size: "
            "use it to pretrain from scratch, or set training.num_train_steps"
        )
    if "model.depth" not in family_named(m.architecture).config_fields(m):
        raise ConfigError(
            f"training.target_param_data_ratio scales from a depth-{REFERENCE_DEPTH} reference; "
            f"model.architecture={m.architecture} is not built from model.depth (use gpt or gpt2)"
        )
    plan.target_tokens = int(tr.target_param_data_ratio * plan.counts["scaling"])
    reference = config.model_copy(update={"model": m.model_copy(update={"depth": REFERENCE_DEPTH})})
    reference_model = new_model(reference, unwrap_model(model).config.vocab_size, "meta")
    plan.reference_tokens = int(tr.target_param_data_ratio * parameter_counts(reference_model)["scaling"])


def _batch(config: TierlmConfig, plan: Plan) -> None:
    """Steps 2-4 of nanochat's rule: the batch (given or predicted), its accumulation, and the LR and weight-decay
    scales."""
    tr, per_step = config.training, plan.micro_batch_tokens * plan.world_size
    if (
        "gradient_accumulation_steps" in tr.model_fields_set
        and tr.total_batch_size != per_step * tr.gradient_accumulation_steps
    ):
        raise ConfigError(
            "set training.total_batch_size or training.gradient_accumulation_steps, not both "
            "(the accumulation follows from the batch)"
        )
    if tr.total_batch_size == "auto":
        plan.predicted_batch = optimal_batch_tokens(plan.target_tokens, plan.reference_tokens)
        plan.accumulation = max(1, round(plan.predicted_batch / per_step))
        if plan.batch_tokens != plan.predicted_batch:
            plan.notes.append(
                f"the predicted batch ({plan.predicted_batch:,} tokens) is not a multiple of a step's "
                f"micro-batches ({per_step:,}); {plan.batch_tokens:,} is used"
            )
    else:
        if tr.total_batch_size % per_step:
            raise ConfigError(
                f"training.total_batch_size ({tr.total_batch_size:,}) must be a multiple of one micro-batch "
                f"on every rank: {tr.per_device_train_batch_size} rows x "
                f"{plan.micro_batch_tokens // tr.per_device_train_batch_size} tokens x "
                f"{plan.world_size} rank(s) = {per_step:,} tokens"
            )
        plan.accumulation = tr.total_batch_size // per_step
    if tr.scale_hyperparameters:
        plan.lr_scale = (plan.batch_tokens / B_REF) ** 0.5
        if plan.target_tokens:
            plan.weight_decay_scale = plan.lr_scale * plan.reference_tokens / plan.target_tokens


def _epoch_steps(tr, batches_per_epoch: int | None, accumulation: int) -> int:
    """Optimizer steps of training.num_train_epochs passes: their whole global batches, `accumulation` a step, the
    last partial step dropped (nanochat's SFT: examples // examples per step)."""
    assert batches_per_epoch is not None, "num_train_epochs needs the batches of one pass (Run.resolve counts them)"
    steps = int(tr.num_train_epochs * batches_per_epoch) // accumulation
    if "num_train_steps" in tr.model_fields_set and tr.num_train_steps not in (None, steps):  # resolved: they agree
        raise ConfigError(
            f"training.num_train_epochs={tr.num_train_epochs:g} and training.num_train_steps={tr.num_train_steps} "
            "each set the length of the run: set training.num_train_steps=null to train by epochs"
        )
    if steps < 1:
        raise ConfigError(
            f"{tr.num_train_epochs:g} epoch(s) of {batches_per_epoch} batches make no whole step of {accumulation} "
            "micro-batches: add data or epochs, or lower the batch size or gradient_accumulation_steps"
        )
    if tr.warmup_steps >= steps:
        raise ConfigError(
            f"training.warmup_steps ({tr.warmup_steps}) must be < the {steps} steps of {tr.num_train_epochs:g} "
            "epoch(s); lower it"
        )
    return steps


def trained_row_tokens(config: TierlmConfig, model: nn.Module | None) -> int:
    """Tokens a batch row trains on: data.max_seq_length, or an encoder-decoder's decoder row (its targets;
    the encoder's data.max_encoder_length tokens are read, not predicted)."""
    if model is not None and family_of(model).seq2seq:
        return config.data.max_decoder_length
    return config.data.max_seq_length


def resolve(
    config: TierlmConfig,
    stage: Stage,
    model: nn.Module | None,
    world_size: int = 1,
    batches_per_epoch: int | None = None,
) -> tuple[TierlmConfig, Plan]:
    """(the config with every derived value filled in, the plan). `model` may be on the meta device;
    `batches_per_epoch`: the global micro-batches of one pass over the data (with training.num_train_epochs)."""
    tr = config.training
    counts = parameter_counts(model) if model is not None else None
    width = model_width(model) if counts and (counts["embedding"] or counts["unembedding"]) else None
    row = trained_row_tokens(config, model)
    flops = family_of(model).flops_per_token(unwrap_model(model), row) if model is not None else None
    micro = tr.per_device_train_batch_size * row
    plan = Plan(stage.name, counts, flops, micro, world_size, tr.gradient_accumulation_steps, tr.num_train_steps)
    if (tr.target_param_data_ratio is not None or tr.total_batch_size is not None) and not stage.token_rows:
        raise ConfigError(
            f"training.total_batch_size and training.target_param_data_ratio count tokens of fixed rows; {stage.name} "
            "batches are pairs or rollouts: use per_device_train_batch_size and gradient_accumulation_steps"
        )
    updates: dict[str, Any] = {}
    if tr.target_param_data_ratio is not None:
        _horizon(config, stage, model, plan)
    if tr.total_batch_size is not None:
        _batch(config, plan)
        updates.update(total_batch_size=plan.batch_tokens, gradient_accumulation_steps=plan.accumulation)
    if plan.target_tokens is not None and (tr.num_train_steps is None or "num_train_steps" not in tr.model_fields_set):
        plan.num_train_steps = updates["num_train_steps"] = max(1, plan.target_tokens // plan.batch_tokens)
        if tr.warmup_steps >= plan.num_train_steps:
            raise ConfigError(
                f"training.warmup_steps ({tr.warmup_steps}) must be < the derived num_train_steps "
                f"({plan.num_train_steps}); lower it or set training.num_train_steps"
            )
        if (
            tr.total_batch_size == "auto" and plan.num_train_steps < 100
        ):  # docs/benchmarks.md, "A mini scaling law on CPU"
            plan.notes.append(
                f"only {plan.num_train_steps} optimizer steps: the batch law is anchored at d{REFERENCE_DEPTH} and "
                "gives small models large batches; a smaller training.total_batch_size may train better"
            )
    if tr.num_train_epochs is not None:
        per_step = 1 if stage.micro_batch_key == "rl.micro_batch_size" else plan.accumulation  # RL: prompts a step
        plan.num_train_steps = updates["num_train_steps"] = _epoch_steps(tr, batches_per_epoch, per_step)
        plan.epochs, plan.batches_per_epoch = tr.num_train_epochs, batches_per_epoch
    if tr.warmup_ratio is not None:  # now that the steps are known
        steps = updates.get("num_train_steps", tr.num_train_steps)
        updates.update(warmup_steps=min(math.ceil(tr.warmup_ratio * steps), steps - 1), warmup_ratio=None)
    positions = model is not None and positions_only(model)
    lrs = {role: lr * plan.lr_scale for role, lr in role_learning_rates(config, width, positions).items()}
    for role, lr in lrs.items():
        if not lr < 1:
            raise ConfigError(f"the {role} learning rate comes to {lr:.4g} (>= 1); lower training.{role}_lr")
    updates.update(
        {f"{role}_lr": lr for role, lr in lrs.items()},
        learning_rate=tr.learning_rate * plan.lr_scale,
        weight_decay=tr.weight_decay * plan.weight_decay_scale,
        scale_hyperparameters=False,
    )
    resolved = type(tr).model_validate(
        tr.model_copy(update=updates).model_dump()
    )  # validated, and every value now explicit
    for role in ROLES if counts else ():
        if counts[role]:
            optimizer = ("muon" if role == "matrix" else "adamw") if tr.optimizer == "muon" else tr.optimizer
            decay = resolved.weight_decay if role == "matrix" or tr.decay_norms_and_embeddings else 0.0
            plan.groups.append(
                {"role": role, "optimizer": optimizer, "params": counts[role], "lr": lrs[role], "weight_decay": decay}
            )
    return config.model_copy(update={"training": resolved}), plan


def measure_tokens_per_sec(
    config: TierlmConfig, vocab_size: int, pretrained: Path | str | None, steps: int = 3
) -> float:
    """Training tokens/s of one process here: a few AdamW steps of the config's model (new, or the
    pretrained one) on random micro-batches on the config's device; the first step is not timed."""
    import time

    from tierlm.models import load_pretrained_model
    from tierlm.primitives import resolve_device

    device = resolve_device(config.infra.device_type, config.infra.gpu_rank)
    model = (
        new_model(config, vocab_size, device)
        if pretrained is None
        else load_pretrained_model(pretrained, device=device)
    )
    family = family_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows, T = config.training.per_device_train_batch_size, trained_row_tokens(config, model)
    ids = torch.randint(0, vocab_size, (rows, T), device=device)
    batch = {"input_ids": ids, "labels": ids}
    if family.seq2seq:  # the encoder reads its own rows
        batch["decoder_input_ids"] = ids
        batch["input_ids"] = torch.randint(0, vocab_size, (rows, config.data.max_encoder_length), device=device)
    elapsed = 0.0
    for step in range(steps + 1):
        start = time.perf_counter()
        if family.fuses_cross_entropy(model):
            total = family.cross_entropy(model, batch, None)[0]
        else:
            total = nn.functional.cross_entropy(
                family.logits(model, batch).flatten(0, 1), ids.flatten(), reduction="sum"
            )
        total.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step:
            elapsed += time.perf_counter() - start
    return rows * T * steps / elapsed


# -- RL: its steps as the optimizer counts them ----------------------------------------------
@dataclass
class PromptPasses:
    """RL's passes over its task, for training.num_train_epochs: each step draws rl.prompts_per_step prompts of the
    epoch's permutation (`RLTrainer._indices`)."""

    prompts: int
    prompts_per_step: int

    def batches_per_pass(self) -> int:
        return self.prompts // self.prompts_per_step


def optimizer_schedule(config: TierlmConfig, world_size: int):
    """The training section as the optimizer sees it: each RL step makes rl.ppo_epochs x rl.mini_batches optimizer
    steps (the LR schedule counts optimizer steps), each over a share of this rank's rollouts in micro-batches (DDP
    synchronises on the last)."""
    tr, rl = config.training, config.rl
    rows = rl.prompts_per_step // world_size * rl.group_size // rl.mini_batches
    steps = rl.ppo_epochs * rl.mini_batches
    return tr.model_copy(
        update={
            "num_train_steps": tr.num_train_steps * steps,
            "warmup_steps": tr.warmup_steps * steps,
            "gradient_accumulation_steps": -(-rows // rl.micro_batch_size),
        }
    )

"""Before a run: what it will do and need, derived once and printed before training.

- `scaling`: the hyperparameters the config implies (the token horizon from the model's size, the batch,
  learning rates and steps: nanochat's scaling rule and the Power Lines batch law);
- `memory`: the one home of memory estimation (the traced step per rank, its quick lower bounds in
  `memory.bounds`, model-parallel layouts in `memory.layouts`);
- `batch`: training.per_device_train_batch_size=auto;

`plan_run` is all of it for one run, without running it (`tierlm plan`).
"""

from __future__ import annotations

from tierlm.builders.model import describe_model
from tierlm.builders.stage import Stage, resolve_config
from tierlm.builders.tokenizer import existing_tokenizer, pretrained_location, train_tokenizer
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError
from tierlm.metrics.memory import format_bytes
from tierlm.plan.batch import auto_batch_size, with_batch_size
from tierlm.plan.memory import estimate_run_memory, memory_budget
from tierlm.plan.scaling import (  # noqa: F401  (the scaling names, importable from the package)
    B_REF,
    BATCH_EXPONENT,
    REFERENCE_DEPTH,
    Plan,
    measure_tokens_per_sec,
    optimal_batch_tokens,
    parameter_counts,
    resolve,
    trained_row_tokens,
)
from tierlm.primitives import resolve_device
from tierlm.primitives.hub import HubUnreachable


def plan_run(config: TierlmConfig, stage: Stage, world_size: int = 1, vocab_size: int | None = None):
    """(resolved config, plan, model on the meta device) of a run, without running it (`tierlm plan`):
    the tokenizer is the one the run would use (trained here when the run would train one), unless
    `vocab_size` sizes a model from scratch directly."""
    config = resolve_config(config, stage, launched=world_size > 1)
    pretrained = pretrained_location(config)
    unknown = []  # what cannot be known here (a Hub tokenizer on a machine without the Hub), said in the plan
    if vocab_size is None or pretrained is not None:
        try:
            tokenizer = existing_tokenizer(config, pretrained) or train_tokenizer(config, stage.example_kind)
            vocab_size = tokenizer.vocab_size
        except HubUnreachable:
            if pretrained is not None:  # the model itself comes from the Hub: nothing to size
                raise
            vocab_size = config.tokenizer.vocab_size
            unknown.append(
                f"the tokenizer {config.model.tokenizer_name_or_path!r} is not in the local cache and the Hub cannot "
                f"be reached: the model is sized for a vocabulary of {vocab_size:,} (tokenizer.vocab_size; "
                "--vocab-size N for the tokenizer's own)"
            )
    model = describe_model(config, vocab_size, pretrained)
    if model is None:
        raise ConfigError(
            f"model.model_name_or_path={pretrained} is a hub id: tierlm plan sizes local models; download it first"
        )
    device = resolve_device(config.infra.device_type, config.infra.gpu_rank)
    budget = memory_budget(device, config.infra.max_memory_gb, world_size if device.type == "cpu" else 1)
    auto_rows = None
    if config.training.per_device_train_batch_size == "auto":
        rows, why = auto_batch_size(
            config, stage, budget, world_size, vocab_size=vocab_size, pretrained=pretrained, device_type=device.type
        )
        config = with_batch_size(config, rows)
        auto_rows = f"training.per_device_train_batch_size=auto: {rows} rows ({why})"
    resolved, plan = resolve(config, stage, model, world_size)
    plan.memory = estimate_run_memory(resolved, world_size, stage, vocab_size, pretrained, device_type=device.type)
    plan.notes += unknown
    if auto_rows:
        plan.notes.append(auto_rows)
    if budget is not None and plan.memory.total > budget:
        plan.notes.append(
            f"this run would be refused here: it needs about {format_bytes(plan.memory.total)} per rank, "
            f"{format_bytes(budget)} is available"
        )
    return resolved, plan, model

"""Tier 1: granular primitives. Pure, explicit functions; no config objects."""

from tierlm.primitives.dtype_device import compute_device_map_single_gpu, parse_dtype, resolve_device
from tierlm.primitives.losses import (
    IGNORE_INDEX,
    count_loss_tokens,
    create_cross_entropy_loss,
    cross_entropy_sum,
    get_labels,
    label_cross_entropy_only,
    linear_cross_entropy,
    per_token_cross_entropy,
)
from tierlm.primitives.models import create_hf_model_from_config, load_hf_model
from tierlm.primitives.optim import create_adamw_optimizer, split_decay_params
from tierlm.primitives.schedules import (
    create_warmup_cosine_scheduler,
    create_warmup_scheduler,
    lr_multiplier,
)

__all__ = [
    "IGNORE_INDEX",
    "compute_device_map_single_gpu",
    "count_loss_tokens",
    "create_adamw_optimizer",
    "create_cross_entropy_loss",
    "create_hf_model_from_config",
    "create_warmup_cosine_scheduler",
    "create_warmup_scheduler",
    "cross_entropy_sum",
    "get_labels",
    "label_cross_entropy_only",
    "linear_cross_entropy",
    "load_hf_model",
    "lr_multiplier",
    "parse_dtype",
    "per_token_cross_entropy",
    "resolve_device",
    "split_decay_params",
]

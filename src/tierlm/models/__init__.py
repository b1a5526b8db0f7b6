"""Models: the native families (GPT, GPT-2) and any transformers causal LM, behind one adapter each
(`tierlm.models.registry`). The functions here ask a model's family; nothing checks model types.

Nothing here knows about distribution; backends apply sharding, compile and checkpointing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from tierlm.errors import ModelLoadError
from tierlm.models.gpt import family as _gpt  # noqa: F401  (each family module registers its family)
from tierlm.models.gpt.model import GPT, GPTConfig, build_gpt
from tierlm.models.gpt2 import family as _gpt2  # noqa: F401
from tierlm.models.io import (
    build_model_from_folder_config,
    is_native_folder,
    load_model_state,
    read_model_state,
    save_model_config,
    save_model_folder,
)
from tierlm.models.lora import adapter_apart, load_adapter_folder
from tierlm.models.qwen3_encdec import family as _qwen3_encdec  # noqa: F401
from tierlm.models.registry import (
    FAMILIES,
    ModelFamily,
    family_for_folder,
    family_named,
    family_of,
    register_family,
)
from tierlm.models.reward import is_reward_model_folder
from tierlm.models.transformers.family import PLAIN_HEAD_MODEL_TYPES  # (it registers the fallback family)


def load_pretrained_model(
    name_or_path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
) -> nn.Module:
    """A native model folder (written by tierlm) or any transformers causal LM (hub id or folder); a folder
    whose LoRA adapter is kept apart from its weights (a checkpoint's) loads with the adapter merged in. A reward
    model's folder is refused: it scores text (`tierlm.models.reward.RewardScorer`)."""
    if is_reward_model_folder(name_or_path):
        raise ModelLoadError(
            f"{name_or_path} is a reward model (a sequence classifier): it scores text and cannot generate or be "
            "trained on as a language model; pass it as rl.reward_model"
        )
    model = family_for_folder(name_or_path).load(
        name_or_path, device=device, dtype=dtype, trust_remote_code=trust_remote_code
    )
    return load_adapter_folder(model, name_or_path) if adapter_apart(name_or_path) else model


def load_native_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Rebuild a native model from a folder written by `save_model_folder`."""
    assert is_native_folder(path), f"{path} is not a native model folder (no tierlm_model.json)"
    return load_pretrained_model(path, device, dtype)


def forward_logits(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Logits (B, T, V) of any model for `batch["input_ids"]`; optional `position_ids` restart positions
    per packed document."""
    return family_of(model).logits(model, batch)


def fuses_cross_entropy(model: nn.Module) -> bool:
    """True when the model's loss can be computed with the LM head fused in (`forward_cross_entropy`)."""
    return family_of(model).fuses_cross_entropy(model)


def forward_cross_entropy(
    model: nn.Module, batch: Mapping[str, torch.Tensor], weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of `weights` x cross-entropy, per-token cross-entropy (B, T)) of the batch's labels,
    without the (B, T, V) logits; for models where `fuses_cross_entropy` holds.

    >>> from tierlm.models import GPTConfig, build_gpt
    >>> gpt = build_gpt(GPTConfig(depth=1, aspect_ratio=16, head_dim=16, vocab_size=10, max_seq_len=8))
    >>> batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[2, 3, -100]])}
    >>> total, per_token = forward_cross_entropy(gpt, batch)
    >>> reference = torch.nn.functional.cross_entropy(forward_logits(gpt, batch)[0], batch["labels"][0],
    ...     reduction="sum")
    >>> torch.allclose(total, reference), per_token.shape
    (True, torch.Size([1, 3]))
    """
    family = family_of(model)
    assert family.fuses_cross_entropy(model), (
        f"{type(unwrap_model(model)).__name__} has no LM head that can be fused into the loss"
    )
    return family.cross_entropy(model, batch, weights)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper (FSDP2 and compile keep the class)."""
    return getattr(model, "module", model)


def model_max_seq_len(model: nn.Module) -> int | None:
    """The longest sequence the model was built for, when it says."""
    return family_of(model).max_seq_len(unwrap_model(model))


__all__ = [
    "FAMILIES",
    "GPT",
    "GPTConfig",
    "ModelFamily",
    "PLAIN_HEAD_MODEL_TYPES",
    "build_gpt",
    "build_model_from_folder_config",
    "family_for_folder",
    "family_named",
    "family_of",
    "forward_cross_entropy",
    "forward_logits",
    "fuses_cross_entropy",
    "is_native_folder",
    "load_model_state",
    "load_native_model",
    "load_pretrained_model",
    "model_max_seq_len",
    "read_model_state",
    "register_family",
    "save_model_config",
    "save_model_folder",
    "unwrap_model",
]

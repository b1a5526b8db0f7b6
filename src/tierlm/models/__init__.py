"""Models: the native GPT and adapters that make any transformers causal LM look the same.

Nothing here knows about distribution; backends apply sharding, compile and checkpointing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from tierlm.models.gpt import GPT, GPTConfig, build_gpt
from tierlm.models.io import (
    build_model_from_folder_config,
    is_native_folder,
    load_model_state,
    load_native_model,
    read_model_state,
    save_model_config,
    save_model_folder,
)
from tierlm.primitives.losses import get_labels, linear_cross_entropy
from tierlm.primitives.models import load_hf_model


def load_pretrained_model(
    name_or_path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
) -> nn.Module:
    """A native GPT folder (written by tierlm) or any transformers causal LM (hub id or folder)."""
    if is_native_folder(name_or_path):
        return load_native_model(name_or_path, device=device, dtype=dtype)
    model = load_hf_model(str(name_or_path), dtype, None, trust_remote_code=trust_remote_code)
    return model.to(device)


def forward_logits(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Logits (B, T, V) of a native or transformers model for `batch["input_ids"]`.

    Optional `position_ids` restart positions per packed document.
    """
    input_ids, position_ids = batch["input_ids"], batch.get("position_ids")
    if isinstance(unwrap_model(model), GPT):
        return model(input_ids, position_ids=position_ids)
    out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    return out.logits


# transformers model types whose logits are exactly `lm_head(last hidden state)`: no soft-capping,
# scaling or bias after the head, so the head may be fused into the loss.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "olmo2", "phi3", "smollm3"})


def fuses_cross_entropy(model: nn.Module) -> bool:
    """True when the model's loss can be computed with the LM head fused in (`forward_cross_entropy`):
    the native GPT always; a transformers model of a plain-head type run as it is (a DDP or FSDP
    wrapper must see the whole forward, so wrapped transformers models compute logits)."""
    if isinstance(unwrap_model(model), GPT):
        return True
    from torch.distributed.fsdp import FSDPModule

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return (
        unwrap_model(model) is model and not isinstance(model, FSDPModule)
        and getattr(getattr(model, "config", None), "model_type", None) in PLAIN_HEAD_MODEL_TYPES
        and isinstance(head, nn.Linear) and head.bias is None
    )


def forward_cross_entropy(
    model: nn.Module, batch: Mapping[str, torch.Tensor], weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of `weights` x cross-entropy, per-token cross-entropy (B, T)) of the batch's labels,
    without the (B, T, V) logits; for models where `fuses_cross_entropy` holds.

    >>> from tierlm.models import GPTConfig, build_gpt
    >>> gpt = build_gpt(GPTConfig(depth=1, aspect_ratio=16, head_dim=16, vocab_size=10, max_seq_len=8))
    >>> batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[2, 3, -100]])}
    >>> total, per_token = forward_cross_entropy(gpt, batch)
    >>> reference = torch.nn.functional.cross_entropy(forward_logits(gpt, batch)[0], batch["labels"][0], reduction="sum")
    >>> torch.allclose(total, reference), per_token.shape
    (True, torch.Size([1, 3]))
    """
    assert fuses_cross_entropy(model), f"{type(unwrap_model(model)).__name__} has no LM head that can be fused into the loss"
    labels = get_labels(batch)
    input_ids, position_ids = batch["input_ids"], batch.get("position_ids")
    if isinstance(unwrap_model(model), GPT):
        return model(input_ids, position_ids=position_ids, labels=labels, loss_weights=weights)
    hidden = model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    flat_weights = weights.flatten() if weights is not None else None
    total, losses = linear_cross_entropy(hidden.flatten(0, 1), model.get_output_embeddings().weight, labels.flatten(), flat_weights)
    return total, losses.view(labels.shape)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper (FSDP2 and compile keep the class)."""
    return getattr(model, "module", model)


def model_max_seq_len(model: nn.Module) -> int | None:
    """The longest sequence the model was built for, when it says."""
    model = unwrap_model(model)
    if isinstance(model, GPT):
        return model.config.max_seq_len
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


__all__ = [
    "GPT",
    "GPTConfig",
    "build_gpt",
    "build_model_from_folder_config",
    "forward_cross_entropy",
    "forward_logits",
    "fuses_cross_entropy",
    "is_native_folder",
    "load_model_state",
    "load_native_model",
    "load_pretrained_model",
    "model_max_seq_len",
    "read_model_state",
    "save_model_config",
    "save_model_folder",
    "unwrap_model",
]

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
    "forward_logits",
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

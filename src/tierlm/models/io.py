"""Model folders: one layout for every family.

A model folder is what `transformers.AutoModelForCausalLM.from_pretrained` loads (`config.json`
and `model.safetensors`) when the family has a transformers twin; a native family's folder also
holds `tierlm_model.json`, from which tierlm rebuilds its own module (`tierlm.models.native`).
Each function asks the model's (or folder's) family. Loading never unpickles anything.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tierlm.models.registry import NATIVE_CONFIG_FILE, WEIGHTS_FILE, family_for_folder, family_of

__all__ = ["NATIVE_CONFIG_FILE", "WEIGHTS_FILE", "build_model_from_folder_config", "is_native_folder", "load_model_state",
           "read_model_state", "save_model_config", "save_model_folder"]


def is_native_folder(path: str | Path) -> bool:
    return (Path(path) / NATIVE_CONFIG_FILE).is_file()


def save_model_folder(model: nn.Module, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `model` as a model folder (native families under their transformers twin's names).

    `state_dict` (e.g. a CPU copy taken earlier) is written instead of the model's live weights.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    family_of(model).save(model, path, state_dict)
    return path


def save_model_config(model: nn.Module, path: str | Path) -> Path:
    """Write only the description of `model` (config.json, and tierlm_model.json for a native family)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    family_of(model).save_config(model, path)
    return path


def build_model_from_folder_config(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An untrained model of the architecture a model folder describes (weights are loaded separately)."""
    return family_for_folder(path).build_from_folder(Path(path), dtype)


def read_model_state(model: nn.Module, path: str | Path) -> dict[str, torch.Tensor]:
    """A model folder's weights (CPU), named as `model.state_dict()` names them."""
    return family_of(model).read_state(model, Path(path))


def load_model_state(model: nn.Module, path: str | Path) -> None:
    """Load weights from a model folder into an existing (unsharded) model of the same architecture, in place."""
    model.load_state_dict(read_model_state(model, path))

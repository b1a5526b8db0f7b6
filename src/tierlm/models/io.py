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

from tierlm.errors import ModelLoadError
from tierlm.models.lora import (
    adapter_apart,
    has_lora,
    inject_saved_adapter,
    lora_scalings,
    merged_state,
    model_state,
    read_adapter,
    save_adapter,
    save_adapter_config,
    saved_adapter,
    split_state,
)
from tierlm.models.registry import NATIVE_CONFIG_FILE, WEIGHTS_FILE, family_for_folder, family_of
from tierlm.models.reward import classifier_state, is_reward_model, mark_classifier

__all__ = [
    "NATIVE_CONFIG_FILE",
    "WEIGHTS_FILE",
    "build_model_from_folder_config",
    "is_native_folder",
    "load_model_state",
    "read_model_state",
    "save_model_config",
    "save_model_folder",
]


def is_native_folder(path: str | Path) -> bool:
    return (Path(path) / NATIVE_CONFIG_FILE).is_file()


def save_model_folder(
    model: nn.Module, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None, merge_lora: bool = False
) -> Path:
    """Write `model` as a model folder (native families under their transformers twin's names).

    `state_dict` (e.g. a CPU copy taken earlier) is written instead of the model's live weights. A LoRA
    model's adapters go to adapter/ (`tierlm.models.lora`), and its weights are the frozen base, or
    with `merge_lora` the base with the adapters' update added (a plain model anything can load). A reward model
    (`tierlm.models.reward`) is written as its transformers sequence classifier.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if has_lora(model):
        base, adapter = split_state(state_dict if state_dict is not None else model.state_dict())
        if merge_lora:
            base = merged_state(base, adapter, lora_scalings(model))
        family_of(model).save(model, path, base)
        save_adapter(model, path, adapter, merged=merge_lora)
        return path
    if is_reward_model(model):  # written under its sequence classifier's names (score.weight), its config after
        state_dict = classifier_state(state_dict if state_dict is not None else model.state_dict())
    family_of(model).save(model, path, state_dict)
    if is_reward_model(model):
        mark_classifier(model, path)
    return path


def save_model_config(model: nn.Module, path: str | Path) -> Path:
    """Write only the description of `model` (config.json, and tierlm_model.json for a native family)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    family_of(model).save_config(model, path)
    if is_reward_model(model):
        mark_classifier(model, path)
    if has_lora(model):  # the sharded weights hold base and adapters apart
        save_adapter_config(model, path)
    return path


def build_model_from_folder_config(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An untrained model of the architecture a model folder describes (weights are loaded separately);
    with LoRA layers when the folder's adapter is kept apart from its weights."""
    model = family_for_folder(path).build_from_folder(Path(path), dtype)
    return inject_saved_adapter(model, path) if adapter_apart(path) else model


def read_model_state(model: nn.Module, path: str | Path) -> dict[str, torch.Tensor]:
    """A model folder's weights (CPU), named as `model.state_dict()` names them (a LoRA model's base and adapters)."""
    if has_lora(model):
        adapter = saved_adapter(path)
        if adapter is not None and adapter["merged"]:
            raise ModelLoadError(
                f"{path} holds weights with the adapters merged in: it cannot be resumed as base + adapters"
            )
        return model_state(
            model, family_of(model).read_state(model, Path(path)), read_adapter(model, path) if adapter else {}
        )
    state = family_of(model).read_state(model, Path(path))
    if is_reward_model(model) and "score.weight" in state:  # written as its sequence classifier (`mark_classifier`)
        state["lm_head.weight"] = state.pop("score.weight")
    return state


def load_model_state(model: nn.Module, path: str | Path) -> None:
    """Load weights from a model folder into an existing (unsharded) model of the same architecture, in place."""
    model.load_state_dict(read_model_state(model, path))

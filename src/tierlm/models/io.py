"""Model folders: one layout for native and transformers models alike.

A model folder is what `transformers.AutoModelForCausalLM.from_pretrained` loads: `config.json`
and `model.safetensors`. A native GPT's folder also holds `tierlm_model.json` (its `GPTConfig`)
so tierlm rebuilds the native module from the same weights. Loading never unpickles anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from tierlm.errors import ModelLoadError, first_line
from tierlm.models.gpt import GPT, GPTConfig, build_gpt
from tierlm.models.hf_export import from_hf_name, to_hf_config, to_hf_name

NATIVE_CONFIG_FILE = "tierlm_model.json"
WEIGHTS_FILE = "model.safetensors"


def is_native_folder(path: str | Path) -> bool:
    return (Path(path) / NATIVE_CONFIG_FILE).is_file()


def save_model_folder(model: nn.Module, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `model` as a transformers-loadable folder (native GPTs are written as Qwen3).

    `state_dict` (e.g. a CPU copy taken earlier) is written instead of the model's live weights.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state_dict = state_dict if state_dict is not None else model.state_dict()
    if isinstance(model, GPT):
        state = {to_hf_name(k): v.detach().contiguous().cpu() for k, v in state_dict.items()}
        if model.config.tie_embeddings:
            state.pop("lm_head.weight")  # transformers re-ties it from embed_tokens
        save_file(state, path / WEIGHTS_FILE, metadata={"format": "pt"})
        save_model_config(model, path)
    else:
        model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
    return path


def save_model_config(model: nn.Module, path: str | Path) -> Path:
    """Write only the description of `model` (config.json, and tierlm_model.json for a native GPT)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(model, GPT):
        to_hf_config(model.config).save_pretrained(path)
        (path / NATIVE_CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    else:
        model.config.save_pretrained(path)
    return path


def build_model_from_folder_config(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An untrained model of the architecture a model folder describes (weights are loaded separately)."""
    path = Path(path)
    if is_native_folder(path):
        return build_gpt(GPTConfig(**json.loads((path / NATIVE_CONFIG_FILE).read_text())), dtype=dtype)
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)


def load_native_model(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> GPT:
    """Rebuild a native GPT from a model folder written by `save_model_folder`."""
    path = Path(path)
    try:
        config = GPTConfig(**json.loads((path / NATIVE_CONFIG_FILE).read_text()))
        hf_state = load_file(path / WEIGHTS_FILE, device=str(device))
    except (OSError, TypeError, ValueError, SafetensorError) as e:
        raise ModelLoadError(f"cannot read native model folder {path}: {e}") from e
    model = build_gpt(config, device=device, dtype=dtype)
    state = {from_hf_name(k): v for k, v in hf_state.items()}
    if config.tie_embeddings and "embed.weight" in state:
        state.setdefault("lm_head.weight", state["embed.weight"])
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes that differ from the config
        raise ModelLoadError(f"{path / WEIGHTS_FILE} does not match its config ({first_line(e)}: {str(e).splitlines()[1].strip()})") from None
    if missing or unexpected:
        raise ModelLoadError(f"{path / WEIGHTS_FILE} does not match its config: missing {missing}, unexpected {unexpected}")
    return model


def read_model_state(model: nn.Module, path: str | Path) -> dict[str, torch.Tensor]:
    """A model folder's weights (CPU), named as `model.state_dict()` names them."""
    state = load_file(Path(path) / WEIGHTS_FILE, device="cpu")
    if isinstance(model, GPT):
        state = {from_hf_name(k): v for k, v in state.items()}
        if model.config.tie_embeddings:
            state.setdefault("lm_head.weight", state["embed.weight"])
    else:
        for name, tied in _tied_names(model).items():
            if name not in state and tied in state:
                state[name] = state[tied]
    return state


def _tied_names(model: nn.Module) -> dict[str, str]:
    """{name: name it shares storage with} for parameters `state_dict()` lists twice."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied_to = first.setdefault(id(param), name)
        if tied_to != name:
            tied[name] = tied_to
    return tied


def load_model_state(model: nn.Module, path: str | Path) -> None:
    """Load weights from a model folder into an existing (unsharded) model of the same architecture, in place."""
    model.load_state_dict(read_model_state(model, path))

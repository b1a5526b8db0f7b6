"""Model folders: one layout for native and transformers models alike.

A model folder is what `transformers.AutoModelForCausalLM.from_pretrained` loads: `config.json`
and `model.safetensors`. A native GPT's folder also holds `tierlm_model.json` (its `GPTConfig`)
so tierlm rebuilds the native module from the same weights. Loading never unpickles anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tierlm.errors import ModelLoadError
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
        to_hf_config(model.config).save_pretrained(path)
        (path / NATIVE_CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    else:
        model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
    return path


def load_native_model(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> GPT:
    """Rebuild a native GPT from a model folder written by `save_model_folder`."""
    path = Path(path)
    try:
        config = GPTConfig(**json.loads((path / NATIVE_CONFIG_FILE).read_text()))
        hf_state = load_file(path / WEIGHTS_FILE, device=str(device))
    except (OSError, TypeError, ValueError) as e:
        raise ModelLoadError(f"cannot read native model folder {path}: {e}") from e
    model = build_gpt(config, device=device, dtype=dtype)
    state = {from_hf_name(k): v for k, v in hf_state.items()}
    if config.tie_embeddings:
        state.setdefault("lm_head.weight", state["embed.weight"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelLoadError(f"{path / WEIGHTS_FILE} does not match its config: missing {missing}, unexpected {unexpected}")
    return model


def load_model_state(model: nn.Module, path: str | Path) -> None:
    """Load weights from a model folder into an existing model of the same architecture, in place."""
    path = Path(path)
    if isinstance(model, GPT):
        state = {from_hf_name(k): v for k, v in load_file(path / WEIGHTS_FILE, device="cpu").items()}
        if model.config.tie_embeddings:
            state.setdefault("lm_head.weight", state["embed.weight"])
        model.load_state_dict(state)
    else:
        from safetensors.torch import load_model

        load_model(model, path / WEIGHTS_FILE, strict=False)

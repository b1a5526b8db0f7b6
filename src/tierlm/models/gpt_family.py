"""The native GPT as a model family (`model.architecture: gpt`): built from `model.depth` and
`model.aspect_ratio`, run with the fused head + loss and its own KV cache, saved under
transformers Qwen3 names (it is Qwen3 without biases; its S layers are Qwen3's sliding-window layers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tierlm.errors import ConfigError
from tierlm.models.gpt import GPT, GPTConfig
from tierlm.models.hf_export import from_hf_name, to_hf_config, to_hf_name
from tierlm.models.native import NativeCausalLM
from tierlm.models.registry import register_family

SHAPE_FIELDS = ("depth", "aspect_ratio", "head_dim", "n_kv_head", "mlp_ratio", "rope_theta", "tie_embeddings", "window_pattern",
                "short_window")


class GPTFamily(NativeCausalLM):
    name = "gpt"
    model_class = GPT
    config_class = GPTConfig

    def config_fields(self, model_config) -> dict[str, Any]:
        shape = self._shape(model_config)
        if shape["window_pattern"].upper() == "L":  # full attention everywhere: as runs recorded before windows existed
            shape.pop("window_pattern")
            shape.pop("short_window", None)
        return {f"model.{k}": v for k, v in shape.items()}

    @staticmethod
    def _shape(model_config) -> dict[str, Any]:
        shape = {k: getattr(model_config, k) for k in SHAPE_FIELDS}
        shape["mlp_ratio"] = shape["mlp_ratio"] if shape["mlp_ratio"] is not None else 8 / 3  # SwiGLU's usual width
        if shape["short_window"] is None:
            del shape["short_window"]  # the model's default; new_model sets it from data.max_seq_length
        return shape

    def gpt_config(self, model_config, vocab_size: int, max_seq_len: int) -> GPTConfig:
        config = GPTConfig(vocab_size=vocab_size, max_seq_len=max_seq_len, **self._shape(model_config))
        problems = config.validate()
        if problems:
            raise ConfigError(f"model.{problems[0]}")
        return config

    def build(self, model_config, vocab_size, max_seq_len, device="cpu", dtype=torch.float32):
        return self.build_from_config(self.gpt_config(model_config, vocab_size, max_seq_len), device, dtype)

    def attention_shape(self, model):
        return model.config.depth, model.config.n_head * model.config.head_dim

    def blocks(self, model) -> nn.ModuleList:
        return model.blocks

    def jax_forward(self, model):
        from tierlm.jax.gpt import forward

        config = model.config
        return lambda params, batch: forward(params, config, batch["input_ids"], batch.get("position_ids"))

    # -- the transformers twin: Qwen3 ------------------------------------------------------
    def hf_config(self, config):
        return to_hf_config(config)

    def to_hf_state(self, model, state):
        out = {to_hf_name(k): v for k, v in state.items()}
        if model.config.tie_embeddings:
            out.pop("lm_head.weight", None)  # transformers re-ties it from embed_tokens
        return out

    def from_hf_state(self, model, state):
        out = {from_hf_name(k): v for k, v in state.items()}
        if model.config.tie_embeddings and "embed.weight" in out:
            out.setdefault("lm_head.weight", out["embed.weight"])
        return out


GPT_FAMILY = register_family(GPTFamily())

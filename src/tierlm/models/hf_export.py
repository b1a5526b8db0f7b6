"""Native GPT <-> transformers Qwen3: the config and the parameter names, both ways.

The native GPT is Qwen3 without biases or sliding windows, so the mapping is a rename.
"""

from __future__ import annotations

import re

from tierlm.models.gpt import GPTConfig

# native name pattern -> transformers name (Qwen3ForCausalLM)
_RENAMES = [
    (r"^embed\.", "model.embed_tokens."),
    (r"^norm\.", "model.norm."),
    (r"^blocks\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^blocks\.(\d+)\.mlp_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^blocks\.(\d+)\.attn\.", r"model.layers.\1.self_attn."),
    (r"^blocks\.(\d+)\.mlp\.", r"model.layers.\1.mlp."),
]
_INVERSE = [
    (r"^model\.embed_tokens\.", "embed."),
    (r"^model\.norm\.", "norm."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"blocks.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"blocks.\1.mlp_norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.", r"blocks.\1.attn."),
    (r"^model\.layers\.(\d+)\.mlp\.", r"blocks.\1.mlp."),
]


def _rename(name: str, rules: list[tuple[str, str]]) -> str:
    for pattern, replacement in rules:
        new, count = re.subn(pattern, replacement, name)
        if count:
            return new
    return name  # lm_head.weight is the same on both sides


def to_hf_name(name: str) -> str:
    """>>> to_hf_name("blocks.3.attn.q_norm.weight")
    'model.layers.3.self_attn.q_norm.weight'
    """
    return _rename(name, _RENAMES)


def from_hf_name(name: str) -> str:
    """>>> from_hf_name("model.layers.0.post_attention_layernorm.weight")
    'blocks.0.mlp_norm.weight'
    """
    return _rename(name, _INVERSE)


def to_hf_config(config: GPTConfig):
    """The `transformers.Qwen3Config` with the same architecture as `config`."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.depth,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        use_sliding_window=False,
        hidden_act="silu",
        architectures=["Qwen3ForCausalLM"],
    )

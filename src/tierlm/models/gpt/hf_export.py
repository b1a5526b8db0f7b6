"""Native GPT <-> transformers Qwen3: the config and the parameter names, both ways.

The native GPT is Qwen3 without biases, so the mapping is a rename (its sliding-window layers are
Qwen3's `sliding_attention` layers); with `moe` it is Qwen3-MoE (every layer sparse).
"""

from __future__ import annotations

import re

import torch

from tierlm.models.gpt.model import GPTConfig

# (native prefix, transformers prefix); {i} is the block index. lm_head.weight is the same on both sides.
_PREFIXES = [
    ("embed.", "model.embed_tokens."),
    ("norm.", "model.norm."),
    ("blocks.{i}.attn_norm.", "model.layers.{i}.input_layernorm."),
    ("blocks.{i}.mlp_norm.", "model.layers.{i}.post_attention_layernorm."),
    ("blocks.{i}.attn.", "model.layers.{i}.self_attn."),
    # A mixture of experts in transformers' Qwen3-MoE names (the router is its `gate`); before the dense rule.
    ("blocks.{i}.mlp.router.", "model.layers.{i}.mlp.gate."),
    ("blocks.{i}.mlp.experts.", "model.layers.{i}.mlp.experts."),
    ("blocks.{i}.mlp.", "model.layers.{i}.mlp."),
]


def _rule(source: str, target: str) -> tuple[re.Pattern, str]:
    """A prefix ending in "." renames everything under it; any other source is one whole name."""
    pattern = "^" + re.escape(source).replace(re.escape("{i}"), r"(\d+)") + ("" if source.endswith(".") else "$")
    return re.compile(pattern), target.replace("{i}", r"\1")


_TO_HF = [_rule(native, hf) for native, hf in _PREFIXES]
_FROM_HF = [_rule(hf, native) for native, hf in _PREFIXES]


def _rename(name: str, rules: list[tuple[re.Pattern, str]]) -> str:
    for pattern, replacement in rules:
        new, count = pattern.subn(replacement, name)
        if count:
            return new
    return name


def to_hf_name(name: str) -> str:
    """>>> to_hf_name("blocks.3.attn.q_norm.weight"), to_hf_name("blocks.0.mlp.down_proj.weight")
    ('model.layers.3.self_attn.q_norm.weight', 'model.layers.0.mlp.down_proj.weight')
    >>> to_hf_name("blocks.1.mlp.experts.down_proj"), to_hf_name("blocks.1.mlp.router.weight")
    ('model.layers.1.mlp.experts.down_proj', 'model.layers.1.mlp.gate.weight')
    """
    return _rename(name, _TO_HF)


def from_hf_name(name: str) -> str:
    """>>> from_hf_name("model.layers.0.post_attention_layernorm.weight")
    'blocks.0.mlp_norm.weight'
    """
    return _rename(name, _FROM_HF)


_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def fuse_experts(state: dict) -> dict:
    """A Qwen3-MoE state in the Hub's per-expert layout (`experts.<e>.gate_proj.weight`, ... as released checkpoints
    and transformers' `save_pretrained` write it) in the fused one transformers computes with and tierlm holds
    (`experts.gate_up_proj` (E, 2W, D): each expert's gate rows then its up rows; `experts.down_proj` (E, D, W)).

    >>> import torch
    >>> state = {f"model.layers.0.mlp.experts.{e}.{p}_proj.weight": torch.full((2, 3), e) for e in range(2)
    ...          for p in ("gate", "up")} | {f"model.layers.0.mlp.experts.{e}.down_proj.weight": torch.zeros(3, 2)
    ...          for e in range(2)}
    >>> {k: tuple(v.shape) for k, v in fuse_experts(state).items()}
    {'model.layers.0.mlp.experts.gate_up_proj': (2, 4, 3), 'model.layers.0.mlp.experts.down_proj': (2, 3, 2)}
    """
    out, experts = {}, {}
    for name, value in state.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = value
        else:
            prefix, expert, kind = match.groups()
            experts.setdefault(prefix, {}).setdefault(int(expert), {})[kind] = value
    for prefix, by_expert in experts.items():
        order = [by_expert[e] for e in sorted(by_expert)]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([w["gate"], w["up"]]) for w in order])
        out[f"{prefix}.down_proj"] = torch.stack([w["down"] for w in order])
    return out


def _qwen3_fields(config: GPTConfig) -> dict:
    """What Qwen3 and Qwen3-MoE configs share: the attention, the widths, the norms, the embeddings."""
    return dict(
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
        hidden_act="silu",
    )


def to_hf_config(config: GPTConfig):
    """The `transformers.Qwen3Config` with the same architecture as `config` (`Qwen3MoeConfig` with `moe`)."""
    from transformers import Qwen3Config

    if config.moe is not None:
        return to_hf_moe_config(config)
    return Qwen3Config(
        **_qwen3_fields(config),
        use_sliding_window="S" in config.window_pattern.upper(),
        sliding_window=config.short_window,
        layer_types=["full_attention" if w is None else "sliding_attention" for w in config.layer_windows()],
        architectures=["Qwen3ForCausalLM"],
    )


def to_hf_moe_config(config: GPTConfig):
    """The `transformers.Qwen3MoeConfig` of a native GPT with `moe` (every layer sparse, softmax routing, full
    attention; the balancing bias, DeepSeek-V3's, has no Qwen3-MoE twin: it travels in the folder for tierlm alone)."""
    from transformers import Qwen3MoeConfig

    moe = config.moe
    return Qwen3MoeConfig(
        **_qwen3_fields(config),
        moe_intermediate_size=moe.expert_width,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.experts_per_token,
        norm_topk_prob=moe.normalize_top_k,
        router_aux_loss_coef=moe.aux_loss_coef,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        architectures=["Qwen3MoeForCausalLM"],
    )

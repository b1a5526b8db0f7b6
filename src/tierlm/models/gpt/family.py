"""The native GPT as a model family (`model.architecture: gpt`): built from `model.depth` and
`model.aspect_ratio`, run with the fused head + loss and its own KV cache, saved under
transformers Qwen3 names (it is Qwen3 without biases; its S layers are Qwen3's sliding-window layers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tierlm.errors import ConfigError, ModelLoadError
from tierlm.models.gpt.documents import packed_mask
from tierlm.models.gpt.hf_export import from_hf_name, fuse_experts, to_hf_config, to_hf_name
from tierlm.models.gpt.model import GPT, GPTConfig
from tierlm.models.moe import MoEConfig
from tierlm.models.native import NativeCausalLM
from tierlm.models.registry import WEIGHTS_FILE, register_family, unwrap_ddp
from tierlm.primitives.model_parallel import megatron_plan, received_positions

SHAPE_FIELDS = (
    "depth",
    "aspect_ratio",
    "head_dim",
    "n_kv_head",
    "mlp_ratio",
    "rope_theta",
    "tie_embeddings",
    "window_pattern",
    "short_window",
    "moe",
)


class GPTFamily(NativeCausalLM):
    name = "gpt"
    model_fields = SHAPE_FIELDS
    model_class = GPT
    config_class = GPTConfig

    def config_fields(self, model_config) -> dict[str, Any]:
        shape = self._shape(model_config)
        if shape["window_pattern"].upper() == "L":  # full attention everywhere: as runs recorded before windows existed
            shape.pop("window_pattern")
            shape.pop("short_window", None)
        moe = shape.pop("moe")  # dense: as runs recorded before experts existed
        if moe is not None:
            shape.update({f"moe.{k}": v for k, v in moe.__dict__.items() if k in type(model_config.moe).model_fields})
        return {f"model.{k}": v for k, v in shape.items()}

    @staticmethod
    def _shape(model_config) -> dict[str, Any]:
        shape = {k: getattr(model_config, k) for k in SHAPE_FIELDS}
        shape["mlp_ratio"] = shape["mlp_ratio"] if shape["mlp_ratio"] is not None else 8 / 3  # SwiGLU's usual width
        if shape["short_window"] is None:
            del shape["short_window"]  # the model's default; new_model sets it from data.max_seq_length
        shape["moe"] = GPTFamily._experts(shape, model_config.moe)
        return shape

    @staticmethod
    def _experts(shape: dict[str, Any], moe) -> MoEConfig | None:
        """model.moe as the model's MoEConfig (None: dense); an expert's width defaults to the dense SwiGLU's over
        experts_per_token, so a token meets as many feed-forward weights as in the dense model."""
        if not moe.num_experts:
            return None
        if moe.experts_per_token > moe.num_experts:
            raise ConfigError(
                f"model.moe.experts_per_token ({moe.experts_per_token}) must be at most model.moe.num_experts "
                f"({moe.num_experts})"
            )
        dense = GPTConfig(**{k: v for k, v in shape.items() if k != "moe"}).intermediate_size
        width = moe.expert_width or -(-dense // moe.experts_per_token // 32) * 32
        return MoEConfig(**{**moe.model_dump(), "expert_width": width})  # model.moe's fields are MoEConfig's

    def gpt_config(self, model_config, vocab_size: int, max_seq_len: int) -> GPTConfig:
        config = GPTConfig(vocab_size=vocab_size, max_seq_len=max_seq_len, **self._shape(model_config))
        problems = config.validate()
        if problems:
            raise ConfigError(f"model.{problems[0]}")
        return config

    def build(self, model_config, vocab_size, max_seq_len, device="cpu", dtype=torch.float32):
        return self.build_from_config(self.gpt_config(model_config, vocab_size, max_seq_len), device, dtype)

    def model_inputs(self, batch) -> dict:
        """Beside the positions, a sampler's expert routes: `routes` replayed (rollout routing replay), or
        `sampler_routes` only compared with the model's own (`GPT.routing_agreement`)."""
        routes = batch.get("routes", batch.get("sampler_routes"))
        return {"position_ids": batch.get("position_ids"), "routes": routes, "replay": "routes" in batch}

    def last_routes(self, model):
        return unwrap_ddp(model).last_routes()

    def routing_agreement(self, model):
        return unwrap_ddp(model).routing_agreement()

    def attention_shape(self, model):
        return model.config.depth, model.config.n_head * model.config.head_dim

    def blocks(self, model) -> nn.ModuleList:
        return model.blocks

    def owns(self, model) -> bool:
        return isinstance(model, (GPT, GPTStage))  # a stage reads and describes its slice under the GPT's names

    def pipeline_stage(self, model, block_ids, first, last):
        return GPTStage(model, block_ids, first, last)

    def tensor_parallel_plan(self, model, tp):
        c = model.config
        return megatron_plan(
            "attn.",
            "mlp.",
            c.n_head,
            c.num_kv_heads,
            c.intermediate_size,
            tp,
            qk_norm=True,
            norms=("attn_norm", "mlp_norm"),
        )

    def tensor_parallel_model_plan(self, model, sequence_parallel):
        if model.config.tie_embeddings:
            if sequence_parallel:
                raise ConfigError(
                    "sequence parallelism splits the embedding and the head by vocabulary, which a tied pair "
                    "cannot be: set model.tie_embeddings=false or drop infra.sequence_parallel"
                )
            return {}
        return {"embed": "vocab_embedding", "norm": "sequence_norm", "lm_head": "vocab_head"}

    def jax_forward(self, model, head=True):
        from tierlm.models.gpt.jax import forward

        config = model.config
        return lambda params, batch: forward(params, config, batch["input_ids"], batch.get("position_ids"), head)

    # -- the transformers twin: Qwen3 ------------------------------------------------------
    def hf_config(self, config):
        return to_hf_config(config)

    def to_hf_state(self, model, state):
        out = {to_hf_name(k): v for k, v in state.items()}
        if model.config.tie_embeddings:
            out.pop("lm_head.weight", None)  # transformers re-ties it from embed_tokens
        return out

    def import_transformers(self, folder, device="cpu", dtype=torch.float32, vocab_size=None, model_config=None):
        """A transformers Qwen3-MoE folder as the native GPT with experts (its grouped experts, routing replay and
        expert parallelism instead of transformers' loop over the experts), the same logits; None for any other
        folder (a dense Qwen3 or Llama stays transformers' model, as it loads today). What the native block cannot
        hold (sliding windows, dense layers among the sparse ones, scaled rotary embeddings) is refused in one line."""
        from safetensors.torch import load_file
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(folder)
        if hf.model_type != "qwen3_moe":
            return None
        rope = getattr(hf, "rope_parameters", None) or {"rope_theta": getattr(hf, "rope_theta", 10000.0)}
        unheld = {
            "sliding-window attention": getattr(hf, "use_sliding_window", False),
            "dense layers among the sparse ones (mlp_only_layers, decoder_sparse_step)": bool(hf.mlp_only_layers)
            or hf.decoder_sparse_step != 1,
            "attention biases": hf.attention_bias,
            f"rotary scaling {rope.get('rope_type')}": rope.get("rope_type", "default") != "default",
            f"activation {hf.hidden_act}": hf.hidden_act != "silu",
        }
        for what, present in unheld.items():
            if present:
                raise ConfigError(
                    f"{folder} is a Qwen3-MoE with {what}, which tierlm's native mixture of experts does not hold: "
                    "set model.architecture=qwen3_moe to train it as transformers' model"
                )
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        config = GPTConfig(
            depth=hf.num_hidden_layers, width=hf.hidden_size, num_heads=hf.num_attention_heads, head_dim=head_dim,
            n_kv_head=hf.num_key_value_heads, vocab_size=hf.vocab_size, max_seq_len=hf.max_position_embeddings,
            mlp_ratio=hf.intermediate_size / hf.hidden_size, rope_theta=rope["rope_theta"], norm_eps=hf.rms_norm_eps,
            tie_embeddings=hf.tie_word_embeddings,
            moe=MoEConfig(
                num_experts=hf.num_experts, experts_per_token=hf.num_experts_per_tok,
                expert_width=hf.moe_intermediate_size, normalize_top_k=hf.norm_topk_prob,
                aux_loss_coef=hf.router_aux_loss_coef if getattr(hf, "output_router_logits", False) else 0.0,
            ),
        )  # fmt: skip
        model = self.build_from_config(config, device, dtype)
        index = Path(folder) / f"{WEIGHTS_FILE}.index.json"  # a large checkpoint's shards, else one file
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [WEIGHTS_FILE]
        weights = {k: v for name in files for k, v in load_file(Path(folder) / name, device=str(device)).items()}
        missing, unexpected = model.load_state_dict(self.from_hf_state(model, weights), strict=False)
        missing = [name for name in missing if not name.endswith("expert_bias")]  # tierlm's own: zero, no bias
        if missing or unexpected:
            raise ModelLoadError(
                f"{folder} does not fit its Qwen3-MoE config: missing {missing}, unexpected {unexpected}"
            )
        return model

    def from_hf_state(self, model, state):
        out = {from_hf_name(k): v for k, v in fuse_experts(state).items()}
        if model.config.tie_embeddings and "embed.weight" in out:
            out.setdefault("lm_head.weight", out["embed.weight"])
        return out


GPT_FAMILY = register_family(GPTFamily())


class GPTStage(nn.Module):
    """Blocks of a native GPT — with the embedding on the first stage, the final norm and head on the last —
    under the GPT's own parameter names (`blocks.<i>....`), so a stage's state dict is a slice of the model's.
    With `tie_embeddings` the last stage holds the embedding too (its head's weight); the backend sums the
    two copies' gradients.

    >>> from tierlm.models.gpt.model import build_gpt
    >>> gpt = build_gpt(GPTConfig(depth=2, aspect_ratio=32, head_dim=16, vocab_size=50, max_seq_len=16))
    >>> ids, positions = torch.randint(0, 50, (2, 8)), torch.arange(8).expand(2, 8)
    >>> x, positions = GPTStage(gpt, [0], first=True, last=False)(ids, positions)
    >>> bool(torch.allclose(GPTStage(gpt, [1], first=False, last=True)(x, positions), gpt(ids), atol=1e-5))
    True
    """

    is_pipeline_stage = True  # its state dict is a slice of the whole model's (checkpoints load the slice)

    def __init__(self, model: GPT, block_ids: list[int], first: bool, last: bool):
        super().__init__()
        self.config = model.config
        self.first = first
        self.embed = (
            model.embed if first or (last and model.config.tie_embeddings) else None
        )  # before lm_head, as in GPT
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in block_ids})
        self.norm, self.lm_head = (model.norm, model.lm_head) if last else (None, None)
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        if self.first:
            x = self.embed(x)
        position_ids = received_positions(position_ids, self.config.max_seq_len)
        cos, sin = self.rope_cos[position_ids].unsqueeze(1), self.rope_sin[position_ids].unsqueeze(1)
        mask = packed_mask(position_ids)
        for block in self.blocks.values():
            x = block(x, cos, sin, mask)
        if self.lm_head is None:
            return x, position_ids.float()
        return self.lm_head(self.norm(x))

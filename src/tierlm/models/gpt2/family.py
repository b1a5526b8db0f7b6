"""GPT-2 as a model family (`model.architecture: gpt2`).

Shape from the `model` section: `depth` blocks, width `depth x aspect_ratio` rounded up to whole
heads of `head_dim` (the 124M model: depth 12, aspect_ratio 64, head_dim 64), `dropout`, `bias`.
Folders hold the weights under transformers' `GPT2LMHeadModel` names (its `Conv1D` weights are
the transpose of our `nn.Linear` ones), so they load in transformers and transformers' GPT-2
weights load here.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tierlm.errors import ConfigError
from tierlm.models.gpt.documents import packed_mask
from tierlm.models.gpt2.model import GPT2, GPT2Config
from tierlm.models.native import NativeCausalLM
from tierlm.models.registry import WEIGHTS_FILE, register_family
from tierlm.primitives.model_parallel import check_tensor_parallel_shape, received_positions

SHAPE_FIELDS = ("depth", "aspect_ratio", "head_dim", "bias", "variant")
_CONV1D = re.compile(
    r"^h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$"
)  # stored (in, out) by transformers

# The GPT-2 research V-series: a step name sets the variant's fields;
# explicit `model.ra.*` values override it. The other steps (R-MLP, delayed activation, KV pruning)
# are not built yet and are refused by name.
VARIANTS: dict[str, dict[str, Any]] = {
    "V0": {},
    "V1": {"ra.r": 4},
    "V2": {"ra.r": 4, "ra.self_restart": True},
    "V3": {"ra.r": 4, "rmlp.r_ff": 64},
    "V4": {"ra.r": 4, "rmlp.r_ff": 64, "rmlp.mixer": True},
    "V5": {"ra.r": 4, "rmlp.r_ff": 64, "rmlp.gate_alpha": True},
    "V6": {"ra.r": 4, "rmlp.r_ff": 64, "rmlp.mixer": True, "rmlp.gate_alpha": True},
    "V7": {"ra.r": 8},
    "V8": {"ra.r": 8, "ra.self_restart": True},
    "V9": {"ra.r": 2},
    "V10": {"ra.r": 4, "ra.self_restart": True, "mlp_ratio": 6.0},  # upstream forgot to widen the MLP; this does
    "V11": {"rmlp.r_ff": 64, "delay.mode": "step", "delay.start_step": 75},
    "V12": {"ra.r": 4, "delay.mode": "step", "delay.start_step": 75},
    "V13": {"rmlp.r_ff": 1152, "delay.mode": "step", "delay.start_step": 75},
    "V14": {
        "rmlp.r_ff": 64,
        "delay.mode": "step",
        "delay.start_step": 75,
        "kv.enabled": True,
        "kv.keep_ratio": 0.382,
        "kv.recency": 64,
    },
    "V15": {"rmlp.r_ff": 1152, "delay.mode": "step", "delay.start_step": 75, "kv.enabled": True, "kv.learned": True},
    "V16": {"ra.r": 4, "ra.per_head_gates": True, "delay.mode": "loss_stability"},
    "V17": {"rmlp.r_ff": 64, "kv.enabled": True, "delay.mode": "loss_stability"},
    "V18": {"rmlp.r_ff": 1152, "kv.enabled": True, "kv.learned": True, "delay.mode": "loss_stability"},
    "V19": {"kv.enabled": True, "kv.values_only": True, "kv.keep_ratio": 0.382},
}


VARIANT_KEYS = ("variant", "ra", "rmlp", "delay", "kv_pruning", "mlp_ratio")
"""The model settings that make a research variant (they may reshape a pretrained GPT-2: `import_transformers`)."""
PRESERVING = {"ra.r", "ra.per_head_gates", "ra.self_restart", "rmlp.r_ff", "rmlp.mixer", "rmlp.gate_alpha"}
"""Variant fields whose new parameters can start as the identity, so a pretrained GPT-2 keeps its function."""


def variant_fields(model_config) -> dict[str, Any]:
    """The variant fields of `model.variant`, overridden by explicit `model.ra.*`, `model.rmlp.*`
    and `model.mlp_ratio` values, as {"ra.r": 4, "rmlp.r_ff": 64, "mlp_ratio": 6.0, ...}.

    >>> from tierlm.config import ModelConfig
    >>> variant_fields(ModelConfig(architecture="gpt2", variant="V2", ra={"per_head_gates": True}))
    {'ra.r': 4, 'ra.self_restart': True, 'ra.per_head_gates': True}
    """
    name = model_config.variant
    if name is not None and name not in VARIANTS:
        raise ConfigError(f"model.variant {name!r} is not a V-series step; steps: {', '.join(VARIANTS)}")
    fields = dict(VARIANTS.get(name, {}))
    for prefix, section in (("ra", "ra"), ("rmlp", "rmlp"), ("delay", "delay"), ("kv", "kv_pruning")):
        fields.update(
            {f"{prefix}.{k}": v for k, v in getattr(model_config, section).model_dump().items() if v is not None}
        )
    if model_config.mlp_ratio is not None:
        fields["mlp_ratio"] = model_config.mlp_ratio
    return fields


def variant_config(v: dict[str, Any]) -> dict[str, Any]:
    """`variant_fields`' values as `GPT2Config` fields (ra.r -> ra_r, ...); what they leave unset stays off."""
    return {
        "ra_r": v.get("ra.r", 0),
        "ra_per_head": v.get("ra.per_head_gates", False),
        "self_restart": v.get("ra.self_restart", False),
        "rmlp_r_ff": v.get("rmlp.r_ff", 0),
        "rmlp_mixer": v.get("rmlp.mixer", False),
        "rmlp_gate_alpha": v.get("rmlp.gate_alpha", False),
        "rmlp_attention_aware": v.get("rmlp.attention_aware", False),
        "delay_mode": v.get("delay.mode", "none"),
        "kv_prune": v.get("kv.enabled", False),
        **{
            f"delay_{k}": v[f"delay.{k}"]
            for k in ("start_step", "ramp_steps", "window", "cv_threshold")
            if f"delay.{k}" in v
        },
        **{f"kv_{k}": v[f"kv.{k}"] for k in ("keep_ratio", "recency", "learned", "values_only") if f"kv.{k}" in v},
    }


class GPT2Family(NativeCausalLM):
    name = "gpt2"
    model_fields = (*SHAPE_FIELDS, "dropout", "ra", "rmlp", "delay", "kv_pruning", "mlp_ratio")
    model_class = GPT2
    config_class = GPT2Config

    def input_embedding(self, model: nn.Module) -> nn.Embedding:
        return model.wte

    def config_fields(self, model_config) -> dict[str, Any]:
        fields = {f"model.{k}": getattr(model_config, k) for k in SHAPE_FIELDS}
        fields.update({f"model.{k}": v for k, v in variant_fields(model_config).items()})
        return fields

    def on_step(self, model, step: int, loss: float) -> None:
        if model.coupling is not None and math.isfinite(loss):
            model.coupling.update(step, loss)

    def diagnostics(self, model) -> dict[str, float]:
        from tierlm.models.gpt2.ra import gate_summary

        return gate_summary(model)

    def gpt2_config(self, model_config, vocab_size: int, max_seq_len: int) -> GPT2Config:
        m = model_config
        width = math.ceil(m.depth * m.aspect_ratio / m.head_dim) * m.head_dim
        v = variant_fields(m)
        config = GPT2Config(
            n_layer=m.depth,
            n_head=width // m.head_dim,
            n_embd=width,
            vocab_size=vocab_size,
            block_size=max_seq_len,
            dropout=m.dropout,
            bias=m.bias,
            mlp_ratio=v.get("mlp_ratio", 4.0),
            **variant_config(v),
        )
        problems = config.validate()
        if problems:
            raise ConfigError(f"model ({self.name}): {problems[0]}")
        return config

    def build(self, model_config, vocab_size, max_seq_len, device="cpu", dtype=torch.float32):
        return self.build_from_config(self.gpt2_config(model_config, vocab_size, max_seq_len), device, dtype)

    # -- running: NativeCausalLM's, except that a KV-pruned model decodes by recomputing ----------
    def prefill(self, model, ids, max_len):
        if (
            model.config.kv_prune
        ):  # pruning scores keys with every earlier query: the "cache" is the sequence, recomputed
            return model(ids)[:, -1], [ids]
        return super().prefill(model, ids, max_len)

    def decode(self, model, tokens, cache):
        if isinstance(cache, list):
            cache[0] = torch.cat([cache[0], tokens[:, None]], dim=1)
            return model(cache[0])[:, -1]
        return super().decode(model, tokens, cache)

    def repeat_cache(self, cache, n):
        if isinstance(cache, list):
            cache[0] = cache[0].repeat_interleave(n, dim=0)
        else:
            super().repeat_cache(cache, n)

    def attention_shape(self, model):
        return model.config.n_layer, model.config.n_embd

    def blocks(self, model) -> nn.ModuleList | nn.ModuleDict:
        return model.h

    def owns(self, model) -> bool:
        return isinstance(model, (GPT2, GPT2Stage))  # a stage reads and describes its slice under GPT-2's names

    # -- model parallelism: plain GPT-2 (the research variants add per-head or model-wide state) ---------
    def tensor_parallel_plan(self, model, tp):
        """c_attn (q, k and v fused) by columns with each rank's share taken from each of the three
        (a strided shard: rank r holds q_r, k_r, v_r, so it runs whole heads), c_fc by columns, both c_proj by rows."""
        c = model.config
        self._refuse_variants(c, "tensor parallelism", also=("ra_r", "self_restart", "rmlp_r_ff", "kv_prune"))
        problems = check_tensor_parallel_shape(c.n_head, c.n_head, c.mlp_hidden, tp)
        if problems:
            raise ConfigError(f"infra.tensor_parallel_size={tp}: {'; '.join(problems)}")
        return {"attn.c_attn": "colwise_qkv", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}

    def pipeline_stage(self, model, block_ids, first, last):
        self._refuse_variants(model.config, "pipeline parallelism")
        return GPT2Stage(model, block_ids, first, last)

    @staticmethod
    def _refuse_variants(config: GPT2Config, what: str, also: tuple[str, ...] = ()) -> None:
        used = [name for name in also if getattr(config, name)] + (
            ["delay_mode"] if config.delay_mode != "none" else []
        )
        if used:
            raise ConfigError(
                f"{what} covers plain GPT-2 blocks; this variant sets {', '.join(used)} (state shared across heads "
                "or stages): train it with data parallelism (infra.distributed=fsdp)"
            )

    # -- the transformers twin: GPT2LMHeadModel --------------------------------------------------
    def hf_config(self, config: GPT2Config):
        if (
            not config.bias
            or config.ra_r
            or config.self_restart
            or config.rmlp_r_ff
            or config.delay_mode != "none"
            or config.kv_prune
        ):
            return None  # transformers' GPT-2 always has biases, and none of the research variants
        from transformers import GPT2Config as HFGPT2Config

        return HFGPT2Config(
            vocab_size=config.vocab_size,
            n_positions=config.block_size,
            n_embd=config.n_embd,
            n_layer=config.n_layer,
            n_head=config.n_head,
            n_inner=config.mlp_hidden,
            resid_pdrop=config.dropout,
            embd_pdrop=config.dropout,
            attn_pdrop=config.dropout,
            layer_norm_epsilon=config.layer_norm_eps,
            activation_function="gelu_new",
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=None,  # the tokenizer's, in generation_config.json (GPT-2's 50256 may not exist here)
            architectures=["GPT2LMHeadModel"],
        )

    def jax_forward(self, model, head=True):
        from tierlm.models.gpt2.jax import forward, unsupported

        config = model.config
        if unsupported(config):
            raise ConfigError(
                f"the JAX backend computes plain GPT-2; this model uses {', '.join(unsupported(config))}: "
                "use infra.backend=pytorch"
            )
        return lambda params, batch: forward(params, config, batch["input_ids"], batch.get("position_ids"), head)

    def import_transformers(
        self, folder, device="cpu", dtype=torch.float32, vocab_size=None, model_config=None
    ) -> GPT2:
        """A transformers GPT-2 folder (`GPT2LMHeadModel`'s config.json and safetensors) as a native GPT2, made the
        research variant `model_config` asks for (model.variant, model.ra.*, model.rmlp.*) with its new parameters
        at the identity (`start_as_pretrained`): the variant computes the pretrained model's logits until it trains.
        A variant that cannot start so (delayed activation, KV pruning, another MLP width) is refused."""
        from safetensors.torch import load_file
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(folder)
        if hf.model_type != "gpt2":
            raise ConfigError(
                f"{folder} holds a {hf.model_type!r} model, not GPT-2; drop model.architecture=gpt2 to train it as it "
                f"is"
            )
        mlp_ratio = (hf.n_inner or 4 * hf.n_embd) / hf.n_embd
        v = variant_fields(model_config) if model_config is not None else {}
        changed = [k for k, value in v.items() if k not in PRESERVING and value not in (None, False, "none")]
        if changed and not (changed == ["mlp_ratio"] and v["mlp_ratio"] == mlp_ratio):
            raise ConfigError(
                f"model.{changed[0]} cannot start as the pretrained GPT-2 in {folder} (it changes what the model "
                "computes, or its shape); from a pretrained GPT-2 use RA and R-MLP (V1-V9), or train from scratch"
            )
        config = GPT2Config(
            n_layer=hf.n_layer,
            n_head=hf.n_head,
            n_embd=hf.n_embd,
            vocab_size=hf.vocab_size,
            block_size=hf.n_positions,
            dropout=hf.resid_pdrop,
            layer_norm_eps=hf.layer_norm_epsilon,
            mlp_ratio=mlp_ratio,
            **variant_config(v),
        )
        problems = config.validate()
        if problems:
            raise ConfigError(f"model ({self.name}) from {folder}: {problems[0]}")
        model = self.build_from_config(config, device, dtype)
        state = self.from_hf_state(model, load_file(Path(folder) / WEIGHTS_FILE, device=str(device)))
        missing, unexpected = model.load_state_dict(state, strict=False)
        new = {name for name, _ in model.named_parameters() if name not in state}
        assert not unexpected and set(missing) <= new, f"GPT-2 weights do not fit: {unexpected or missing}"
        start_as_pretrained(model)
        return model

    def to_hf_state(self, model, state):
        out = {}
        for name, tensor in state.items():
            if name == "lm_head.weight":
                continue  # tied: transformers re-ties it from wte
            out[f"transformer.{name}"] = tensor.t() if _CONV1D.match(name) else tensor
        return out

    def from_hf_state(self, model, state):
        out = {}
        for name, tensor in state.items():
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # causal-mask buffers of older transformers versions
            native = name.removeprefix("transformer.")
            out[native] = tensor.t() if _CONV1D.match(native) else tensor
        if "wte.weight" in out:
            out["lm_head.weight"] = out["wte.weight"]
        return out


@torch.no_grad()
def start_as_pretrained(model: nn.Module) -> None:
    """The research variants' new parameters at the identity: RA's and R-MLP's gates at 1 (each slice weighs as in
    the plain model), R-MLP's extra scalar at 1 and its mixer the identity, self-restart's share of the values at 0.

    >>> from tierlm.models.gpt2.model import GPT2Config
    >>> plain = GPT2_FAMILY.build_from_config(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=20, block_size=8))
    >>> v2 = GPT2_FAMILY.build_from_config(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=20, block_size=8,
    ...                                              ra_r=2, self_restart=True, rmlp_r_ff=8, rmlp_mixer=True))
    >>> _ = v2.load_state_dict(plain.state_dict(), strict=False); start_as_pretrained(v2)
    >>> ids = torch.tensor([[1, 2, 3]]); torch.allclose(v2(ids), plain(ids), atol=1e-6)
    True
    """
    from tierlm.models.gpt2.ra import ReciprocalGates, SelfRestart
    from tierlm.models.gpt2.rmlp import ReciprocalMLP

    for module in model.modules():
        if isinstance(module, (ReciprocalGates, ReciprocalMLP)):
            module.w_std.fill_(1.0)
            module.w_rec.fill_(1.0)
        if isinstance(module, SelfRestart):
            module.alpha.zero_()
        if isinstance(module, ReciprocalMLP):
            if module.gate_alpha is not None:
                module.gate_alpha.fill_(1.0)
            if module.attn_alpha is not None:
                module.attn_alpha.zero_()
            if module.mixer is not None:
                torch.nn.init.eye_(module.mixer.weight)


GPT2_FAMILY = register_family(GPT2Family())


class GPT2Stage(nn.Module):
    """Blocks of a GPT-2 — the embeddings on the first stage, the final norm and head on the last — under
    GPT-2's own parameter names (`h.<i>....`), so a stage's state dict is a slice of the model's. The head
    is tied to the token embedding: the last stage holds `wte` too (the same parameter as its head, as in
    the whole model), and the backend sums its gradient with the first stage's copy (Megatron's
    embedding group), so both copies take the same update.

    >>> config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, block_size=16)
    >>> gpt2 = GPT2_FAMILY.build_from_config(config)
    >>> ids, positions = torch.randint(0, 50, (2, 8)), torch.arange(8).expand(2, 8)
    >>> x, positions = GPT2Stage(gpt2, [0], first=True, last=False)(ids, positions)
    >>> bool(torch.allclose(GPT2Stage(gpt2, [1], first=False, last=True)(x, positions), gpt2(ids), atol=1e-5))
    True
    """

    is_pipeline_stage = True  # its state dict is a slice of the whole model's (checkpoints load the slice)

    def __init__(self, model: GPT2, block_ids: list[int], first: bool, last: bool):
        super().__init__()
        self.config = model.config
        self.wte = (
            model.wte if first or last else None
        )  # registered before lm_head: the tied parameter's first name, as in GPT2
        self.wpe, self.drop = (model.wpe, model.drop) if first else (None, None)
        self.h = nn.ModuleDict({str(i): model.h[i] for i in block_ids})
        self.ln_f, self.lm_head = (model.ln_f, model.lm_head) if last else (None, None)
        self.coupling = None  # delayed activation (model-wide) is refused under pipeline parallelism

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        position_ids = received_positions(position_ids, self.config.block_size)
        if self.wpe is not None:
            x = self.drop(self.wte(x) + self.wpe(position_ids))
        mask = packed_mask(position_ids)
        for block in self.h.values():
            x = block(x, mask)
        if self.lm_head is None:
            return x, position_ids.float()
        return self.lm_head(self.ln_f(x))

"""Any transformers causal LM, by its `model_type`: the family adapter tierlm falls back to for every model no
native family owns (registered as the fallback of `tierlm.models.registry`), beside its pipeline split
(`pipeline`)."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tierlm.errors import ConfigError
from tierlm.models.registry import FAMILIES, WEIGHTS_FILE, ModelFamily, register_family, unwrap_ddp
from tierlm.primitives.dtype_device import move_to
from tierlm.primitives.losses import get_labels, linear_cross_entropy
from tierlm.primitives.model_parallel import megatron_plan
from tierlm.primitives.models import tied_names


def _cache_keyword(model: nn.Module) -> str:
    """What the model's forward calls its KV cache: `cache` in recent transformers (5.25 here, which deprecates
    `past_key_values` for removal in 5.40), `past_key_values` before (5.19 names only it)."""
    return "cache" if "cache" in _forward_names(model) else "past_key_values"


def _forward_names(model: nn.Module) -> frozenset[str]:
    """The arguments the model's forward names. A PEFT wrapper's forward takes anything: its base model's says."""
    return _forward_names_of(type(model.get_base_model() if hasattr(model, "get_base_model") else model))


@functools.cache
def _forward_names_of(model_class: type) -> frozenset[str]:
    """Per class, once: reading a signature costs ~20 us, and the engine asks at every decode step."""
    return frozenset(inspect.signature(model_class.forward).parameters)


# -- transformers models ---------------------------------------------------------------------
# Model types whose logits are exactly `lm_head(last hidden state)`: no soft-capping, scaling or
# bias after the head, so the head may be fused into the loss.
LLAMA_STYLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Separate q/k/v/o and gate/up/down projections, attention reshaped by head_dim: the tensor-parallel plan fits."""
PLAIN_HEAD_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "olmo2", "phi3", "smollm3"}
)


class TransformersFamily(ModelFamily):
    """Any transformers causal LM, by its `model_type`."""

    name = "transformers"
    model_fields = ("hf_config",)

    def owns(self, model: nn.Module) -> bool:
        return hasattr(getattr(model, "config", None), "model_type")

    def config_fields(self, model_config) -> dict[str, Any]:
        return {"model.hf_config": model_config.hf_config}

    def build(self, model_config, vocab_size, max_seq_len, device="cpu", dtype=torch.float32):
        from tierlm.primitives.models import create_hf_model_from_config

        check_causal_lm(model_config.architecture, "model.architecture")
        on_meta = torch.device(device).type == "meta"
        with torch.device("meta" if on_meta else "cpu"):
            model = create_hf_model_from_config(
                model_config.architecture, torch_dtype=dtype, **{"vocab_size": vocab_size, **model_config.hf_config}
            )
        return model if on_meta else move_to(model, device)

    def fuses_cross_entropy(self, model: nn.Module) -> bool:
        """A plain-head type run as it is (a DDP or FSDP wrapper must see the whole forward)."""
        from torch.distributed.fsdp import FSDPModule

        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        return (
            unwrap_ddp(model) is model
            and not isinstance(model, FSDPModule)
            and getattr(getattr(model, "config", None), "model_type", None) in PLAIN_HEAD_MODEL_TYPES
            and isinstance(head, nn.Linear)
            and head.bias is None
        )

    def cross_entropy(self, model, batch, weights):
        labels = get_labels(batch)
        hidden = model.base_model(
            input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False
        ).last_hidden_state
        flat_weights = weights.flatten() if weights is not None else None
        total, losses = linear_cross_entropy(
            hidden.flatten(0, 1), model.get_output_embeddings().weight, labels.flatten(), flat_weights
        )
        return total, losses.view(labels.shape)

    def prefill(self, model, ids, max_len):
        from transformers import DynamicCache

        cache = DynamicCache()
        inputs = {_cache_keyword(model): cache}
        if "logits_to_keep" in _forward_names(model):  # the last position's logits, not (B, T, V) for every one
            inputs["logits_to_keep"] = 1
        return model(input_ids=ids, use_cache=True, **inputs).logits[:, -1], cache

    def decode(self, model, tokens, cache):
        return model(input_ids=tokens[:, None], use_cache=True, **{_cache_keyword(model): cache}).logits[:, -1]

    def repeat_cache(self, cache, n: int) -> None:
        cache.batch_repeat_interleave(n)

    def max_seq_len(self, model):
        return getattr(getattr(model, "config", None), "max_position_embeddings", None)

    def attention_shape(self, model):
        config = getattr(model, "config", None)
        layers = getattr(config, "num_hidden_layers", 0)
        heads = getattr(config, "num_attention_heads", 0)
        return layers, heads * (getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // max(heads, 1))

    def tensor_parallel_plan(self, model, tp):
        """Llama-style blocks (Llama, Mistral, Qwen2, Qwen3): attention and MLP split Megatron-style; their
        attention reshapes by head_dim, so each rank runs its own heads unchanged."""
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None) not in LLAMA_STYLE_MODEL_TYPES:
            raise ConfigError(
                f"tensor parallelism covers {', '.join(sorted(LLAMA_STYLE_MODEL_TYPES))} transformers models, "
                f"not {getattr(config, 'model_type', type(model).__name__)!r}; use data parallelism (fsdp)"
            )
        return megatron_plan(
            "self_attn.",
            "mlp.",
            config.num_attention_heads,
            config.num_key_value_heads or config.num_attention_heads,
            config.intermediate_size,
            tp,
            qk_norm=config.model_type == "qwen3",
        )

    def blocks(self, model):
        return model.model.layers if getattr(model, "is_pipeline_stage", False) else super().blocks(model)

    def tensor_parallel_model_plan(self, model, sequence_parallel):
        if (
            sequence_parallel
        ):  # transformers sizes its masks from the embedding output, which would hold 1/tp of the tokens
            raise ConfigError(
                "sequence parallelism covers the native GPT (transformers builds its attention masks from the "
                "embedding's output, which it splits): drop infra.sequence_parallel"
            )
        if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
            # tied: one matrix cannot be split as both (its rows are the vocabulary either way, but two styles re-
            # register it)
            return {}
        return {"model.embed_tokens": "vocab_embedding", "lm_head": "vocab_head"}

    def pipeline_stage(self, model, block_ids, first, last):
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None) not in LLAMA_STYLE_MODEL_TYPES:
            raise ConfigError(
                f"pipeline stages cover {', '.join(sorted(LLAMA_STYLE_MODEL_TYPES))} transformers models, "
                f"not {getattr(config, 'model_type', type(model).__name__)!r}; use tensor parallelism or FSDP2"
            )
        from tierlm.models.transformers.pipeline import TransformersStage

        return TransformersStage(model, block_ids, first, last)

    def save(self, model, folder, state_dict=None):
        model.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)

    def save_config(self, model, folder):
        model.config.save_pretrained(folder)

    def build_from_folder(self, folder, dtype=torch.float32):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(folder)
        check_causal_lm(config.model_type, f"{folder} holds a model whose model_type")
        return AutoModelForCausalLM.from_config(config, dtype=dtype)

    def after_materialize(self, model: nn.Module) -> None:
        """After `to_empty`: the tied weights tied again (the rotary tables, which no state dict carries, come from
        rank 0 by broadcast: `tierlm.backends.distributed.broadcast_full_state`)."""
        model.tie_weights()

    def load(self, folder, device="cpu", dtype=torch.float32, trust_remote_code=False):
        from tierlm.primitives.models import load_hf_model

        return load_hf_model(str(folder), dtype, None, trust_remote_code=trust_remote_code).to(device)

    def read_state(self, model, folder):
        from safetensors.torch import load_file

        state = load_file(Path(folder) / WEIGHTS_FILE, device="cpu")
        for name, tied in {n: group[0] for group in tied_names(model) for n in group[1:]}.items():
            if name not in state and tied in state:
                state[name] = state[tied]
        return state


TRANSFORMERS = register_family(TransformersFamily(), fallback=True)


def check_causal_lm(model_type: str, what: str) -> None:
    """Refuse, in one line, a transformers model_type that is unknown or not a decoder-only causal LM (T5, BERT,
    ...): tierlm trains those, and encoder-decoders as its own qwen3_encdec.

    >>> check_causal_lm("qwen3", "model.architecture")
    >>> check_causal_lm("t5", "model.architecture")
    Traceback (most recent call last):
    ...
    tierlm.errors.ConfigError: model.architecture 't5' is not a decoder-only causal LM (transformers has no
    AutoModelForCausalLM for it); tierlm trains gpt, gpt2 or a transformers causal LM (qwen3, llama, ...), and
    encoder-decoders as qwen3_encdec
    """
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING:
        raise unknown_architecture(model_type)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(
            f"{what} {model_type!r} is not a decoder-only causal LM (transformers has no AutoModelForCausalLM for it); "
            "tierlm trains gpt, gpt2 or a transformers causal LM (qwen3, llama, ...), "
            "and encoder-decoders as qwen3_encdec"
        )


def unknown_architecture(architecture: str) -> ConfigError:
    return ConfigError(
        f"model.architecture {architecture!r} is neither a tierlm family ({', '.join(FAMILIES)}) "
        "nor a transformers model_type"
    )

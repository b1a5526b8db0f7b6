"""Model families behind one adapter (torchtitan's "train spec", in our size).

A family answers everything the rest of tierlm asks of a model: how to build it from the config
(on the meta device, then one `init_weights()`), how to run it (logits, the fused head + loss,
KV-cache prefill and decode for the engine), its FLOPs per token, its repeated blocks (for FSDP,
activation checkpointing and compile), and how it is saved, loaded and exported. The trainer,
backends, engine, metrics and checkpoints ask `family_of(model)` (or `family_for_folder(path)`,
`family_named(model.architecture)`) and never check a model's type.

Adding a family is one module with a `ModelFamily` subclass and one `register_family(...)` line
(see `tierlm.models.gpt2.model` and the README's walk-through). Any architecture name that is not a
registered family is a transformers `model_type` ("qwen3", "llama", ...), served by
`TransformersFamily`.

>>> sorted(FAMILIES)
['gpt', 'gpt2', 'qwen3_encdec']
>>> family_named("qwen3").name
'transformers'
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from tierlm.errors import ConfigError, ModelLoadError, first_line
from tierlm.models.moe import MoE

NATIVE_CONFIG_FILE = "tierlm_model.json"  # in a native model folder: {"family": name, **its config}
WEIGHTS_FILE = "model.safetensors"


class ModelFamily:
    """The adapter protocol; each method has the transformers behaviour unless a family overrides it."""

    name = "base"
    model_fields: tuple[str, ...] | None = None
    """The model.* settings (`tierlm.config.model.FROM_SCRATCH_FIELDS`) it reads to build a model from scratch
    (None: not declared, so overrides of them are not checked)."""
    native = False
    """True for families tierlm builds itself (their folders carry tierlm_model.json)."""
    seq2seq = False
    """True for encoder-decoders: batches carry the encoder's rows and the decoder's (UL2), prompts go to the
    encoder."""

    def owns(self, model: nn.Module) -> bool:
        """Is `model` (unwrapped) one of this family's?"""
        raise NotImplementedError

    # -- building --------------------------------------------------------------------------
    def config_fields(self, model_config) -> dict[str, Any]:
        """The `model.*` fields that set this family's shape (they enter a run's fingerprint)."""
        raise NotImplementedError

    def build(self, model_config, vocab_size: int, max_seq_len: int, device="cpu", dtype=torch.float32) -> nn.Module:
        """A new model from the `model` config section: on the meta device, then `init_weights()` on
        `device` (device "meta": only described, for sizing)."""
        raise NotImplementedError

    # -- running ---------------------------------------------------------------------------
    def logits(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Logits (B, T, V); optional `position_ids` restart per packed document."""
        out = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False)
        return out.logits

    def fuses_cross_entropy(self, model: nn.Module) -> bool:
        return False

    def cross_entropy(self, model: nn.Module, batch: Mapping[str, torch.Tensor], weights: torch.Tensor | None):
        """(sum of weighted cross-entropy, per-token cross-entropy (B, T)) without the (B, T, V) logits."""
        raise NotImplementedError

    def prefill(self, model: nn.Module, ids: torch.Tensor, max_len: int) -> tuple[torch.Tensor, Any]:
        """Logits of the last position (B, V) and a cache holding the prompt."""
        raise NotImplementedError

    def decode(self, model: nn.Module, tokens: torch.Tensor, cache) -> torch.Tensor:
        """Logits (B, V) of one new token per row, continuing `cache`."""
        raise NotImplementedError

    def repeat_cache(self, cache, n: int) -> None:
        """Copy each row of `cache` n times (one prompt prefilled, sampled n ways)."""
        raise NotImplementedError

    def max_seq_len(self, model: nn.Module) -> int | None:
        return None

    # -- mixtures of experts (rollout routing replay) ----------------------------------------
    def last_routes(self, model: nn.Module) -> torch.Tensor | None:
        """The experts each token of the model's last forward went to, (tokens, MoE layers, k); None when the model
        routes nothing or does not say (then routes are neither recorded nor replayed)."""
        return None

    def routing_agreement(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Counts of where the last forward, given a sampler's routes (the batch's `routes` or `sampler_routes`),
        routed as the sampler did: route_tokens(_agree), route_decisions(_agree). Empty when none were given."""
        return {}

    def vocab_size(self, model: nn.Module) -> int:
        """Rows of the model's token table: the largest vocabulary it can take."""
        return self.input_embedding(model).num_embeddings

    def input_embedding(self, model: nn.Module) -> nn.Embedding:
        """The token embedding table."""
        return model.get_input_embeddings()

    def output_head(self, model: nn.Module) -> nn.Module:
        """The output head (hidden state -> logits)."""
        return model.get_output_embeddings()

    def with_output_head(self, model: nn.Module, head: nn.Module) -> nn.Module:
        """`model` with `head` as its output head, untied from the embedding (PPO's value model)."""
        model.set_output_embeddings(head)
        return model

    def flops_per_token(self, model: nn.Module, seq_len: int) -> float:
        """Training FLOPs per token: 6 x non-embedding params + 12 x layers x attention width x T (PaLM, appendix B);
        of a mixture of experts, the params a token goes through (its experts_per_token of num_experts experts)."""
        layers, width = self.attention_shape(model)
        embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
        params = sum(p.numel() for p in model.parameters()) - embedding
        params -= sum(m.idle_params() for m in model.modules() if isinstance(m, MoE))
        return float(6 * params + 12 * layers * width * seq_len)

    def attention_shape(self, model: nn.Module) -> tuple[int, int]:
        """(layers, heads x head width), for the attention term of the FLOPs."""
        raise NotImplementedError

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        """The repeated transformer blocks (wrapped one by one by FSDP, checkpointing, compile)."""
        from tierlm.primitives.parallel import block_list

        return block_list(model)

    def tensor_parallel_plan(self, model: nn.Module, tp: int) -> dict[str, str]:
        """How each block splits over `tp` ranks: {module path inside a block: "colwise" | "rowwise"}
        (`tierlm.primitives.model_parallel.apply_tensor_parallel`); a `ConfigError` saying why when it cannot."""
        raise ConfigError(
            f"the {self.name} model family has no tensor-parallel plan; use data parallelism (fsdp) "
            "or a native GPT / Llama / Qwen3 model"
        )

    def tensor_parallel_model_plan(self, model: nn.Module, sequence_parallel: bool) -> dict[str, str]:
        """How the modules around the blocks split: {module path: "vocab_embedding" | "vocab_head" | "sequence_norm"}
        (`tierlm.primitives.model_parallel.apply_vocab_parallel`); empty to keep them whole on every rank. A
        `ConfigError` when `sequence_parallel` cannot be done."""
        if sequence_parallel:
            raise ConfigError(
                f"the {self.name} model family has no sequence-parallel plan: drop infra.sequence_parallel"
            )
        return {}

    def pipeline_stage(self, model: nn.Module, block_ids: list[int], first: bool, last: bool) -> nn.Module:
        """The part of `model` one pipeline stage runs, under the model's own parameter names: the blocks
        `block_ids`, with the embedding when `first` and the final norm and head when `last`. Its forward
        takes (token ids or the residual stream, position ids) and returns (the residual stream, position
        ids as float32: what travels between stages is floating point), or the logits when `last`."""
        raise ConfigError(
            f"the {self.name} model family has no pipeline stages; use tensor parallelism or FSDP2 "
            "(pipeline stages cover the native GPT, GPT-2 and Llama-style transformers models)"
        )

    # -- folders ---------------------------------------------------------------------------
    def save(self, model: nn.Module, folder: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        raise NotImplementedError

    def save_config(self, model: nn.Module, folder: Path) -> None:
        raise NotImplementedError

    def build_from_folder(self, folder: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
        """An untrained model of the shape a folder describes (weights are loaded separately)."""
        raise NotImplementedError

    def load(
        self, folder: Path | str, device="cpu", dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
    ) -> nn.Module:
        raise NotImplementedError

    def read_state(self, model: nn.Module, folder: Path) -> dict[str, torch.Tensor]:
        """A folder's weights (CPU), named as `model.state_dict()` names them."""
        raise NotImplementedError

    def jax_forward(self, model: nn.Module, head: bool = True):
        """`(params, batch) -> logits` in JAX for this model's parameters by name (`tierlm.jax`), or None
        when the family has no JAX twin (the JAX backend refuses it). `head=False`: `(params, batch) -> (final
        hidden states, the head's weight)`, for the loss that fuses the head."""
        return None

    def exportable(self, model: nn.Module) -> str | None:
        """None when the saved folder loads in transformers as it is; else the reason it cannot."""
        return None

    def on_step(self, model: nn.Module, step: int, loss: float) -> None:
        """Called after each optimizer step with the step's training loss (e.g. to switch a delayed gate on)."""

    def diagnostics(self, model: nn.Module) -> dict[str, float]:
        """Figures about the model itself for the train and eval lines (e.g. learned gates)."""
        return {}


# -- the registry ----------------------------------------------------------------------------
FAMILIES: dict[str, ModelFamily] = {}


FALLBACK: list[ModelFamily] = []
"""The family of every model no registered family owns: transformers' (`tierlm.models.transformers.family`), which
registers itself here as the others register in FAMILIES."""


def register_family(family: ModelFamily, fallback: bool = False) -> ModelFamily:
    """Make `family` known by its name (its `model.architecture`), or as the fallback of every other model."""
    if fallback:
        FALLBACK[:] = [family]
        return family
    assert family.name and family.name != "transformers", f"a family needs its own name, got {family.name!r}"
    FAMILIES[family.name] = family
    return family


def fallback_family() -> ModelFamily:
    assert FALLBACK, "tierlm.models.transformers.family registers the fallback family (import tierlm.models)"
    return FALLBACK[0]


def unwrap_ddp(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DistributedDataParallel; FSDP2 and compile keep the class


def family_of(model: nn.Module) -> ModelFamily:
    """The family of a (possibly DDP-wrapped) model: a registered one that owns it, else transformers."""
    inner = unwrap_ddp(model)
    return next((f for f in FAMILIES.values() if f.owns(inner)), fallback_family())


def family_named(architecture: str) -> ModelFamily:
    """The family `model.architecture` names: a registered family, else transformers' `model_type`."""
    return FAMILIES.get(architecture) or fallback_family()


def native_description(folder: Path | str) -> dict | None:
    """The tierlm_model.json of a native model folder (None for other folders)."""
    path = Path(folder) / NATIVE_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        description = json.loads(path.read_text())
        assert isinstance(description, dict), "tierlm_model.json must hold an object"
    except (OSError, ValueError, AssertionError) as e:
        raise ModelLoadError(f"cannot read {path}: {first_line(e)}") from None
    return description


def family_for_folder(folder: Path | str) -> ModelFamily:
    """The family that wrote a model folder: its tierlm_model.json's "family" (folders from before
    families were named hold the native GPT), else transformers."""
    description = native_description(folder)
    if description is None:
        return fallback_family()
    name = description.get("family", "gpt")
    if name not in FAMILIES:
        raise ModelLoadError(
            f"{folder} holds a {name!r} model, a family this tierlm does not know (known: {', '.join(FAMILIES)})"
        )
    return FAMILIES[name]

"""The Qwen3 encoder–decoder as a model family (`model.architecture: qwen3_encdec`): built from the model
section (both stacks `model.depth` deep, `model.depth x model.aspect_ratio` wide, `model.head_dim`,
`model.n_kv_head`), run with the fused head + loss over its decoder, its two block lists sharded /
checkpointed / compiled block by block, saved as a tierlm folder (transformers has no class that
represents it exactly: T5 has relative position buckets and no rotary embedding or QK-norm).

A batch is what `tierlm.data.ul2.UL2DataCollator` makes: `input_ids` (encoder), `decoder_input_ids`,
`labels` and optional segment ids and positions for packed rows.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torch import nn

from tierlm.errors import ConfigError
from tierlm.models.native import NativeFamily
from tierlm.models.qwen3_encdec.model import Qwen3EncDecConfig, Qwen3ForSeq2SeqLM, initialize_from_qwen3
from tierlm.models.registry import register_family
from tierlm.primitives.losses import get_labels

BATCH_KEYS = ("encoder_segment_ids", "decoder_segment_ids", "encoder_positions", "decoder_positions")


class BlockLists:
    """Several `nn.ModuleList`s seen as one sequence of blocks: assigning `blocks[i]` (activation
    checkpointing's wrapper) replaces the block in the list it lives in."""

    def __init__(self, *lists: nn.ModuleList):
        self.lists = lists

    def _locate(self, index: int) -> tuple[nn.ModuleList, int]:
        for modules in self.lists:
            if index < len(modules):
                return modules, index
            index -= len(modules)
        raise IndexError(index)

    def __len__(self) -> int:
        return sum(len(m) for m in self.lists)

    def __getitem__(self, index: int) -> nn.Module:
        modules, i = self._locate(index)
        return modules[i]

    def __setitem__(self, index: int, module: nn.Module) -> None:
        modules, i = self._locate(index)
        modules[i] = module

    def __iter__(self) -> Iterator[nn.Module]:
        for modules in self.lists:
            yield from modules


class Qwen3EncDecFamily(NativeFamily):
    name = "qwen3_encdec"
    model_fields = ("depth", "aspect_ratio", "head_dim", "n_kv_head", "mlp_ratio", "rope_theta", "tie_embeddings")
    model_class = Qwen3ForSeq2SeqLM
    config_class = Qwen3EncDecConfig
    seq2seq = True

    def config_fields(self, model_config) -> dict[str, Any]:
        return {
            f"model.{k}": getattr(model_config, k)
            for k in (
                "depth",
                "aspect_ratio",
                "head_dim",
                "n_kv_head",
                "mlp_ratio",
                "rope_theta",
                "tie_embeddings",
                "num_sentinel_tokens",
            )
        }

    def encdec_config(self, model_config, vocab_size: int, max_seq_len: int) -> Qwen3EncDecConfig:
        heads = max(1, math.ceil(model_config.depth * model_config.aspect_ratio / model_config.head_dim))
        width = heads * model_config.head_dim
        hidden = 32 * math.ceil(width * (model_config.mlp_ratio or 8 / 3) / 32)
        config = Qwen3EncDecConfig(
            vocab_size=vocab_size,
            hidden_size=width,
            intermediate_size=hidden,
            num_encoder_layers=model_config.depth,
            num_decoder_layers=model_config.depth,
            num_attention_heads=heads,
            num_key_value_heads=model_config.n_kv_head or heads,
            head_dim=model_config.head_dim,
            rope_theta=model_config.rope_theta,
            max_position_embeddings=max_seq_len,
            tie_word_embeddings=model_config.tie_embeddings,
        )
        problems = config.validate()
        if problems:
            raise ConfigError(f"model: {problems[0]}")
        return config

    def build(self, model_config, vocab_size, max_seq_len, device="cpu", dtype=torch.float32):
        return self.build_from_config(self.encdec_config(model_config, vocab_size, max_seq_len), device, dtype)

    def import_transformers(
        self, folder, device="cpu", dtype=torch.float32, vocab_size=None, model_config=None
    ) -> Qwen3ForSeq2SeqLM:
        """A decoder-only transformers Qwen3 folder as the start of both stacks (`initialize_from_qwen3`),
        its vocabulary grown to `vocab_size` (the run's tokenizer: the source's with sentinels and mode tokens)."""
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(folder)
        if hf.model_type != "qwen3":
            raise ConfigError(
                f"{folder} holds a {hf.model_type!r} model; an encoder-decoder starts from a decoder-only Qwen3 "
                "(or drop model.model_name_or_path to train one from scratch)"
            )
        model = initialize_from_qwen3(folder, vocab_size=max(vocab_size or 0, hf.vocab_size))
        return model.to(device=device, dtype=dtype)

    # -- folders: tierlm's names; a tied head is saved once, as the embedding ----------------------
    def to_hf_state(self, model, state):
        out = dict(state)
        if model.config.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out

    def from_hf_state(self, model, state):
        out = dict(state)
        if model.config.tie_word_embeddings and "embed.weight" in out:
            out.setdefault("lm_head.weight", out["embed.weight"])
        return out

    # -- running ---------------------------------------------------------------------------
    @staticmethod
    def _inputs(batch) -> dict[str, torch.Tensor]:
        return {k: batch[k] for k in BATCH_KEYS if k in batch}

    def logits(self, model, batch):
        return model(batch["input_ids"], batch["decoder_input_ids"], **self._inputs(batch))

    def fuses_cross_entropy(self, model):
        return True

    def cross_entropy(self, model, batch, weights):
        return model(
            batch["input_ids"],
            batch["decoder_input_ids"],
            labels=get_labels(batch),
            loss_weights=weights,
            **self._inputs(batch),
        )

    def prefill(self, model, ids, max_len):
        """The prompt goes to the encoder; the decoder starts from `decoder_start_token_id`."""
        cache = model.start_cache(ids, max_len)
        start = torch.full((ids.shape[0], 1), model.config.decoder_start_token_id, dtype=torch.long, device=ids.device)
        return model.step(start, cache)[:, -1], cache

    def decode(self, model, tokens, cache):
        return model.step(tokens[:, None], cache)[:, -1]

    def repeat_cache(self, cache, n):
        cache.repeat(n)

    def max_seq_len(self, model):
        return model.config.max_position_embeddings

    def attention_shape(self, model):
        c = model.config
        return (
            c.num_encoder_layers + 2 * c.num_decoder_layers,
            c.num_attention_heads * c.head_dim,
        )  # decoder: self + cross

    def blocks(self, model):
        return BlockLists(model.encoder_blocks, model.decoder_blocks)


QWEN3_ENCDEC_FAMILY = register_family(Qwen3EncDecFamily())

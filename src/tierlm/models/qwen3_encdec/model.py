"""A Qwen3 encoder–decoder: a bidirectional encoder stack and a causal decoder stack with
cross-attention, built from the native GPT's Qwen3 blocks (RMSNorm, RoPE, QK-norm, grouped-query
attention, SwiGLU), one token embedding shared by both stacks (and tied to the head when configured).

Packed rows: `encoder_segment_ids` / `decoder_segment_ids` number the examples of a row from 1 (0 is
padding; `tierlm.data.ul2.UL2DataCollator` makes them). The encoder attends within a segment both ways,
the decoder causally within a segment, and cross-attention from a decoder segment to the encoder segment
of the same number, so a packed row computes what its examples would alone. Cross-attention has no
rotary embedding (decoder and encoder positions are not aligned).

`initialize_from_qwen3` builds one from a decoder-only Qwen3: both stacks start as the source's layers,
cross-attention's query / key / value (and their norms) as the same layer's self-attention and its output
projection at zero, so before training the decoder computes exactly the source language model (tested)
and learns to read the encoder from there (zero-initialised residual branches, as the native GPT's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.models.gpt.model import MLP, Attention, Block, LayerCache, fill_rotary
from tierlm.primitives.losses import linear_cross_entropy
from tierlm.primitives.models import materialize, meta_device


@dataclass
class Qwen3EncDecConfig:
    vocab_size: int = 32768
    hidden_size: int = 256
    intermediate_size: int = 768
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    pad_token_id: int = 0
    decoder_start_token_id: int = 0

    # The names the native GPT's blocks read.
    @property
    def n_embd(self) -> int:
        return self.hidden_size

    @property
    def n_head(self) -> int:
        return self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def norm_eps(self) -> float:
        return self.rms_norm_eps

    def validate(self) -> list[str]:
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        return problems


class CrossAttention(nn.Module):
    """Decoder queries over the encoder's keys and values (no rotary embedding), QK-normed, grouped-query."""

    def __init__(self, config: Qwen3EncDecConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)

    def memory(self, encoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder output's keys and values (B, Hkv, S, D): computed once per sequence when decoding."""
        B, S, _ = encoded.shape
        k = self.k_norm(self.k_proj(encoded).view(B, S, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(encoded).view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)
        return k, v

    def forward(
        self, x: torch.Tensor, memory: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k, v = memory
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv_head != self.n_head)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class DecoderBlock(nn.Module):
    """Self-attention (causal), cross-attention, MLP; each pre-normed on the residual stream."""

    def __init__(self, config: Qwen3EncDecConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = Attention(config)
        self.cross_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.cross = CrossAttention(config)
        self.mlp_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, memory, cross_mask, cache=None):
        """`memory`: the encoder's output (B, S, C), projected here (inside the block, where FSDP has gathered
        its weights), or its cross-attention keys and values already projected (decoding)."""
        if isinstance(memory, torch.Tensor):
            memory = self.cross.memory(memory)
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)
        x = x + self.cross(self.cross_norm(x), memory, cross_mask)
        return x + self.mlp(self.mlp_norm(x))


class EncDecCache:
    """What decoding keeps: the decoder's self-attention keys and values (a `LayerCache` per layer, up to
    `max_len` target positions) and each layer's cross-attention keys and values of the encoded prompt,
    computed once."""

    def __init__(self, layers: list[LayerCache], memories: list[tuple[torch.Tensor, torch.Tensor]]):
        self.layers, self.memories = layers, memories

    @property
    def length(self) -> int:
        return self.layers[0].length

    def repeat(self, n: int) -> None:
        for layer in self.layers:
            layer.repeat(n)
        self.memories = [(k.repeat_interleave(n, dim=0), v.repeat_interleave(n, dim=0)) for k, v in self.memories]


def segment_masks(
    encoder_segments: torch.Tensor | None, decoder_segments: torch.Tensor | None, Te: int, Td: int, device
):
    """(encoder self, decoder self, cross) boolean masks (B, 1, Tq, Tk); None where a plain mask does
    (no segments: the encoder sees everything, the decoder is causal, cross-attention sees everything).

    >>> enc, dec, cross = segment_masks(torch.tensor([[1, 1, 2]]), torch.tensor([[1, 2, 2]]), 3, 3, "cpu")
    >>> cross[0, 0].int().tolist(), dec[0, 0].int().tolist()
    ([[1, 1, 0], [0, 0, 1], [0, 0, 1]], [[1, 0, 0], [0, 1, 0], [0, 1, 1]])
    """
    if encoder_segments is None and decoder_segments is None:
        return None, None, None
    if encoder_segments is None or decoder_segments is None:
        raise ValueError("packed rows need both encoder_segment_ids and decoder_segment_ids")
    causal = torch.ones(Td, Td, dtype=torch.bool, device=device).tril()
    enc = encoder_segments[:, None, :, None] == encoder_segments[:, None, None, :]
    dec = (decoder_segments[:, None, :, None] == decoder_segments[:, None, None, :]) & causal
    cross = decoder_segments[:, None, :, None] == encoder_segments[:, None, None, :]
    return enc, dec, cross


class Qwen3ForSeq2SeqLM(nn.Module):
    """Encoder–decoder language model; `forward` returns decoder logits (B, Td, V) or, with `labels`,
    (sum of cross-entropy, per-token cross-entropy) from the head fused into the loss."""

    def __init__(self, config: Qwen3EncDecConfig):
        super().__init__()
        problems = config.validate()
        assert not problems, f"invalid Qwen3EncDecConfig: {'; '.join(problems)}"
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.encoder_blocks = nn.ModuleList(Block(config) for _ in range(config.num_encoder_layers))
        self.encoder_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.decoder_blocks = nn.ModuleList(DecoderBlock(config) for _ in range(config.num_decoder_layers))
        self.decoder_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rope_cos", torch.empty(config.max_position_embeddings, config.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(config.max_position_embeddings, config.head_dim), persistent=False)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def init_rotary(self) -> None:
        fill_rotary(self, self.config.head_dim, self.config.rope_theta)

    @torch.no_grad()
    def init_weights(self) -> None:
        """From scratch: uniform with std 1/sqrt(width) in, zero residual projections out (the native GPT's scheme)."""
        c = self.config
        self.init_rotary()
        bound = (3.0 / c.hidden_size) ** 0.5
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.uniform_(module.weight, -bound, bound)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        for block in [*self.encoder_blocks, *self.decoder_blocks]:
            nn.init.zeros_(block.attn.o_proj.weight)
            nn.init.zeros_(block.mlp.down_proj.weight)
        for block in self.decoder_blocks:
            nn.init.zeros_(block.cross.o_proj.weight)
        nn.init.normal_(self.embed.weight, std=c.hidden_size**-0.5 if c.tie_word_embeddings else 1.0)
        if not c.tie_word_embeddings:
            nn.init.normal_(self.lm_head.weight, std=0.001)

    def _rotary(self, positions: torch.Tensor | None, T: int):
        if positions is None:
            return self.rope_cos[:T], self.rope_sin[:T]
        return self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)

    def encode(
        self,
        input_ids: torch.Tensor,
        encoder_segment_ids: torch.Tensor | None = None,
        encoder_positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The encoder's output (B, Te, C)."""
        B, T = input_ids.shape
        if mask is None and encoder_segment_ids is not None:
            mask = encoder_segment_ids[:, None, :, None] == encoder_segment_ids[:, None, None, :]
        bidirectional = mask if mask is not None else torch.ones(1, 1, T, T, dtype=torch.bool, device=input_ids.device)
        cos, sin = self._rotary(encoder_positions, T)
        x = self.embed(input_ids)
        for block in self.encoder_blocks:
            x = block(x, cos, sin, bidirectional)
        return self.encoder_norm(x)

    def decode(
        self,
        decoder_input_ids: torch.Tensor,
        encoded: torch.Tensor,
        self_mask=None,
        cross_mask=None,
        decoder_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder's final hidden states (B, Td, C) over `encoded`."""
        cos, sin = self._rotary(decoder_positions, decoder_input_ids.shape[1])
        x = self.embed(decoder_input_ids)
        for block in self.decoder_blocks:
            x = block(x, cos, sin, self_mask, encoded, cross_mask)
        return self.decoder_norm(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        encoder_segment_ids: torch.Tensor | None = None,
        decoder_segment_ids: torch.Tensor | None = None,
        encoder_positions: torch.Tensor | None = None,
        decoder_positions: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        **_unused,
    ):
        enc_mask, dec_mask, cross_mask = segment_masks(
            encoder_segment_ids, decoder_segment_ids, input_ids.shape[1], decoder_input_ids.shape[1], input_ids.device
        )
        encoded = self.encode(input_ids, mask=enc_mask, encoder_positions=encoder_positions)
        hidden = self.decode(decoder_input_ids, encoded, dec_mask, cross_mask, decoder_positions)
        if labels is None:
            return self.lm_head(hidden)
        weights = loss_weights.flatten() if loss_weights is not None else None
        total, losses = linear_cross_entropy(hidden.flatten(0, 1), self.lm_head.weight, labels.flatten(), weights)
        return total, losses.view(labels.shape)

    @torch.no_grad()
    def start_cache(self, input_ids: torch.Tensor, max_len: int) -> EncDecCache:
        """Encode a batch of prompts (one per row, unpadded) and prepare to decode up to `max_len` targets."""
        c = self.config
        assert max_len <= c.max_position_embeddings, (
            f"max_len {max_len} > max_position_embeddings {c.max_position_embeddings}"
        )
        encoded = self.encode(input_ids)
        dtype = encoded.dtype
        layers = [
            LayerCache(input_ids.shape[0], c.num_key_value_heads, max_len, c.head_dim, input_ids.device, dtype)
            for _ in self.decoder_blocks
        ]
        return EncDecCache(layers, [block.cross.memory(encoded) for block in self.decoder_blocks])

    def step(self, decoder_ids: torch.Tensor, cache: EncDecCache) -> torch.Tensor:
        """Logits (B, T, V) of T more target tokens, continuing `cache`."""
        start, T = cache.length, decoder_ids.shape[1]
        cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        x = self.embed(decoder_ids)
        for block, layer, memory in zip(self.decoder_blocks, cache.layers, cache.memories):
            x = block(x, cos, sin, None, memory, None, layer)
        return self.lm_head(self.decoder_norm(x))


def build_qwen3_encdec(
    config: Qwen3EncDecConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Qwen3ForSeq2SeqLM:
    """Build on the meta device, allocate on `device`, initialise once.

    >>> model = build_qwen3_encdec(Qwen3EncDecConfig(vocab_size=50, hidden_size=32, intermediate_size=64, head_dim=16))
    >>> model(torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 5))).shape
    torch.Size([2, 5, 50])
    """
    with meta_device():
        model = Qwen3ForSeq2SeqLM(config)
    model = materialize(model, device)
    model.tie_weights()
    model.init_weights()
    return model.to(dtype=dtype) if dtype != torch.float32 else model


# -- from a decoder-only Qwen3 -------------------------------------------------------------------
def _source_model(path_or_model):
    if isinstance(path_or_model, nn.Module):
        return path_or_model
    from transformers import AutoModelForCausalLM

    from tierlm.primitives.hub import hub_access

    with hub_access(path_or_model, "model"):
        return AutoModelForCausalLM.from_pretrained(
            str(path_or_model) if isinstance(path_or_model, Path) else path_or_model, dtype=torch.float32
        )


@torch.no_grad()
def initialize_from_qwen3(
    path_or_model, num_sentinel_tokens: int = 100, vocab_size: int | None = None, num_mode_tokens: int = 3
) -> Qwen3ForSeq2SeqLM:
    """An encoder–decoder whose two stacks start as a decoder-only Qwen3 (a `Qwen3ForCausalLM`, a folder or
    a hub id). The vocabulary grows to `vocab_size` (default: the source's plus the sentinels and mode
    tokens), the new rows set to the mean of the source's embeddings; see the module docstring for the rest.
    """
    source = _source_model(path_or_model)
    sc = source.config
    assert getattr(sc, "model_type", None) == "qwen3", (
        f"initialize_from_qwen3 takes a Qwen3 model, got {getattr(sc, 'model_type', type(source))}"
    )
    old_vocab = source.get_input_embeddings().weight.shape[0]
    config = Qwen3EncDecConfig(
        vocab_size=vocab_size or old_vocab + num_sentinel_tokens + num_mode_tokens,
        hidden_size=sc.hidden_size,
        intermediate_size=sc.intermediate_size,
        num_encoder_layers=sc.num_hidden_layers,
        num_decoder_layers=sc.num_hidden_layers,
        num_attention_heads=sc.num_attention_heads,
        num_key_value_heads=sc.num_key_value_heads,
        head_dim=getattr(sc, "head_dim", None) or sc.hidden_size // sc.num_attention_heads,
        rope_theta=sc.rope_parameters["rope_theta"] if getattr(sc, "rope_parameters", None) else sc.rope_theta,
        rms_norm_eps=sc.rms_norm_eps,
        max_position_embeddings=sc.max_position_embeddings,
        tie_word_embeddings=bool(sc.tie_word_embeddings),
        pad_token_id=sc.pad_token_id if sc.pad_token_id is not None else 0,
    )
    assert config.vocab_size >= old_vocab, f"vocab_size {config.vocab_size} < the source's {old_vocab}"
    model = build_qwen3_encdec(config)
    src = source.model

    def grown(weight: torch.Tensor) -> torch.Tensor:
        extra = weight.mean(dim=0, keepdim=True).expand(config.vocab_size - old_vocab, -1)
        return torch.cat([weight, extra])

    model.embed.weight.copy_(grown(src.embed_tokens.weight))
    if not config.tie_word_embeddings:
        model.lm_head.weight.copy_(grown(source.lm_head.weight))
    for layers in (model.encoder_blocks, model.decoder_blocks):
        for block, layer in zip(layers, src.layers):
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                getattr(block.attn, name).weight.copy_(getattr(attn, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(block.mlp, name).weight.copy_(getattr(layer.mlp, name).weight)
            block.attn_norm.weight.copy_(layer.input_layernorm.weight)
            block.mlp_norm.weight.copy_(layer.post_attention_layernorm.weight)
            if isinstance(block, DecoderBlock):
                for name in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"):
                    getattr(block.cross, name).weight.copy_(getattr(attn, name).weight)
                block.cross.o_proj.weight.zero_()
                block.cross_norm.weight.copy_(layer.input_layernorm.weight)
    model.encoder_norm.weight.copy_(src.norm.weight)
    model.decoder_norm.weight.copy_(src.norm.weight)
    return model


__all__ = ["Qwen3EncDecConfig", "Qwen3ForSeq2SeqLM", "build_qwen3_encdec", "initialize_from_qwen3", "segment_masks"]

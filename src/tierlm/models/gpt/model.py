"""The native GPT: one readable file, no distributed code.

Depth-parameterised as nanochat: width = depth x aspect_ratio (rounded up to whole heads).
Pre-norm blocks with RMSNorm, rotary position embeddings, QK-norm, grouped-query attention
through `scaled_dot_product_attention`, and a SwiGLU MLP. The architecture is exactly Qwen3's
(without biases or sliding windows), so `tierlm.models.gpt.hf_export` can write a folder that
`transformers.AutoModelForCausalLM.from_pretrained` loads with the same logits.

Build on the meta device, allocate, then initialise in one place:

>>> config = GPTConfig(depth=2, aspect_ratio=32, head_dim=16, vocab_size=64, max_seq_len=32)
>>> with torch.device("meta"):
...     model = GPT(config)
>>> model = model.to_empty(device="cpu")
>>> model.tie_weights()  # to_empty allocates every parameter anew; shared ones must be shared again
>>> model.init_weights()
>>> model(torch.randint(0, 64, (2, 8))).shape  # (B, T, V)
torch.Size([2, 8, 64])
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.models.gpt.documents import (
    PackedDocuments,
    attend_documents,
    document_causal_mask,
    packed_mask,
    window_mask,
)
from tierlm.models.kv_cache import KVCache, LayerCache
from tierlm.models.moe import MoE, MoEConfig, SwiGLU
from tierlm.primitives.losses import linear_cross_entropy
from tierlm.primitives.models import materialize, meta_device


@dataclass
class GPTConfig:
    """Shape of the native GPT. Every other size follows from `depth` and `aspect_ratio`."""

    depth: int = 4
    """Number of transformer blocks."""
    aspect_ratio: int = 64
    """Model width per layer of depth: n_embd = depth * aspect_ratio, rounded up to whole heads."""
    head_dim: int = 64
    """Width of one attention head."""
    n_kv_head: int | None = None
    """Key/value heads for grouped-query attention; None means one per query head."""
    vocab_size: int = 32768
    """Token vocabulary size (rows of the embedding and the LM head)."""
    max_seq_len: int = 2048
    """Longest sequence the rotary tables cover."""
    mlp_ratio: float = 8 / 3
    """SwiGLU hidden width as a multiple of n_embd (rounded up to a multiple of 32)."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the LM head."""
    window_pattern: str = "L"
    """Attention span per layer, tiled over the depth: L full context, S a sliding window of
    `short_window` tokens (nanochat's "SSSL"); the last layer is always L."""
    short_window: int = 1024
    """Tokens an S layer's query sees, itself included (transformers' `sliding_window`)."""
    width: int | None = None
    """The model width when it is not `depth` x `aspect_ratio` (a transformers Qwen3-MoE imported as it is)."""
    num_heads: int | None = None
    """Query heads when not width / head_dim (Qwen3's attention can be wider than its residual stream)."""
    moe: MoEConfig | None = None
    """Each block's feed-forward a mixture of experts (`tierlm.models.moe`, in Qwen3-MoE's layout) instead of one
    SwiGLU; None: dense. A dict (as tierlm_model.json holds it) is read as a MoEConfig."""

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)

    def layer_windows(self) -> list[int | None]:
        """Each layer's window (None: full context).

        >>> GPTConfig(depth=5, window_pattern="SL", short_window=8).layer_windows()
        [8, None, 8, None, None]
        """
        pattern = self.window_pattern.upper()
        windows = [self.short_window if pattern[i % len(pattern)] == "S" else None for i in range(self.depth)]
        return windows[:-1] + [None]

    @property
    def n_embd(self) -> int:
        return self.width or math.ceil(self.depth * self.aspect_ratio / self.head_dim) * self.head_dim

    @property
    def n_head(self) -> int:
        return self.num_heads or self.n_embd // self.head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def intermediate_size(self) -> int:
        return math.ceil(self.mlp_ratio * self.n_embd / 32) * 32

    def validate(self) -> list[str]:
        """Problems with this config, as 'field: reason' strings (empty when valid)."""
        problems = []
        for name in ("depth", "aspect_ratio", "head_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.n_kv_head is not None and (self.n_kv_head <= 0 or self.n_head % self.n_kv_head):
            problems.append(f"n_kv_head ({self.n_kv_head}) must divide the number of heads ({self.n_head})")
        if self.mlp_ratio <= 0:
            problems.append(f"mlp_ratio must be > 0, got {self.mlp_ratio}")
        if not self.window_pattern or set(self.window_pattern.upper()) - {"S", "L"}:
            problems.append(
                f"window_pattern must be a string of S (sliding window) and L (full context), got "
                f"{self.window_pattern!r}"
            )
        if self.short_window < 1:
            problems.append(f"short_window must be >= 1, got {self.short_window}")
        if self.moe is not None:  # what transformers' Qwen3-MoE, the folder's twin, can hold
            if self.moe.score != "softmax" or self.moe.shared_experts:
                problems.append(
                    "moe: sigmoid routing and shared experts have no transformers Qwen3-MoE twin to save as; use "
                    "score=softmax and shared_experts=0"
                )
            if "S" in self.window_pattern.upper():
                problems.append("moe: sliding-window layers with experts are not saved as Qwen3-MoE yet; use L")
            if self.moe.expert_width <= 0:
                problems.append(f"moe.expert_width must be > 0, got {self.moe.expert_width}")
        return problems

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def rotary_tables(head_dim: int, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (..., head_dim) for integer `positions`, in fp32, halves duplicated (as transformers)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq  # (..., head_dim / 2)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The sine table as `apply_rotary` takes it (and the models' `rope_sin` buffers hold it): first half negated."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) by the position's angle; first and second halves pair up. `sin` is `signed_sin`'s, so
    the turn is x cos + (x's halves swapped) sin: the same numbers as transformers' x cos + rotate_half(x) sin, whose
    negation of x is folded into the table (a kernel fewer each call, two a layer of a GPU's decode step).

    >>> x, (cos, sin) = torch.randn(1, 2, 3, 8), rotary_tables(8, torch.arange(3), 10000.0)
    >>> textbook = x * cos + torch.cat((-x[..., 4:], x[..., :4]), dim=-1) * sin
    >>> torch.equal(apply_rotary(x, cos, signed_sin(sin)), textbook)
    True
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + swapped * sin.to(x.dtype)


def turn_keys(model: nn.Module, offset: int):
    """A function moving keys (B, H, T, D) a model cached at positions p to p + `offset` (negative: back): one more
    rotary turn, R(p + d) = R(d) R(p), in float32 then back to the keys' dtype. Attention depends only on the distance
    between a query and a key, so the turned keys are those of the same tokens `offset` positions later."""
    if offset == 0:
        return lambda k: k
    cos = model.rope_cos[abs(offset)].float()
    sin = model.rope_sin[abs(offset)].float() * (1 if offset > 0 else -1)
    return lambda k: apply_rotary(k.float(), cos, sin).to(k.dtype)


@torch.no_grad()
def fill_rotary(module: nn.Module, head_dim: int, theta: float) -> None:
    """Fill a model's non-persistent `rope_cos` / `rope_sin` buffers (positions x head_dim) with their tables (the
    sine signed for `apply_rotary`)."""
    positions = torch.arange(module.rope_cos.shape[0], device=module.rope_cos.device)
    cos, sin = rotary_tables(head_dim, positions, theta)
    module.rope_cos.copy_(cos)
    module.rope_sin.copy_(signed_sin(sin))


class Attention(nn.Module):
    def __init__(self, config: GPTConfig, window: int | None = None):
        super().__init__()
        self.window = window  # None: full context; else a sliding window of this many tokens
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=False)
        # QK-norm keeps attention logits bounded, which lets tiny and large models share LRs.
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
        self.qkv_widths = (self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim)
        self.qkv_weight: torch.Tensor | None = None
        """q, k and v's weights as one matrix, their rows stacked: set only while a fixed-shape decode step runs
        (`tierlm.rollout.static_decode.packed`, whose weights are views of it), so the three are one matmul; read
        only without gradients."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | PackedDocuments | None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """`mask`: None (causal), a boolean (B, 1, T, T) mask, or `PackedDocuments` (attended one by
        one in eager mode; under `torch.compile` the document mask, so the graph does not depend on
        the documents' lengths)."""
        B, T, _ = x.shape
        if self.qkv_weight is None or torch.is_grad_enabled():  # (a plain tensor: no gradient reaches the weights)
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = F.linear(x, self.qkv_weight).split(self.qkv_widths, dim=-1)
        # Heads counted from the projections' widths: under tensor parallelism each rank holds a share of them.
        q = self.q_norm(q.view(B, T, -1, self.head_dim)).transpose(1, 2)  # (B, H, T, D)
        k = self.k_norm(k.view(B, T, -1, self.head_dim)).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        gqa = self.n_kv_head != self.n_head
        if cache is not None:  # decoding: attend to everything cached so far plus these T tokens
            k, v = cache.append(k, v)
        if self.window is not None and k.shape[2] > self.window:  # a sliding window that cuts something off
            band = window_mask(T, k.shape[2], self.window, x.device)  # (T, S)
            if isinstance(mask, PackedDocuments):
                mask = document_causal_mask(mask.position_ids)
            mask = band if mask is None else mask & band
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        if T == 1 and cache is not None:  # one new token attends to everything its row cached: no causal mask
            seen = mask if cache.position is not None else cache.attention_mask()  # (the model's, at a position)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=gqa)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        if isinstance(mask, PackedDocuments):
            if not torch.compiler.is_compiling():  # eager: each document alone
                return self.o_proj(attend_documents(q, k, v, mask.lengths).transpose(1, 2).reshape(B, T, -1))
            mask = document_causal_mask(mask.position_ids)  # compiled: one graph for every layout of documents
        if mask is None and k.shape[2] != T:  # T new queries after cached keys: causal, offset by the cache
            mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril(diagonal=k.shape[2] - T)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(SwiGLU):
    """The dense feed-forward: one SwiGLU of the config's intermediate size (an expert's shape in tierlm.models.moe)."""

    def __init__(self, config: GPTConfig):
        super().__init__(config.n_embd, config.intermediate_size)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, window: int | None = None):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = Attention(config, window)
        self.mlp_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        moe = getattr(config, "moe", None)  # the encoder-decoder builds these blocks from a config without experts
        self.mlp = MoE(config.n_embd, moe) if moe is not None else MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | PackedDocuments | None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        problems = config.validate()
        assert not problems, f"invalid GPTConfig: {'; '.join(problems)}"
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, window) for window in config.layer_windows())
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()
        # Rotary tables are derived, not learned: non-persistent, rebuilt by init_weights().
        self.register_buffer("rope_cos", torch.empty(config.max_seq_len, config.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(config.max_seq_len, config.head_dim), persistent=False)

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when configured (again after `to_empty`, which unties)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """The single source of initial values (nanochat's scheme)."""
        c = self.config
        self.init_rotary()
        bound = math.sqrt(3.0 / c.n_embd)  # uniform with std 1/sqrt(n_embd)
        for block in self.blocks:
            for linear in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                nn.init.uniform_(linear.weight, -bound, bound)
            # Zero output projections: every block starts as the identity on the residual stream.
            nn.init.zeros_(block.attn.o_proj.weight)
            if isinstance(block.mlp, MoE):  # each expert as a dense MLP; the router uniform, its bias zero
                for weight in (block.mlp.router.weight, block.mlp.experts.gate_up_proj):
                    nn.init.uniform_(weight, -bound, bound)
                nn.init.zeros_(block.mlp.experts.down_proj)
                block.mlp.expert_bias.zero_()
            else:
                for linear in (block.mlp.gate_proj, block.mlp.up_proj):
                    nn.init.uniform_(linear.weight, -bound, bound)
                nn.init.zeros_(block.mlp.down_proj.weight)
        for module in self.modules():
            if isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        if c.tie_embeddings:
            nn.init.normal_(self.embed.weight, std=c.n_embd**-0.5)
        else:
            nn.init.normal_(self.embed.weight, std=1.0)
            nn.init.normal_(self.lm_head.weight, std=0.001)

    @torch.no_grad()
    def init_rotary(self) -> None:
        fill_rotary(self, self.config.head_dim, self.config.rope_theta)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        labels: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        routes: torch.Tensor | None = None,
        replay: bool = False,
        logits_at: torch.Tensor | None = None,
    ):
        """Logits (B, T, V) for token ids (B, T); with `labels`, the loss instead.

        `position_ids` (B, T) mark packed documents: positions restart at each one, and attention
        stays inside each one, so a packed row computes what its documents would alone.
        With a `cache`, the T tokens continue the cached ones (incremental decoding).
        With `labels` (B, T; -100 not trained) and optional `loss_weights` (B, T), returns
        (sum of weighted cross-entropy, per-token cross-entropy (B, T)) from the LM head fused
        into the loss (`linear_cross_entropy`): the (B, T, V) logits never exist at once.
        With `routes` (B, T, MoE layers, k): the experts a sampler chose for each token (-1 where unknown), each
        mixture-of-experts layer counts where its own choice agrees (`routing_agreement`) and, with `replay`, uses
        them instead (rollout routing replay).
        With `logits_at` (B,): the logits of that one position of each row only, (B, V) — the last prompt tokens of a
        prefill, without the (B, T, V) of every position.
        """
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        assert start + T <= self.config.max_seq_len, (
            f"sequence length {start + T} > max_seq_len {self.config.max_seq_len}"
        )
        assert cache is None or position_ids is None, "a KV cache decodes one sequence per row: no packed position_ids"
        if cache is not None and cache.position is not None:  # one token at a tensor position: shapes never change
            cos, sin = self.rope_cos[cache.position], self.rope_sin[cache.position]  # (1, D)
            mask = cache.layers[0].attention_mask()  # the layers share one timeline: made once a step, not a layer
        elif position_ids is None:
            cos, sin, mask = self.rope_cos[start : start + T], self.rope_sin[start : start + T], None  # (T, D)
        else:
            cos, sin = (
                self.rope_cos[position_ids].unsqueeze(1),
                self.rope_sin[position_ids].unsqueeze(1),
            )  # (B, 1, T, D)
            mask = packed_mask(position_ids)
        x = self.embed(input_ids)  # (B, T, C)
        with self._sampled_routes(routes, replay):
            for i, block in enumerate(self.blocks):
                x = block(x, cos, sin, mask, cache.layers[i]) if cache is not None else block(x, cos, sin, mask)
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at]  # (B, C)
        x = self.norm(x)
        if labels is None:
            return self.lm_head(x)
        assert logits_at is None, "logits_at picks logits: no labels with it"
        weights = loss_weights.flatten() if loss_weights is not None else None
        total, losses = linear_cross_entropy(x.flatten(0, 1), self.lm_head.weight, labels.flatten(), weights)
        if self.training and self.config.moe is not None:  # the routers' terms, per trained token like the loss
            tokens = weights.sum() if weights is not None else (labels != -100).sum()
            total = total + sum(layer.router_loss() for layer in self.moe_layers()) * tokens
        return total, losses.view(labels.shape)

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """Parameters; `active`: those one token goes through (a mixture of experts counts its experts_per_token
        of num_experts experts).

        >>> moe = MoEConfig(num_experts=4, experts_per_token=1, expert_width=32)
        >>> gpt = GPT(GPTConfig(depth=1, aspect_ratio=32, head_dim=16, vocab_size=10, max_seq_len=8, moe=moe))
        >>> gpt.num_params() - gpt.num_params(active=True) == 3 * 3 * 32 * 32
        True
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding and not self.config.tie_embeddings:
            n -= self.embed.weight.numel()
        if active:
            n -= sum(layer.idle_params() for layer in self.moe_layers())
        return n

    def moe_layers(self) -> list[MoE]:
        """The mixture-of-experts layers, in depth order (each holds its last forward's `routes` and `stats`)."""
        return [block.mlp for block in self.blocks if isinstance(block.mlp, MoE)]

    @contextlib.contextmanager
    def _sampled_routes(self, routes: torch.Tensor | None, replay: bool):
        """Each MoE layer given its slice of `routes` (B, T, layers, k) for one forward (`forward`)."""
        layers = self.moe_layers() if routes is not None else []
        assert routes is None or routes.shape[2] == len(layers), f"routes for {routes.shape[2]} of {len(layers)} layers"
        for i, layer in enumerate(layers):
            layer.sampler_routes, layer.replay = routes[:, :, i].reshape(-1, routes.shape[-1]), replay
        try:
            yield
        finally:
            for layer in layers:
                layer.sampler_routes, layer.replay = None, False

    def last_routes(self) -> torch.Tensor | None:
        """The experts each token of the last forward went to, (tokens, MoE layers, k) in the order of its (B, T)
        tokens; None for a dense model."""
        layers = self.moe_layers()
        return torch.stack([layer.routes for layer in layers], dim=1) if layers else None

    def routing_agreement(self) -> dict[str, torch.Tensor]:
        """Where the last forward, given a sampler's `routes`, chose as the sampler did: the tokens whose routes were
        known and those routed alike in every layer, the (token, layer) router decisions known and alike. Empty
        when no routes were given."""
        layers = [layer for layer in self.moe_layers() if "route_known" in layer.stats]
        if not layers:
            return {}
        known = layers[0].stats["route_known"]
        agree = torch.stack([layer.stats["route_agree"] for layer in layers]).all(dim=0)
        return {
            "route_tokens": known.sum(),
            "route_tokens_agree": agree.sum(),
            "route_decisions": sum(layer.stats["route_known"].sum() for layer in layers),
            "route_decisions_agree": sum(layer.stats["route_agree"].sum() for layer in layers),
        }


def build_gpt(config: GPTConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> GPT:
    """Build on the meta device, allocate on `device`, initialise once.

    >>> build_gpt(GPTConfig(depth=1, aspect_ratio=16, head_dim=16, vocab_size=10, max_seq_len=8)).num_params()
    4496
    """
    with meta_device():
        model = GPT(config)
    model = materialize(model, device)
    model.tie_weights()
    model.init_weights()
    return model.to(dtype=dtype) if dtype != torch.float32 else model

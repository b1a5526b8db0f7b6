"""GPT-2 (Radford et al., 2019), as one readable file: learned absolute positions, pre-norm
LayerNorm blocks, GELU (tanh) MLP of 4x width, biases, dropout, input and output embeddings tied,
N(0, 0.02) init with the residual projections scaled by 1/sqrt(2 n_layer).

The module names follow transformers' `GPT2LMHeadModel` (without its `transformer.` prefix, and
with `nn.Linear` where it has `Conv1D`), so `tierlm.models.gpt2.family` converts weights both ways
by a rename and a transpose. Packed rows (`position_ids` restarting per document) attend inside
each document, as the native GPT does; the KV cache is the native GPT's.

>>> config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, block_size=16)
>>> with torch.device("meta"):
...     model = GPT2(config)
>>> model = model.to_empty(device="cpu")
>>> model.tie_weights()
>>> model.init_weights()
>>> model(torch.randint(0, 50, (2, 8))).shape  # (B, T, V)
torch.Size([2, 8, 50])
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.models.gpt.documents import PackedDocuments, attend_documents, document_causal_mask, packed_mask
from tierlm.models.gpt2.delay import MODES as DELAY_MODES
from tierlm.models.gpt2.delay import CouplingWarmup
from tierlm.models.gpt2.kv import CausalKVPruning
from tierlm.models.gpt2.ra import ReciprocalGates, SelfRestart
from tierlm.models.gpt2.rmlp import ReciprocalMLP
from tierlm.models.kv_cache import KVCache, LayerCache
from tierlm.primitives.losses import linear_cross_entropy


@dataclass
class GPT2Config:
    """Shape of a GPT-2 model (124M: 12 layers, 12 heads, 768 wide, 50,257 tokens, 1,024 positions)."""

    n_layer: int = 12
    """Transformer blocks."""
    n_head: int = 12
    """Attention heads per block."""
    n_embd: int = 768
    """Model width."""
    vocab_size: int = 50257
    """Token vocabulary size (rows of the tied embedding)."""
    block_size: int = 1024
    """Learned positions: the longest sequence."""
    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches (training only)."""
    bias: bool = True
    """Biases in every linear layer and LayerNorm (GPT-2 has them; transformers needs them to load it)."""
    layer_norm_eps: float = 1e-5
    """LayerNorm epsilon."""
    ra_r: int = 0
    """Unified RA: reciprocal dimensions R of each head (0: plain attention). See `gpt2_ra`."""
    ra_per_head: bool = False
    """Unified RA: one (w_std, w_rec) gate pair per head instead of per layer."""
    self_restart: bool = False
    """Self-restart: each head's output mixes back a learned share of its value vector."""
    mlp_ratio: float = 4.0
    """MLP hidden width as a multiple of n_embd (GPT-2: 4)."""
    rmlp_r_ff: int = 0
    """R-MLP: reciprocal hidden units (0: plain MLP). See `gpt2_rmlp`."""
    rmlp_mixer: bool = False
    """R-MLP: a learned R_ff x R_ff map on the reciprocal units."""
    rmlp_gate_alpha: bool = False
    """R-MLP: one more learned scalar on the reciprocal units."""
    rmlp_attention_aware: bool = False
    """R-MLP: the reciprocal units also read the block's attention output."""
    kv_prune: bool = False
    """Causal KV pruning: each query attends to its most important keys only. See `gpt2_kv`."""
    kv_keep_ratio: float = 0.382
    """KV pruning: the share of visible keys each query keeps (at least kv_recency)."""
    kv_recency: int = 64
    """KV pruning: the newest keys always kept."""
    kv_learned: bool = False
    """KV pruning: learn the keep ratio (soft selection, so it gets a gradient)."""
    kv_values_only: bool = False
    """KV pruning: keep every key in the softmax, drop only the pruned keys' values."""
    delay_mode: str = "none"
    """Delayed activation of the reciprocal gates: none | step | ramp | loss_stability. See `gpt2_delay`."""
    delay_start_step: int = 75
    """Delayed activation: the step the gates come on at (step) or start rising at (ramp)."""
    delay_ramp_steps: int = 100
    """Delayed activation (ramp): steps from 0 to full."""
    delay_window: int = 50
    """Delayed activation (loss_stability): training losses in the window."""
    delay_cv_threshold: float = 0.05
    """Delayed activation (loss_stability): switch on when std / mean of the window falls below this."""

    @property
    def mlp_hidden(self) -> int:
        return int(round(self.mlp_ratio * self.n_embd))

    # What the shared KV cache reads.
    @property
    def depth(self) -> int:
        return self.n_layer

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def num_kv_heads(self) -> int:
        return self.n_head

    @property
    def max_seq_len(self) -> int:
        return self.block_size

    def validate(self) -> list[str]:
        """Problems with this config, as 'field: reason' strings (empty when valid)."""
        problems = [
            f"{name} must be > 0, got {getattr(self, name)}"
            for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")
            if getattr(self, name) <= 0
        ]
        if not problems and self.n_embd % self.n_head:
            problems.append(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if not 0 <= self.dropout < 1:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if self.delay_mode not in DELAY_MODES:
            problems.append(f"delay.mode must be one of {DELAY_MODES}, got {self.delay_mode!r}")
        if not problems and self.rmlp_r_ff and not 0 < self.rmlp_r_ff < self.mlp_hidden:
            problems.append(
                f"rmlp.r_ff must be between 1 and the MLP width - 1 ({self.mlp_hidden - 1}), got {self.rmlp_r_ff}"
            )
        if not problems and self.ra_r and not 0 < self.ra_r < self.head_dim:
            problems.append(f"ra.r must be between 1 and head_dim - 1 ({self.head_dim - 1}), got {self.ra_r}")
        return problems

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.attn_dropout = nn.Dropout(config.dropout)  # its p is the attention kernel's (`tierlm.models.dropout`)
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        # Research variants (gpt2_ra): None in plain GPT-2.
        self.ra = (
            ReciprocalGates(config.n_head, config.head_dim, config.ra_r, config.ra_per_head) if config.ra_r else None
        )
        self.restart = SelfRestart(config.n_head) if config.self_restart else None
        self.kv = (
            CausalKVPruning(config.kv_keep_ratio, config.kv_recency, config.kv_learned, config.kv_values_only)
            if config.kv_prune
            else None
        )

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | PackedDocuments | None,
        cache: LayerCache | None = None,
        coupling: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        # Heads counted from the projection's width: under tensor parallelism a rank's c_attn holds its heads' q, k, v.
        q, k, v = (
            t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=-1)
        )  # (B, H, T, D)
        if self.ra is not None:
            q, k = self.ra(q, k, coupling)
        new_v = v
        if cache is not None:
            k, v = cache.append(k, v)
        p = self.attn_dropout.p if self.training else 0.0
        if self.kv is not None:  # each query over its kept keys; decoding recomputes the sequence (gpt2_family)
            assert cache is None, (
                "KV pruning scores keys with every earlier query: decode by recomputing, not with a KV cache"
            )
            y = self.kv(q, k, v, document_causal_mask(mask.position_ids) if isinstance(mask, PackedDocuments) else mask)
        elif isinstance(mask, PackedDocuments) and p == 0.0 and not torch.compiler.is_compiling():
            y = attend_documents(q, k, v, mask.lengths)  # each packed document alone, no (T, T) mask
        else:
            if isinstance(mask, PackedDocuments):
                mask = document_causal_mask(mask.position_ids)
            if mask is None and k.shape[2] != T:  # T new queries after cached keys
                mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril(diagonal=k.shape[2] - T)
            if mask is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        if self.restart is not None:
            y = self.restart(y, new_v)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).flatten(2)))


class MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, attention_out: torch.Tensor | None = None, coupling: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))  # GPT-2's "gelu_new"


class Block(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = (
            MLP(config)
            if not config.rmlp_r_ff
            else ReciprocalMLP(
                config.n_embd,
                config.mlp_hidden,
                config.rmlp_r_ff,
                config.bias,
                config.dropout,
                config.rmlp_mixer,
                config.rmlp_gate_alpha,
                config.rmlp_attention_aware,
            )
        )

    def forward(
        self, x: torch.Tensor, mask, cache: LayerCache | None = None, coupling: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`coupling`: the delayed-activation scale of the reciprocal gates (None: no delay)."""
        attention_out = self.attn(self.ln_1(x), mask, cache, coupling)
        x = x + attention_out
        return x + self.mlp(self.ln_2(x), attention_out, coupling)


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        problems = config.validate()
        assert not problems, f"invalid GPT2Config: {'; '.join(problems)}"
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.coupling = (
            CouplingWarmup(
                config.delay_mode,
                config.delay_start_step,
                config.delay_ramp_steps,
                config.delay_window,
                config.delay_cv_threshold,
            )
            if config.delay_mode != "none"
            else None
        )
        self.tie_weights()

    def tie_weights(self) -> None:
        """GPT-2 shares the token embedding with the LM head (again after `to_empty`, which unties)."""
        self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """The single source of initial values: N(0, 0.02), residual projections / sqrt(2 n_layer), zero biases."""
        for name, module in self.named_modules():
            if (
                isinstance(module, (nn.Linear, nn.Embedding))
                and module is not self.lm_head
                and not name.endswith("mixer")
            ):
                std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
            if isinstance(module, (ReciprocalGates, SelfRestart, ReciprocalMLP, CouplingWarmup, CausalKVPruning)):
                module.init_weights()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        labels: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
    ):
        """Logits (B, T, V) for token ids (B, T); with `labels` (-100 not trained) and optional
        `loss_weights`, (sum of weighted cross-entropy, per-token cross-entropy (B, T)) from the head
        fused into the loss. `position_ids` mark packed documents; a `cache` continues decoding. With `logits_at`
        (B,): the logits of that one position of each row only, (B, V)."""
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        assert start + T <= self.config.block_size, f"sequence length {start + T} > block_size {self.config.block_size}"
        assert cache is None or position_ids is None, "a KV cache decodes one sequence per row: no packed position_ids"
        if position_ids is None:
            positions, mask = torch.arange(start, start + T, device=input_ids.device), None
        else:
            positions = position_ids
            mask = packed_mask(position_ids)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))  # (B, T, C)
        coupling = self.coupling.scale if self.coupling is not None else None
        for i, block in enumerate(self.h):
            x = block(x, mask, cache.layers[i] if cache is not None else None, coupling)
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at]  # (B, C)
        x = self.ln_f(x)
        if labels is None:
            return self.lm_head(x)
        assert logits_at is None, "logits_at picks logits: no labels with it"
        weights = loss_weights.flatten() if loss_weights is not None else None
        total, losses = linear_cross_entropy(x.flatten(0, 1), self.lm_head.weight, labels.flatten(), weights)
        return total, losses.view(labels.shape)

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if exclude_embedding else n

"""NEFTune: uniform noise on the token embeddings while a model trains (Jain et al., 2023, "NEFTune: Noisy Embeddings
Improve Instruction Finetuning"), TRL's and transformers' `neftune_noise_alpha`.

Each embedding gets noise drawn from U(-s, s), s = alpha / sqrt(L x d), for rows of L tokens and d-wide embeddings:
the rule of transformers' `neftune_post_forward_hook`, written out here because that function has moved between
transformers releases (`trainer_utils`, then `integrations.neftune`); tests/test_models.py checks the two agree. In
evaluation mode the embeddings pass unchanged. Rows of packed conversations count as one row of L tokens, as in TRL's
packed batches.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def add_embedding_noise(model: nn.Module, alpha: float) -> RemovableHandle:
    """Noise `model`'s token embeddings while it trains (its family's input embedding), until the handle is removed.

    >>> from tierlm.models import GPTConfig, build_gpt
    >>> model = build_gpt(GPTConfig(depth=1, aspect_ratio=16, head_dim=16, vocab_size=32, max_seq_len=8))
    >>> ids = torch.arange(8)[None]
    >>> handle = add_embedding_noise(model, 5.0)
    >>> noisy = model.embed(ids) - model.embed.weight[ids]
    >>> bool(noisy.abs().max() <= 5.0 / math.sqrt(8 * 16)) and bool(noisy.abs().max() > 0)
    True
    >>> bool((model.eval().embed(ids) == model.embed.weight[ids]).all())
    True
    """
    from tierlm.models.registry import family_of

    def noise(module: nn.Module, args, embeddings: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return embeddings
        scale = alpha / math.sqrt(embeddings.size(-2) * embeddings.size(-1))
        return embeddings + torch.empty_like(embeddings).uniform_(-scale, scale)

    return family_of(model).input_embedding(model).register_forward_hook(noise)

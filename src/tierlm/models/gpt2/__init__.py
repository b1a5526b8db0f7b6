"""GPT-2 and its research variants (RA, R-MLP, KV pruning, delayed coupling): the model (`model`), the
variants beside it, its family adapter (`family`) and its JAX twin (`jax`)."""

from tierlm.models.gpt2.model import GPT2, GPT2Config

__all__ = ["GPT2", "GPT2Config"]

"""The native GPT (RoPE, RMSNorm, QK-norm, GQA via SDPA, SwiGLU): the model (`model`), its family adapter
(`family`), its transformers Qwen3 twin (`hf_export`) and its JAX twin (`jax`)."""

from tierlm.models.gpt.model import GPT, GPTConfig, build_gpt

__all__ = ["GPT", "GPTConfig", "build_gpt"]

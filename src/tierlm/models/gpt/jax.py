"""The native GPT (`tierlm.models.gpt.model.GPT`) in `jax.numpy`: the same computation over the same
parameters, named as the PyTorch model names them, so weights move between the two unchanged
(`params_from_torch` / `params_into_torch`) and the logits agree to float rounding (tested to 1e-5).

Pre-norm blocks with RMSNorm, rotary embeddings (halves paired, as transformers), QK-norm,
grouped-query attention, SwiGLU; packed documents through `position_ids` (positions restart and
attention stays inside each document); sliding-window layers as the config's `window_pattern` says.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tierlm.models.gpt.model import GPTConfig

Params = dict[str, jax.Array]


def params_from_torch(model: torch.nn.Module) -> Params:
    """The model's trainable parameters as float32 JAX arrays, by name (a tied head appears once, as the embedding)."""
    return {
        name: jnp.asarray(p.detach().float().cpu().numpy()) for name, p in model.named_parameters() if p.requires_grad
    }


@torch.no_grad()
def params_into_torch(params: Params, model: torch.nn.Module) -> None:
    """Copy `params` into the model's parameters of the same names."""
    named = dict(model.named_parameters())
    for name, value in params.items():
        named[name].copy_(torch.from_numpy(np.array(value, dtype=np.float32)).to(named[name].dtype))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rotary_tables(head_dim: int, positions: jax.Array, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin (..., head_dim) for integer positions (as `tierlm.models.gpt.model.rotary_tables`)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def attention_mask(position_ids: jax.Array, window: int | None) -> jax.Array:
    """(B, 1, T, T) boolean: causal, inside each document (a document starts where positions do not
    continue), and within `window` tokens when the layer has one."""
    B, T = position_ids.shape
    starts = jnp.concatenate([jnp.ones((B, 1), bool), position_ids[:, 1:] != position_ids[:, :-1] + 1], axis=1)
    documents = jnp.cumsum(starts, axis=1)
    q, k = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    mask = (k <= q) & (documents[:, :, None] == documents[:, None, :])
    if window is not None:
        mask = mask & (k > q - window)
    return mask[:, None]


def forward(
    params: Params, config: GPTConfig, input_ids: jax.Array, position_ids: jax.Array | None = None, head: bool = True
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Logits (B, T, V) of token ids (B, T); `head=False`: (the final hidden states (B, T, D), the head's weight
    (V, D)), for a loss that fuses the head (`tierlm.primitives.jax_losses.linear_cross_entropy`)."""
    c = config
    B, T = input_ids.shape
    H, Hkv, D = c.n_head, c.num_kv_heads, c.head_dim
    positions = position_ids if position_ids is not None else jnp.broadcast_to(jnp.arange(T), (B, T))
    cos, sin = rotary_tables(D, positions, c.rope_theta)  # (B, T, D)
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D)
    masks = {w: attention_mask(positions, w) for w in set(c.layer_windows())}
    x = params["embed.weight"][input_ids]
    for i, window in enumerate(c.layer_windows()):
        p = f"blocks.{i}."
        h = rms_norm(x, params[p + "attn_norm.weight"], c.norm_eps)

        def heads(name: str, n: int) -> jax.Array:
            return (h @ params[p + f"attn.{name}.weight"].T).reshape(B, T, n, D)

        q = rms_norm(heads("q_proj", H), params[p + "attn.q_norm.weight"], c.norm_eps).transpose(0, 2, 1, 3)
        k = rms_norm(heads("k_proj", Hkv), params[p + "attn.k_norm.weight"], c.norm_eps).transpose(0, 2, 1, 3)
        v = heads("v_proj", Hkv).transpose(0, 2, 1, 3)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = (
            jnp.repeat(k, H // Hkv, axis=1),
            jnp.repeat(v, H // Hkv, axis=1),
        )  # query head h reads kv head h // (H / Hkv)
        scores = jnp.where(masks[window], (q @ k.transpose(0, 1, 3, 2)) / np.sqrt(D), -jnp.inf)
        y = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B, T, H * D)
        x = x + y @ params[p + "attn.o_proj.weight"].T
        h = rms_norm(x, params[p + "mlp_norm.weight"], c.norm_eps)
        gated = jax.nn.silu(h @ params[p + "mlp.gate_proj.weight"].T) * (h @ params[p + "mlp.up_proj.weight"].T)
        x = x + gated @ params[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, params["norm.weight"], c.norm_eps)
    weight = params["embed.weight"] if c.tie_embeddings else params["lm_head.weight"]
    return x @ weight.T if head else (x, weight)

"""GPT-2 (`tierlm.models.gpt2.model.GPT2`, the plain architecture) in `jax.numpy`, over the PyTorch model's
parameter names: learned positions, pre-norm LayerNorm blocks, one fused q/k/v projection, GELU (tanh)
MLP, the head tied to the token embedding. The research variants (reciprocal attention, R-MLP, KV
pruning, delayed gates) and dropout have no JAX twin: `unsupported` names what a config uses of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tierlm.models.gpt.jax import Params, attention_mask
from tierlm.models.gpt2.model import GPT2Config


def unsupported(config: GPT2Config) -> list[str]:
    """The config's settings this JAX forward does not compute (empty: it computes the model exactly)."""
    asked = {
        "ra_r": config.ra_r,
        "self_restart": config.self_restart,
        "rmlp_r_ff": config.rmlp_r_ff,
        "kv_prune": config.kv_prune,
        "delay_mode": config.delay_mode != "none",
        "dropout": config.dropout,
    }
    return [name for name, value in asked.items() if value]


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array | None, eps: float) -> jax.Array:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    out = (x - mean) * jax.lax.rsqrt(var + eps) * weight
    return out + bias if bias is not None else out


def forward(
    params: Params, config: GPT2Config, input_ids: jax.Array, position_ids: jax.Array | None = None, head: bool = True
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Logits (B, T, V) of token ids (B, T); `position_ids` restart at each packed document. `head=False`: (the
    final hidden states, the tied head's weight), for a loss that fuses the head."""
    c = config
    B, T = input_ids.shape
    H, C = c.n_head, c.n_embd
    D = C // H
    positions = position_ids if position_ids is not None else jnp.broadcast_to(jnp.arange(T), (B, T))
    mask = attention_mask(positions, None)

    def linear(x, name):
        y = x @ params[name + ".weight"].T
        return y + params[name + ".bias"] if name + ".bias" in params else y

    def norm(x, name):
        return layer_norm(x, params[name + ".weight"], params.get(name + ".bias"), c.layer_norm_eps)

    x = params["wte.weight"][input_ids] + params["wpe.weight"][positions]
    for i in range(c.n_layer):
        p = f"h.{i}."
        q, k, v = (
            t.reshape(B, T, H, D).transpose(0, 2, 1, 3)
            for t in jnp.split(linear(norm(x, p + "ln_1"), p + "attn.c_attn"), 3, axis=-1)
        )
        scores = jnp.where(mask, (q @ k.transpose(0, 1, 3, 2)) / np.sqrt(D), -jnp.inf)
        y = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
        x = x + linear(y, p + "attn.c_proj")
        x = x + linear(jax.nn.gelu(linear(norm(x, p + "ln_2"), p + "mlp.c_fc"), approximate=True), p + "mlp.c_proj")
    x = norm(x, "ln_f")
    return x @ params["wte.weight"].T if head else (x, params["wte.weight"])

"""`tierlm.strategies.rl_losses` in `jax.numpy`, for the JAX backend: the same losses over the same inputs (the
trainer's log-probs of the sampled tokens, the rollout batch, the trained-token mask), returning (summed loss,
normaliser) — tested equal to the PyTorch functions. A row of `RL_LOSSES` names its twin here (`RLLoss.jax`).
The loss statistics (clip fractions, GSPO's ratios) are the PyTorch backend's only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tierlm.strategies.rl_terms import LossSettings

Result = tuple[jax.Array, jax.Array]


def per_token(values: jax.Array, like: jax.Array) -> jax.Array:
    return values if values.ndim == 2 else jnp.broadcast_to(values[:, None], like.shape)


def ratio_to_old(logprobs: jax.Array, batch: dict) -> jax.Array:
    old = batch.get("old_logprobs")
    return jnp.exp(logprobs - (jax.lax.stop_gradient(logprobs) if old is None else old))


def clipped_surrogate(ratio: jax.Array, advantages: jax.Array, low: float | None, high: float | None) -> jax.Array:
    unclipped = ratio * advantages
    if low is None and high is None:
        return -unclipped
    clipped = jnp.clip(ratio, None if low is None else 1.0 - low, None if high is None else 1.0 + high)
    return -jnp.minimum(unclipped, clipped * advantages)


def kl_term(logprobs: jax.Array, batch: dict, coef: float) -> jax.Array | float:
    ref = batch.get("ref_logprobs")
    if ref is None or not coef:
        return 0.0
    delta = ref - logprobs
    return coef * (jnp.exp(delta) - delta - 1.0)


def normalise(per_tok: jax.Array, mask: jax.Array, how: str, max_new_tokens: int = 0) -> Result:
    masked, rows = per_tok * mask, (mask.sum(axis=1) > 0).astype(jnp.float32)
    if how == "tokens":
        return masked.sum(), mask.sum()
    if how == "sequences":
        return (masked.sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)).sum(), rows.sum()
    assert how == "constant", f"unknown normalisation {how!r}"
    return masked.sum(), rows.sum() * max_new_tokens


def token_loss(logprobs, batch, mask, s: LossSettings) -> Result:
    advantages = per_token(batch["advantages"], logprobs)
    loss = clipped_surrogate(ratio_to_old(logprobs, batch), advantages, s.clip_low, s.clip_high)
    if batch.get("importance") is not None:
        loss = loss * batch["importance"]
    return normalise(loss + kl_term(logprobs, batch, s.kl_coef), mask, s.normalise, s.max_new_tokens)


def cispo(logprobs, batch, mask, s: LossSettings) -> Result:
    ratio = jax.lax.stop_gradient(ratio_to_old(logprobs, batch))
    weight = jnp.minimum(ratio, 1.0 + s.clip_high) if s.clip_high is not None else ratio
    loss = -weight * per_token(batch["advantages"], logprobs) * logprobs
    if batch.get("importance") is not None:
        loss = loss * batch["importance"]
    return normalise(loss + kl_term(logprobs, batch, s.kl_coef), mask, s.normalise, s.max_new_tokens)


def gspo(logprobs, batch, mask, s: LossSettings) -> Result:
    lengths = jnp.maximum(mask.sum(axis=1), 1.0)
    old = batch.get("old_logprobs")
    delta = (logprobs - (jax.lax.stop_gradient(logprobs) if old is None else old)) * mask
    seq_ratio = jnp.exp(delta.sum(axis=1) / lengths)
    loss = clipped_surrogate(seq_ratio, batch["advantages"], s.clip_low, s.clip_high)
    if batch.get("importance") is not None:
        loss = loss * (batch["importance"] * mask).sum(axis=1) / lengths
    kl = kl_term(logprobs, batch, s.kl_coef)
    if not isinstance(kl, float):
        loss = loss + (kl * mask).sum(axis=1) / lengths
    rows = (mask.sum(axis=1) > 0).astype(jnp.float32)
    return (loss * rows).sum(), rows.sum()

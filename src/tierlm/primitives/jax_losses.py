"""The strategies' losses in `jax.numpy` (twins of `tierlm.primitives.losses` and the DPO loss, tested
equal), and `jax_twin`, which finds a strategy function's twin: the method `jax_<name>` of the same
object (`CrossEntropyStrategy.compute_loss` -> `jax_compute_loss`).

>>> import jax.numpy as jnp
>>> total, count = cross_entropy_sum(jnp.zeros((1, 2, 4)), jnp.array([[0, -100]]))  # uniform over 4: ln 4 a token
>>> round(float(total), 4), float(count)
(1.3863, 1.0)
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

IGNORE_INDEX = -100


def token_weights(labels: jax.Array, loss_mask: jax.Array | None = None) -> jax.Array:
    weights = (labels != IGNORE_INDEX).astype(jnp.float32)
    return weights * loss_mask.astype(jnp.float32) if loss_mask is not None else weights


def token_logprobs(logits: jax.Array, labels: jax.Array, temperature: float = 1.0) -> jax.Array:
    """log p(label) at every position (B, T) under softmax(logits / temperature); 0 where unlabelled."""
    scaled = logits.astype(jnp.float32)
    scaled = scaled / temperature if temperature not in (0.0, 1.0) else scaled
    # the label's logit less the log-sum-exp: no (B, T, V) array of log-probs beside the logits
    picked = jnp.take_along_axis(scaled, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    return (picked - jax.nn.logsumexp(scaled, axis=-1)) * (labels != IGNORE_INDEX)


def per_token_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return -token_logprobs(logits, labels)


def cross_entropy_sum(
    logits: jax.Array, labels: jax.Array, loss_mask: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(summed cross-entropy over the trained tokens, their count), as `tierlm.primitives.losses.cross_entropy_sum`."""
    weights = token_weights(labels, loss_mask)
    return (per_token_cross_entropy(logits, labels) * weights).sum(), weights.sum()


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float):
    """Per-pair (loss, chosen reward, rejected reward), as `tierlm.strategies.dpo.dpo_loss`."""
    chosen, rejected = beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected)
    return -jax.nn.log_sigmoid(chosen - rejected), chosen, rejected


def jax_twin(fn: Callable | None) -> Callable | None:
    """The JAX twin of a strategy's loss or metrics function (None stays None)."""
    if fn is None:
        return None
    owner, name = getattr(fn, "__self__", None), getattr(fn, "__name__", repr(fn))
    twin = getattr(owner, f"jax_{name.lstrip('_')}", None) if owner is not None else None
    if twin is None:
        raise NotImplementedError(
            f"{type(owner).__name__ if owner is not None else name} has no JAX twin of {name} "
            f"(a method jax_{name.lstrip('_')}); the JAX backend trains pretraining, SFT, DPO and the policy-gradient losses"
        )
    return twin

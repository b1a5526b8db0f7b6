"""The strategies' losses in `jax.numpy` (twins of `tierlm.primitives.losses` and the DPO loss, tested
equal), and `jax_twin`, which finds a strategy function's twin: the method `jax_<name>` of the same
object (`CrossEntropyStrategy.compute_loss` -> `jax_compute_loss`).

>>> import jax.numpy as jnp
>>> total, count = cross_entropy_sum(jnp.zeros((1, 2, 4)), jnp.array([[0, -100]]))  # uniform over 4: ln 4 a token
>>> round(float(total), 4), float(count)
(1.3863, 1.0)
"""

from __future__ import annotations

from functools import partial
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


def linear_cross_entropy(
    hidden: jax.Array, weight: jax.Array, labels: jax.Array, loss_mask: jax.Array | None = None, chunk_rows: int = 0
) -> tuple[jax.Array, jax.Array]:
    """`cross_entropy_sum(hidden @ weight.T, labels, loss_mask)` without the (B, T, V) logits: the LM head fused into
    the loss, `chunk_rows` rows at a time (0: as many as keep a chunk's logits near 2^25 elements), each chunk's
    gradients by `hidden` and `weight` computed as its logits are (a custom VJP: no chunk is recomputed), as
    `tierlm.primitives.losses.linear_cross_entropy` does for PyTorch.

    >>> h, w = jnp.ones((1, 2, 3)), jnp.zeros((4, 3))   # zero logits: ln 4 a token
    >>> total, count = linear_cross_entropy(h, w, jnp.array([[1, -100]]))
    >>> round(float(total), 4), float(count)
    (1.3863, 1.0)
    """
    weights = token_weights(labels, loss_mask)
    rows = chunk_rows or max(64, (1 << 25) // weight.shape[0])
    flat = hidden.reshape(-1, hidden.shape[-1])
    total = _fused_loss(flat, weight, labels.reshape(-1), weights.reshape(-1), min(rows, flat.shape[0]))
    return total, weights.sum()


def _chunked(hidden, weight, labels, weights, rows: int, with_grad: bool):
    """(summed loss, d loss / d hidden, d loss / d weight) over chunks of `rows` rows (gradients None without
    `with_grad`)."""
    n, width = hidden.shape
    pad = -n % rows
    if pad:
        hidden = jnp.concatenate([hidden, jnp.zeros((pad, width), hidden.dtype)])
        labels = jnp.concatenate([labels, jnp.zeros(pad, labels.dtype)])
        weights = jnp.concatenate([weights, jnp.zeros(pad, weights.dtype)])
    chunks = (hidden.reshape(-1, rows, width), labels.reshape(-1, rows), weights.reshape(-1, rows))

    def one(grad_weight, chunk):
        h, y, w = chunk
        logits = (h @ weight.T).astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, jnp.maximum(y, 0)[:, None], axis=-1)[:, 0]
        loss = ((lse - picked) * w).sum()
        if not with_grad:
            return grad_weight, (loss, None)
        d = (jnp.exp(logits - lse[:, None]) - jax.nn.one_hot(jnp.maximum(y, 0), logits.shape[-1])) * w[:, None]
        return grad_weight + d.T @ h.astype(jnp.float32), (loss, (d @ weight.astype(jnp.float32)).astype(h.dtype))

    start = jnp.zeros(weight.shape, jnp.float32) if with_grad else None
    grad_weight, (losses, grad_hidden) = jax.lax.scan(one, start, chunks)
    if not with_grad:
        return losses.sum(), None, None
    return losses.sum(), grad_hidden.reshape(-1, width)[:n], grad_weight.astype(weight.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_loss(hidden, weight, labels, weights, rows):
    return _chunked(hidden, weight, labels, weights, rows, with_grad=False)[0]


def _fused_forward(hidden, weight, labels, weights, rows):
    total, grad_hidden, grad_weight = _chunked(hidden, weight, labels, weights, rows, with_grad=True)
    return total, (grad_hidden, grad_weight)


def _fused_backward(rows, saved, g):
    grad_hidden, grad_weight = saved
    return g * grad_hidden, g * grad_weight, None, None


_fused_loss.defvjp(_fused_forward, _fused_backward)


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float):
    """Per-pair (loss, chosen reward, rejected reward), as `tierlm.strategies.preference_losses.dpo_loss`."""
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
            f"(a method jax_{name.lstrip('_')}); the JAX backend trains pretraining, SFT, DPO and the policy-gradient "
            "losses"
        )
    return twin

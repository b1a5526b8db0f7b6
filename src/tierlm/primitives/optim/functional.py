"""Tier 1: optimizers in the functional form of the trainer API, `init(params) -> state` and
`update(grads, state, params) -> (updates, state)`, the same protocol for PyTorch tensors and JAX
arrays (`tierlm.primitives.optim.jax.JaxAdam`).

`params`, `grads` and `updates` are pytrees: one tensor, or a dict of them (a model's named
parameters). Nothing is changed in place: the caller applies `params + updates` (`apply_updates`),
and the new state is a new object. The math is torch's own, step for step: `PyTorchAdam` with
`weight_decay` is `torch.optim.AdamW` (decoupled decay), without it `torch.optim.Adam`; `FunctionalMuon`
is `tierlm.primitives.optim.muon.Muon` (tested equal to each).

>>> import torch
>>> opt = PyTorchAdam(lr=0.1)
>>> params = {"w": torch.ones(2)}
>>> state = opt.init(params)
>>> updates, state = opt.update({"w": torch.tensor([1.0, -1.0])}, state, params)
>>> apply_updates(params, updates)["w"].tolist(), state["step"]
([0.8999999761581421, 1.100000023841858], 1)
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

import torch

from tierlm.errors import ConfigError
from tierlm.primitives.optim.muon import newton_schulz_orthogonalize

Tree = TypeVar("Tree")
OptimizerState = Any  # a dict of tensors for the PyTorch forms, an optax pytree for JAX


@runtime_checkable
class Optimizer(Protocol):
    """The functional optimizer protocol (JAX/PyTorch agnostic)."""

    def init(self, params: Any) -> OptimizerState:
        """The initial state for parameters shaped like `params`."""
        ...

    def update(self, grads: Any, opt_state: OptimizerState, params: Any) -> tuple[Any, OptimizerState]:
        """(updates to add to the parameters, the new state)."""
        ...


def require_functional(optimizer: Any) -> None:
    """Refuse, in one line, an optimizer that is neither a backend's own nor of the functional protocol.

    >>> require_functional(PyTorchAdam())
    """
    if not all(callable(getattr(optimizer, method, None)) for method in ("init", "update")):
        raise ConfigError(
            f"{type(optimizer).__name__} is neither the backend's optimizer nor a functional one (init(params), "
            "update(grads, state, params))"
        )


def tree_map(fn: Callable, tree, *rest):
    """`fn` over the leaves of a tensor or a dict of tensors (and the matching leaves of `rest`)."""
    if isinstance(tree, dict):
        return {k: tree_map(fn, v, *(r[k] for r in rest)) for k, v in tree.items()}
    return fn(tree, *rest)


def apply_updates(params: Tree, updates: Tree) -> Tree:
    """`params + updates`, leaf by leaf (optax's `apply_updates`)."""
    return tree_map(lambda p, u: p + u, params, updates)


class PyTorchAdam:
    """Adam / AdamW in the functional form (the trainer API's `PyTorchAdam`): bias-corrected moments, `eps`
    added to the corrected root, decoupled weight decay `lr * weight_decay * param` (AdamW).

    `lr` may be a number or a function of the step count (1, 2, ...), as an optax schedule.
    """

    def __init__(
        self,
        lr: float | Callable[[int], float] = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        assert 0 <= beta1 < 1 and 0 <= beta2 < 1, f"betas must be in [0, 1), got {beta1}, {beta2}"
        self.lr, self.betas, self.eps, self.weight_decay = lr, (beta1, beta2), eps, weight_decay

    def init(self, params) -> dict:
        return {
            "step": 0,
            "exp_avg": tree_map(torch.zeros_like, params),
            "exp_avg_sq": tree_map(torch.zeros_like, params),
        }

    def update(self, grads, opt_state: dict, params) -> tuple[Any, dict]:
        (beta1, beta2), step = self.betas, opt_state["step"] + 1
        lr = self.lr(step) if callable(self.lr) else self.lr
        exp_avg = tree_map(lambda m, g: m.lerp(g, 1 - beta1), opt_state["exp_avg"], grads)
        exp_avg_sq = tree_map(lambda v, g: v * beta2 + (1 - beta2) * g * g, opt_state["exp_avg_sq"], grads)
        correction1, correction2 = 1 - beta1**step, 1 - beta2**step

        def leaf(m, v, p):
            update = -(lr / correction1) * m / ((v / correction2).sqrt() + self.eps)
            return update - lr * self.weight_decay * p if self.weight_decay else update

        updates = tree_map(leaf, exp_avg, exp_avg_sq, params)
        return updates, {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


class FunctionalMuon:
    """Muon (`tierlm.primitives.optim.muon.Muon`) in the functional form, for 2-D parameters: Nesterov momentum,
    the direction orthogonalised by Newton–Schulz, scaled by `sqrt(max(1, rows / cols))`, decoupled
    weight decay."""

    def __init__(
        self,
        lr: float | Callable[[int], float] = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        ns_dtype: torch.dtype = torch.float32,
    ):
        self.lr, self.momentum, self.nesterov, self.ns_steps = lr, momentum, nesterov, ns_steps
        self.weight_decay, self.ns_dtype = weight_decay, ns_dtype

    def init(self, params) -> dict:
        def check(p):
            assert p.ndim == 2, f"Muon takes matrices only; a parameter of shape {tuple(p.shape)} belongs with Adam"
            return torch.zeros_like(p)

        return {"step": 0, "momentum_buffer": tree_map(check, params)}

    def update(self, grads, opt_state: dict, params) -> tuple[Any, dict]:
        step, m = opt_state["step"] + 1, self.momentum
        lr = self.lr(step) if callable(self.lr) else self.lr
        buffers = tree_map(lambda b, g: b.lerp(g, 1 - m), opt_state["momentum_buffer"], grads)

        def leaf(b, g, p):
            direction = g.lerp(b, m) if self.nesterov else b
            rows, cols = p.shape
            update = (
                -lr
                * max(1.0, rows / cols) ** 0.5
                * newton_schulz_orthogonalize(direction, self.ns_steps, self.ns_dtype)
            )
            return update - lr * self.weight_decay * p if self.weight_decay else update

        return tree_map(leaf, buffers, grads, params), {"step": step, "momentum_buffer": buffers}

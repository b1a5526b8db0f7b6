"""The functional optimizer API's `JaxAdam`: optax's Adam / AdamW behind the functional optimizer protocol
(`init(params)`, `update(grads, state, params) -> (updates, state)`; see
`tierlm.primitives.optim.functional` for the PyTorch forms), with its hyperparameters injected so the
learning rate can change every step without recompiling (`with_learning_rate`), and its moments
readable and writable (`moments` / `with_moments`) so a PyTorch checkpoint's AdamW state crosses over.

>>> import jax.numpy as jnp
>>> opt = JaxAdam(lr=0.1)
>>> params = {"w": jnp.ones(2)}
>>> state = opt.init(params)
>>> updates, state = opt.update({"w": jnp.array([1.0, -1.0])}, state, params)
>>> [round(float(x), 4) for x in (params["w"] + updates["w"])]
[0.9, 1.1]
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax


class JaxAdam:
    """Adam (`weight_decay=0`) or AdamW (decoupled decay `lr * weight_decay * param`, as
    `torch.optim.AdamW`) from optax."""

    def __init__(
        self, lr: float = 0.001, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0
    ):
        self.optax_optimizer = optax.inject_hyperparams(optax.adamw)(
            learning_rate=lr, b1=beta1, b2=beta2, eps=eps, weight_decay=weight_decay
        )

    def init(self, params: Any) -> Any:
        return self.optax_optimizer.init(params)

    def update(self, grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
        return self.optax_optimizer.update(grads, opt_state, params)

    @staticmethod
    def with_learning_rate(opt_state: Any, lr: float) -> Any:
        """The state with the learning rate the next update uses set to `lr`."""
        return opt_state._replace(
            hyperparams={**opt_state.hyperparams, "learning_rate": jnp.asarray(lr, dtype=jnp.float32)}
        )

    @staticmethod
    def moments(opt_state: Any) -> tuple[int, Any, Any]:
        """(steps taken, first moments, second moments), pytrees shaped like the parameters."""
        adam = opt_state.inner_state[0]
        assert isinstance(adam, optax.ScaleByAdamState), f"not an Adam state: {type(adam).__name__}"
        return int(adam.count), adam.mu, adam.nu

    @staticmethod
    def with_moments(opt_state: Any, count: int, mu: Any, nu: Any) -> Any:
        """The state with the given steps and moments (e.g. read from a PyTorch AdamW checkpoint)."""
        adam, *rest = opt_state.inner_state
        adam = adam._replace(count=jnp.asarray(count, dtype=jnp.int32), mu=mu, nu=nu)
        return opt_state._replace(count=jnp.asarray(count, dtype=jnp.int32), inner_state=(adam, *rest))

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
import numpy as np
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

    @staticmethod
    def with_hyperparameters(opt_state: Any, group: dict) -> Any:
        """The state for a step at a PyTorch parameter group's settings (AdamW: its LR)."""
        return JaxAdam.with_learning_rate(opt_state, group["lr"])

    def torch_state(self, opt_state: Any) -> dict[str, dict]:
        """{parameter: torch.optim.AdamW's state of it} (none before the first step)."""
        count, mu, nu = self.moments(opt_state)
        step = np.float32(count)  # a float32 scalar, as torch.optim.AdamW keeps it
        return {n: {"step": step, "exp_avg": mu[n], "exp_avg_sq": nu[n]} for n in mu} if count else {}

    def from_torch_state(self, opt_state: Any, states: dict[str, dict]) -> Any:
        """`opt_state` with the moments of torch.optim.AdamW's `states` ({parameter: its state}), when it has any."""
        if not states or "exp_avg" not in next(iter(states.values())):
            return opt_state
        count = int(next(iter(states.values()))["step"])
        mu = {n: jnp.asarray(s["exp_avg"].float().numpy()) for n, s in states.items()}
        nu = {n: jnp.asarray(s["exp_avg_sq"].float().numpy()) for n, s in states.items()}
        return self.with_moments(opt_state, count, mu, nu)


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # tierlm.primitives.optim.muon's (Keller Jordan's quintic)


def newton_schulz_orthogonalize(update: jnp.ndarray, steps: int = 5) -> jnp.ndarray:
    """`tierlm.primitives.optim.muon.newton_schulz_orthogonalize` in jax.numpy (fp32): an approximation of U V^T.

    >>> g = jnp.arange(12.0).reshape(3, 4) ** 0.5
    >>> s = jnp.linalg.svd(newton_schulz_orthogonalize(g), compute_uv=False)
    >>> bool(s.min() > 0.5), bool(s.max() < 1.3)
    (True, True)
    """
    a, b, c = NS_COEFFICIENTS
    tall = update.shape[0] > update.shape[1]
    x = update.T if tall else update
    x = x / (jnp.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class JaxMuon:
    """`tierlm.primitives.optim.muon.Muon` behind the functional optimizer protocol: Nesterov momentum, Newton-Schulz
    orthogonalisation, the step scaled by sqrt(max(1, rows / cols)), decoupled weight decay — its LR, momentum and
    weight decay in the state, so nanochat's schedules of all three compile nothing.

    >>> opt = JaxMuon(lr=0.1)
    >>> params = {"w": jnp.zeros((2, 2))}
    >>> updates, _ = opt.update({"w": jnp.diag(jnp.array([10.0, 1.0]))}, opt.init(params), params)
    >>> [round(float(x), 3) for x in jnp.diag(updates["w"])]   # both directions move by about lr, as torch's Muon
    [-0.07, -0.071]
    """

    def __init__(
        self, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, weight_decay=0.0
    ):
        self.nesterov, self.ns_steps = nesterov, ns_steps
        self.hyperparameters = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}

    def init(self, params: dict) -> dict:
        return {
            "momentum_buffer": {k: jnp.zeros_like(v) for k, v in params.items()},
            "hyperparams": {k: jnp.asarray(v, dtype=jnp.float32) for k, v in self.hyperparameters.items()},
        }

    def update(self, grads: dict, opt_state: dict, params: dict) -> tuple[dict, dict]:
        h, buffers, updates = opt_state["hyperparams"], {}, {}
        lr, momentum, decay = h["lr"], h["momentum"], h["weight_decay"]
        for name, grad in grads.items():
            buffer = opt_state["momentum_buffer"][name]
            buffer = buffer + (1 - momentum) * (grad - buffer)  # torch's buf.lerp_(grad, 1 - momentum)
            direction = grad + momentum * (buffer - grad) if self.nesterov else buffer
            rows, cols = params[name].shape
            step = newton_schulz_orthogonalize(direction, self.ns_steps) * (lr * max(1.0, rows / cols) ** 0.5)
            updates[name] = -lr * decay * params[name] - step
            buffers[name] = buffer
        return updates, {"momentum_buffer": buffers, "hyperparams": h}

    @staticmethod
    def torch_state(opt_state: dict) -> dict[str, dict]:
        """{parameter: tierlm's PyTorch Muon's state of it}."""
        return {n: {"momentum_buffer": b} for n, b in opt_state["momentum_buffer"].items()}

    @staticmethod
    def from_torch_state(opt_state: dict, states: dict[str, dict]) -> dict:
        """`opt_state` with the momentum buffers of the PyTorch Muon's `states`, when it has them."""
        if not states or "momentum_buffer" not in next(iter(states.values())):
            return opt_state
        buffers = {n: jnp.asarray(s["momentum_buffer"].float().numpy()) for n, s in states.items()}
        return {**opt_state, "momentum_buffer": buffers}

    @staticmethod
    def with_hyperparameters(opt_state: dict, group: dict) -> dict:
        """The state for a step at a PyTorch Muon group's LR, momentum and weight decay."""
        keys = ("lr", "momentum", "weight_decay")
        return {**opt_state, "hyperparams": {k: jnp.asarray(group[k], dtype=jnp.float32) for k in keys}}

"""Tier 0: the JAX backend — the same protocol as `PyTorchTrainingBackend`, computed by `jax.jit`-compiled
functions over a flat dict of parameters named as the PyTorch model names them.

What it keeps from PyTorch, on purpose: the model module (its family's JAX forward reads its config,
and its parameters are the names and the initial values), the optimizer's parameter groups (each
group's LR, betas, eps and weight decay become one `JaxAdam`) and the LR schedule (it moves the groups'
LRs, which each step hands to optax), and the checkpoint format: at a save the parameters and the
Adam moments are written into the module and the optimizer and saved by `tierlm.checkpoint` exactly as
the PyTorch backend saves them, so a checkpoint crosses between the two backends as it is.

The step math is the PyTorch backend's: each micro-batch's gradient is that of its summed loss;
`optim_step` divides the accumulated gradients by the step's trained tokens, clips their global norm
as `torch.nn.utils.clip_grad_norm_` does, skips a non-finite step, then updates. Losses come from the
strategies' JAX twins (`tierlm.primitives.jax_losses.jax_twin`). Several local devices (GPUs, TPU cores, or CPU
devices from XLA_FLAGS=--xla_force_host_platform_device_count=N) split each batch's rows with
`jax.sharding`; the parameters are replicated.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tierlm import checkpoint
from tierlm.backends.options import BackendOptions
from tierlm.backends.protocol import Batch, TrainFuture, TrainingBackend
from tierlm.backends.state import GradientInfo, ModelState
from tierlm.errors import ConfigError
from tierlm.models import family_of
from tierlm.primitives.losses import get_labels, reads_label_cross_entropy_only
from tierlm.primitives.optim import inner_optimizers
from tierlm.primitives.optim.functional import require_functional

HYPERPARAMETERS = ("lr", "momentum", "weight_decay")
"""What a PyTorch parameter group's schedule may change between steps, handed to the jitted step."""


def functional_twin(optimizer: torch.optim.Optimizer, group: dict):
    """The JAX optimizer of one PyTorch parameter group: `JaxAdam` for Adam / AdamW, `JaxMuon` for Muon."""
    from tierlm.primitives.optim.jax import JaxAdam, JaxMuon
    from tierlm.primitives.optim.muon import Muon

    if isinstance(optimizer, Muon):
        return JaxMuon(group["lr"], group["momentum"], group["nesterov"], group["ns_steps"], group["weight_decay"])
    if isinstance(optimizer, torch.optim.AdamW) or type(optimizer) is torch.optim.Adam:
        return JaxAdam(group["lr"], *group["betas"], group["eps"], group["weight_decay"])
    raise ConfigError(
        f"the JAX backend trains with AdamW and Muon (their JAX twins); got {type(optimizer).__name__}: "
        "set training.optimizer=adamw or muon"
    )


def keep_compiled_programs(environ=os.environ) -> str | None:
    """Keep XLA's compiled programs on disk (JAX's persistent compilation cache), as tierlm keeps the memory
    planner's traces: a resumed, repeated or ablated run reads back the steps it compiled before instead of compiling
    them again (the programs that took over JAX's threshold to compile, a second by default). In tierlm's cache
    folder (`tierlm.primitives.cache`: `jax-compilation/`), unless JAX already has one (JAX_COMPILATION_CACHE_DIR or
    `jax.config`); `TIERLM_CACHE_DIR=off` keeps nothing. The folder in use, or None. It must run before the
    process's first compilation (JAX decides then whether it caches).

    >>> import jax; before = jax.config.jax_compilation_cache_dir
    >>> jax.config.update("jax_compilation_cache_dir", "/mine"); keep_compiled_programs({"TIERLM_CACHE_DIR": "/t"})
    '/mine'
    >>> jax.config.update("jax_compilation_cache_dir", None); keep_compiled_programs({"TIERLM_CACHE_DIR": "off"})
    >>> keep_compiled_programs({"TIERLM_CACHE_DIR": "/t"}), jax.config.jax_compilation_cache_dir
    ('/t/jax-compilation', '/t/jax-compilation')
    >>> jax.config.update("jax_compilation_cache_dir", before)
    """
    import jax

    from tierlm.primitives.cache import cache_folder

    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    folder = cache_folder("jax-compilation", environ)
    if folder is not None:
        jax.config.update("jax_compilation_cache_dir", str(folder))
    return None if folder is None else str(folder)


class JaxTrainingBackend(TrainingBackend):
    """One model trained by JAX on the local devices (data parallel over them when there are several)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        checkpoint_dir: str | Path,
        scheduler: Any | None = None,
        options: BackendOptions | None = None,
        loss_fn: Callable | None = None,
        jax_forward: Callable | None = None,
    ):
        """`options`: gradient clipping (`max_grad_norm`); the JAX backend computes in fp32 and the builder refuses
        the options it does not take."""
        import jax

        from tierlm.models.gpt.jax import params_from_torch

        keep_compiled_programs()
        max_grad_norm = (options or BackendOptions()).max_grad_norm
        assert max_grad_norm >= 0, f"max_grad_norm must be >= 0 (0 disables clipping), got {max_grad_norm}"
        self.forward_fn = jax_forward or family_of(model).jax_forward(model)
        self.hidden_fn = None if jax_forward else family_of(model).jax_forward(model, head=False)  # the fused loss
        if self.forward_fn is None:
            raise ConfigError(
                f"the JAX backend has no twin of the {family_of(model).name} family; use infra.backend=pytorch"
            )
        self._module, self.optimizer, self.scheduler = model.float().cpu(), optimizer, scheduler
        optimizer._opt_called = True  # it never steps (it carries the LRs): no "scheduler before optimizer" warning
        self.checkpoint_dir, self.max_grad_norm, self.loss_fn = Path(checkpoint_dir), max_grad_norm, loss_fn
        self.device = torch.device("cpu")  # where batches and results live on the PyTorch side
        names = {id(p): n for n, p in model.named_parameters()}
        self.owners = [(inner, g) for inner in inner_optimizers(optimizer) for g in inner.param_groups]
        self.groups = [[names[id(p)] for p in g["params"]] for _, g in self.owners]
        self.adams = [functional_twin(inner, g) for inner, g in self.owners]  # each group's optax / JAX optimizer
        self._own = (self.owners, self.groups, self.adams)  # what `use_optimizer(None)` goes back to
        self.params = params_from_torch(model)
        self.opt_states = [adam.init(self._group(self.params, i)) for i, adam in enumerate(self.adams)]
        self.devices = jax.local_devices()
        self.step, self._synced = 0, True
        self._jitted: dict[Any, Callable] = {}
        self._reset_accumulators()

    # -- the PyTorch side ------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The PyTorch module holding the current weights (copied from JAX when they changed)."""
        if not self._synced:
            from tierlm.models.gpt.jax import params_into_torch

            params_into_torch(self.params, self._module)
            self._synced = True
        return self._module

    eval_model = model

    def sampler_state(self) -> dict[str, torch.Tensor]:
        """The weights JAX holds now, in the PyTorch module's names, for RL's rollout engine (a PyTorch model)."""
        return self.model.state_dict()

    def memory_stats(self) -> dict[str, float]:
        params = sum(int(np.prod(v.shape)) * 4 for v in self.params.values())
        return {"param_bytes": float(params), "optimizer_bytes": float(2 * params)}

    # -- helpers ---------------------------------------------------------------------------
    def _group(self, tree: dict, i: int) -> dict:
        return {name: tree[name] for name in self.groups[i]}

    def _reset_accumulators(self) -> None:
        self._grads: dict | None = None
        self._loss_sum, self._num_tokens, self._num_micro_batches = 0.0, 0.0, 0

    def _to_jax(self, batch: Batch) -> dict:
        """Tensors as JAX arrays (ids as int32, floats as float32), rows split over the local devices."""
        import jax
        import jax.numpy as jnp

        out = {}
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor):
                continue
            array = value.detach().cpu().numpy()
            array = array.astype(np.int32) if np.issubdtype(array.dtype, np.integer) else array.astype(np.float32)
            out[key] = jnp.asarray(array)
        if len(self.devices) > 1 and all(v.ndim and v.shape[0] % len(self.devices) == 0 for v in out.values()):
            mesh = jax.sharding.Mesh(np.array(self.devices), ("data",))
            rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
            out = {k: jax.device_put(v, rows) for k, v in out.items()}
        return out

    def _loss(self, loss_fn: Callable | None) -> tuple[Any, Callable]:
        """(cache key, JAX twin) of a strategy loss; the default is token cross-entropy."""
        from tierlm.primitives.jax_losses import cross_entropy_sum, jax_twin

        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            return "cross_entropy", lambda logits, batch: cross_entropy_sum(
                logits, batch["labels"], batch.get("loss_mask")
            )
        return (id(getattr(loss_fn, "__self__", None)), getattr(loss_fn, "__name__", "")), jax_twin(loss_fn)

    def _fuses(self, loss_fn: Callable | None) -> bool:
        """Train the token cross-entropy with the head fused into it (no (B, T, V) logits)?"""
        loss_fn = loss_fn or self.loss_fn
        return self.hidden_fn is not None and (loss_fn is None or reads_label_cross_entropy_only(loss_fn))

    def _compiled(self, kind: str, loss_fn: Callable | None) -> Callable:
        import jax

        key, twin = self._loss(loss_fn)
        forward, fused = self.forward_fn, kind == "grad" and self._fuses(loss_fn)
        if fused:  # the model's hidden states and head weight go into the loss, not its logits
            from tierlm.primitives.jax_losses import linear_cross_entropy

            key, forward = ("fused", key), self.hidden_fn

            def twin(hidden_and_head, batch):  # the labels as the strategy's loss reads them
                return linear_cross_entropy(*hidden_and_head, get_labels(batch), batch.get("loss_mask"))

        if (kind, key) not in self._jitted:
            if kind == "grad":

                def loss(params, batch):
                    total, count = twin(forward(params, batch), batch)
                    return total, count

                self._jitted[kind, key] = jax.jit(jax.value_and_grad(loss, has_aux=True))
            else:
                self._jitted[kind, key] = jax.jit(lambda params, batch: twin(forward(params, batch), batch))
        return self._jitted[kind, key]

    # -- protocol --------------------------------------------------------------------------
    def forward_backward(self, batch: Batch, loss_fn: Callable | None = None) -> TrainFuture[dict[str, float]]:
        import jax
        import jax.numpy as jnp

        (total, count), grads = self._compiled("grad", loss_fn)(self.params, self._to_jax(batch))
        if self._grads is None:
            self._grads = grads
        else:
            if "add" not in self._jitted:
                self._jitted["add"] = jax.jit(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b), donate_argnums=0)
            self._grads = self._jitted["add"](self._grads, grads)
        total, count = float(total), float(count)
        self._loss_sum += total
        self._num_tokens += count
        self._num_micro_batches += 1
        return TrainFuture.ready({"loss": total / max(count, 1.0), "num_tokens": count})

    def forward(
        self, batch: Batch, fn: Callable | None = None, params: dict | None = None
    ) -> TrainFuture[dict[str, float]]:
        out = self._compiled("eval", fn)(self.params if params is None else params, self._to_jax(batch))
        if fn is None and self.loss_fn is None:
            out = {"loss_sum": out[0], "num_tokens": out[1]}
        return TrainFuture.ready(
            {k: float(v) if np.ndim(v) == 0 else torch.from_numpy(np.array(v)) for k, v in out.items()}
        )

    def optim_step(self) -> TrainFuture[dict[str, float]]:
        assert self._num_micro_batches > 0, "optim_step() called without a forward_backward() since the last step"
        loss, num_tokens = self._loss_sum / max(self._num_tokens, 1.0), self._num_tokens
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        reported = {
            "lr": lrs[0],
            **(
                {f"lr_{g['role']}": g["lr"] for g in self.optimizer.param_groups if "role" in g}
                if len(set(lrs)) > 1
                else {}
            ),
        }
        settings = (
            [{k: v for k, v in g.items() if k in HYPERPARAMETERS} for g in self.optimizer.param_groups]
            if self.owners is not None
            else [None]  # a functional optimizer (`use_optimizer`) keeps its own settings
        )
        params, opt_states, grad_norm = self._step_fn()(self.params, self._grads, self.opt_states, settings, num_tokens)
        grad_norm = float(grad_norm)
        finite = bool(np.isfinite(grad_norm) and np.isfinite(loss))
        if finite:  # else the step is skipped: the old parameters and moments stay
            self.params, self.opt_states, self._synced = params, list(opt_states), False
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        self._reset_accumulators()
        return TrainFuture.ready(
            {"loss": loss, "grad_norm": grad_norm, **reported, "num_tokens": num_tokens, "skipped": float(not finite)}
        )

    def _step_fn(self) -> Callable:
        """The whole optimizer step as one `jax.jit` program: the summed gradients divided by the step's tokens, their
        global norm, clipped as `torch.nn.utils.clip_grad_norm_` clips, each group's update (AdamW, Muon) at its
        group's LR, momentum and weight decay (arguments: scheduling them compiles nothing)."""
        if self._jitted.get("step") is None:
            import jax
            import jax.numpy as jnp

            adams, groups, max_norm = self.adams, self.groups, self.max_grad_norm

            def step(params, grads, opt_states, settings, num_tokens):
                grads = jax.tree_util.tree_map(lambda g: g / jnp.maximum(num_tokens, 1.0), grads)
                norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
                if max_norm > 0:
                    scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
                    grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
                new_params, new_states = dict(params), []
                for i, adam in enumerate(adams):
                    group = {name: params[name] for name in groups[i]}
                    state = opt_states[i]
                    if settings[i] is not None:
                        state = adam.with_hyperparameters(state, settings[i])
                    updates, state = adam.update({name: grads[name] for name in groups[i]}, state, group)
                    new_params.update({name: group[name] + updates[name] for name in group})
                    new_states.append(state)
                return new_params, new_states, norm

            self._jitted["step"] = jax.jit(step)
        return self._jitted["step"]

    # -- the functional trainer API (tierlm.backends.state; Trainer.train_step) ------------
    def model_state(self) -> ModelState:
        """The current state, a value (JAX arrays never change): hand an older one back to step from it."""
        opt_state = list(self.opt_states) if self.owners is not None else self.opt_states[0]
        return ModelState(
            dict(self.params), opt_state, self.step, {"lr": [g["lr"] for g in self.optimizer.param_groups]}
        )

    def load_model_state(self, state: ModelState, optimizer_state: Any | None = None) -> None:
        self.params, self._synced = dict(state.weights), False
        opt_state = state.optimizer_state if optimizer_state is None else optimizer_state
        if self.owners is None:  # a functional optimizer's state (None: it starts afresh)
            self.opt_states = [self.adams[0].init(self.params) if opt_state is None else opt_state]
        else:
            self.opt_states = list(opt_state)
        self.step = state.step

    def use_optimizer(self, optimizer) -> None:
        """Update every parameter with `optimizer` (JAX's functional form: JaxAdam, JaxMuon, an optax transformation)
        from now on; `model_state().optimizer_state` is then its state. The backend's own optimizer: None."""
        if optimizer is None or optimizer is self.optimizer:
            self.owners, self.groups, self.adams = self._own
        else:
            require_functional(optimizer)
            self.owners, self.groups, self.adams = None, [list(self.params)], [optimizer]
        self.opt_states = [adam.init(self._group(self.params, i)) for i, adam in enumerate(self.adams)]
        self._jitted.pop("step", None)

    def gradient_info(self) -> GradientInfo:
        return GradientInfo(dict(self._grads or {}), self._loss_sum, self._num_tokens, reduced=True)

    def all_reduce_gradients(self, gradients: GradientInfo) -> GradientInfo:
        """One process: the local devices' rows were summed inside the jitted step (XLA's collectives)."""
        return gradients

    def communication_bytes(self) -> int:
        return 0

    def apply_gradients(self, model, gradients: GradientInfo, optimizer=None):
        """Normalise, clip, update (`optim_step`) with `optimizer` — the backend's own, or a functional one
        (`use_optimizer`); returns the new parameters; metrics in `last_step_metrics`."""
        if optimizer is not None and optimizer is not self.optimizer and self.adams != [optimizer]:
            self.use_optimizer(optimizer)
        self._grads, self._loss_sum, self._num_tokens = (
            dict(gradients.gradients),
            gradients.loss_sum,
            gradients.num_tokens,
        )
        self._num_micro_batches = max(self._num_micro_batches, 1)
        self.last_step_metrics = self.optim_step().wait()
        return self.params

    def frozen_reference(self) -> "JaxFrozenReference":
        """The model as it is now, for DPO's reference (no copy: JAX arrays never change)."""
        return JaxFrozenReference(self, self.params)

    # -- checkpoints: the PyTorch backend's files --------------------------------------------
    @torch.no_grad()
    def _optimizer_into_torch(self) -> None:
        """The optimizers' state written into the PyTorch optimizers (AdamW's moments, Muon's momentum), per parameter,
        as the PyTorch backend keeps it (a functional optimizer's state is its caller's: not written)."""
        if self.owners is None:
            return
        named = dict(self.model.named_parameters())
        for i, ((inner, _), adam) in enumerate(zip(self.owners, self.adams)):
            for name, state in adam.torch_state(self.opt_states[i]).items():
                inner.state[named[name]] = {k: torch.from_numpy(np.array(v)) for k, v in state.items()}

    def _optimizer_from_torch(self) -> None:
        from tierlm.models.gpt.jax import params_from_torch

        self.params, self._synced = params_from_torch(self._module), True
        if self.owners is None:
            return
        named = dict(self._module.named_parameters())
        for i, ((inner, _), adam) in enumerate(zip(self.owners, self.adams)):
            states = {name: inner.state.get(named[name], {}) for name in self.groups[i]}
            self.opt_states[i] = adam.from_torch_state(adam.init(self._group(self.params, i)), states)

    def save_checkpoint(
        self,
        step: int,
        trainer_state: dict | None = None,
        write_extra: Callable[[Path], None] | None = None,
        metric: float | None = None,
    ) -> TrainFuture[Path]:
        self._optimizer_into_torch()
        snapshot = checkpoint.take_snapshot(self.model, self.optimizer, self.scheduler)
        checkpoint.write_snapshot(
            self.checkpoint_dir,
            step,
            snapshot,
            {"backend_step": self.step, **(trainer_state or {})},
            write_extra,
            metric,
        )
        return TrainFuture.ready(self.checkpoint_dir / f"step_{step}")

    def load_checkpoint(self, path: str | Path | None = None) -> TrainFuture[dict]:
        state = checkpoint.load_checkpoint(
            checkpoint.checkpoint_to_load(path, self.checkpoint_dir), self._module, self.optimizer, self.scheduler
        )
        self._optimizer_from_torch()
        self.step = state.get("backend_step", self.step)
        return TrainFuture.ready(state)


class JaxFrozenReference:
    """The `forward` half of the protocol over fixed parameters (as `tierlm.backends.references.FrozenReference`)."""

    def __init__(self, backend: JaxTrainingBackend, params: dict):
        self.backend, self.params = backend, params

    def forward(self, batch: Batch, fn: Callable) -> TrainFuture[dict]:
        return self.backend.forward(batch, fn, params=self.params)

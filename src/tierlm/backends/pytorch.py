"""Tier 0: the single-device PyTorch backend."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from tierlm import checkpoint
from tierlm.backends.options import BackendOptions
from tierlm.backends.protocol import Batch, TrainFuture, TrainingBackend
from tierlm.backends.state import GradientInfo, ModelState, ring_all_reduce_bytes
from tierlm.errors import ConfigError
from tierlm.models import family_of, forward_cross_entropy, forward_logits, fuses_cross_entropy, unwrap_model
from tierlm.models.moe import MoE
from tierlm.primitives.dtype_device import move_to
from tierlm.primitives.losses import (
    count_loss_tokens,
    create_cross_entropy_loss,
    get_labels,
    reads_label_cross_entropy_only,
    token_weights,
)
from tierlm.primitives.model_parallel import by_mesh
from tierlm.primitives.optim import optimizer_metrics
from tierlm.primitives.optim.functional import require_functional
from tierlm.primitives.parallel import full_tensor, parameter_and_optimizer_bytes


def loss_sum_and_count(loss_fn: Callable, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `loss_fn` and return (summed loss, loss tokens).

    A loss function may return `(sum, count)` itself (preferred: losses are sums). A scalar is
    read as the mean over the batch's trained tokens, so it is multiplied back by their count.
    """
    out = loss_fn(logits, batch)
    if isinstance(out, tuple):
        total, count = out
        return total, torch.as_tensor(count, dtype=torch.float32, device=total.device)
    count = count_loss_tokens(batch).to(out.device)
    return out * count, count


WHOLE_COMPILE_OPTIONS: dict[str, Any] = {}
"""`torch.compile`'s options for `compile="model"`'s training forward (the tests trace with a cheaper backend)."""


def to_host(value: Any) -> float | torch.Tensor:
    """A scalar metric as a float; a per-row or per-token tensor (e.g. log-probs) as a CPU tensor, float32 unless it
    holds integers (e.g. token ids)."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        value = value.detach()
        return (value.float() if value.is_floating_point() else value).cpu()
    return float(value)


def _shares_tensors(optimizer_state: dict, optimizer) -> bool:
    """Is `optimizer_state` the optimizer's own (its `state_dict()`, sharing the state tensors)?"""

    def tensors(state_dict: dict) -> list[torch.Tensor]:  # an OptimizerContainer's holds its optimizers' states
        parts = state_dict["optimizers"] if "optimizers" in state_dict else [state_dict]
        return [
            t
            for part in parts
            for s in part.get("state", {}).values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        ]

    mine = tensors(optimizer.state_dict())
    theirs = tensors(optimizer_state)
    return len(mine) == len(theirs) and all(a is b for a, b in zip(mine, theirs))


class PyTorchTrainingBackend(TrainingBackend):
    """One model on one device.

    Gradients of each micro-batch are those of its *summed* loss; `optim_step` divides them by
    the trained-token count of the whole step before clipping, so accumulating micro-batches of
    uneven length gives exactly the gradient of one big batch.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable | None,
        checkpoint_dir: str | Path,
        device: torch.device | str,
        scheduler: Any | None = None,
        options: BackendOptions | None = None,
    ):
        """`options` (`tierlm.backends.options.BackendOptions`): gradient clipping, the compute dtype (autocast) and
        fp16 loss scaling, the fused head + loss, the attention kernels, async saves."""
        options = options or BackendOptions()
        assert options.max_grad_norm >= 0, f"max_grad_norm must be >= 0 (0: no clipping), got {options.max_grad_norm}"
        self.device, self.options = torch.device(device), options
        self.model = self._place(model)
        self.optimizer = optimizer
        self.loss_fn = loss_fn or create_cross_entropy_loss()
        self.checkpoint_dir = Path(checkpoint_dir)  # created by the first save, not before
        self.scheduler = scheduler
        self.max_grad_norm = options.max_grad_norm
        self.autocast_dtype = options.compute_dtype
        self.async_save = options.async_save
        self.fused_cross_entropy = options.fused_cross_entropy
        self.grad_scaler = torch.amp.GradScaler(self.device.type) if options.loss_scaling else None
        self.flash_attention = options.flash_attention
        self._cross_entropy, self._logits = forward_cross_entropy, forward_logits
        if options.compile == "model":  # the training forward whole, loss included; eval and generation as they are
            self._cross_entropy = torch.compile(forward_cross_entropy, **WHOLE_COMPILE_OPTIONS)
            self._logits = torch.compile(forward_logits, **WHOLE_COMPILE_OPTIONS)
        self._model_fuses: dict[int, bool] = {}
        self.functional, self.functional_state = None, None  # a functional optimizer in use (`use_optimizer`)
        self.step = 0
        self._save_thread: threading.Thread | None = None
        self._save_error: BaseException | None = None
        self._reset_accumulators()

    # -- helpers ---------------------------------------------------------------------------
    def _place(self, model: nn.Module) -> nn.Module:
        return move_to(model, self.device)

    @property
    def eval_model(self) -> nn.Module:
        """The module `forward` runs (a DDP backend skips its wrapper)."""
        return self.model

    def _reset_accumulators(self) -> None:
        self._loss_sum = torch.zeros((), device=self.device)
        self._num_tokens = torch.zeros((), device=self.device)
        self._num_micro_batches = 0

    def _to_device(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _autocast(self):
        """Autocast to the compute dtype, and the attention kernels the run allows."""
        stack = contextlib.ExitStack()
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype))
        if not self.flash_attention:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]))
        return stack

    def _fuses(self, model: nn.Module, fn: Callable) -> bool:
        """Compute `fn` from a fused LM head + cross-entropy instead of the (B, T, V) logits?"""
        if not (self.fused_cross_entropy and reads_label_cross_entropy_only(fn)):
            return False
        if id(model) not in self._model_fuses:  # the model (or DDP's inner one) never changes: ask once
            self._model_fuses[id(model)] = fuses_cross_entropy(model)
        return self._model_fuses[id(model)]

    def _learning_rates(self) -> dict[str, float]:
        """{"lr": the first parameter group's LR} and, when the groups are parameter roles with
        different LRs (e.g. Muon's matrices beside AdamW's embeddings), {"lr_<role>": ...} for each."""
        groups = self.optimizer.param_groups
        out = {"lr": groups[0]["lr"]}
        if len({g["lr"] for g in groups}) > 1:
            out.update({f"lr_{g['role']}": g["lr"] for g in groups if "role" in g})
        return out

    def _params_with_grad(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.grad is not None]

    # One process; the distributed backends override these (and the protocol's rank, world_size, all_reduce_sums).

    def reduce_step_totals(self, totals: torch.Tensor) -> torch.Tensor:
        """[loss sum, trained tokens] of the step summed over ranks (one process: itself)."""
        return totals

    def _grad_divisor(self, num_tokens: torch.Tensor) -> torch.Tensor:
        """What the accumulated gradients are divided by: the step's trained tokens."""
        return num_tokens.clamp(min=1.0)

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """Collective under torchrun: the whole model's weights on the CPU of rank 0 (None elsewhere, and in one
        process whose weights are plain tensors: the live weights are saved). FSDP2's weights are DTensor shards
        even on one rank, so they are gathered there too."""
        if self.world_size == 1 and not any(hasattr(p, "full_tensor") for p in self.model.parameters()):
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.rank == 0 else None

    def _clip_gradients(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The gradients' total norm, after clipping them to `max_grad_norm` (0: no clipping)."""
        if self.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in grads])
        return full_tensor(grad_norm)  # FSDP: a DTensor; the same value on every rank

    def memory_stats(self) -> dict[str, float]:
        """This rank's parameter and optimizer-state bytes (shards only, when sharded)."""
        params, states = parameter_and_optimizer_bytes(self.model, self.optimizer)
        return {"param_bytes": float(params), "optimizer_bytes": float(states)}

    # -- protocol --------------------------------------------------------------------------
    def forward_backward(self, batch: Batch, loss_fn: Callable | None = None) -> TrainFuture[dict[str, float]]:
        self.model.train()
        batch = self._to_device(batch)
        loss_fn = loss_fn or self.loss_fn
        if self._fuses(self.model, loss_fn):  # the loss is token cross-entropy: no (B, T, V) logits
            weights = token_weights(get_labels(batch), batch.get("loss_mask"))
            with self._autocast():
                total, _ = self._cross_entropy(self.model, batch, weights)
            count = weights.sum()
        else:
            with self._autocast():
                logits = self._logits(self.model, batch)  # (B, T, V)
            total, count = loss_sum_and_count(loss_fn, logits, batch)
        self._backward(total)
        return self._accumulate(total.detach(), count.detach())

    def _backward(self, total: torch.Tensor) -> None:
        """Back-propagate a micro-batch's summed loss (scaled first under fp16's loss scaling)."""
        (self.grad_scaler.scale(total) if self.grad_scaler is not None else total).backward()

    def _accumulate(self, total: torch.Tensor, count: torch.Tensor) -> TrainFuture[dict[str, float]]:
        """Add a back-propagated micro-batch's summed loss and trained tokens to the step's."""
        self._loss_sum += total
        self._num_tokens += count
        self._num_micro_batches += 1
        return TrainFuture(lambda: {"loss": (total / count.clamp(min=1)).item(), "num_tokens": count.item()})

    @torch.no_grad()
    def forward(self, batch: Batch, fn: Callable | None = None) -> TrainFuture[dict[str, float]]:
        model = self.eval_model
        was_training = model.training
        model.eval()
        batch = self._to_device(batch)
        with self._autocast():
            if self._fuses(model, fn or self.loss_fn):  # per-token losses (B, T) stand in for the logits
                logits = forward_cross_entropy(model, batch)[1]
            else:
                logits = forward_logits(model, batch)
        if fn is None:
            total, count = loss_sum_and_count(self.loss_fn, logits, batch)
            out = {"loss_sum": total, "num_tokens": count}
        else:
            out = fn(logits, batch)
        out.update(family_of(model).routing_agreement(model))  # given a sampler's expert routes: where they agree
        model.train(was_training)
        return TrainFuture(lambda: {k: to_host(v) for k, v in out.items()})

    def optim_step(self) -> TrainFuture[dict[str, float]]:
        assert self._num_micro_batches > 0, "optim_step() called without a forward_backward() since the last step"
        loss_sum, num_tokens = self.reduce_step_totals(torch.stack([self._loss_sum, self._num_tokens]))
        grads = self._params_with_grad()
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
        divisor = float(self._grad_divisor(num_tokens))
        for same_mesh in by_mesh(
            [p.grad for p in grads]
        ):  # foreach ops take tensors of one kind (plain, or one DTensor mesh)
            torch._foreach_div_(same_mesh, divisor)
        grad_norm = self._clip_gradients(grads)
        reported = self._learning_rates()  # the LRs this update uses
        loss = loss_sum / num_tokens.clamp(min=1.0)
        # A NaN/Inf loss or gradient would poison the weights and the optimizer state: skip the
        # update (one host sync per step; the schedule still advances, as the step still counts).
        finite = bool(torch.isfinite(grad_norm) & torch.isfinite(loss))
        if finite:
            self._update()
        experts = self._balance_experts()
        if self.grad_scaler is not None:  # an overflow of the scaled gradients is the scaler's to handle, not a failure
            overflow = not finite and bool(torch.isfinite(loss))
            reported.update(loss_scale=self.grad_scaler.get_scale(), overflow=float(overflow))
            self.grad_scaler.update()
            finite = finite or overflow
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        reported.update(optimizer_metrics(self.optimizer))  # e.g. AdamWPrune's sparsity (cached: no host sync)
        self.step += 1
        self._reset_accumulators()
        return TrainFuture(
            lambda: {
                "loss": loss.item(),
                "grad_norm": grad_norm.item(),
                **reported,
                "num_tokens": num_tokens.item(),
                "skipped": float(not finite),
                **({"expert_imbalance": experts.item()} if experts is not None else {}),
            }
        )

    def _balance_experts(self) -> torch.Tensor | None:
        """After the update, the mixture-of-experts layers' step: their tokens per expert summed over the ranks,
        DeepSeek-V3's bias update where a layer asks for it (every rank's bias stays the same), and the step's
        imbalance returned — the busiest expert's tokens over the mean, averaged over the layers (1: balanced;
        None without experts)."""
        layers = [m for m in self.model.modules() if isinstance(m, MoE)]
        if not layers:
            return None
        loads = torch.stack([torch.zeros_like(m.expert_bias) if m.load is None else m.load.float() for m in layers])
        loads = self.reduce_step_totals(loads)
        for layer, load in zip(layers, loads):
            if layer.config.bias_update_rate:
                layer.balance_bias(load, layer.config.bias_update_rate)
            layer.load = None
        return (loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1e-9)).mean()

    def _update(self) -> None:
        """The update of the normalised, clipped gradients: the optimizer's step, or the functional optimizer's
        `params + update(grads, state, params)`, its new state kept for `model_state`."""
        if self.functional is None:
            self.optimizer.step()
            return
        params = {n: p for n, p in unwrap_model(self.model).named_parameters() if p.grad is not None}
        values = {n: p.detach() for n, p in params.items()}
        state = self.functional.init(values) if self.functional_state is None else self.functional_state
        updates, self.functional_state = self.functional.update({n: p.grad for n, p in params.items()}, state, values)
        with torch.no_grad():
            for name, param in params.items():
                param.add_(updates[name])

    def use_optimizer(self, optimizer) -> None:
        if optimizer is None or optimizer is self.optimizer:
            self.functional, self.functional_state = None, None
            return
        require_functional(optimizer)
        if any(hasattr(p, "device_mesh") for p in self.model.parameters()):
            raise ConfigError("a functional optimizer updates whole tensors: use the backend's optimizer under FSDP")
        if optimizer is not self.functional:
            self.functional, self.functional_state = optimizer, None

    # -- the functional trainer API (tierlm.backends.state; Trainer.train_step) ------------
    def model_state(self) -> ModelState:
        """The live state (a view: the next step changes it in place)."""
        return ModelState(
            dict(unwrap_model(self.model).named_parameters()),
            self.functional_state if self.functional is not None else self.optimizer.state_dict(),
            self.step,
            {"lr": [g["lr"] for g in self.optimizer.param_groups]},
        )

    @torch.no_grad()
    def load_model_state(self, state: ModelState, optimizer_state: Any | None = None) -> None:
        """Make `state` the backend's (nothing to do for its own live state)."""
        params = dict(unwrap_model(self.model).named_parameters())
        for name, value in state.weights.items():
            if value is not params[name]:
                params[name].copy_(value)
        optimizer_state = state.optimizer_state if optimizer_state is None else optimizer_state
        if self.functional is not None:  # the functional optimizer's state (None: it starts afresh)
            self.functional_state = optimizer_state
        elif optimizer_state is not None and not _shares_tensors(optimizer_state, self.optimizer):
            self.optimizer.load_state_dict(optimizer_state)
        self.step = state.step

    def gradient_info(self) -> GradientInfo:
        """The gradients `forward_backward` accumulated (the parameters' `.grad`, sums over the step's tokens)."""
        grads = {n: p.grad for n, p in unwrap_model(self.model).named_parameters() if p.grad is not None}
        return GradientInfo(grads, float(self._loss_sum), float(self._num_tokens), reduced=self.world_size == 1)

    def all_reduce_gradients(self, gradients: GradientInfo) -> GradientInfo:
        """Gradients summed over the data-parallel ranks. DDP and FSDP2 reduce them during backward (in
        buckets, overlapped with the computation), so here they already are; one process has nothing to reduce."""
        gradients.reduced = True
        return gradients

    def communication_bytes(self) -> int:
        """Gradient bytes each rank sends per step (ring all-reduce; 0 in one process)."""
        grad_bytes = sum(
            p.numel() * p.element_size() for _, p in unwrap_model(self.model).named_parameters() if p.requires_grad
        )
        return ring_all_reduce_bytes(grad_bytes, self.world_size)

    def apply_gradients(self, model: nn.Module, gradients: GradientInfo, optimizer=None) -> nn.Module:
        """Normalise by the step's tokens, clip, step (`optim_step`) with `optimizer` — the backend's own, or a
        functional one (`use_optimizer`); its metrics are `last_step_metrics`."""
        assert gradients.reduced, "apply_gradients takes reduced gradients (all_reduce_gradients first)"
        if optimizer is not None and optimizer is not self.optimizer and optimizer is not self.functional:
            self.use_optimizer(optimizer)
        self.last_step_metrics = self.optim_step().wait()
        return model

    def save_checkpoint(
        self,
        step: int,
        trainer_state: dict | None = None,
        write_extra: Callable[[Path], None] | None = None,
        metric: float | None = None,
    ) -> TrainFuture[Path]:
        """Save now, or with `async_save` copy the state to CPU now and write it on a background
        thread (the next save, `wait_for_save()` or the future's result waits for it)."""
        self.wait_for_save()
        state = {"backend_step": self.step, **(trainer_state or {})}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        snapshot = checkpoint.take_snapshot(self.model, self.optimizer, self.scheduler)
        path = self.checkpoint_dir / f"step_{step}"

        def write() -> None:
            try:
                checkpoint.write_snapshot(self.checkpoint_dir, step, snapshot, state, write_extra, metric)
            except BaseException as error:  # re-raised in the training thread by wait_for_save()
                self._save_error = error

        if not self.async_save:
            write()
            self.wait_for_save()  # raises the write's error here, in the caller
            return TrainFuture.ready(path)
        self._save_thread = threading.Thread(target=write, name=f"tierlm-save-{step}")
        self._save_thread.start()
        return TrainFuture(lambda: (self.wait_for_save(), path)[1])

    def wait_for_save(self) -> None:
        """Block until a background save has finished; raise its error if it failed."""
        if self._save_thread is not None:
            self._save_thread.join()
            self._save_thread = None
        if self._save_error is not None:
            error, self._save_error = self._save_error, None
            raise error

    def load_checkpoint(self, path: str | Path | None = None) -> TrainFuture[dict]:
        state = checkpoint.load_checkpoint(
            checkpoint.checkpoint_to_load(path, self.checkpoint_dir), self.model, self.optimizer, self.scheduler
        )
        self.step = state.get("backend_step", self.step)
        if self.grad_scaler is not None and state.get("grad_scaler"):
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        return TrainFuture.ready(state)

"""Tier 0: ZeRO through DeepSpeed's own engine (`deepspeed.initialize`), launched by torchrun or `deepspeed`.

The alternative to FSDP2 for users whose clusters and habits are DeepSpeed's: ZeRO stage 3 (parameters,
gradients and optimizer state partitioned), or 1/2, with the optimizer state (and at stage 3 the parameters)
offloaded to CPU memory. tierlm keeps its own arithmetic on top: each rank back-propagates the *sum* of its
micro-batches' losses, and `optim_step` hands DeepSpeed the step's trained-token count as the loss scale,
which DeepSpeed divides out before clipping and stepping (exactly what it does for fp16's loss scale), so the
update is the gradient of the global token-mean loss and N ranks equal one process on the same global batch.
The loop owns the accumulation boundary (`managed_gradient_accumulation: false`): any number of
`forward_backward` calls, then one `optim_step`.

Checkpoints hold DeepSpeed's own partitioned files beside tierlm's config, scheduler, RNG and trainer state
(`tierlm.checkpoint.zero`); they resume at the same world size, and `tierlm export` consolidates them into a
model folder.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from tierlm.backends.distributed import DistributedTrainingBackend
from tierlm.backends.options import BackendOptions
from tierlm.backends.protocol import TrainFuture
from tierlm.checkpoint.zero import load_deepspeed_checkpoint, save_deepspeed_checkpoint
from tierlm.errors import ConfigError
from tierlm.models import family_of
from tierlm.primitives.parallel import parameter_and_optimizer_bytes


def deepspeed_config(
    zero_stage: int = 3,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    bf16: bool = False,
    max_grad_norm: float = 1.0,
    micro_batch_size: int = 1,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config a tierlm run means, with `overrides` (a user's own DeepSpeed JSON, say) merged over it.

    >>> c = deepspeed_config(zero_stage=3, offload_optimizer=True, max_grad_norm=0.5)
    >>> c["zero_optimization"]["stage"], c["zero_optimization"]["offload_optimizer"], c["gradient_clipping"]
    (3, {'device': 'cpu'}, 0.5)
    >>> deepspeed_config(overrides={"zero_optimization": {"stage": 2}})["zero_optimization"]["stage"]
    2
    """
    if zero_stage not in (1, 2, 3):
        raise ConfigError(f"DeepSpeed ZeRO stage must be 1, 2 or 3, not {zero_stage}")
    if offload_params and zero_stage != 3:
        raise ConfigError("offloading the parameters to CPU needs ZeRO stage 3; set the stage to 3 or drop the offload")
    zero: dict[str, Any] = {"stage": zero_stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_params:
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # tierlm's loop says when a step ends
        "gradient_clipping": max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,  # tierlm's own AdamW groups (per-role LRs), as built for every backend
        "zero_force_ds_cpu_optimizer": False,  # ...also with the optimizer offloaded (torch's AdamW on the CPU)
        "steps_per_print": 1 << 30,
    }
    for key, value in (overrides or {}).items():
        config[key] = (
            {**config[key], **value} if isinstance(value, dict) and isinstance(config.get(key), dict) else value
        )
    return config


class DeepSpeedTrainingBackend(DistributedTrainingBackend):
    """ZeRO stage 1-3 through DeepSpeed's engine; the same protocol and arithmetic as the DDP and FSDP2 backends."""

    def _wrap(self, model: nn.Module, device: torch.device, o: BackendOptions) -> tuple[nn.Module, BackendOptions]:
        """The model placed, DeepSpeed's config written from `o` (ZeRO's stage and offloads, bf16, the micro-batch, a
        DeepSpeed JSON's overrides, clipping); the engine does the mixed precision, loss scaling and saving."""
        ds = o.zero_stage, o.offload_optimizer, o.offload_params, o.bf16, o.max_grad_norm, o.micro_batch_size
        self.ds_config, self.zero_stage = deepspeed_config(*ds, o.deepspeed_overrides), o.zero_stage
        return model.to(device), replace(o, compute_dtype=None, loss_scaling=False, async_save=False)

    def _after_init(self) -> None:
        import deepspeed

        client_optimizer = self.optimizer
        if getattr(client_optimizer, "optimizers", None) is not None:
            raise ConfigError(
                "DeepSpeed takes one torch optimizer; Muon's container does not partition under ZeRO: use "
                "training.optimizer=adamw with infra.distributed_type=deepspeed, or FSDP2 for Muon"
            )
        if self.device.type == "cpu":
            # DeepSpeed's CPU accelerator compiles a shared-memory all-reduce for *inference* when it first joins the
            # group (~40 s of g++ on a fresh machine); training reduces through torch.distributed (gloo) either way.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        self.engine, self.ds_optimizer, _, _ = deepspeed.initialize(
            model=self.model, optimizer=client_optimizer, config=self.ds_config, dist_init_required=False
        )
        if self.zero_stage == 3:
            _register_fused_head(self.engine.module)
        self.model = self.engine  # the engine forwards to the module, with ZeRO-3's gathering hooks around it
        self.optimizer = client_optimizer  # its param_groups carry the LRs the scheduler sets and DeepSpeed steps with

    def _place(self, model: nn.Module) -> nn.Module:
        return model  # placed before DeepSpeed partitions it

    @property
    def eval_model(self) -> nn.Module:
        return self.engine.module

    @property
    def export_model(self) -> nn.Module:
        return self.engine.module

    # -- the step ---------------------------------------------------------------------------------
    def _backward(self, total: torch.Tensor) -> None:
        self.engine.backward(total, scale_wrt_gas=False)

    def optim_step(self) -> TrainFuture[dict[str, float]]:
        assert self._num_micro_batches > 0, "optim_step() called without a forward_backward() since the last step"
        loss_sum, num_tokens = self.reduce_step_totals(torch.stack([self._loss_sum, self._num_tokens]))
        reported = self._learning_rates()  # the LRs this update uses
        # The gradients are the token-summed loss's, averaged over ranks: the token-mean's scaled by
        # tokens / ranks. Given as the loss scale, DeepSpeed divides it out before it clips and steps.
        self.ds_optimizer.loss_scale = float(self._grad_divisor(num_tokens))
        try:
            self.engine.step()
        finally:
            self.ds_optimizer.loss_scale = 1.0
        applied = self.engine.was_step_applied()
        grad_norm = self.engine.get_global_grad_norm()
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        self._reset_accumulators()
        loss = loss_sum / num_tokens.clamp(min=1.0)
        return TrainFuture(
            lambda: {
                "loss": loss.item(),
                "grad_norm": float(grad_norm if grad_norm is not None else float("nan")),
                **reported,
                "num_tokens": num_tokens.item(),
                "skipped": float(not applied),
            }
        )

    # -- weights ------------------------------------------------------------------------------------
    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's fp32 master weights on rank 0's CPU, one tensor at a time."""
        state = {}
        for name, value in self.engine.module.state_dict(keep_vars=True).items():
            whole = _gathered(value)
            if self.rank == 0:
                state[name] = whole.detach().to("cpu", copy=True)
        return state if self.rank == 0 else None

    def memory_stats(self) -> dict[str, float]:
        """This rank's partition of the parameters (ZeRO-3's `ds_tensor`) and of the optimizer state."""
        params = sum(
            (p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() * p.element_size()
            for p in self.engine.module.parameters()
        )
        _, states = parameter_and_optimizer_bytes(self.engine.module, self.optimizer)
        return {"param_bytes": float(params), "optimizer_bytes": float(states)}

    @classmethod
    def memory_per_rank(
        cls,
        parts: dict[str, float],
        model: nn.Module,
        world_size: int,
        compute_bytes: int = 4,
        zero_stage: int = 3,
        **layout,
    ) -> dict[str, float]:
        """ZeRO's partitions over the ranks: stage 1 splits the optimizer state, 2 the gradients as well, 3 the
        parameters too, each block gathered whole (in the compute dtype) while it runs. Offloaded state is still
        counted where it was (the planner's figure is the device's plus the host's)."""
        if world_size == 1:
            return parts
        parts["optimizer state"] /= world_size
        if zero_stage >= 2:
            parts["gradients"] /= world_size
        if zero_stage == 3:
            parts["parameters"] /= world_size
            block = max((sum(p.numel() for p in b.parameters()) for b in family_of(model).blocks(model)), default=0)
            parts["ZeRO-3 gathered blocks"] = block * compute_bytes * (1 - 1 / world_size)
        return parts

    def model_state(self):
        raise NotImplementedError(
            "DeepSpeed keeps the weights partitioned inside its engine: train with forward_backward and optim_step "
            "(the functional train_step needs the PyTorch, DDP or FSDP2 backend)"
        )

    # -- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        step: int,
        trainer_state: dict | None = None,
        write_extra: Callable[[Path], None] | None = None,
        metric: float | None = None,
    ) -> TrainFuture[Path]:
        """Collective: DeepSpeed's partitions from every rank, sealed with tierlm's state by rank 0."""
        state = {"backend_step": self.step, **(trainer_state or {})}
        path = save_deepspeed_checkpoint(
            self.checkpoint_dir, step, self.engine, self.scheduler, state, write_extra, metric
        )
        return TrainFuture.ready(path)

    def load_checkpoint(self, path: str | Path | None = None) -> TrainFuture[dict]:
        state = load_deepspeed_checkpoint(path, self.checkpoint_dir, self.engine, self.scheduler, self.world_size)
        self.step = state.get("backend_step", self.step)
        return TrainFuture.ready(state)


def _register_fused_head(model: nn.Module) -> None:
    """ZeRO-3 gathers a module's parameters around its own forward; the fused LM-head loss reads the head's
    weight from the model's forward instead, so the head is registered as the model's external parameter."""
    import deepspeed

    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        deepspeed.zero.register_external_parameter(model, head.weight)


def _gathered(value: torch.Tensor) -> torch.Tensor:
    """A parameter whole (its fp32 master copy where the optimizer keeps one; gathered from the ranks' partitions
    where it is frozen), or a buffer as it is. Collective for a partitioned parameter."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    if not isinstance(value, nn.Parameter):
        return value
    whole = safe_get_full_fp32_param(value) if value.requires_grad else None
    if whole is None:
        with deepspeed.zero.GatheredParameters([value]):
            whole = value.detach().clone()
    return whole

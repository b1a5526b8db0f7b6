"""Tier 0: expert parallelism beside data parallelism. The ranks form a (replica, ep) mesh: each `ep` group shares
out every mixture-of-experts layer's experts (`tierlm.primitives.expert_parallel`: rows go to their experts' ranks
and back, an all-to-all each way), and DDP replicates the rest of the model over every rank
(`ExpertParallelTrainingBackend`) or FSDP2 shards it over every rank (`ExpertParallelFSDPTrainingBackend`, the
experts left to their own mesh as torchtitan does). N ranks take the step one process takes at the same global batch:

- the experts' gradients arrive summed over every rank's rows (the all-to-all's backward brings them); summed over
  the replicas and divided by the world size, they are what DDP's / FSDP2's averaged gradients are for the other
  weights;
- the gradient norm adds the dense weights' (whole on every rank under DDP, FSDP2's DTensor norm over its shards) to
  the experts' summed over the `ep` group;
- checkpoints hold the experts as DTensor shards of the whole (torch.distributed.checkpoint writes each once and
  reshards them on load), so a run resumes at any world size or in one process, and exports whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tierlm.backends.distributed import DDPTrainingBackend, FSDPTrainingBackend
from tierlm.backends.options import BackendOptions
from tierlm.backends.parallelize import parallelize
from tierlm.errors import ConfigError
from tierlm.models.moe import GroupedExperts
from tierlm.primitives.expert_parallel import as_dtensors, expert_shards, shard_experts
from tierlm.primitives.parallel import apply_ddp, apply_fsdp, full_tensor


class ExpertParallel:
    """What expert parallelism adds to a data-parallel backend (mixed in before it): the mesh and the experts' shards,
    their gradients, the norm, the whole model."""

    mesh: object
    expert_params: list[nn.Parameter]

    def _refuse(self, model: nn.Module, options: BackendOptions) -> None:
        if not any(isinstance(m, GroupedExperts) for m in model.modules()):
            raise ConfigError(
                "infra.expert_parallel_size shares out a mixture of experts' experts, and this model has none: set "
                "model.moe.num_experts, or drop infra.expert_parallel_size"
            )
        if options.compile:
            raise ConfigError("expert parallelism runs the experts' dispatch eagerly: drop infra.compile")
        if options.broadcast_weights:
            raise ConfigError("expert parallelism reads the model on every rank: drop infra.cpu_ram_efficient_loading")

    def _share_out_experts(self, model: nn.Module, device: torch.device, o: BackendOptions) -> None:
        """The (replica, ep) mesh, and this rank's share of every layer's experts (hooked for the dispatch)."""
        from torch.distributed.device_mesh import init_device_mesh

        world, ep = dist.get_world_size(), o.expert_parallel_size
        counts = {m.gate_up_proj.shape[0] for m in model.modules() if isinstance(m, GroupedExperts)}
        if world % ep or any(n % ep for n in counts):
            raise ConfigError(
                f"infra.expert_parallel_size={ep} must divide the ranks ({world}) and the experts per layer "
                f"({sorted(counts)})"
            )
        self.mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("replica", "ep"))
        self.expert_params = [
            p for e in model.modules() if isinstance(e, GroupedExperts) for p in shard_experts(e, self.mesh)
        ]

    @classmethod
    def memory_per_rank(cls, parts: dict[str, float], model: nn.Module, world_size: int, **layout) -> dict[str, float]:
        """The data-parallel backend's, with each rank holding 1/ep of the experts' weights, gradients and optimizer
        state (and, under FSDP2, 1/N of the rest)."""
        total = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters())
        share = experts / max(total, 1)
        expert_parts = {n: parts[n] * share for n in ("parameters", "gradients", "optimizer state")}
        parts = super().memory_per_rank(  # the dense rest as the data-parallel backend lays it out
            {**parts, **{n: parts[n] - v for n, v in expert_parts.items()}}, model, world_size, **layout
        )
        ep = layout.get("expert_parallel_size", 1)
        for name, value in expert_parts.items():
            parts[name] += value / ep
        if "DDP gradient buckets" in parts:
            parts["DDP gradient buckets"] *= 1 - share
        return parts

    def optim_step(self):
        """The experts' gradients summed over the replicas and scaled as DDP scales the rest, then the step."""
        replicas = self.mesh["replica"]
        for p in self.expert_params:
            if p.grad is None:  # no row reached this rank's experts in the step
                p.grad = torch.zeros_like(p)
            if replicas.size() > 1:
                dist.all_reduce(p.grad, group=replicas.get_group())
            p.grad.div_(self.world_size)
        return super().optim_step()

    def _clip_gradients(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The whole model's gradient norm: the dense weights' (whole on every rank, or FSDP2's norm of its shards) and
        the experts' (each `ep` rank holds some), then the clip."""
        experts = {id(p) for p in self.expert_params}
        dense = [p for p in grads if id(p) not in experts]
        dense_norm = full_tensor(torch.nn.utils.get_total_norm([p.grad for p in dense])).to(self.device)
        mine = torch.nn.utils.get_total_norm([p.grad for p in self.expert_params]).to(self.device) ** 2
        dist.all_reduce(mine, group=self.mesh["ep"].get_group())
        total = (dense_norm**2 + mine).sqrt()
        if self.max_grad_norm > 0:  # one kind of tensor at a time (FSDP2's gradients are DTensors, the experts' not)
            for part in (dense, self.expert_params):
                torch.nn.utils.clip_grads_with_norm_(part, self.max_grad_norm, total)
        return total

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model on rank 0's CPU, each layer's experts gathered from the `ep` group."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = as_dtensors(get_model_state_dict(self.model), expert_shards(self.model))
        whole = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in state.items()}
        return whole if self.rank == 0 else None


class ExpertParallelTrainingBackend(ExpertParallel, DDPTrainingBackend):
    """DDP for the dense weights, `options.expert_parallel_size` ranks sharing out the experts."""

    def _wrap(self, model: nn.Module, device: torch.device, o: BackendOptions) -> tuple[nn.Module, BackendOptions]:
        from torch.nn.parallel import DistributedDataParallel

        self.gradient_accumulation_steps = o.gradient_accumulation_steps

        def shard_then_replicate(m: nn.Module, block_list) -> nn.Module:
            self._share_out_experts(m, device, o)
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(m, list(expert_shards(m)))
            return apply_ddp(m, device)

        transforms = dict(fp8=o.fp8, activation_checkpointing=o.activation_checkpointing)
        return parallelize(model, device, data_parallel=shard_then_replicate, **transforms), o


class ExpertParallelFSDPTrainingBackend(ExpertParallel, FSDPTrainingBackend):
    """FSDP2 sharding the dense weights over every rank (bf16 compute as FSDP2's), `options.expert_parallel_size` ranks
    sharing out the experts, which FSDP2 leaves alone (`ignored_params`)."""

    def _wrap(self, model: nn.Module, device: torch.device, o: BackendOptions) -> tuple[nn.Module, BackendOptions]:
        from dataclasses import replace

        def share_out_then_shard(m: nn.Module, block_list) -> None:
            self._share_out_experts(m, device, o)
            dtypes = o.compute_dtype, o.reduce_dtype
            apply_fsdp(m, dist.get_world_size(), device.type, *dtypes, blocks=block_list(), ignored_params=set(
                self.expert_params
            ))  # fmt: skip

        transforms = dict(fp8=o.fp8, activation_checkpointing=o.activation_checkpointing)
        model = parallelize(model, device, data_parallel=share_out_then_shard, **transforms)
        self.cpu_offload = False
        return model, replace(o, compute_dtype=None)  # FSDP2's mixed precision computes in its param dtype

"""Expert parallelism: each rank of an expert-parallel group holds num_experts / size of every mixture-of-experts
layer's experts. Around the experts' own forward (a module `(rows sorted by expert, rows per expert) -> rows` whose
parameters lead with the expert dimension, as `tierlm.models.moe.GroupedExperts`), hooks send each row to the rank
holding its expert and bring the results back — an all-to-all each way, differentiable, so the backward moves the
gradients the same way — as torchtitan's `ExpertParallel` does with its input and output hooks. The model never
knows; any backend torch.distributed has all-to-all for runs it (gloo on CPU included).

The world is a (replica, ep) mesh: ranks in one `ep` group share out the experts; the `replica` groups each hold all
of them (their expert gradients are summed over the replicas, as data parallelism sums the rest). A rank's experts
are plain tensors (the optimizer and gradient clipping see one kind of tensor); a checkpoint sees them as DTensor
shards of the whole (`as_dtensors`), so torch.distributed.checkpoint writes each once and loads them at any layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd


class ExpertDispatch:
    """The two hooks around one layer's `GroupedExperts`, which holds this rank's `local` experts of a group of
    `size` ranks."""

    def __init__(self, group: dist.ProcessGroup, local: int):
        self.group, self.size, self.local = group, dist.get_world_size(group), local
        self.pending: list[tuple[list[int], list[int], torch.Tensor]] = []  # calls in flight (recomputation nests)

    def dispatch(self, module: nn.Module, args: tuple[torch.Tensor, torch.Tensor]):
        """(rows sorted by expert, rows per expert (E,)) -> (the rows of every rank for this rank's experts, sorted
        by expert, rows per local expert)."""
        x, counts = args
        mine = counts.view(self.size, self.local)  # [r, e]: rows for expert e of rank r
        theirs = torch.empty_like(mine)  # [r, e]: rank r's rows for my expert e
        dist.all_to_all_single(theirs, mine, group=self.group)
        send, receive = mine.sum(dim=1).tolist(), theirs.sum(dim=1).tolist()
        rows = all_to_all_single_autograd(x, receive, send, self.group)  # by source rank, then by expert
        chunks = torch.arange(sum(receive)).split(theirs.flatten().tolist())  # [r * local + e]: rank r's, expert e
        order = torch.cat([chunks[r * self.local + e] for e in range(self.local) for r in range(self.size)])
        order = order.to(x.device)
        self.pending.append((send, receive, order))
        return rows[order], theirs.sum(dim=0)

    def combine(self, module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
        """The experts' results back to the ranks (and the order) their rows came from."""
        send, receive, order = self.pending.pop()
        by_source = torch.zeros_like(out).index_copy(0, order, out)
        return all_to_all_single_autograd(by_source, send, receive, self.group)


def shard_experts(experts: nn.Module, mesh) -> list[nn.Parameter]:
    """Keep this rank's share (its place in `mesh["ep"]`) of an experts module's parameters (expert dimension first)
    and hook the dispatch around its forward; returns the new parameters (each tagged with `expert_mesh`, for
    `as_dtensors`)."""
    group, size, rank = mesh["ep"].get_group(), mesh["ep"].size(), mesh["ep"].get_local_rank()
    params = list(experts.named_parameters(recurse=False))
    total = params[0][1].shape[0]
    assert total % size == 0, f"{total} experts over {size} expert-parallel ranks"
    local, sharded = total // size, []
    for name, param in params:
        shard = nn.Parameter(param.detach()[rank * local : (rank + 1) * local].clone())
        shard.expert_mesh = mesh
        setattr(experts, name, shard)
        sharded.append(shard)
    hooks = ExpertDispatch(group, local)
    experts.register_forward_pre_hook(hooks.dispatch)
    experts.register_forward_hook(hooks.combine)
    return sharded


def expert_shards(model: nn.Module) -> dict[str, nn.Parameter]:
    """The sharded expert parameters by name (as state dicts name them: no DDP prefix)."""
    inner = getattr(model, "module", model)
    return {name: p for name, p in inner.named_parameters() if hasattr(p, "expert_mesh")}


def as_dtensors(state: dict, shards: dict[str, nn.Parameter]) -> dict:
    """`state` (a model's, or a flattened optimizer state's: `state.<name>.<slot>`) with the values of the sharded
    experts as DTensor shards of the whole (replicated over `replica`, split over `ep` along the experts), sharing
    this rank's storage: torch.distributed.checkpoint writes each once and loads into them in place."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out = dict(state)
    for name, param in shards.items():
        mesh = param.expert_mesh
        whole = (param.shape[0] * mesh["ep"].size(), *param.shape[1:])
        keys = [name] + [k for k in state if k.startswith(f"state.{name}.")]
        for key in keys:
            value = state.get(key)
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                out[key] = DTensor.from_local(
                    value, mesh, [Replicate(), Shard(0)], run_check=False, shape=whole,
                    stride=torch.empty(whole, device="meta").stride(),
                )  # fmt: skip
    return out


def as_local(state: dict) -> dict:
    """`state` with its DTensors back as this rank's shards (what the model and optimizer hold)."""
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in state.items()}

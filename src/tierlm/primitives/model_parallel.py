"""Tier 1: model parallelism on PyTorch's own engine — one `DeviceMesh` for the layout, tensor parallelism
through `torch.distributed.tensor.parallel` plans that each model family supplies, and the gradient norm
of parameters that live on different meshes.

The layout is torchtitan's: `pp x dp x cp x tp` ranks, tensor parallel innermost (the ranks that talk
most, on one machine), data parallel the rest of the world. Tensor parallelism splits each block's
attention and MLP Megatron-style — the query/key/value and gate/up projections by output columns (each
rank holds whole heads), the output and down projections by input rows, one all-reduce after each —
and leaves the norms, the embedding and the head whole on every rank of the group. Data parallelism
over the other dimension is FSDP2 on the `dp` sub-mesh (torchtitan composes the two the same way).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from tierlm.errors import ConfigError
from tierlm.primitives.parallel import block_items


@dataclass(frozen=True)
class ParallelDims:
    """How `world_size` ranks split: pipeline x data x context x tensor parallel (data = the rest).

    >>> ParallelDims.from_sizes(8, tensor=2, pipeline=2)
    ParallelDims(pp=2, dp=2, cp=1, tp=2)
    >>> ParallelDims.from_sizes(8, tensor=2, pipeline=2).mesh_shape()
    (('pp', 2), ('dp', 2), ('tp', 2))
    """

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1

    @classmethod
    def from_sizes(cls, world_size: int, tensor: int = 1, pipeline: int = 1, context: int = 1) -> "ParallelDims":
        model_ranks = tensor * pipeline * context
        if world_size % model_ranks:
            raise ConfigError(
                f"{world_size} ranks do not split into tensor {tensor} x pipeline {pipeline} x context {context} "
                f"(= {model_ranks}) groups: make the world size a multiple of {model_ranks}"
            )
        return cls(pp=pipeline, dp=world_size // model_ranks, cp=context, tp=tensor)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def data_rank(self, rank: int) -> int:
        """Global `rank`'s coordinate on the data-parallel dimension of `build_mesh`'s mesh (row-major pp, dp, cp, tp):
        the share of each batch it reads, before the mesh exists.

        >>> [ParallelDims.from_sizes(8, tensor=2, pipeline=2).data_rank(r) for r in range(8)]
        [0, 0, 1, 1, 0, 0, 1, 1]
        """
        return (rank // (self.cp * self.tp)) % self.dp

    def mesh_shape(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of each mesh dimension, outermost first; data parallel kept even at size 1."""
        return tuple(
            (name, size)
            for name, size in (("pp", self.pp), ("dp", self.dp), ("cp", self.cp), ("tp", self.tp))
            if size > 1 or name == "dp"
        )

    def build_mesh(self, device_type: str):
        """The `DeviceMesh` of this layout (needs the process group)."""
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = zip(*self.mesh_shape())
        assert dist.get_world_size() == self.world_size, (
            f"the layout needs {self.world_size} ranks, the job has {dist.get_world_size()}"
        )
        return init_device_mesh(device_type, sizes, mesh_dim_names=names)


def received_positions(sent: torch.Tensor, limit: int) -> torch.Tensor:
    """Position ids as a pipeline stage receives them: sent as float32 (what travels between stages is floating
    point; exact below 2**24), clamped to [0, limit), as the pipeline's shape inference runs a stage once on
    uninitialised inputs.

    >>> received_positions(torch.tensor([[0.0, 1.0, float("nan"), 9.0]]), 4)
    tensor([[0, 1, 0, 3]])
    """
    return sent.nan_to_num(0.0).clamp(0, limit - 1).long()


def check_tensor_parallel_shape(n_head: int, n_kv_head: int, intermediate: int, tp: int) -> list[str]:
    """What stops a model from splitting its heads and MLP over `tp` ranks (each rank takes whole heads).

    >>> check_tensor_parallel_shape(8, 2, 512, 4)
    ['2 key/value heads do not split over 4 tensor-parallel ranks']
    """
    problems = []
    for what, count in (
        ("attention heads", n_head),
        ("key/value heads", n_kv_head),
        ("MLP hidden units", intermediate),
    ):
        if count % tp:
            problems.append(f"{count} {what} do not split over {tp} tensor-parallel ranks")
    return problems


def megatron_plan(
    attention: str,
    mlp: str,
    n_head: int,
    n_kv_head: int,
    intermediate: int,
    tp: int,
    qk_norm: bool = False,
    norms: tuple[str, str] | None = None,
) -> dict[str, str]:
    """The plan of a Llama-style block whose attention and MLP modules are at `attention` / `mlp`
    (prefixes inside the block): q/k/v and gate/up by columns, o and down by rows. With `qk_norm`, the
    per-head norms (shared by all heads, so each rank sees only its heads' share of their gradient) are
    kept whole with their gradients summed over the group. `norms` (the block's two norms) make the plan
    sequence-parallel capable: under `infra.sequence_parallel` the norms run on each rank's share of the
    sequence, which is gathered into the attention and the MLP and scattered back by their row-wise
    outputs. A `ConfigError` when the heads or the MLP do not split over `tp` ranks.

    >>> plan = megatron_plan("attn.", "mlp.", 4, 2, 64, 2, qk_norm=True, norms=("attn_norm", "mlp_norm"))
    >>> plan["attn.q_norm"], plan["attn_norm"], plan["attn"]
    ('grad_allreduce', 'sequence_norm', 'sequence_gather')
    """
    problems = check_tensor_parallel_shape(n_head, n_kv_head, intermediate, tp)
    if problems:
        raise ConfigError(f"infra.tensor_parallel_size={tp}: {'; '.join(problems)}")
    plan = {f"{attention}{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")}
    plan.update(
        {
            f"{attention}o_proj": "rowwise",
            f"{mlp}gate_proj": "colwise",
            f"{mlp}up_proj": "colwise",
            f"{mlp}down_proj": "rowwise",
        }
    )
    if qk_norm:
        plan.update({f"{attention}q_norm": "grad_allreduce", f"{attention}k_norm": "grad_allreduce"})
    if norms:
        plan.update(
            {
                norms[0]: "sequence_norm",
                norms[1]: "sequence_norm",
                attention.rstrip("."): "sequence_gather",
                mlp.rstrip("."): "sequence_gather",
            }
        )
    return plan


SEQUENCE_STYLES = ("sequence_norm", "sequence_gather")
"""Plan entries that only sequence parallelism applies (otherwise the norms run whole on every rank)."""


def _parallel_styles(sequence_parallel: bool) -> dict:
    """Each plan word as a `ParallelStyle` (PyTorch's own, but for the fused q/k/v split and the gather of a
    sequence-sharded input, which `PrepareModuleInput` would need every positional argument's layout for)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    class FusedQKVColwiseParallel(ColwiseParallel):
        """Column-wise for q, k and v fused in one linear layer (GPT-2's c_attn): each rank takes its share of
        each of the three (a strided shard of the output rows: q_r, k_r, v_r), so it holds whole heads."""

        def _partition_linear_fn(self, name, module, device_mesh):
            for param_name, param in module.named_parameters():
                shard = distribute_tensor(
                    param, device_mesh, [_StridedShard(0, split_factor=3)], src_data_rank=self.src_data_rank
                )
                module.register_parameter(param_name, nn.Parameter(shard, requires_grad=param.requires_grad))

        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            return outputs.to_local()  # this rank's q_r, k_r, v_r as they are (a plain Shard(-1) would regroup them)

    class GatherSequence(ParallelStyle):
        """The module's first input arrives as this rank's share of the sequence (dimension 1) and is gathered
        whole; in backward its gradient (summed over the group by the column-wise layers) is split back."""

        def _apply(self, module, device_mesh):
            def gather(_, args):
                shard = DTensor.from_local(args[0], device_mesh, [Shard(1)], run_check=False)
                return (shard.redistribute(device_mesh, [Replicate()]).to_local(), *args[1:])

            module.register_forward_pre_hook(gather)
            return module

    sequence = Shard(1) if sequence_parallel else Replicate()
    return {
        "colwise": ColwiseParallel(),
        "colwise_qkv": FusedQKVColwiseParallel(),
        "rowwise": RowwiseParallel(output_layouts=sequence),
        "sequence_norm": SequenceParallel(use_local_output=True),
        "sequence_gather": GatherSequence(),
        # the embedding split by vocabulary rows: each rank looks up the ids in its rows, summed (or scattered by
        # sequence)
        "vocab_embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence),
        # the head split by vocabulary: logits stay sharded by vocabulary, for the loss-parallel cross-entropy
        "vocab_head": ColwiseParallel(input_layouts=sequence, output_layouts=Shard(-1), use_local_output=False),
    }


def apply_tensor_parallel(
    tp_mesh, blocks: nn.ModuleList | nn.ModuleDict, plan: dict[str, str], sequence_parallel: bool = False
) -> list[nn.Parameter]:
    """Split every block by `plan` ({module path inside a block: "colwise" | "colwise_qkv" | "rowwise" |
    "grad_allreduce" | "sequence_norm" | "sequence_gather"}) over `tp_mesh`; returns the "grad_allreduce"
    modules' parameters, whose gradients the caller sums over the group before the update (`sum_gradients`).

    Column-wise layers keep their output sharded on the last dimension (local heads / hidden units);
    row-wise layers take that and all-reduce to a whole activation, so each block's input and output
    are ordinary tensors, the same on every rank of the group — or, with `sequence_parallel`,
    reduce-scatter it by sequence: between the attention and the MLP each rank holds (and its norms
    compute) a 1/tp share of the tokens. "colwise_qkv" is column-wise for fused q/k/v projections.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    styles = _parallel_styles(sequence_parallel)
    assert set(plan.values()) <= {*styles, "grad_allreduce"}, f"unknown tensor-parallel styles in {plan}"
    wanted = {
        path: styles[kind]
        for path, kind in plan.items()
        if kind in styles and (sequence_parallel or kind not in SEQUENCE_STYLES)
    }
    summed = []
    for _, block in block_items(blocks):
        with frozen_kept(block):
            parallelize_module(block, tp_mesh, wanted)
        summed += [
            p for path, kind in plan.items() if kind == "grad_allreduce" for p in block.get_submodule(path).parameters()
        ]
    return summed


def apply_vocab_parallel(tp_mesh, model: nn.Module, plan: dict[str, str], sequence_parallel: bool = False) -> None:
    """Split the modules around the blocks by `plan` ({module path in `model`: "vocab_embedding" | "vocab_head" |
    "sequence_norm"}): the embedding and the head by vocabulary rows, the final norm by sequence. The head's
    logits stay sharded by vocabulary (a DTensor): the cross-entropy must run under `loss_parallel()`.
    Paths `model` does not hold are skipped (a pipeline stage holds the embedding or the head, or neither)."""
    from torch.distributed.tensor.parallel import parallelize_module

    styles = _parallel_styles(sequence_parallel)
    held = dict(model.named_modules())
    with frozen_kept(model):
        parallelize_module(
            model,
            tp_mesh,
            {
                path: styles[kind]
                for path, kind in plan.items()
                if path in held and (sequence_parallel or kind not in SEQUENCE_STYLES)
            },
        )


@contextlib.contextmanager
def frozen_kept(module: nn.Module):
    """Parameters frozen before (LoRA's base weights) frozen after: PyTorch's `SequenceParallel` style re-registers
    a norm's weight as a new `nn.Parameter`, which trains by default."""
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    yield
    for name, param in module.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def sum_gradients(params: list[nn.Parameter], group) -> None:
    """Sum these parameters' gradients over `group`, in one flat all-reduce (an FSDP-sharded gradient:
    its local shard, the same slice on every rank of a tensor-parallel group)."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    if grads:
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=group)
        torch._foreach_copy_(
            grads, [piece.view_as(g) for piece, g in zip(flat.split([g.numel() for g in grads]), grads)]
        )


def by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped for foreach ops: plain tensors together, DTensors by their mesh and placements.

    >>> [len(g) for g in by_mesh([torch.ones(1), torch.ones(2)])]
    [2]
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        key = (id(t.device_mesh), tuple(t.placements)) if hasattr(t, "device_mesh") else ()
        groups.setdefault(key, []).append(t)
    return list(groups.values())


def clip_grad_norm(
    grads: list[torch.Tensor], max_norm: float, extra_group=None, also_scale: list[torch.Tensor] = ()
) -> torch.Tensor:
    """The total L2 norm of `grads` — plain tensors and DTensors on any meshes (tensor-parallel shards,
    FSDP shards, both) — and, when `max_norm` > 0, every gradient scaled as `clip_grad_norm_` does.

    A DTensor's norm is reduced over its own mesh; a plain tensor counts as this rank holds it (the
    replicated layers of a tensor-parallel group hold the same gradient on every rank). `extra_group`
    sums the squares over ranks that hold different parameters (pipeline stages); `also_scale` are clipped
    without counting in the norm (another rank counts them: a tied embedding's copy).

    >>> mine, torchs = [torch.full((2,), 3.0), torch.full((1,), 4.0)], [torch.full((2,), 3.0), torch.full((1,), 4.0)]
    >>> params = [torch.nn.Parameter(torch.zeros_like(g)) for g in torchs]
    >>> for p, g in zip(params, torchs): p.grad = g
    >>> bool(torch.isclose(clip_grad_norm(mine, 1.0), torch.nn.utils.clip_grad_norm_(params, 1.0)))
    True
    >>> all(torch.allclose(a, b) for a, b in zip(mine, torchs))
    True
    """
    squares = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    for g in grads:
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares = squares + norm.double() ** 2
    if extra_group is not None:
        dist.all_reduce(squares, group=extra_group)
    total = squares.sqrt().float()
    if max_norm > 0 and grads:
        scale = min(1.0, max_norm / (float(total) + 1e-6))  # a number: DTensors and plain tensors both take it
        for g in [*grads, *also_scale]:
            g.mul_(scale)
    return total


def _dcp_describable(placements, mesh_sizes) -> bool:
    """Does each rank hold one contiguous block of the tensor? A strided shard does when it is the outer
    split of a tensor dimension that later mesh dimensions split `split_factor` ways (FSDP2 over tensor
    parallel); alone (fused q/k/v) it holds several pieces, which DCP's chunks cannot describe."""
    for i, placement in enumerate(placements):
        factor = getattr(placement, "split_factor", None)
        if factor is not None:
            later = 1
            for size, other in zip(mesh_sizes[i + 1 :], placements[i + 1 :]):
                later *= size if getattr(other, "dim", None) == placement.dim else 1
            if later != factor:
                return False
    return True


def dcp_storable(state: dict) -> tuple[dict, Callable[[], None]]:
    """`state` (nested dicts of tensors and numbers) as DCP can save and load it: a copy in which every DTensor
    whose shards are not one block per rank (see `_dcp_describable`) is redistributed to plain shards of the
    same dimensions. Returns (that copy, a function that hands what DCP loaded into it back to `state`:
    those DTensors redistributed and copied into the originals, every other value set in place).

    >>> state = {"optim": {"lr": 1.0}}
    >>> storable, restore = dcp_storable(state)
    >>> storable["optim"]["lr"] = 0.5  # as DCP's load sets a number
    >>> restore(); state["optim"]["lr"]
    0.5
    """
    from torch.distributed.tensor import Shard

    def convert(value):
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        if not hasattr(value, "placements") or _dcp_describable(value.placements, value.device_mesh.shape):
            return value
        return value.redistribute(
            value.device_mesh, [Shard(p.dim) if hasattr(p, "split_factor") else p for p in value.placements]
        )

    storable = convert(state)

    def restore(original: dict = state, loaded: dict = storable) -> None:
        for key, value in loaded.items():
            if isinstance(value, dict):
                restore(original[key], value)
            elif hasattr(value, "placements") and value is not original[key]:
                with torch.no_grad():
                    original[key].copy_(value.redistribute(original[key].device_mesh, original[key].placements))
            else:
                original[key] = value

    return storable, restore

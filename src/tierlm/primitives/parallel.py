"""Tier 1: process groups and the parallelisms applied to a model from outside it.

Models carry no distributed code: these functions find a model's transformer blocks and wrap
them (activation checkpointing, `torch.compile`, FSDP2 `fully_shard`) the way torchtitan does.
All of it is PyTorch's own engine; launch with `torchrun`.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tierlm.errors import ConfigError, DeviceError


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in a job started by torchrun (or any launcher that sets its variables)."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_distributed() -> bool:
    """True when a launcher (torchrun, srun with the torchrun variables) started this process."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def init_distributed(device_type: str = "auto", timeout_s: float = 600.0) -> DistributedContext:
    """Join the process group torchrun described in the environment; one GPU per local rank.

    NCCL on CUDA, gloo on CPU. `timeout_s` bounds how long a collective waits for a rank that
    died, so a lost peer ends the job instead of hanging it.
    """
    if not launched_distributed():
        raise ConfigError(
            "distributed training needs a launcher: run under `torchrun --nproc_per_node=N -m tierlm ...`"
        )
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    use_cuda = device_type == "cuda" or (device_type == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise DeviceError("infra.device_type=cuda but no CUDA GPU is visible; use device_type=cpu")
        if local_rank >= torch.cuda.device_count():
            raise DeviceError(
                f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); lower --nproc_per_node"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    elif device_type in ("auto", "cpu"):
        device = torch.device("cpu")
    else:
        raise DeviceError(f"distributed training runs on cuda or cpu, not {device_type}")
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if use_cuda else None,
        )
    return DistributedContext(rank, local_rank, world_size, device)


def shutdown_distributed() -> None:
    """Leave the process group: a barrier, then collect, then destroy.

    The barrier first, since gloo aborts a process that tears down while a peer still talks. Call
    it after the models are out of scope: a DDP reducer or FSDP state left in a reference cycle keeps
    the process group alive past `destroy_process_group`, and a gloo group destroyed during
    interpreter finalization can abort the process after its work is done.
    """
    if dist.is_initialized():
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def block_list(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks of a transformer: the longest `ModuleList` whose children share one class.

    Works for the native GPT (`model.blocks`) and transformers models (`model.model.layers`).

    >>> from tierlm.models import GPTConfig, build_gpt
    >>> gpt = build_gpt(GPTConfig(depth=3, aspect_ratio=32, head_dim=16, vocab_size=50, max_seq_len=16))
    >>> block_list(gpt) is gpt.blocks, len(block_list(gpt))
    (True, 3)
    """
    best = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > (len(best) if best is not None else 0):
            if len({type(child) for child in module}) == 1:
                best = module
    assert best is not None, f"{type(model).__name__} has no ModuleList of identical blocks to wrap"
    return best


def block_items(blocks: nn.ModuleList | nn.ModuleDict) -> list[tuple[int | str, nn.Module]]:
    """(key, block) of a model's blocks: by position, or by name for a pipeline stage's (a `ModuleDict`
    keeping the whole model's indices).

    >>> block_items(nn.ModuleDict({"3": nn.Identity()}))
    [('3', Identity())]
    """
    return list(blocks.items()) if isinstance(blocks, nn.ModuleDict) else list(enumerate(blocks))


def apply_activation_checkpointing(model: nn.Module, blocks: nn.ModuleList | None = None) -> nn.Module:
    """Recompute each block's activations in the backward pass instead of storing them.

    `blocks` (default: `block_list(model)`) is the model family's list of repeated blocks.
    Parameter names are unchanged in `state_dict()` (the wrapper strips its prefix).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = blocks if blocks is not None else block_list(model)
    for key, block in block_items(blocks):
        blocks[key] = checkpoint_wrapper(block, preserve_rng_state=False)
    return model


def apply_compile(model: nn.Module, blocks: nn.ModuleList | None = None, **options) -> nn.Module:
    """`torch.compile` each block in place (the blocks are identical, so one graph is reused);
    `options` go to `torch.compile` (e.g. `mode`, or `backend="eager"` to trace without code generation)."""
    for _, block in block_items(blocks if blocks is not None else block_list(model)):
        block.compile(**options)
    return model


FSDP_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")


def apply_fsdp(
    model: nn.Module,
    world_size: int,
    device_type: str,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    cpu_offload: bool = False,
    blocks: nn.ModuleList | None = None,
    sharding: str = "FULL_SHARD",
    shard_size: int | None = None,
    mesh=None,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """FSDP2: `fully_shard` every block (`blocks`, default `block_list(model)`), then the root
    (embeddings, final norm, head).

    `param_dtype` (e.g. bf16) is what forward and backward compute in, `reduce_dtype` what
    gradients are reduced in; the sharded master weights and optimizer state stay fp32.
    `sharding` is Accelerate's fsdp_sharding_strategy in FSDP2's terms: FULL_SHARD re-shards each
    block after its forward; SHARD_GRAD_OP keeps the gathered parameters until the backward (more
    memory, no second all-gather); HYBRID_SHARD shards within groups of `shard_size` ranks (default:
    the ranks of one machine, LOCAL_WORLD_SIZE) and replicates across them, on a 2-D mesh.
    `mesh`: shard over this (sub-)mesh instead — the data-parallel dimension of a model-parallel layout.
    `ignored_params`: left as they are, unsharded and unreduced (a rank's own experts under expert parallelism).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    assert sharding in FSDP_SHARDING, f"sharding must be one of {FSDP_SHARDING}, got {sharding!r}"
    if mesh is not None:
        assert sharding != "HYBRID_SHARD", "HYBRID_SHARD builds its own 2-D mesh; give a mesh or the strategy, not both"
    elif sharding == "HYBRID_SHARD":
        shard_size = shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        assert world_size % shard_size == 0, (
            f"HYBRID_SHARD: {world_size} ranks do not split into groups of {shard_size}"
        )
        mesh = init_device_mesh(
            device_type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(device_type, (world_size,))
    kwargs = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if ignored_params:
        kwargs["ignored_params"] = ignored_params
    blocks = [block for _, block in block_items(blocks if blocks is not None else block_list(model))]
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(block, reshard_after_forward=sharding != "SHARD_GRAD_OP" and i < len(blocks) - 1, **kwargs)
    fully_shard(model, reshard_after_forward=sharding != "SHARD_GRAD_OP", **kwargs)
    return model


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """Wrap `model` in DistributedDataParallel (rank 0's weights are broadcast to every rank)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor (a collective), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def parameter_and_optimizer_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes this rank holds for parameters and for optimizer state (shards only, under FSDP).

    >>> model = nn.Linear(4, 2)   # 8 + 2 fp32 parameters
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> model(torch.ones(1, 4)).sum().backward(); opt.step()
    >>> parameter_and_optimizer_bytes(model, opt)   # AdamW: exp_avg + exp_avg_sq (+ a step scalar each)
    (40, 88)
    """
    nbytes = lambda t: local_tensor(t).numel() * t.element_size()  # noqa: E731
    params = sum(nbytes(p) for p in model.parameters())
    states = sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return params, states

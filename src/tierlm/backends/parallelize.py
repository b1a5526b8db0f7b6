"""The one order in which every backend transforms a model before training it (torchtitan's
`parallelize`): on the device, FP8 linear layers, tensor parallelism, per-block activation checkpointing,
per-block compile, then data parallelism (FSDP2 or DDP) outermost. The model's family says which modules
are its repeated blocks; the model itself knows nothing of any of this.

>>> from tierlm.models import GPTConfig, build_gpt
>>> gpt = build_gpt(GPTConfig(depth=2, aspect_ratio=32, head_dim=16, vocab_size=50, max_seq_len=16))
>>> parallelize(gpt, torch.device("cpu"), activation_checkpointing=True) is gpt
True
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tierlm.models import family_of
from tierlm.primitives.dtype_device import move_to
from tierlm.primitives.fp8 import apply_float8_training, check_fp8_device
from tierlm.primitives.parallel import apply_activation_checkpointing, apply_compile

BlockTransform = Callable[[nn.Module, nn.ModuleList], "nn.Module | None"]
DataParallel = Callable[[nn.Module, Callable[[], nn.ModuleList]], "nn.Module | None"]


def parallelize(
    model: nn.Module,
    device: torch.device,
    *,
    fp8: bool = False,
    tensor_parallel: BlockTransform | None = None,
    activation_checkpointing: bool = False,
    compile: bool | str = False,
    data_parallel: DataParallel | None = None,
    blocks: nn.ModuleList | None = None,
) -> nn.Module:
    """`model` on `device` with each transform asked for, in the one order. `tensor_parallel(model, blocks)`
    and `data_parallel(model, block_list)` apply a backend's plans (in place, or returning the wrapped module;
    FSDP2 asks `block_list()` for the blocks it shards one by one, DDP needs none); `blocks` (default: what the
    model's family names) are the repeated blocks (a pipeline stage's own)."""
    model = move_to(model, device)

    def block_list() -> nn.ModuleList:  # asked only by the transforms that work block by block
        return blocks if blocks is not None else family_of(model).blocks(model)

    if fp8:
        check_fp8_device(device)
        apply_float8_training(model)
    if tensor_parallel is not None:
        tensor_parallel(model, block_list())
    if activation_checkpointing:
        apply_activation_checkpointing(model, block_list())
    if compile is True:  # "model": the backend compiles its whole training forward instead (PyTorchTrainingBackend)
        apply_compile(model, block_list())
    if data_parallel is not None:
        model = data_parallel(model, block_list) or model
    return model

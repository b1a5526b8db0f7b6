"""Tier 1: FP8 training through torchao (H100-class GPUs), and a switch back to bf16 for evaluation.

`apply_float8_training` swaps the eligible `nn.Linear` layers of a model for torchao's
`Float8Linear` (dynamic tensorwise scaling: e4m3 activations and weights, e5m2 gradients) — the
matmuls run on the GPU's FP8 tensor cores, weights and optimizer state stay in their own dtype.
Only layers whose both sizes are multiples of 16 qualify (the hardware's tile), and never the
output head (its logits need the precision). `disable_fp8(model)` runs the swapped layers as plain
linear layers inside its block, so evaluation and sampling see the unquantised model (as nanochat does).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.errors import ConfigError


def fp8_eligible(module: nn.Module, name: str) -> bool:
    """A linear layer FP8 can run: both sizes multiples of 16, and not the output head.

    >>> fp8_eligible(nn.Linear(32, 64), "blocks.0.mlp.up_proj"), fp8_eligible(nn.Linear(32, 50), "x")
    (True, False)
    >>> fp8_eligible(nn.Linear(32, 64), "lm_head")
    False
    """
    return (
        isinstance(module, nn.Linear)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
        and name.split(".")[-1] not in ("lm_head", "output", "head")
    )


def check_fp8_device(device: torch.device) -> None:
    """Refuse FP8 training where its kernels do not exist (anything but a CUDA GPU of compute capability >= 8.9)."""
    if device.type != "cuda":
        raise ConfigError(
            f"training.fp8 needs an H100-class CUDA GPU (FP8 tensor cores); this run is on {device.type}: set "
            f"training.fp8=false"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(
            f"training.fp8 needs compute capability >= 8.9 (Ada, Hopper); {torch.cuda.get_device_name(device)} is "
            f"{major}.{minor}: set training.fp8=false"
        )


def apply_float8_training(model: nn.Module) -> int:
    """Swap the model's eligible linear layers for torchao's `Float8Linear`, in place; returns how many.

    Apply before FSDP and `torch.compile` (the transform pipeline's order).
    """
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        raise ConfigError("training.fp8 needs torchao: pip install 'tierlm[fp8]'") from None
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=fp8_eligible)
    return before - sum(type(m) is nn.Linear for m in model.modules())


def _is_float8(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


@contextlib.contextmanager
def disable_fp8(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, every `Float8Linear` of `model` computes a plain `F.linear` in its input's dtype.

    >>> model = nn.Sequential(nn.Linear(4, 4))
    >>> with disable_fp8(model) as same:   # a model without FP8 layers is left as it is
    ...     same is model
    True
    """
    swapped = [m for m in model.modules() if _is_float8(m)]
    for module in swapped:
        module.forward = lambda x, m=module: F.linear(
            x, m.weight.to(x.dtype), None if m.bias is None else m.bias.to(x.dtype)
        )
    try:
        yield model
    finally:
        for module in swapped:
            del module.forward  # back to the class's FP8 forward

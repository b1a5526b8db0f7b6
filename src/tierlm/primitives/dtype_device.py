"""Tier 1: dtypes and devices, from strings users write to objects torch wants."""

from __future__ import annotations

import torch

from tierlm.errors import ConfigError, DeviceError

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}
DEVICE_TYPES = ("auto", "cuda", "cpu", "mps")


def parse_dtype(dtype_str: str) -> torch.dtype:
    """Convert a dtype name ("bfloat16" | "float32" | "float16", or bf16/fp32/fp16) to a torch dtype.

    >>> parse_dtype("bfloat16")
    torch.bfloat16
    >>> parse_dtype("fp32")
    torch.float32
    >>> parse_dtype("int8")
    Traceback (most recent call last):
    ...
    tierlm.errors.ConfigError: Invalid dtype: 'int8'. Must be one of ['bfloat16', 'bf16', 'float32', 'fp32', 'float16',
    'fp16']
    """
    if dtype_str not in _DTYPES:
        raise ConfigError(f"Invalid dtype: {dtype_str!r}. Must be one of {list(_DTYPES)}")
    return _DTYPES[dtype_str]


def compute_device_map_single_gpu(device_type: str, gpu_rank: int) -> dict[str, int] | None:
    """The transformers `device_map` that puts a whole model on one GPU; None for CPU/MPS.

    >>> compute_device_map_single_gpu("cuda", 4)
    {'': 4}
    >>> compute_device_map_single_gpu("cpu", 0) is None
    True
    """
    if device_type not in ("cuda", "cpu", "mps"):
        raise ConfigError(f"Invalid device_type: {device_type!r}. Must be 'cuda', 'cpu' or 'mps'")
    if gpu_rank < 0:
        raise ConfigError(f"gpu_rank must be >= 0, got {gpu_rank}")
    return {"": gpu_rank} if device_type == "cuda" else None


def resolve_device(device_type: str = "auto", gpu_rank: int = 0) -> torch.device:
    """The torch device for `device_type` ("auto" picks cuda, then mps, then cpu).

    Asking for a device this machine does not have is a `DeviceError` with what to do instead.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if device_type not in DEVICE_TYPES:
        raise ConfigError(f"Invalid device_type: {device_type!r}. Must be one of {list(DEVICE_TYPES)}")
    if device_type == "auto":
        if torch.cuda.is_available():
            device_type = "cuda"
        elif torch.backends.mps.is_available():
            device_type = "mps"
        else:
            device_type = "cpu"
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                "device_type 'cuda' was requested but torch sees no CUDA GPU "
                f"(torch {torch.__version__}); use device_type='cpu' or 'auto'"
            )
        if gpu_rank >= torch.cuda.device_count():
            raise DeviceError(
                f"gpu_rank {gpu_rank} does not exist: this machine has {torch.cuda.device_count()} GPU(s)"
            )
        return torch.device("cuda", gpu_rank)
    if device_type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError("device_type 'mps' was requested but MPS is not available; use 'cpu' or 'auto'")
    return torch.device(device_type)


def move_to(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """`module.to(device)`, skipped when every parameter and buffer is already there (a no-op
    walk, and one that FakeTensorMode, used by the memory planner, cannot take) or the module is on the meta
    device (infra.cpu_ram_efficient_loading's other ranks: materialised after sharding).

    >>> layer = torch.nn.Linear(2, 2)
    >>> move_to(layer, "cpu") is layer
    True
    """
    device = torch.device(device)
    tensors = [*module.parameters(), *module.buffers()]
    if all(t.device == device or (t.device.type == device.type and device.index is None) for t in tensors):
        return module
    if any(t.is_meta for t in tensors):  # shapes only: FSDP2 allocates its shards with `to_empty` after sharding
        return module
    return module.to(device)

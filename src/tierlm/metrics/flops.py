"""FLOPs per token and peak FLOP/s, for the MFU estimate."""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

# Dense bf16 peak (no sparsity), FLOP/s.
GPU_PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A10G": 125e12,
    "L4": 121e12,
    "4090": 165e12,
}


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 x non-embedding params + 12 x layers x attention width x T (PaLM appendix B).

    >>> from tierlm.models import GPTConfig, build_gpt
    >>> model = build_gpt(GPTConfig(depth=2, aspect_ratio=32, head_dim=16, vocab_size=100, max_seq_len=64))
    >>> flops_per_token(model, 64)
    777984.0
    """
    from tierlm.models import family_of, unwrap_model

    return family_of(model).flops_per_token(unwrap_model(model), seq_len)


@functools.lru_cache(maxsize=None)
def _measured_cpu_flops() -> float:
    """Best fp32 matmul throughput of this CPU over a few short trials, measured once (~0.1 s)."""
    n, repeats = 512, 8
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = max(best, 2 * n**3 * repeats / (time.perf_counter() - start))
    return best


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of `device`: a known GPU's bf16 figure, a measured matmul rate on CPU, or None."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((flops for key, flops in GPU_PEAK_FLOPS.items() if key in name), None)
    if device.type == "cpu":
        return _measured_cpu_flops()
    return None

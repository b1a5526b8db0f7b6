"""FLOPs per token and peak FLOP/s, for the MFU estimate."""

from __future__ import annotations

import functools
import sys
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


GPU_MEMORY_BANDWIDTH = {  # bytes/s, the vendors' figures; the first name found in the device's name wins
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "H200": 4.8e12,
    "H800": 3.35e12,
    "A100": 2.0e12,
    "A10G": 0.6e12,
    "L4": 0.3e12,
    "4090": 1.0e12,
}


def memory_bandwidth(device: torch.device, override: float | None = None) -> float | None:
    """Bytes/s the memory of `device` moves: a known GPU's figure, or on CPU a measured copy of 256 MiB (bytes read
    plus bytes written, the best of three): the roofline a decode step, which reads every weight once, is held to.

    >>> memory_bandwidth(torch.device("cpu"), override=1e11)
    100000000000.0
    """
    if override:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((rate for key, rate in GPU_MEMORY_BANDWIDTH.items() if key in name), None)
    if device.type != "cpu":
        return None
    source = torch.ones(64 * 2**20)  # 256 MiB of float32
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * source.element_size() / best


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 x non-embedding params + 12 x layers x attention width x T (PaLM appendix B).

    >>> from tierlm.models import GPTConfig, build_gpt
    >>> model = build_gpt(GPTConfig(depth=2, aspect_ratio=32, head_dim=16, vocab_size=100, max_seq_len=64))
    >>> flops_per_token(model, 64)
    777984.0
    """
    from tierlm.models import family_of, unwrap_model

    return family_of(model).flops_per_token(unwrap_model(model), seq_len)


def flops_line(model: nn.Module) -> tuple[float, float]:
    """`flops_per_token` as the line a + b x T it is (a = 6 x parameters, b = 12 x layers x attention width): a row of
    T tokens costs T x (a + b x T) training FLOPs.

    >>> from tierlm.models import GPTConfig, build_gpt
    >>> a, b = flops_line(build_gpt(GPTConfig(depth=2, aspect_ratio=32, head_dim=16, vocab_size=100, max_seq_len=64)))
    >>> a + b * 64
    777984.0
    """
    one, two = flops_per_token(model, 1), flops_per_token(model, 2)
    return 2 * one - two, two - one


def measure_cpu_flops(dtype: torch.dtype = torch.float32, n: int = 512, repeats: int = 8, trials: int = 5) -> float:
    """Best `dtype` matmul throughput of this CPU at this thread count over a few short trials (~0.1 s)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm up
    best = 0.0
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = max(best, 2 * n**3 * repeats / (time.perf_counter() - start))
    return best


@functools.lru_cache(maxsize=None)
def _measured_cpu_flops(threads: int, dtype: torch.dtype) -> float:
    """`measure_cpu_flops`, once per process, thread count and dtype."""
    return measure_cpu_flops(dtype)


def peak_flops(
    device: torch.device, override_tflops: float | None = None, dtype: torch.dtype = torch.float32
) -> float | None:
    """Peak FLOP/s of `device`: a known GPU's bf16 figure, a measured `dtype` matmul rate on CPU, or None."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((flops for key, flops in GPU_PEAK_FLOPS.items() if key in name), None)
    if device.type == "cpu":
        return _measured_cpu_flops(torch.get_num_threads(), dtype)
    return None


class PeakFlops:
    """The peak a utilisation figure divides by, which no step may beat: a step faster than it means the peak was
    measured low (on a CPU, something else ran during the measurement), so it is measured again, once, at that
    moment; a step still faster makes the peak unknown (no MFU printed, and a warning) rather than a figure over
    100%.

    >>> peak = PeakFlops(torch.device("cpu"), measure=lambda: 1e9)
    >>> peak.utilisation(5e8)
    0.5
    >>> peak.utilisation(2e9) is None, peak.value   # beaten twice: unknown from here on
    (True, None)
    """

    def __init__(
        self,
        device: torch.device,
        override_tflops: float | None = None,
        dtype: torch.dtype = torch.float32,
        measure=None,
    ):
        """`dtype`: what the run computes in (a CPU's bf16 matmuls may run at another rate than its fp32 ones)."""
        self.device, self.override = device, override_tflops
        self.measure = measure or (lambda: peak_flops(device, override_tflops, dtype))
        self.value, self.remeasured = self.measure(), False

    def utilisation(self, achieved: float) -> float | None:
        """`achieved` FLOP/s as a share of the peak (None: unknown)."""
        if self.value and achieved > self.value and not self.remeasured:
            self.remeasured = True
            if self.device.type == "cpu" and not self.override:
                _measured_cpu_flops.cache_clear()
                self.value = self.measure()
        if self.value and achieved > self.value:
            print(
                f"tierlm: warning: a step ran at {achieved / 1e12:.3g} TFLOP/s, above the peak this device was "
                f"measured (or set: infra.peak_tflops) at, {self.value / 1e12:.3g}: MFU is not printed from here on",
                file=sys.stderr,
            )
            self.value = None
        return achieved / self.value if self.value else None

"""Training throughput and MFU on a GPU: a ~0.5B dense native GPT in bf16, with and without torch.compile.

    python bench/gpu_mfu.py                      # on a GPU: eager, then compiled (per block)
    python bench/gpu_mfu.py --dry-run            # tiny sizes on CPU, 3 steps: keeps the script from rotting (CI)

MFU = FLOPs per token (PaLM / nanochat count: 6 N + 12 L H Q T) x tokens/s / peak, with the
peak of the GPU's dense bf16 (989 TFLOP/s for H100/H200; see tierlm.metrics.flops). The model is
trained through tierlm's own backend (fp32 master weights, bf16 autocast, fused AdamW, token-sum
loss with the LM head fused into it unless --logits-loss); steps after the warm-up are timed with the device
synchronised at both ends.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tierlm.backends import PyTorchTrainingBackend
from tierlm.backends.options import BackendOptions
from tierlm.metrics import flops_per_token, peak_flops
from tierlm.models import GPTConfig, build_gpt
from tierlm.primitives import create_adamw_optimizer
from tierlm.primitives.parallel import apply_compile


def measure(
    config: GPTConfig,
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
    compile: bool,
    device: torch.device,
    fused_cross_entropy: bool = True,
) -> dict:
    torch.manual_seed(0)
    model = build_gpt(config, device=device)
    if compile:
        apply_compile(model)
    backend = PyTorchTrainingBackend(
        model,
        create_adamw_optimizer(model, lr=3e-4),
        None,
        "/tmp/tierlm_gpu_mfu",
        device,
        None,
        BackendOptions(
            compute_dtype=torch.bfloat16 if device.type == "cuda" else None, fused_cross_entropy=fused_cross_entropy
        ),
    )
    data = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)
    step_batch = {"input_ids": data[:, :-1], "labels": data[:, 1:]}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        backend.forward_backward(step_batch)
        backend.optim_step().wait()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        backend.forward_backward(step_batch)
        metrics = backend.optim_step()
    metrics = metrics.wait()
    sync()
    elapsed = time.perf_counter() - start
    tokens_per_sec = steps * batch * seq / elapsed
    fpt = flops_per_token(model, seq)
    peak = peak_flops(device)
    return {
        "compile": compile,
        "fused_cross_entropy": fused_cross_entropy,
        "params": sum(p.numel() for p in model.parameters()),
        "batch": batch,
        "seq": seq,
        "steps": steps,
        "tokens_per_sec": tokens_per_sec,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "mfu": fpt * tokens_per_sec / peak if peak else None,
        "loss": metrics["loss"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU, 3 steps (no GPU needed)")
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--aspect-ratio", type=int, default=64, help="width = depth x aspect ratio (20 x 64 = 1280)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true", help="only the eager run")
    parser.add_argument(
        "--logits-loss", action="store_true", help="logits, then the loss (default: the LM head fused into the loss)"
    )
    args = parser.parse_args()
    if args.dry_run:
        config, device = (
            GPTConfig(depth=2, aspect_ratio=32, head_dim=32, vocab_size=512, max_seq_len=64),
            torch.device("cpu"),
        )
        batch, seq, steps, warmup, modes = 2, 64, 3, 1, [False]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_mfu.py: no CUDA GPU here; use --dry-run to check the script on CPU")
        config = GPTConfig(
            depth=args.depth, aspect_ratio=args.aspect_ratio, head_dim=128, vocab_size=32768, max_seq_len=args.seq
        )
        device, batch, seq, steps, warmup = torch.device("cuda"), args.batch, args.seq, args.steps, 5
        modes = [False] if args.no_compile else [False, True]
    for compile in modes:
        print(json.dumps(measure(config, batch, seq, steps, warmup, compile, device, not args.logits_loss)), flush=True)


if __name__ == "__main__":
    main()

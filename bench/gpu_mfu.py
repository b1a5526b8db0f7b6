"""Training throughput and MFU on a GPU: a ~0.5B dense native GPT in bf16, eager, compiled, and compiled in FP8.

    python bench/gpu_mfu.py                      # on a GPU: eager, compiled (per block), compiled + FP8 (torchao)
    python bench/gpu_mfu.py --modes compiled,compiled-model    # per block against the whole model compiled
    python bench/gpu_mfu.py --profile            # ... then torch.profiler's kernels of three compiled steps
    python bench/gpu_mfu.py --dry-run            # tiny sizes on CPU, 3 steps: keeps the script from rotting (CI)

MFU = FLOPs per token (PaLM / nanochat count: 6 N + 12 L H Q T) x tokens/s / peak, with the
peak of the GPU's dense bf16 (989 TFLOP/s for H100/H200; see tierlm.metrics.flops) for every mode, FP8's too. The
model is trained through tierlm's own backend (fp32 master weights, bf16 autocast, fused AdamW, token-sum loss with
the LM head fused into it unless --logits-loss) on bytes of Tiny Shakespeare (the package's copy; the same batches
for every mode), so each mode's loss curve (`losses`, every 5th step) can be set beside the others': FP8 is only a
win if it learns as bf16 does. Steps after the warm-up are timed with the device synchronised at both ends.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources

import torch

from tierlm.backends import PyTorchTrainingBackend
from tierlm.backends.options import BackendOptions
from tierlm.metrics import flops_per_token, peak_flops
from tierlm.models import GPTConfig, build_gpt
from tierlm.primitives import create_adamw_optimizer
from tierlm.primitives.parallel import apply_compile


def shakespeare_batches(count: int, batch: int, seq: int, device: torch.device) -> list[dict]:
    """`count` batches of random windows of Tiny Shakespeare's bytes (ids 0-255), the same for every mode."""
    text = resources.files("tierlm.data.corpora").joinpath("tinyshakespeare.txt").read_bytes()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
        rows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).to(device)
        batches.append({"input_ids": rows[:, :-1], "labels": rows[:, 1:]})
    return batches


def measure(
    config: GPTConfig,
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
    compile: bool | str,
    device: torch.device,
    fused_cross_entropy: bool = True,
    fp8: bool = False,
    profile: bool = False,
) -> dict:
    torch.manual_seed(0)
    model = build_gpt(config, device=device)
    if fp8:
        from tierlm.primitives.fp8 import apply_float8_training

        apply_float8_training(model)
    if compile is True:  # each block (infra.compile=true); "model": the backend compiles its whole training forward
        apply_compile(model)
    backend = PyTorchTrainingBackend(
        model,
        create_adamw_optimizer(model, lr=3e-4),
        None,
        "/tmp/tierlm_gpu_mfu",
        device,
        None,
        BackendOptions(
            compute_dtype=torch.bfloat16 if device.type == "cuda" else None,
            fused_cross_entropy=fused_cross_entropy,
            compile="model" if compile == "model" else False,  # infra.compile=model: the whole training forward
        ),
    )
    batches = shakespeare_batches(warmup + steps, batch, seq, device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    losses = []
    for step_batch in batches[:warmup]:
        backend.forward_backward(step_batch)
        losses.append(backend.optim_step().wait()["loss"])
    sync()
    start = time.perf_counter()
    pending = []
    for step_batch in batches[warmup:]:
        backend.forward_backward(step_batch)
        pending.append(backend.optim_step())
    metrics = pending[-1].wait()
    sync()
    elapsed = time.perf_counter() - start
    losses += [m.wait()["loss"] for m in pending]
    if profile:
        kernels(backend, batches[-3:], device)
    tokens_per_sec = steps * batch * seq / elapsed
    fpt = flops_per_token(model, seq)
    peak = peak_flops(device)
    return {
        "compile": compile,
        "fp8": fp8,
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
        "losses": [round(x, 3) for x in losses[::5]],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


def kernels(backend, batches: list[dict], device: torch.device) -> None:
    """torch.profiler's view of a few steps: the kernels by their GPU time (where a step goes)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for step_batch in batches:
            backend.forward_backward(step_batch)
            backend.optim_step().wait()
        if device.type == "cuda":
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU, 3 steps (no GPU needed)")
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--aspect-ratio", type=int, default=64, help="width = depth x aspect ratio (20 x 64 = 1280)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--modes",
        default=None,
        help="any of eager, compiled (each block), compiled-model (the whole forward, loss included), compiled-fp8 "
        "(default: eager,compiled,compiled-fp8; --dry-run: eager)",
    )
    parser.add_argument("--profile", action="store_true", help="also the kernels of three steps of the last mode")
    parser.add_argument(
        "--logits-loss", action="store_true", help="logits, then the loss (default: the LM head fused into the loss)"
    )
    args = parser.parse_args()
    if args.dry_run:
        config, device = (
            GPTConfig(depth=2, aspect_ratio=32, head_dim=32, vocab_size=512, max_seq_len=64),
            torch.device("cpu"),
        )
        batch, seq, steps, warmup, modes = 2, 64, 3, 1, (args.modes or "eager").split(",")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_mfu.py: no CUDA GPU here; use --dry-run to check the script on CPU")
        config = GPTConfig(
            depth=args.depth, aspect_ratio=args.aspect_ratio, head_dim=128, vocab_size=32768, max_seq_len=args.seq
        )
        device, batch, seq, steps, warmup = torch.device("cuda"), args.batch, args.seq, args.steps, 5
        modes = (args.modes or "eager,compiled,compiled-fp8").split(",")
    compiles = {"eager": False, "compiled": True, "compiled-model": "model", "compiled-fp8": True}
    for i, mode in enumerate(modes):
        assert mode in compiles, f"no mode {mode} (one of {', '.join(compiles)})"
        figures = measure(
            config, batch, seq, steps, warmup, compiles[mode], device, not args.logits_loss, mode.endswith("fp8"),
            args.profile and i == len(modes) - 1,
        )  # fmt: skip
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()

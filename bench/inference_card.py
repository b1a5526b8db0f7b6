"""The inference card: latency, throughput, memory and memory-bandwidth utilisation (MBU) across decode batch sizes.

    python bench/inference_card.py                      # on a GPU: the 478 M model in bf16, batch 1/16/64
    python bench/inference_card.py --device-type cpu --depth 6 --aspect-ratio 64 --batches 1,8
                                                        # on CPU: a smaller model in float32
    python bench/inference_card.py --dry-run            # tiny sizes on CPU: keeps the script from rotting (CI)
    python bench/inference_card.py --profile --batches 16 --new-tokens 32 --contenders tierlm
                                                        # torch.profiler's table of each contender named

The same weights for every contender: a native GPT (default depth 20, width 1280, head 128, vocab 32768, the shape of
bench/gpu_mfu.py) with trained-looking random weights, exported to the equivalent transformers Qwen3 model.
Sampling at temperature 1, no stop token, a 16-token prompt, so each generates exactly batch x new-tokens tokens.
  - tierlm: `Engine` as it runs (on CUDA, each decode step one CUDA graph: `tierlm.rollout.static_decode`, its
    tokens read by the host once every 8 steps);
  - tierlm-compiled: `Engine(compile=True)` (engine.compile=true), the fixed-shape step `torch.compile`d (on CUDA,
    then captured in the graph); its first generation of each shape compiles, in the warm-up;
  - tierlm-every-step (GPU): `tierlm` with the tokens read after every step (what the engine did before);
  - tierlm-compiled-apart: `tierlm-compiled` with each layer's q, k, v, gate and up weights as five matmuls, not
    packed into two (`tierlm.rollout.static_decode.pack`; what the engine did before);
  - tierlm-compiled-math: `tierlm-compiled` with attention compiled from its math (`sdpa_kernel(SDPBackend.MATH)`:
    Inductor's own kernels for q k^T, the softmax and the product with v, not cuDNN's or flash's);
  - tierlm-compiled-descent: `tierlm-compiled` with Inductor's coordinate-descent tuning, as gpt-fast compiles: at
    batch 1 each matmul becomes Inductor's own reduction kernel, its launch shape tuned, which can take the norm
    before it and the residual add after it (`tierlm.rollout.static_decode.COMPILE_OPTIONS`);
  - tierlm-compiled-autotune: that and Inductor's max-autotune (Triton's matmul templates timed against cuBLAS for
    each projection's shape, where batch 1 keeps no matmul); its compile takes the longest;
  - tierlm-eager: `Engine(static=False)`, the step launched kernel by kernel, attending to the cache so far (on
    CPU this is what `tierlm` runs);
  - tierlm-static (CPU): the fixed-shape step without a graph, attending to the whole bucket (masked);
  - transformers-static (GPU only): `generate(cache_implementation="static")`, which compiles its forward
    (transformers' own fast path); skipped on CPU, where its compile takes minutes for nothing.
A row's figures: `prefill_ms` (a generation of one token), `step_ms` (one decode step: the time of `--new-tokens`
less the prefill, over the steps after it; for transformers the whole time over the tokens, its prefill included),
tokens/s and steps/s, `peak_gib` (the device's peak allocation during the generation; CUDA only), and `mbu`: the
bytes a step must read — every weight once, plus the keys and values cached so far on average — per second over the
memory's bandwidth (`tierlm.metrics.flops.memory_bandwidth`: a
known GPU's figure, or a measured copy on CPU). `bound_steps_per_sec` is that roofline for the weights alone.
Each timing is the median of 3 after one warm-up, the device synchronised at both ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tierlm.metrics.flops import memory_bandwidth
from tierlm.models import GPTConfig, build_gpt, load_native_model, save_model_folder
from tierlm.rollout.engine import Engine
from tierlm.rollout.sampling import SamplingParams

PROMPT = list(range(10, 26))


def timed(fn, device: torch.device, calls: int = 3) -> float:
    fn()
    times = []
    for _ in range(calls):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def chosen_device(device_type: str | None, script: str) -> torch.device:
    """--device-type, else CUDA where there is one; a clear exit where CUDA is asked for and missing."""
    device = torch.device(device_type or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{script}: no CUDA GPU here; pass --device-type cpu or --dry-run")
    return device


def card_config(args, dry_max_seq_len: int) -> GPTConfig:
    """The model the card (and bench/rollout_batch.py) measures: --depth x --aspect-ratio with 128-wide heads and a
    32,768-token vocabulary (depth 20: 478 M parameters), or a tiny one for --dry-run."""
    if args.dry_run:
        return GPTConfig(depth=2, aspect_ratio=32, head_dim=32, vocab_size=512, max_seq_len=dry_max_seq_len)
    return GPTConfig(depth=args.depth, aspect_ratio=args.aspect_ratio, head_dim=128, vocab_size=32768, max_seq_len=1024)


def random_gpt(config: GPTConfig):
    """The native GPT of `config` with trained-looking random weights (non-degenerate distributions), seed 0."""
    torch.manual_seed(0)
    gpt = build_gpt(config)
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return gpt


def attending(attention: SDPBackend | None):
    """`sdpa_kernel(attention)` where one is given (a step compiled and captured inside uses that attention)."""
    return sdpa_kernel(attention) if attention is not None else contextlib.nullcontext()


def afresh(name: str) -> None:
    """Compiled contenders share the step's function: each starts from an empty dynamo cache, none reusing another's
    graphs."""
    if name.startswith("tierlm-compiled"):
        torch._dynamo.reset()


def engine_generate(engine: Engine, batch: int, device: torch.device, attention: SDPBackend | None = None):
    """A generation of `new_tokens` from the card's prompt, `attending(attention)`."""
    generator = torch.Generator(device).manual_seed(0)

    def generate(new_tokens: int):
        with attending(attention):
            out = engine.generate(PROMPT, batch, new_tokens, SamplingParams(1.0), generator)
        assert all(len(c.tokens) == new_tokens for c in out)

    return generate


def transformers_generate(model, batch: int, device: torch.device):
    ids = torch.tensor([PROMPT] * batch, device=device)

    @torch.no_grad()
    def generate(new_tokens: int):
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=0,
            eos_token_id=None,
            cache_implementation="static",
        )
        assert out.shape == (batch, len(PROMPT) + new_tokens)

    return generate


def card_row(name, generate, batch, new_tokens, config, params, bytes_per, bandwidth, device) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # transformers' static cache is sized by max_new_tokens, so a one-token generation would compile another
    # graph: its prefill is not measured, and its step is the whole generation's time over the tokens.
    prefill = timed(lambda: generate(1), device) if name != "transformers-static" else None
    total = timed(lambda: generate(new_tokens), device)
    step = max(total - prefill, 1e-9) / (new_tokens - 1) if prefill is not None else total / new_tokens
    mean_positions = len(PROMPT) + new_tokens / 2
    kv_bytes = 2 * config.depth * config.num_kv_heads * config.head_dim * bytes_per * batch * mean_positions
    weight_bytes = params * bytes_per
    return {
        "contender": name,
        "batch": batch,
        "new_tokens": new_tokens,
        "prefill_ms": round(prefill * 1e3, 2) if prefill is not None else None,
        "step_ms": round(step * 1e3, 3),
        "steps_per_sec": round(1 / step, 1),
        "tokens_per_sec": round(batch * new_tokens / total, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "mbu": round((weight_bytes + kv_bytes) / step / bandwidth, 4) if bandwidth else None,
        "bound_steps_per_sec": round(bandwidth / weight_bytes, 1) if bandwidth else None,
        "params": params,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()})",
    }


def profile(engine: Engine, batch: int, new_tokens: int, device: torch.device) -> None:
    """Where a decode step's time goes: the operators by their own host time, and the kernels launched a step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    generate = engine_generate(engine, batch, device)
    generate(new_tokens)  # warm-up (and the CUDA graph's capture)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        generate(new_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))
    if device.type == "cuda":  # the kernels themselves (a CUDA graph's replay among them), by their GPU time
        print(events.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=50))
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    print(json.dumps({"profile_batch": batch, "new_tokens": new_tokens, "kernels_per_step": kernels / new_tokens}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU, batch 1 and 3, 8 tokens")
    parser.add_argument("--device-type", default=None, help="cuda (default where there is one) or cpu")
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--aspect-ratio", type=int, default=64, help="width = depth x aspect ratio (20 x 64 = 1280)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--contenders",
        default=None,
        help="default: tierlm,tierlm-compiled,tierlm-every-step,tierlm-eager,transformers-static (GPU), else "
        "tierlm,tierlm-static,tierlm-compiled (--dry-run: no tierlm-compiled)",
    )
    parser.add_argument("--bandwidth", type=float, default=None, help="bytes/s of the memory (default: known/measured)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler's table of each contender")
    args = parser.parse_args()
    config = card_config(args, dry_max_seq_len=64)
    if args.dry_run:
        device, batches, new_tokens = torch.device("cpu"), [1, 3], 8
    else:
        device = chosen_device(args.device_type, "inference_card.py")
        batches, new_tokens = [int(b) for b in args.batches.split(",")], args.new_tokens
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    folder = Path(tempfile.mkdtemp()) / "model"
    gpt = random_gpt(config)
    save_model_folder(gpt, folder)
    params = sum(p.numel() for p in gpt.parameters())
    del gpt
    native = load_native_model(folder, device, dtype).eval()
    engines = {
        "tierlm": Engine(native),
        "tierlm-eager": Engine(native, static=False),
        "tierlm-static": Engine(native, static=True),
        "tierlm-compiled": Engine(native, compile=True),
        "tierlm-every-step": Engine(native),
    }
    engines["tierlm-every-step"].ahead = 1
    engines["tierlm-compiled-apart"] = Engine(native, compile=True)
    engines["tierlm-compiled-apart"].decoders.pack = False  # q/k/v and gate/up as separate matmuls
    engines["tierlm-compiled-math"] = Engine(native, compile=True)
    engines["tierlm-compiled-descent"] = Engine(native, compile="coordinate-descent")
    engines["tierlm-compiled-autotune"] = Engine(native, compile="max-autotune")
    attention = {"tierlm-compiled-math": SDPBackend.MATH}
    gpu = "tierlm,tierlm-compiled,tierlm-every-step,tierlm-eager,transformers-static"
    # --dry-run (in the suite) leaves Inductor's code generation out: tens of seconds on 2 cores
    default = gpu if device.type == "cuda" else "tierlm,tierlm-static" + ("" if args.dry_run else ",tierlm-compiled")
    names = (args.contenders or default).split(",")
    if args.profile:
        for name in names:
            print(f"=== {name}")
            afresh(name)
            with attending(attention.get(name)):
                profile(engines[name], batches[0], new_tokens, device)
        return
    hf = None
    if "transformers-static" in names:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    bandwidth = memory_bandwidth(device, args.bandwidth)
    bytes_per = torch.finfo(dtype).bits // 8
    for name in names:  # contender by contender: a slow compile last cuts off no one else's rows
        afresh(name)
        for batch in batches:
            if name == "transformers-static":
                generate = transformers_generate(hf, batch, device)
            else:
                generate = engine_generate(engines[name], batch, device, attention.get(name))
            try:
                row = card_row(name, generate, batch, new_tokens, config, params, bytes_per, bandwidth, device)
            except Exception as error:  # noqa: BLE001 - a contender that fails is a row saying so, not the end
                row = {"contender": name, "batch": batch, "error": f"{type(error).__name__}: {error}"[:300]}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""Generation speed on a GPU: tierlm's engine against transformers `generate`, on a ~0.5B model in bf16.

    python bench/gpu_generation.py                   # on a GPU: batch 1, 16 and 64, 128 new tokens
    python bench/gpu_generation.py --dry-run         # tiny sizes on CPU: keeps the script from rotting (CI)

The same weights for every contender: a native GPT (depth 20, width 1280, head 128, vocab 32768, the
shape of bench/gpu_mfu.py), exported to the equivalent transformers Qwen3 model. Sampling at temperature 1,
no stop token, so each contender generates exactly batch x new-tokens tokens from a 16-token prompt.
  - tierlm-native: `Engine` on the native GPT;
  - tierlm-hf: `Engine` on the transformers model (its own cache);
  - transformers: `model.generate(do_sample=True)`, the prompt repeated per row.
Each row is the median of 3 generations after one warm-up, the device synchronised at both ends. The
`bound_steps_per_sec` column is the memory roofline of a decode step: the GPU's bandwidth over the bytes
of the weights (2 per parameter in bf16), which no engine beats below a few hundred rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tierlm.models import GPTConfig, build_gpt, load_native_model, save_model_folder
from tierlm.rollout.engine import Engine


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


def profile(model, prompt: list[int], batch: int, new_tokens: int, device: torch.device) -> None:
    """Where a decode step's time goes: the operators by their own host time, and the kernels launched a step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine = Engine(model)
    engine.generate(prompt, batch, new_tokens, temperature=1.0)  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        engine.generate(prompt, batch, new_tokens, temperature=1.0)
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=20))
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    print(json.dumps({"profile_batch": batch, "new_tokens": new_tokens, "kernels_per_step": kernels / new_tokens}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU, batch 2, 8 tokens")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s of the GPU's memory (H100 SXM)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler's table instead")
    args = parser.parse_args()
    if args.dry_run:
        config = GPTConfig(depth=2, aspect_ratio=32, head_dim=32, vocab_size=512, max_seq_len=64)
        device, dtype, batches, new_tokens = torch.device("cpu"), torch.float32, [2], 8
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_generation.py: no CUDA GPU here; use --dry-run to check the script on CPU")
        config = GPTConfig(depth=20, aspect_ratio=64, head_dim=128, vocab_size=32768, max_seq_len=1024)
        device, dtype = torch.device("cuda"), torch.bfloat16
        batches, new_tokens = [int(b) for b in args.batches.split(",")], args.new_tokens
    from transformers import AutoModelForCausalLM

    folder = Path(tempfile.mkdtemp()) / "model"
    torch.manual_seed(0)
    gpt = build_gpt(config)
    with torch.no_grad():  # trained-looking weights: non-degenerate distributions
        for p in gpt.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_model_folder(gpt, folder)
    params = sum(p.numel() for p in gpt.parameters())
    del gpt
    models = {
        "tierlm-native": load_native_model(folder, device, dtype).eval(),
        "hf": AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval(),
    }
    prompt = list(range(10, 26))
    if args.profile:
        profile(models["tierlm-native"], prompt, batches[0], new_tokens, device)
        return
    for batch in batches:
        g = torch.Generator(device).manual_seed(0)
        ids = torch.tensor([prompt] * batch, device=device)

        def engine(model):
            out = Engine(model).generate(prompt, batch, new_tokens, temperature=1.0, generator=g)
            assert all(len(c.tokens) == new_tokens for c in out)

        @torch.no_grad()
        def transformers_generate():
            out = models["hf"].generate(
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
            )
            assert out.shape == (batch, len(prompt) + new_tokens)

        contenders = {
            "tierlm-native": lambda: engine(models["tierlm-native"]),
            "tierlm-hf": lambda: engine(models["hf"]),
            "transformers": transformers_generate,
        }
        for name, fn in contenders.items():
            seconds = timed(fn, device)
            row = {
                "contender": name,
                "batch": batch,
                "new_tokens": new_tokens,
                "params": params,
                "seconds": round(seconds, 4),
                "tokens_per_sec": round(batch * new_tokens / seconds, 1),
                "steps_per_sec": round(new_tokens / seconds, 1),
                "bound_steps_per_sec": round(args.bandwidth / (2 * params), 1),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

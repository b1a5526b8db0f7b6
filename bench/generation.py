"""Generation speed: tierlm's engine (KV cache, prefill once) against transformers `generate`.

    .venv/bin/python bench/generation.py [--repeats 3] [--new-tokens 128]

The same weights for every contender: a native GPT (depth 4, width 256, vocab 4096), exported
to the equivalent transformers Qwen3 model. Sampling at temperature 1 with no stop token, so
every contender generates exactly batch x new-tokens tokens; the prompt is 16 tokens.
  - tierlm-native: `Engine` on the native GPT;
  - tierlm-hf: `Engine` on the transformers model (its own cache);
  - transformers: `model.generate(do_sample=True)`, the prompt repeated per row;
  - vllm: vLLM's `LLM.generate` (its CPU build, in its own environment .venv-vllm: scripts/setup_vllm.sh), the
    engine core in the same process, float32, one request of n=batch samples; skipped where .venv-vllm is absent.
    Its process's peak memory is `vllm_rss_mb` (the harness's own column measures the parent that starts it).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import parser, run  # noqa: E402

MODEL_DIR = Path(tempfile.gettempdir()) / "tierlm_bench_generation_model"


def model_folder() -> Path:
    from tierlm.models import GPTConfig, build_gpt, save_model_folder

    if not (MODEL_DIR / "model.safetensors").is_file():
        torch.manual_seed(0)
        gpt = build_gpt(
            GPTConfig(depth=4, aspect_ratio=64, head_dim=64, n_kv_head=2, vocab_size=4096, max_seq_len=1024)
        )
        with torch.no_grad():  # trained-looking weights: non-degenerate distributions
            for p in gpt.parameters():
                p.add_(0.05 * torch.randn_like(p))
        save_model_folder(gpt, MODEL_DIR)
    return MODEL_DIR


def _time(fn, batch: int, new_tokens: int, calls: int = 5) -> dict:
    """Median of `calls` generations after one warm-up (allocations, first-call paths)."""
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    elapsed = statistics.median(times)
    return {"tokens_per_sec": batch * new_tokens / elapsed, "seconds": elapsed}


def tierlm(args, hf: bool) -> dict:
    from tierlm.models import load_native_model
    from tierlm.rollout.engine import Engine
    from tierlm.rollout.sampling import SamplingParams

    if hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_folder()).eval()
    else:
        model = load_native_model(model_folder()).eval()
    engine, prompt = Engine(model), list(range(10, 26))
    g = torch.Generator().manual_seed(0)

    def go():
        out = engine.generate(prompt, args.batch, args.new_tokens, SamplingParams(1.0), g)
        assert all(len(c.tokens) == args.new_tokens for c in out)

    return _time(go, args.batch, args.new_tokens)


def transformers_generate(args) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder()).eval()
    ids = torch.arange(10, 26)[None].repeat(args.batch, 1)

    @torch.no_grad()
    def go():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=0,
            eos_token_id=None,
        )
        assert out.shape == (args.batch, 16 + args.new_tokens)

    return _time(go, args.batch, args.new_tokens)


VLLM_PY = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
VLLM_CHILD = """
import json, os, resource, statistics, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
folder, batch, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(model=folder, dtype="float32", max_model_len=256, enforce_eager=True, skip_tokenizer_init=True, seed=0,
          enable_chunked_prefill=False)
params = SamplingParams(n=batch, max_tokens=new, min_tokens=new, temperature=1.0, ignore_eos=True, seed=0)
prompt = [{"prompt_token_ids": list(range(10, 26))}]
def go():
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs
    assert len(out) == batch and all(len(o.token_ids) == new for o in out)
go()
times = []
for _ in range(5):
    start = time.perf_counter(); go(); times.append(time.perf_counter() - start)
elapsed = statistics.median(times)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("VLLM " + json.dumps({"tokens_per_sec": batch * new / elapsed, "seconds": elapsed, "vllm_rss_mb": rss}))
"""


def vllm_generate(args) -> dict:
    import json
    import os
    import subprocess

    if not VLLM_PY.is_file():
        raise SystemExit("vllm: no .venv-vllm (bash scripts/setup_vllm.sh makes it); leave it out with --only")
    command = [str(VLLM_PY), "-c", VLLM_CHILD, str(model_folder()), str(args.batch), str(args.new_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ)  # vLLM binds its threads to cores
    lines = [line for line in done.stdout.splitlines() if line.startswith("VLLM ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(lines[-1][len("VLLM ") :])


CONTENDERS = {
    "tierlm-native": lambda a: tierlm(a, hf=False),
    "tierlm-hf": lambda a: tierlm(a, hf=True),
    "transformers": transformers_generate,
    "vllm": vllm_generate,
}

if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args()
    argv = [f"--batch={args.batch}", f"--new-tokens={args.new_tokens}", f"--threads={args.threads}"]
    if args.contender is None:
        model_folder()
        print(f"generation, batch {args.batch}, {args.new_tokens} new tokens, {args.threads} threads", file=sys.stderr)
    run(CONTENDERS, args, argv, "tokens_per_sec", "transformers")

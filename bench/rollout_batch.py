"""An RL step's generation: its prompts decoded as one batch against one prompt at a time.

    python bench/rollout_batch.py                       # on a GPU: the 478 M model in bf16, 8 prompts x 8 samples
    python bench/rollout_batch.py --device-type cpu --depth 6 --new-tokens 64
    python bench/rollout_batch.py --dry-run             # tiny sizes on CPU

`Engine.generate_many` with the fixed-shape decoder (what the engine runs on CUDA; forced on CPU) right-aligns a
call's prompts in one batch (`tierlm.rollout.static_decode.StaticDecoder.load`) and samples each prompt's rows with
its own generator; `alone` is the same engine generating one prompt after another, as it did before. Prompts of
8-40 tokens (one length per prompt), `--samples` each, temperature 1, no stop token, so every row generates
`--new-tokens` tokens; both contenders sample the same tokens (tests/test_rl.py), so only the time differs. Each
timing is the median of 3 after one warm-up (which captures the graphs and, with --compile, compiles).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tierlm.rollout.engine import Engine
from tierlm.rollout.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference_card import card_config, chosen_device, random_gpt, timed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU, 3 prompts x 2 samples, 8 tokens")
    parser.add_argument("--device-type", default=None, help="cuda (default where there is one) or cpu")
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--aspect-ratio", type=int, default=64, help="width = depth x aspect ratio (20 x 64 = 1280)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--compile", action="store_true", help="engine.compile: the step through Inductor")
    args = parser.parse_args()
    config = card_config(args, dry_max_seq_len=128)
    if args.dry_run:
        device, prompts, samples, new_tokens = torch.device("cpu"), 3, 2, 8
    else:
        device = chosen_device(args.device_type, "rollout_batch.py")
        prompts, samples, new_tokens = args.prompts, args.samples, args.new_tokens
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_gpt(config).to(device, dtype).eval()
    engine = Engine(model, static=True, compile=args.compile)
    lengths = [8 + (32 * i) // max(prompts - 1, 1) for i in range(prompts)]
    texts = [[(7 * i + j) % config.vocab_size for j in range(n)] for i, n in enumerate(lengths)]

    def requests():
        return [(text, samples, torch.Generator(device).manual_seed(i)) for i, text in enumerate(texts)]

    def together():
        out = engine.generate_many(requests(), new_tokens, SamplingParams(1.0))
        assert all(len(c.tokens) == new_tokens for group in out for c in group)

    def alone():
        for text, n, generator in requests():
            engine.generate(text, n, new_tokens, SamplingParams(1.0), generator)

    rows = prompts * samples
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()})"
    figures = {"together": timed(together, device), "alone": timed(alone, device)}
    for name, seconds in figures.items():
        row = {
            "contender": name,
            "prompts": prompts,
            "samples": samples,
            "new_tokens": new_tokens,
            "seconds": round(seconds, 3),
            "tokens_per_sec": round(rows * new_tokens / seconds, 1),
            "compile": args.compile,
            "device": where,
        }
        print(json.dumps(row), flush=True)
    print(json.dumps({"together_speedup": round(figures["alone"] / figures["together"], 2)}))


if __name__ == "__main__":
    main()

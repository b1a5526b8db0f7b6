"""Does a weight push into vLLM take effect, exactly? Run from vLLM's environment (scripts/setup_vllm.sh):

    .venv-vllm/bin/python scripts/vllm_weight_sync.py RUN [--url http://127.0.0.1:8000]

Loads a trained run's model, samples greedy completions of a few prompts with tierlm's own engine and with
tierlm's vLLM engine (in this process, or the server at --url), changes every weight, pushes the new weights
into both engines, and samples again. Prints one JSON line: whether vLLM's greedy tokens equal the native
engine's before and after the push, whether the push changed them, the weight version each completion is
stamped with, the largest log-prob gap, and whether a seeded sampling repeats. Exits 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from tierlm.data import load_tokenizer
from tierlm.models import load_pretrained_model
from tierlm.rollout.engine import Engine
from tierlm.rollout.sampling import GREEDY, SamplingParams
from tierlm.rollout.vllm import VLLMEngine


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=Path)
    parser.add_argument("--url", default=None)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.run / "model")
    model = load_pretrained_model(args.run / "model")
    prompts = [
        tokenizer.render_for_completion([{"role": "user", "content": f"What is {a} + {b}?"}])
        for a, b in ((23, 45), (7, 8), (120, 3), (51, 49))
    ]
    native = Engine(model, tokenizer.stop_ids, tokenizer)
    start = time.perf_counter()
    vllm = VLLMEngine(model, tokenizer.stop_ids, tokenizer, [], Path(tempfile.mkdtemp()), 256, args.url)
    load_s = time.perf_counter() - start

    def greedy(engine):
        return engine.generate_many([(p, 1, None) for p in prompts], 16, GREEDY)

    def gap(a, b):
        return max(abs(x - y) for ca, cb in zip(a, b) for x, y in zip(ca[0].logprobs, cb[0].logprobs))

    before_native, before_vllm = greedy(native), greedy(vllm)
    generator = torch.Generator().manual_seed(0)
    state = {k: v + 0.02 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}
    start = time.perf_counter()
    vllm.load_weights(state, 1)
    push_s = time.perf_counter() - start
    native.load_weights(state, 1)
    after_native, after_vllm = greedy(native), greedy(vllm)
    tokens = lambda batch: [c[0].tokens for c in batch]  # noqa: E731
    seeded = [
        [c.tokens for c in vllm.generate(prompts[0], 4, 16, SamplingParams(1.0), torch.Generator().manual_seed(7))]
        for _ in range(2)
    ]
    report = {
        "load_s": round(load_s, 2),
        "push_s": round(push_s, 4),
        "same_before": tokens(before_native) == tokens(before_vllm),
        "same_after": tokens(after_native) == tokens(after_vllm),
        "changed": tokens(after_vllm) != tokens(before_vllm),
        "versions_after": sorted({c[0].weight_version for c in after_vllm}),
        "max_logprob_gap": max(gap(before_native, before_vllm), gap(after_native, after_vllm)),
        "seeded_repeats": seeded[0] == seeded[1],
    }
    vllm.close()
    print(json.dumps(report))
    ok = report["same_before"] and report["same_after"] and report["changed"] and report["seeded_repeats"]
    return 0 if ok and report["versions_after"] == [1] and report["max_logprob_gap"] < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())

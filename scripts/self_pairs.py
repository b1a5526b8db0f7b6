"""Preference pairs from a chat model's own answers: for each training problem of an RL config's task, sample a
few replies, score them with the task's reward, and pair a right reply (chosen) with a wrong one (rejected) —
the model's own mistakes, which it finds likely, rather than made-up near misses it already ranks last.

    .venv/bin/python scripts/self_pairs.py runs/tiny_sft --config configs/tiny_rl.yaml --problems 2000 \\
        --samples 4 --out runs/self_pairs.jsonl
    tierlm dpo --config configs/tiny_dpo.yaml data.dataset_name=runs/self_pairs.jsonl dpo.loss_type=ipo ...

With `--unpaired`, each pair is written as two rows of KTO's unpaired form instead (TRL's
`unpair_preference_dataset`): `{"prompt": [user], "completion": [assistant], "label": true | false}`, for
`tierlm dpo ... dpo.loss_type=kto`.

Writes `{"chosen": [user, assistant], "rejected": [user, assistant]}` conversations (tool calls and results kept
as the model wrote and received them; DPO masks the results as SFT does) and prints how many problems gave a
pair. Sampling is seeded per problem, so the same command writes the same file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tierlm.builders.engine import EngineSettings, build_engine
from tierlm.builders.tasks import open_task
from tierlm.checkpoint.folders import verified_model_location
from tierlm.config import TierlmConfig
from tierlm.data import load_tokenizer
from tierlm.models import load_pretrained_model
from tierlm.rollout.sampling import SamplingParams
from tierlm.rollout.text import answer_text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--config", default="configs/tiny_rl.yaml", help="the RL config whose task and tools to use")
    parser.add_argument("--problems", type=int, default=2000)
    parser.add_argument("--samples", type=int, default=4, help="replies sampled per problem")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--unpaired", action="store_true", help="write KTO's unpaired rows (two per pair)")
    args = parser.parse_args()
    config = TierlmConfig.load(args.config)
    location = verified_model_location(args.checkpoint)
    tokenizer = load_tokenizer(location)
    model = load_pretrained_model(location).eval()
    task = open_task(config.data.dataset_name, "train", args.problems, config.training.seed)
    engine = build_engine(EngineSettings.of(config), model, tokenizer, args.out.parent / "self_pairs_sampler")
    stop = set(tokenizer.stop_ids)
    pairs = 0
    with args.out.open("w") as f:
        for index in range(len(task)):
            example = task.example(index)
            generator = torch.Generator().manual_seed(config.training.seed * 1_000_003 + index)
            prompt = tokenizer.render_for_completion(example.messages)
            completions = engine.generate(
                prompt, args.samples, config.rl.max_new_tokens, SamplingParams(1.0), generator
            )
            scored = [
                (c, task.reward(example.prompt, answer_text(tokenizer, c.tokens), example.reference))
                for c in completions
            ]
            right = [c for c, r in scored if r >= 1.0 and c.finished]
            wrong = [c for c, r in scored if r < 1.0 and c.finished]
            if not right or not wrong:
                continue

            def turn(c) -> list[dict]:
                tokens = [t for t in c.tokens if t not in stop]
                reply = tokenizer.decode(tokens, skip_special_tokens=False)
                return [*example.messages, {"role": "assistant", "content": reply}]

            chosen, rejected = turn(right[0]), turn(wrong[0])
            if args.unpaired:
                for reply, label in ((chosen, True), (rejected, False)):
                    f.write(json.dumps({"prompt": reply[:-1], "completion": reply[-1:], "label": label}) + "\n")
            else:
                f.write(json.dumps({"chosen": chosen, "rejected": rejected}) + "\n")
            pairs += 1
    engine.close()
    print(f"{pairs} pairs from {len(task)} problems ({args.samples} replies each) -> {args.out}")
    return 0 if pairs else 1


if __name__ == "__main__":
    sys.exit(main())

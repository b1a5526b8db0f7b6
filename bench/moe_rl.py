"""RL on a tiny mixture-of-experts policy, with and without rollout routing replay (docs/moe.md).

The main job's pipeline (configs/tiny_pretrain.yaml -> tiny_sft -> tiny_rl) with model.moe.num_experts experts, then
RL from the same SFT model on-policy and one step off-policy (rl.max_off_policy_steps=1: the sampler's weights are an
update behind the trainer's, the routing mismatch an async RL run meets), each with rl.routing_replay off and on, over
seeds. Per run: held-out pass@1 before -> after, the mean routing agreement of the train lines (tokens routed alike in
every layer; router decisions alike), the mean |trainer - sampler| log-prob per sampled token, and the wall time.

    python bench/moe_rl.py [--seeds 1,2] [--experts 4] [--steps 60] [--work runs/moe_rl]

Runs one after another (two torch processes on 2 cores slow each other many times over).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIERLM = [sys.executable, "-m", "tierlm"]
VARIANTS = {
    "on-policy": [],
    "on-policy + replay": ["rl.routing_replay=true"],
    "1 step off-policy": ["rl.max_off_policy_steps=1"],
    "1 step off-policy + replay": ["rl.max_off_policy_steps=1", "rl.routing_replay=true"],
}


def tierlm(*args: str) -> tuple[float, str]:
    """Run a tierlm command; its wall seconds and what it printed."""
    start = time.perf_counter()
    done = subprocess.run(
        [*TIERLM, *args, "infra.progress_bar=false"], cwd=REPO, check=True, stdout=subprocess.PIPE, text=True
    )
    return time.perf_counter() - start, done.stdout


def figures(run: Path, seconds: float, printed: str) -> dict[str, float]:
    """One RL run's figures: pass@1 before and after (its summary line), the train lines' means."""
    before, after = re.search(r"held-out pass@1 ([0-9.]+) -> ([0-9.]+)", printed).groups()
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if line["type"] == "train"]
    return {
        "initial_pass@1": float(before),
        "pass@1": float(after),
        "tokens_alike": statistics.mean(line["routing_token_agreement"] for line in train),
        "decisions_alike": statistics.mean(line["routing_decision_agreement"] for line in train),
        "dlogp": statistics.mean(line["logprob_abs_diff"] for line in train),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--work", type=Path, default=REPO / "runs/moe_rl")
    args = parser.parse_args()
    work = args.work.resolve()
    pre, sft = work / "pretrain", work / "sft"
    moe = [f"model.moe.num_experts={args.experts}"]
    if not (sft / "model").exists():
        pre_args = ["--config", "configs/tiny_pretrain.yaml", *moe, f"infra.output_dir={pre}"]
        print(f"pretrain {tierlm('pretrain', *pre_args)[0]:.0f} s")
        sft_args = ["--config", "configs/tiny_sft.yaml", f"model.model_name_or_path={pre}", f"infra.output_dir={sft}"]
        print(f"sft {tierlm('sft', *sft_args)[0]:.0f} s")
    rows = {name: [] for name in VARIANTS}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name, extra in VARIANTS.items():
            out = work / f"rl_{name.replace(' ', '_').replace('+', 'r')}_{seed}"
            seconds, printed = tierlm(
                "rl", "--config", "configs/tiny_rl.yaml", f"model.model_name_or_path={sft}", f"infra.output_dir={out}",
                f"training.seed={seed}", f"training.num_train_steps={args.steps}", "training.logging_steps=1",
                "training.save_steps=0", *extra,
            )  # fmt: skip
            rows[name].append(figures(out, seconds, printed))
            print(name, seed, json.dumps(rows[name][-1]), flush=True)
    print(f"\n| RL on a {args.experts}-expert policy | pass@1 before -> after | tokens routed alike | decisions alike "
          "| mean abs(dlogp) | wall s |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, runs in rows.items():

        def band(key: str, fmt: str) -> str:
            values = [r[key] for r in runs]
            return f"{min(values):{fmt}}–{max(values):{fmt}}" if len(values) > 1 else f"{values[0]:{fmt}}"

        print(f"| {name} | {band('initial_pass@1', '.3f')} -> {band('pass@1', '.3f')} | {band('tokens_alike', '.4f')} "
              f"| {band('decisions_alike', '.4f')} | {band('dlogp', '.2e')} | {band('seconds', '.0f')} |")  # fmt: skip


if __name__ == "__main__":
    main()

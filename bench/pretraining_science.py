"""Learning evidence for seed 004's pretraining science, on tinyshakespeare (characters), CPU.

    .venv/bin/python bench/pretraining_science.py optimizers [--steps 400] [--seeds 3]
    .venv/bin/python bench/pretraining_science.py scaling [--depths 2,4,6,8]

optimizers: Muon (hidden matrices) + AdamW (the rest) against AdamW alone at equal tokens. The
native GPT, depth 4, width 128, rows of 128 characters cut from the text as one stream (5% tail held
out), 16 rows a step, a 20-step warmup and a linear warmdown over the last 40%. Each optimizer's LR
is swept (3-4 values, seed 0); the best is re-run with the other seeds; the table gives the final
validation loss (nats per character) as mean +- std over seeds.

scaling: depths 2, 4, 6, 8 (width 16 per layer of depth, head width 16), each at the budget the
plan derives from its depth: 10.5 tokens per scaling parameter, the batch from B ~ D^0.383, Muon +
AdamW with the batch-scaled LRs. Final validation loss against training compute (FLOPs per token x
tokens) as a PNG: a mini scaling-law plot.

Runs go one after another through the CLI (`tierlm pretrain`), each in its own process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
WORK = Path(tempfile.gettempdir()) / "tierlm_bench_science"
COMMON = [
    f"data.dataset_name={DATA}",
    "data.stream=true",
    "data.max_seq_length=128",
    "tokenizer.kind=char",
    "training.per_device_train_batch_size=16",
    "training.per_device_eval_batch_size=32",
    "training.eval_batches=8",
    "training.lr_scheduler_type=warmdown",
    "training.min_lr_ratio=0.0",
    "training.save_steps=0",
    "training.logging_steps=50",
    "training.sample_prompts=[]",
    "infra.progress_bar=false",
    "infra.device_type=cpu",
]


def train(name: str, overrides: list[str]) -> dict:
    """One `tierlm pretrain` run (reused when it already finished); its final eval line and wall time."""
    out = WORK / name
    metrics = out / "metrics.jsonl"
    start = time.perf_counter()
    if not (out / "model").is_dir():
        command = [sys.executable, "-m", "tierlm", "pretrain", *COMMON, *overrides, f"infra.output_dir={out}"]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"{name} failed:\n{result.stderr[-2000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    final = [r for r in records if r["type"] == "eval"][-1]
    train_lines = [r for r in records if r["type"] == "train"]
    return {
        "name": name,
        "val_loss": final["val_loss"],
        "step": final["step"],
        "tokens": train_lines[-1]["tokens_seen"],
        "seconds": time.perf_counter() - start,
    }


def optimizers(steps: int, seeds: int) -> None:
    model = [
        "model.depth=4",
        "model.aspect_ratio=32",
        "model.head_dim=32",
        f"training.num_train_steps={steps}",
        "training.warmup_steps=20",
        "training.warmdown_ratio=0.4",
        "training.eval_steps=0",
    ]
    sweeps = {
        "adamw": [
            ("learning_rate", lr, ["training.optimizer=adamw", f"training.learning_rate={lr}"])
            for lr in (1e-3, 3e-3, 1e-2)
        ],
        "muon": [
            ("matrix_lr", lr, ["training.optimizer=muon", f"training.matrix_lr={lr}", "training.learning_rate=3e-3"])
            for lr in (0.01, 0.02, 0.04, 0.08)
        ],
    }
    results = {}
    for optimizer, sweep in sweeps.items():
        runs = [
            (knob, value, train(f"{optimizer}_{knob}{value}_s0", [*model, *extra, "training.seed=0"]), extra)
            for knob, value, extra in sweep
        ]
        for knob, value, run, _ in runs:
            print(
                f"{optimizer:6s} {knob}={value:<7g} seed 0: val loss {run['val_loss']:.4f} ({run['seconds']:.0f} s)",
                flush=True,
            )
        knob, value, best, extra = min(runs, key=lambda r: r[2]["val_loss"])
        losses = [best["val_loss"]] + [
            train(f"{optimizer}_{knob}{value}_s{s}", [*model, *extra, f"training.seed={s}"])["val_loss"]
            for s in range(1, seeds)
        ]
        results[optimizer] = {
            "best": f"{knob}={value}",
            "val_losses": losses,
            "mean": statistics.mean(losses),
            "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "tokens": best["tokens"],
        }
    print(
        "\n| optimizer | best LR (sweep, seed 0) | final val loss, mean +- std over seeds | tokens |\n|---|---|---|---|"
    )
    for optimizer, r in results.items():
        print(
            f"| {optimizer} | {r['best']} | {r['mean']:.4f} +- {r['std']:.4f} "
            f"({', '.join(f'{v:.4f}' for v in r['val_losses'])}) | "
            f"{r['tokens']:,} |"
        )
    (WORK / "optimizers.json").write_text(json.dumps(results, indent=1))


def scaling(depths: list[int]) -> None:
    sys.path.insert(0, str(REPO / "src"))
    from tierlm.config import TierlmConfig
    from tierlm.metrics.report import plot_series
    from tierlm.plan import plan_run
    from tierlm.stages import STAGES

    points = []
    for depth in depths:
        overrides = [
            f"model.depth={depth}",
            "model.aspect_ratio=16",
            "model.head_dim=16",
            "training.optimizer=muon",
            "training.target_param_data_ratio=10.5",
            "training.total_batch_size=auto",
            "training.num_train_steps=null",
            "training.warmup_steps=0",
            "training.warmdown_ratio=0.5",
            "training.eval_steps=0",
        ]
        run = train(f"scaling_d{depth}", overrides)
        _, plan, _ = plan_run(TierlmConfig.load(None, [*COMMON, *overrides]), STAGES["pretrain"])
        flops = plan.flops_per_token * plan.total_tokens
        points.append(
            {
                "depth": depth,
                "params": plan.counts["total"],
                "scaling_params": plan.counts["scaling"],
                "steps": plan.num_train_steps,
                "batch": plan.batch_tokens,
                "tokens": plan.total_tokens,
                "flops": flops,
                "val_loss": run["val_loss"],
                "seconds": run["seconds"],
            }
        )
        print(
            f"d{depth}: {plan.counts['total']:,} params, {plan.num_train_steps} steps x {plan.batch_tokens:,} tokens, "
            f"{flops:.3g} FLOPs -> val loss {run['val_loss']:.4f} ({run['seconds']:.0f} s)",
            flush=True,
        )
    print(
        "\n| depth | parameters (scaling) | steps x batch | tokens | training FLOPs | final val loss | time "
        "|\n|---|---|---|---|---|---|---|"
    )
    for p in points:
        print(
            f"| {p['depth']} | {p['params']:,} ({p['scaling_params']:,}) | {p['steps']} x {p['batch']:,} | "
            f"{p['tokens']:,} | "
            f"{p['flops']:.3g} | {p['val_loss']:.4f} | {p['seconds'] / 60:.1f} min |"
        )
    png = plot_series(
        REPO / "docs" / "scaling_laws_cpu.png",
        "val loss against compute (each depth at its autoconfig budget)",
        "training FLOPs",
        {"tierlm, Muon + AdamW": ([p["flops"] for p in points], [p["val_loss"] for p in points])},
        "val loss (nats/char)",
        log_x=True,
    )
    (WORK / "scaling.json").write_text(json.dumps(points, indent=1))
    print(f"\nplot: {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["optimizers", "scaling"])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--depths", default="2,4,6,8")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    if args.what == "optimizers":
        optimizers(args.steps, args.seeds)
    else:
        scaling([int(d) for d in args.depths.split(",")])


if __name__ == "__main__":
    main()

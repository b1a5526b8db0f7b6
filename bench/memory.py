"""The memory planner against measured peaks: for each config, the estimate (`tierlm.plan.memory`)
beside the measured RSS growth over the import baseline (`tierlm.commands.probe`), and their ratio.

    .venv/bin/python bench/memory.py [--only NAME ...] [--steps 3]

Runs one command at a time (two torch processes on 2 cores distort each other). The CPU part of
this table is a test (tests/test_memory_plan.py); the published table is in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# A model of ~14M parameters (depth 6, width 384) on 4,096-token micro-batches: activations of
# about 1 GB, so the parts the planner models dominate the measurement.
GPT = [
    "model.architecture=gpt",
    "model.depth=6",
    "model.aspect_ratio=64",
    "tokenizer.kind=char",
    "data.num_synthetic_examples=4000",
    "data.max_seq_length=512",
    "training.per_device_train_batch_size=8",
]
QWEN3 = [
    "model.architecture=qwen3",
    "model.hf_config.hidden_size=384",
    "model.hf_config.intermediate_size=1024",
    "model.hf_config.num_hidden_layers=4",
    "model.hf_config.num_attention_heads=6",
    "model.hf_config.num_key_value_heads=2",
    "model.hf_config.head_dim=64",
    "tokenizer.kind=char",
    "data.num_synthetic_examples=4000",
    "data.max_seq_length=512",
    "training.per_device_train_batch_size=8",
]

BPE = ["tokenizer.kind=bpe", "tokenizer.vocab_size=4096", "data.dataset_name=builtin:tinyshakespeare"]

CONFIGS: dict[str, tuple[str, list[str], int]] = {  # name: (stage, overrides, ranks)
    "gpt": ("pretrain", GPT, 1),
    "gpt-ac": ("pretrain", GPT + ["infra.activation_checkpointing=true"], 1),
    # A 4,096-token BPE vocabulary on tinyshakespeare: the (B, T, V) logits of the unfused head are
    # 64 MiB a copy, and the fused head's chunks stand in for them.
    "gpt-bpe": ("pretrain", GPT + BPE, 1),
    "gpt-bpe-unfused": ("pretrain", GPT + BPE + ["training.fused_cross_entropy=false"], 1),
    "gpt-b16": ("pretrain", GPT[:-1] + ["training.per_device_train_batch_size=16"], 1),
    "gpt2": ("pretrain", GPT + ["model.architecture=gpt2", "model.variant=V1"], 1),
    "qwen3": ("pretrain", QWEN3, 1),
    "gpt-fsdp2": ("pretrain", GPT, 2),
    "gpt-sft": ("sft", GPT, 1),
    "gpt-dpo": (
        "dpo",
        [
            "model.model_name_or_path={sft_model}",
            "data.dataset_name={long_pairs}",
            "data.max_seq_length=512",
            "training.per_device_train_batch_size=4",
        ],
        1,
    ),
    "gpt-muon": ("pretrain", GPT + ["training.optimizer=muon"], 1),
    # An untrained model's completions end at a random end-of-turn; 64 of them make the longest (the
    # padded width of the micro-batch) reach max_new_tokens, as the planner assumes.
    "gpt-rl": (
        "rl",
        [
            "model.model_name_or_path={sft_model}",
            "data.max_seq_length=512",
            "rl.group_size=16",
            "rl.prompts_per_step=4",
            "rl.max_new_tokens=48",
            "rl.micro_batch_size=64",
            "rl.eval_problems=4",
            "rl.kl_coef=0.01",
        ],
        1,
    ),
}
COMMON = [
    "training.eval_steps=0",
    "training.save_steps=0",
    "training.warmup_steps=0",
    "infra.progress_bar=false",
    "training.logging_steps=1",
    "infra.num_threads=2",
]


def source_model(workdir: Path) -> Path:
    """An SFT run of the GPT config (one step) for RL to start from, made once per work folder."""
    out = workdir / "sft-source"
    if not (out / "model").exists():
        cmd = [
            sys.executable,
            "-m",
            "tierlm",
            "sft",
            *GPT,
            *COMMON,
            "training.num_train_steps=1",
            f"infra.output_dir={out}",
        ]
        subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    return out


def long_pairs(workdir: Path) -> Path:
    """Preference pairs whose rows fill data.max_seq_length=512 (the planner sizes for full rows;
    the synthetic pairs are a few dozen tokens), in the characters the arithmetic tokenizer knows."""
    path = workdir / "long_pairs.jsonl"
    if not path.exists():
        rows = [
            {
                "prompt": f"What is {i} + {i}?",
                "chosen": f"{i} + {i} = {2 * i}. " * 30,
                "rejected": f"{i} + {i} = {2 * i + 1}. " * 30,
            }
            for i in range(10, 74)
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def measure(stage: str, overrides: list[str], ranks: int, steps: int, workdir: Path) -> dict:
    """One run under the probe: its estimate and its measured growth (the largest over ranks)."""
    if any("{" in o for o in overrides):
        overrides = [o.format(sft_model=source_model(workdir), long_pairs=long_pairs(workdir)) for o in overrides]
    out = workdir / f"run-{os.getpid()}-{len(list(workdir.iterdir()))}"
    argv = [stage, *overrides, *COMMON, f"training.num_train_steps={steps}", f"infra.output_dir={out}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if ranks > 1:
        env["OMP_NUM_THREADS"] = "1"
        argv = [a for a in argv if not a.startswith("infra.num_threads")] + [
            "infra.num_threads=1",
            "infra.distributed_type=fsdp",
        ]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(ranks),
            "--master-port",
            "29571",
            "-m",
            "tierlm.commands.probe",
            *argv,
        ]
    else:
        cmd = [sys.executable, "-m", "tierlm.commands.probe", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    records = [
        json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("MEMORY_PROBE ")
    ]
    if proc.returncode or not records or any(r["exit_code"] for r in records):
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    worst = max(records, key=lambda r: r["growth_mb"])
    return {
        "estimate_mb": worst["estimate_mb"],
        "measured_mb": worst["growth_mb"],
        "ratio": worst["estimate_mb"] / worst["growth_mb"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print("| config | stage | ranks | estimate (MiB) | measured peak growth (MiB) | estimate / measured |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (stage, overrides, ranks) in CONFIGS.items():
            if args.only and name not in args.only:
                continue
            r = measure(stage, overrides, ranks, args.steps, Path(tmp))
            print(
                f"| {name} | {stage} | {ranks} | {r['estimate_mb']:,.0f} | {r['measured_mb']:,.0f} | {r['ratio']:.2f} "
                f"|",
                flush=True,
            )


if __name__ == "__main__":
    main()

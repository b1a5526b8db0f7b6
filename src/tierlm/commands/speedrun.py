"""Tier 3: `tierlm speedrun --depth D` — tokenizer -> pretrain (sized by the scaling laws from D) -> SFT
-> RL -> a report card, in one command (nanochat's speedrun.sh).

    out/tokenizer  out/pretrain  out/sft  out/rl      the four runs (each resumable on its own)
    out/report.md  out/plots/*.png                    the report card
    out/speedrun.json                                 time per stage and each stage's summary

Re-running the command continues an interrupted stage and skips finished ones (their runs just
report again), so the report card always covers the whole pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from tierlm.commands.options import Command, positive_int
from tierlm.commands.overrides import SHARED, check_overrides
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError

DEFAULT_DEPTH = 4
SAMPLE_QUESTIONS = ("What is 23 + 45?", "What is 316 + 258?", "What is 91 - 37?")


def stage_configs(
    depth: int, out: Path, overrides: list[str], pretrain_data: str | None = None, core: str | None = None
) -> dict[str, TierlmConfig]:
    """The pretrain, SFT and RL configs: the tiny presets, with the pretraining horizon, batch and
    learning rates derived from `depth` (Muon + AdamW, no warmup, a linear warmdown over the second
    half: nanochat) and each stage starting from the one before; with `core` (a CORE eval bundle), CORE measured
    during pretraining at each evaluation and at the end."""
    if depth < 1:
        raise ConfigError(f"--depth must be >= 1, got {depth}")
    chained = "the speedrun places its runs under --out and chains them itself: drop it"
    placed = dict.fromkeys(("infra.output_dir", "model.model_name_or_path", "model.tokenizer_name_or_path"), chained)
    placed["model.depth"] = "the depth is --depth (the horizon, batch and learning rates follow from it)"
    placed["data.dataset_name"] = "the pretraining data is --pretrain-data (SFT and RL read their own)"
    check_overrides("speedrun", overrides, SHARED + ("rl",), placed=placed)
    tokenizer = out / "tokenizer"
    data = [f"data.dataset_name={pretrain_data}"] if pretrain_data else []
    if core:  # checked before the tokenizer is written, not when pretraining begins
        from tierlm.loops.evaluation import bundle_files

        bundle_files(core)
        data += [f"training.core_bundle={core}", "training.core_steps=20"]
    pretrain = TierlmConfig.load(
        "tiny_pretrain",
        [
            f"model.depth={depth}",
            f"model.tokenizer_name_or_path={tokenizer}",
            *data,
            "training.optimizer=muon",
            "training.target_param_data_ratio=10.5",
            "training.total_batch_size=auto",
            "training.num_train_steps=null",
            "training.warmup_steps=0",
            "training.lr_scheduler_type=warmdown",
            "training.warmdown_ratio=0.5",
            "training.eval_steps=20",
            "training.save_steps=20",
            "training.logging_steps=2",
            f"infra.output_dir={out / 'pretrain'}",
            *overrides,
        ],
    )
    sft = TierlmConfig.load(
        "tiny_sft", [f"model.model_name_or_path={out / 'pretrain'}", f"infra.output_dir={out / 'sft'}", *overrides]
    )
    rl = TierlmConfig.load(
        "tiny_rl", [f"model.model_name_or_path={out / 'sft'}", f"infra.output_dir={out / 'rl'}", *overrides]
    )
    return {"pretrain": pretrain, "sft": sft, "rl": rl}


def _train_tokenizer(config: TierlmConfig, folder: Path) -> None:
    from tierlm.builders.tokenizer import train_tokenizer
    from tierlm.checkpoint.folders import publish_tokenizer

    if not (folder / "tokenizer.json").is_file():  # else trained by an earlier run of the speedrun
        publish_tokenizer(train_tokenizer(config, "text"), folder)


def run_speedrun(
    depth: int, out: Path, overrides: list[str] = (), pretrain_data: str | None = None, core: str | None = None
) -> Path:
    """Run (or continue) the whole pipeline into `out`; returns the report card's path."""
    from tierlm.stages import run_stage

    out = Path(out)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "tierlm speedrun runs in one process; under torchrun, run its stages (tierlm pretrain / sft / rl) "
            "with the overrides in tierlm.commands.speedrun.stage_configs"
        )
    configs = stage_configs(depth, out, list(overrides), pretrain_data, core)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder for the speedrun")
    record_file = out / "speedrun.json"
    record: dict[str, Any] = (
        json.loads(record_file.read_text()) if record_file.is_file() else {"depth": depth, "stages": {}}
    )
    if record.get("depth") != depth:
        raise ConfigError(
            f"{out} holds a depth-{record.get('depth')} speedrun; use --depth {record.get('depth')} or a new --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    steps = [
        ("tokenizer", lambda: _train_tokenizer(configs["pretrain"], out / "tokenizer")),
        ("pretrain", lambda: run_stage(configs["pretrain"], "pretrain")),
        ("sft", lambda: run_stage(configs["sft"], "sft")),
        ("rl", lambda: run_stage(configs["rl"], "rl")),
    ]
    for name, step in steps:
        print(f"== speedrun: {name}", flush=True)
        start = time.perf_counter()
        summary = step() or {}
        stage = record["stages"].setdefault(name, {})
        if not stage.get("done"):  # a finished stage re-run only reports: keep the time it took
            stage["seconds"] = stage.get("seconds", 0.0) + time.perf_counter() - start
        stage.update(
            done=True, summary={k: v for k, v in summary.items() if isinstance(v, (int, float, str)) or v is None}
        )
        record_file.write_text(json.dumps(record, indent=1) + "\n")
    return write_report_card(out, configs, record)


def _sample_conversations(rl_dir: Path) -> list[tuple[str, str]]:
    from tierlm.data import load_tokenizer
    from tierlm.models import load_pretrained_model
    from tierlm.rollout.engine import Engine
    from tierlm.rollout.sampling import GREEDY
    from tierlm.rollout.text import prompt_tokens, readable_text
    from tierlm.rollout.tools import Calculator

    tokenizer = load_tokenizer(rl_dir / "model")
    engine = Engine(load_pretrained_model(rl_dir / "model"), tokenizer.stop_ids, tokenizer, [Calculator()])
    answers = []
    for question in SAMPLE_QUESTIONS:
        ids = prompt_tokens(tokenizer, question, chat=True)
        answers.append((question, readable_text(tokenizer, engine.generate(ids, 1, 32, GREEDY)[0].tokens)))
    return answers


def write_report_card(out: Path, configs: dict[str, TierlmConfig], record: dict[str, Any]) -> Path:
    """report.md and plots/*.png from the stage runs under `out`."""
    from tierlm.metrics.report import git_commit, hardware, stage_curves
    from tierlm.plan import plan_run
    from tierlm.stages import STAGES

    plots = []
    for name in ("pretrain", "sft", "rl"):
        plots += stage_curves(out / name, out / "plots", name)
    _, plan, _ = plan_run(configs["pretrain"], STAGES["pretrain"])
    stages = record["stages"]
    pre, sft, rl = (stages.get(n, {}).get("summary", {}) for n in ("pretrain", "sft", "rl"))
    total = sum(s.get("seconds", 0.0) for s in stages.values())
    lines = [
        f"# tierlm speedrun: depth {record['depth']}",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; tierlm commit {git_commit()}",
        f"- hardware: {hardware()}",
        "",
        "## Pretraining plan (from the depth, by nanochat's scaling rule)",
        "",
        "```",
        plan.table(),
        "```",
        "",
        "## Time per stage",
        "",
        "| stage | time |",
        "|---|---|",
        *[f"| {name} | {s.get('seconds', 0.0) / 60:.1f} min |" for name, s in stages.items()],
        f"| **total** | **{total / 60:.1f} min** |",
        "",
        "## Results",
        "",
        "| | |",
        "|---|---|",
        f"| pretrain val loss / bits per byte | {pre.get('val_loss', float('nan')):.4f} / "
        f"{pre.get('val_bpb', float('nan')):.4f} |",
        f"| SFT val loss / bits per byte | {sft.get('val_loss', float('nan')):.4f} / "
        f"{sft.get('val_bpb', float('nan')):.4f} |",
        f"| RL held-out pass@1 (before -> after) | {rl.get('initial_pass@1', float('nan')):.3f} -> "
        f"{rl.get('pass@1', float('nan')):.3f} "
        f"({rl.get('eval_problems', '?')} problems) |",
        f"| RL held-out pass@{rl.get('k', '?')} | {rl.get('pass@k', float('nan')):.3f} |",
        *([f"| pretrain CORE (the end of pretraining) | {pre['core']:.4f} |"] if "core" in pre else []),
        "",
        "## Sample conversations (the RL model, greedy, with the calculator)",
        "",
        *[f"- **{q}** -> {a}" for q, a in _sample_conversations(out / "rl")],
        "",
        "## Curves",
        "",
        *[f"![{p.stem}](plots/{p.name})" for p in plots],
        "",
    ]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


# -- the command ----------------------------------------------------------------------------
def arguments(speedrun: argparse.ArgumentParser) -> None:
    speedrun.add_argument(
        "--depth",
        type=positive_int,
        default=None,
        help="model depth; everything else follows (default 4: ~10 min on 2 CPU cores)",
    )
    speedrun.add_argument(
        "--out", default=None, help="folder for the four runs and report.md (default runs/speedrun_d<depth>)"
    )
    speedrun.add_argument(
        "--pretrain-data", default=None, help="pretraining data instead of the embedded arithmetic text"
    )
    speedrun.add_argument(
        "--core",
        default=None,
        metavar="BUNDLE",
        help="a CORE eval bundle folder (nanochat's layout): CORE during pretraining, on the report card",
    )
    speedrun.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="applied to every stage, e.g. infra.device_type=cuda"
    )


def run(args: argparse.Namespace) -> None:
    depth = args.depth or DEFAULT_DEPTH
    out = Path(args.out or f"runs/speedrun_d{depth}")
    report = run_speedrun(depth, out, args.overrides, args.pretrain_data, args.core)
    print(f"report card: {report}")


COMMAND = Command(arguments, run)

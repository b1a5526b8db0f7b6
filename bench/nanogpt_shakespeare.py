"""tierlm's `gpt2-shakespeare-char` beside nanoGPT's own train.py on the same characters, hyperparameters and tokens,
both models scored by one protocol: every held-out character once.

    git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT      # never committed here
    .venv/bin/python bench/nanogpt_shakespeare.py --nanogpt /tmp/nanoGPT [--steps 2000] [--seeds 1337,1,2] [--out DIR]
    .venv/bin/python bench/nanogpt_shakespeare.py --nanogpt /tmp/nanoGPT --time-to-target [--recipe NAME]

nanoGPT runs its README's CPU command (`config/train_shakespeare_char.py --device=cpu --compile=False
--eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
--max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`) on tinyshakespeare written where its prepare.py reads it (its
90/10 split); tierlm runs the preset with the same model (4 layers, 4 heads, 128 wide, no biases, no dropout),
optimizer (AdamW 1e-3, beta2 0.99, weight decay 0.1 on matrices, clip 1.0, 100 warm-up steps, cosine to 1e-4),
batches (12 x 64) and steps. Each library's own validation figure is printed as it reports it (nanoGPT: the mean of
20 random batches; tierlm: data.stream's held-out tail, every character once), then both models are scored on the
same windows: the held-out text cut into consecutive windows of 64, every character after the first a target once
(nats per character). Wall time: each whole training command, one after the other on this machine.

--time-to-target: the target is nanoGPT's same-windows loss after its `--steps` iterations (per seed); tierlm runs
`--recipe` (a preset or YAML: the same model size, its own optimizer and schedule) evaluating every held-out
character every `--eval-every` steps, and reaches the target at its first evaluation at or below it. Both sides are
timed by their training loops with the evaluations left out (nanoGPT: the sum of its printed iteration times up to
its last update, an iteration that evaluated counted at the median; tierlm: the loop's wall time at that step less
its evaluations' own seconds), and by their whole commands (tierlm's less the evaluations this mode adds). Pairs
are matched by seed; the ratio's mean comes with the 95% paired interval `tierlm ablate` reports.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from tierlm.commands.ablate import paired_difference  # noqa: E402
from tierlm.data import load_tokenizer  # noqa: E402
from tierlm.data.sources import builtin_corpus  # noqa: E402
from tierlm.models import forward_logits, load_pretrained_model  # noqa: E402

BLOCK = 64


def run_nanogpt(nanogpt: Path, out: Path, steps: int, seed: int = 1337) -> tuple[float, float, Path]:
    """(nanoGPT's own last val loss, its wall seconds, its checkpoint). `seed` replaces train.py's 1337 in the copy
    (nanoGPT has no option for it)."""
    work = out / "nanoGPT"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(nanogpt, work, ignore=shutil.ignore_patterns(".git"))
    train = (work / "train.py").read_text()
    assert "torch.manual_seed(1337 + seed_offset)" in train, "nanoGPT's train.py seeds elsewhere: update the bench"
    (work / "train.py").write_text(train.replace("torch.manual_seed(1337 ", f"torch.manual_seed({seed} "))
    data = work / "data" / "shakespeare_char"
    shutil.copy(builtin_corpus("builtin:tinyshakespeare"), data / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    command = [sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False"]
    command += ["--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4"]
    command += ["--n_head=4", "--n_embd=128", f"--max_iters={steps}", f"--lr_decay_iters={steps}", "--dropout=0.0"]
    command += [
        "--always_save_checkpoint=True",
        f"--eval_interval={min(250, steps)}",
        f"--out_dir={out / 'out-nanogpt'}",
    ]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=work, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    val = float(re.findall(r"val loss ([0-9.]+)", result.stdout)[-1])
    (out / "nanogpt.log").write_text(result.stdout)
    return val, seconds, out / "out-nanogpt" / "ckpt.pt"


def nanogpt_loop_seconds(log: str, steps: int) -> float:
    """Seconds nanoGPT's loop spent on its first `steps` updates, evaluations left out: its printed iteration times
    (`iter N: ..., time T ms`, the time since the previous line) for iterations 0 .. steps - 1, an iteration that
    began with an evaluation (and its checkpoint) counted at the median iteration."""
    times = {int(i): float(ms) / 1e3 for i, ms in re.findall(r"iter (\d+): loss [0-9.]+, time ([0-9.]+)ms", log)}
    evaluated = {int(i) for i in re.findall(r"step (\d+): train loss", log)}
    median = float(np.median([times[i] for i in range(steps) if i not in evaluated]))
    return sum(median if i in evaluated else times[i] for i in range(steps))


def run_recipe(out: Path, recipe: str, seed: int, target: float, eval_every: int) -> dict:
    """tierlm's `recipe` evaluated every `eval_every` steps: the first step at or below `target`, the loop's seconds
    to it and the whole command's, each with the evaluations this mode adds left out."""
    run = out / "recipe"
    shutil.rmtree(run, ignore_errors=True)
    overrides = [f"training.eval_steps={eval_every}", "training.eval_batches=all", "training.save_steps=0"]
    overrides += ["infra.progress_bar=false", f"training.seed={seed}", f"infra.output_dir={run}"]
    command = [sys.executable, "-m", "tierlm", "pretrain", "--config", recipe, *overrides]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": "src"})
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["type"] == "eval"]
    added = evals[1:-1]  # the evaluation before step 1 and the final one are the recipe's own
    hit = next((r for r in evals if r["val_loss"] <= target), None)
    loop = None if hit is None else hit["elapsed_s"] - sum(r["eval_s"] for r in evals[1:] if r["step"] < hit["step"])
    return {
        "step": None if hit is None else hit["step"],
        "loss": evals[-1]["val_loss"] if hit is None else hit["val_loss"],
        "loop_s": loop,
        "command_s": seconds - sum(r["eval_s"] for r in added),
    }


def run_tierlm(out: Path, steps: int, seed: int = 1337) -> tuple[float, float, Path]:
    """(tierlm's own final val loss, its wall seconds, its model folder)."""
    run = out / "tierlm"
    shutil.rmtree(run, ignore_errors=True)
    overrides = [f"training.num_train_steps={steps}", f"training.warmup_steps={min(100, steps // 2)}"]
    overrides += ["training.learning_rate=1e-3", "training.min_lr_ratio=0.1"]
    overrides += ["training.eval_steps=0", "training.save_steps=0", "model.bias=false", f"infra.output_dir={run}"]
    overrides += ["infra.progress_bar=false", f"training.seed={seed}"]
    command = [sys.executable, "-m", "tierlm", "pretrain", "--config", "gpt2-shakespeare-char", *overrides]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": "src"})
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout.strip().splitlines()[-3], "|", result.stdout.strip().splitlines()[-2].strip())
    val = float(re.findall(r"final val loss: ([0-9.]+)", result.stdout)[-1])
    return val, seconds, run / "model"


@torch.no_grad()
def windows_loss(logits_of, ids: np.ndarray, batch: int = 64) -> float:
    """Mean cross-entropy (nats) of every target of consecutive windows of BLOCK + 1 ids overlapping by one."""
    n = (len(ids) - 1) // BLOCK
    windows = torch.from_numpy(np.stack([ids[i * BLOCK : i * BLOCK + BLOCK + 1] for i in range(n)]).astype(np.int64))
    total = 0.0
    for lo in range(0, n, batch):
        rows = windows[lo : lo + batch]
        logits = logits_of(rows[:, :-1])
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), rows[:, 1:].reshape(-1), reduction="sum"
        ).item()
    return total / (n * BLOCK)


def nanogpt_scorer(nanogpt: Path, checkpoint: Path):
    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig  # nanoGPT's own model.py

    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)  # nanoGPT's pickle, written just now
    model = GPT(GPTConfig(**saved["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in saved["model"].items()})
    model.eval()

    def logits_of(x: torch.Tensor) -> torch.Tensor:  # nanoGPT returns every position's logits when given targets
        return model(x, targets=x.contiguous())[0]

    return logits_of


def same_windows(out: Path, folder: Path | None, checkpoint: Path) -> tuple[float | None, float]:
    """(tierlm's model at `folder`, nanoGPT's `checkpoint`) scored on the same held-out windows."""
    held_out = held_out_text()
    meta = pickle.loads((out / "nanoGPT" / "data" / "shakespeare_char" / "meta.pkl").read_bytes())
    nano_ids = np.array([meta["stoi"][c] for c in held_out])
    nano_same = windows_loss(nanogpt_scorer(out / "nanoGPT", checkpoint), nano_ids)
    if folder is None:
        return None, nano_same
    ours_ids = np.array(load_tokenizer(folder).encode(held_out))
    assert len(ours_ids) == len(nano_ids), "both tokenizers read one token per character"
    model = load_pretrained_model(folder).eval()
    return windows_loss(lambda x: forward_logits(model, {"input_ids": x}), ours_ids), nano_same


def held_out_text() -> str:
    text = builtin_corpus("builtin:tinyshakespeare").read_text(encoding="utf-8")
    return text[int(len(text) * 0.9) :]


def time_to_target(args: argparse.Namespace, seeds: list[int]) -> None:
    rows = []
    for seed in seeds:
        out = args.out / f"seed{seed}"
        out.mkdir(parents=True, exist_ok=True)
        _, nano_s, checkpoint = run_nanogpt(args.nanogpt.resolve(), out, args.steps, seed)
        nano_loop = nanogpt_loop_seconds((out / "nanogpt.log").read_text(), args.steps)
        _, target = same_windows(out, None, checkpoint)
        ours = run_recipe(out, args.recipe, seed, target, args.eval_every)
        rows.append((seed, target, ours, nano_loop, nano_s))
        print(f"seed {seed}: target {target:.4f}, {ours}, nanoGPT loop {nano_loop:.1f} s, command {nano_s:.1f} s")
    print(f"\ntime to nanoGPT's same-windows loss after {args.steps} iterations; tierlm: {args.recipe}, ", end="")
    threads = os.environ.get("OMP_NUM_THREADS", os.cpu_count())  # what the two training commands ran with
    print(f"evaluated every {args.eval_every} steps; {threads} threads")
    print(
        "| seed | target | tierlm step | loss there | loop s: nanoGPT | tierlm | ratio | command s: nanoGPT | tierlm "
        "| ratio |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    loops, commands = [], []
    for seed, target, ours, nano_loop, nano_s in rows:
        reached = ours["loop_s"] is not None
        loop = ours["loop_s"] / nano_loop if reached else float("nan")
        command = ours["command_s"] / nano_s
        loops.append(loop)
        commands.append(command)
        print(f"| {seed} | {target:.4f} | {ours['step'] if reached else 'not reached'} | {ours['loss']:.4f} ", end="")
        print(f"| {nano_loop:.1f} | {ours['loop_s'] or float('nan'):.1f} | {loop:.3f} | {nano_s:.1f} ", end="")
        print(f"| {ours['command_s']:.1f} | {command:.3f} |")
    for name, ratios in (("loop", loops), ("command", commands)):
        mean, half = paired_difference(ratios, [0.0] * len(ratios))
        band = f" +- {half:.3f} (95% paired interval)" if half is not None else ""
        print(f"{name} time, tierlm / nanoGPT: {mean:.3f}{band}; range {min(ratios):.3f}-{max(ratios):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", default="1337", help="each library trained once per seed (nanoGPT's is 1337)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/nanogpt-bench"))
    parser.add_argument("--time-to-target", action="store_true", help="time both to nanoGPT's final loss")
    parser.add_argument("--recipe", default="shakespeare-char-muon", help="--time-to-target: tierlm's preset or YAML")
    parser.add_argument("--eval-every", type=int, default=10, help="--time-to-target: tierlm's evaluation interval")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    seeds = list(map(int, args.seeds.split(",")))
    if args.time_to_target:
        return time_to_target(args, seeds)
    rows = []
    for seed in seeds:
        out = args.out / f"seed{seed}"
        out.mkdir(parents=True, exist_ok=True)
        nano_val, nano_s, checkpoint = run_nanogpt(args.nanogpt.resolve(), out, args.steps, seed)
        ours_val, ours_s, folder = run_tierlm(out, args.steps, seed)
        ours_same, nano_same = same_windows(out, folder, checkpoint)
        rows.append((seed, nano_val, ours_val, nano_same, ours_same, nano_s, ours_s))

    print(f"\n{args.steps} steps of 12 x 64 characters, {torch.get_num_threads()} threads")
    header = f"{'seed':>6}{'own val: nanoGPT':>18}{'tierlm':>8}{'same windows: nanoGPT':>23}{'tierlm':>8}{'ratio':>7}"
    print(header + f"{'wall s: nanoGPT':>17}{'tierlm':>8}{'ratio':>7}")
    for seed, nano_val, ours_val, nano_same, ours_same, nano_s, ours_s in rows:
        print(f"{seed:>6}{nano_val:>18.4f}{ours_val:>8.4f}{nano_same:>23.4f}{ours_same:>8.4f}", end="")
        print(f"{ours_same / nano_same:>7.3f}{nano_s:>17.1f}{ours_s:>8.1f}{ours_s / nano_s:>7.3f}")
    if len(rows) > 1:
        nano, ours = np.array([r[3] for r in rows]), np.array([r[4] for r in rows])
        print(
            f"same windows over {len(rows)} seeds: nanoGPT {nano.mean():.4f} +- {nano.std(ddof=1):.4f}, "
            f"tierlm {ours.mean():.4f} +- {ours.std(ddof=1):.4f} (mean +- sample std)"
        )


if __name__ == "__main__":
    main()

"""tierlm's `gpt2-shakespeare-char` beside nanoGPT's own train.py on the same characters, hyperparameters and tokens,
both models scored by one protocol: every held-out character once.

    git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT      # never committed here
    .venv/bin/python bench/nanogpt_shakespeare.py --nanogpt /tmp/nanoGPT [--steps 2000] [--seeds 1337,1,2] [--out DIR]

nanoGPT runs its README's CPU command (`config/train_shakespeare_char.py --device=cpu --compile=False
--eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
--max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`) on tinyshakespeare written where its prepare.py reads it (its
90/10 split); tierlm runs the preset with the same model (4 layers, 4 heads, 128 wide, no biases, no dropout),
optimizer (AdamW 1e-3, beta2 0.99, weight decay 0.1 on matrices, clip 1.0, 100 warm-up steps, cosine to 1e-4),
batches (12 x 64) and steps. Each library's own validation figure is printed as it reports it (nanoGPT: the mean of
20 random batches; tierlm: data.stream's held-out tail, every character once), then both models are scored on the
same windows: the held-out text cut into consecutive windows of 64, every character after the first a target once
(nats per character). Wall time: each whole training command, one after the other on this machine.
"""

from __future__ import annotations

import argparse
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
    return val, seconds, out / "out-nanogpt" / "ckpt.pt"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", default="1337", help="each library trained once per seed (nanoGPT's is 1337)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/nanogpt-bench"))
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    text = builtin_corpus("builtin:tinyshakespeare").read_text(encoding="utf-8")
    held_out = text[int(len(text) * 0.9) :]
    rows = []
    for seed in map(int, args.seeds.split(",")):
        out = args.out / f"seed{seed}"
        out.mkdir(parents=True, exist_ok=True)
        nano_val, nano_s, checkpoint = run_nanogpt(args.nanogpt.resolve(), out, args.steps, seed)
        ours_val, ours_s, folder = run_tierlm(out, args.steps, seed)
        meta = pickle.loads((out / "nanoGPT" / "data" / "shakespeare_char" / "meta.pkl").read_bytes())
        nano_ids = np.array([meta["stoi"][c] for c in held_out])
        ours_ids = np.array(load_tokenizer(folder).encode(held_out))
        assert len(ours_ids) == len(nano_ids), "both tokenizers read one token per character"
        model = load_pretrained_model(folder).eval()
        ours_same = windows_loss(lambda x: forward_logits(model, {"input_ids": x}), ours_ids)
        nano_same = windows_loss(nanogpt_scorer(out / "nanoGPT", checkpoint), nano_ids)
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

"""Train on a 2 GB pre-tokenized file and report resident memory growth (goal: < 500 MB).

    .venv/bin/python bench/token_file_memory.py [--gigabytes 2] [--steps 200] [--dir /tmp]

Writes a flat uint16 token file (documents of ~1,000 tokens, each starting with BOS), then runs
`tierlm pretrain` on it in this process (configs/tiny_pretrain.yaml: 128-token rows, so training
activations stay small and the figure is about the data). Prints the resident set before the data
is opened, after the run, and the peak (VmHWM): the growth includes the document index, the
shuffled order, the loader, the prefetch queue, the model and its optimizer.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


def status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def write_token_file(path: Path, gigabytes: float, bos: int, vocab: int) -> int:
    n_tokens, chunk = int(gigabytes * 2**30) // 2, 1 << 26
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for start in range(0, n_tokens, chunk):
            block = rng.integers(bos + 1, vocab, size=min(chunk, n_tokens - start), dtype=np.uint16)
            block[rng.integers(0, len(block), size=len(block) // 1000)] = bos
            block[0] = bos
            f.write(block.tobytes())
    return n_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dir", default="/tmp")
    args = parser.parse_args()

    from tierlm.config import TierlmConfig
    from tierlm.data import train_bpe_tokenizer
    from tierlm.stages import run_stage

    work = Path(args.dir) / "tierlm_token_file_bench"
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe_tokenizer(["some text to train a small tokenizer on, 0123456789"] * 50, vocab_size=512)
    tokenizer.save(work / "tokenizer")
    data = work / "tokens.bin"
    start = time.perf_counter()
    n_tokens = write_token_file(data, args.gigabytes, tokenizer.document_separator_id, tokenizer.vocab_size)
    print(
        f"wrote {data}: {n_tokens:,} tokens ({data.stat().st_size / 2**30:.2f} GiB) in "
        f"{time.perf_counter() - start:.0f} s"
    )

    config = TierlmConfig.load(
        "configs/tiny_pretrain.yaml",
        [
            f"data.dataset_name={data}",
            f"model.tokenizer_name_or_path={work / 'tokenizer'}",
            f"training.num_train_steps={args.steps}",
            "training.warmup_steps=0",
            "training.eval_steps=0",
            "training.eval_batches=2",
            "infra.progress_bar=false",
            f"infra.output_dir={work / 'run'}",
            "training.resume=auto",
            "training.logging_steps=50",
        ],
    )
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM): writing the file is not the question
    before = status_mb("VmRSS")
    start = time.perf_counter()
    summary = run_stage(config, "pretrain")
    after, peak = status_mb("VmRSS"), status_mb("VmHWM")
    print(f"trained {summary['step']} steps, {summary['tokens_seen']:,} tokens, in {time.perf_counter() - start:.0f} s")
    print(f"resident memory: before {before:.0f} MB, after {after:.0f} MB, peak {peak:.0f} MB")
    print(f"growth: {after - before:.0f} MB at the end, {peak - before:.0f} MB at the peak (goal < 500 MB)")


if __name__ == "__main__":
    main()

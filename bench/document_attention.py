"""Attention over packed documents: one call under the document mask against one call per document.

    .venv/bin/python bench/document_attention.py [--threads 2]

Forward + backward of one attention layer (4 query heads, 2 key/value heads, head width 64) on 8
packed rows, side by side in this process (interleaved, median of 5 rounds of 20 calls; 3 for rows of 2,048):
  - masked: `scaled_dot_product_attention` with the (B, 1, T, T) document mask;
  - per-document: `tierlm.models.gpt.model.attend_documents`, causal attention inside each document
    (what the native GPT does for packed rows on CPU).
Rows: tinyshakespeare paragraphs (median 24 tokens) in rows of 256 and 2,048; SFT-like documents
(log-normal, median ~160 tokens) in rows of 512; and one document per row (the worst case).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pretrain import prepare  # noqa: E402
from tierlm.models.gpt.documents import attend_documents, document_causal_mask, document_lengths  # noqa: E402


def packed_positions(rows: int, length: int, draw) -> torch.Tensor:
    positions = []
    for _ in range(rows):
        row: list[int] = []
        while len(row) < length:
            row += range(max(1, min(int(draw()), length - len(row))))
        positions.append(row[:length])
    return torch.tensor(positions)


def milliseconds(fn, calls: int = 20) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tokens = np.fromfile(prepare()[1], dtype=np.uint16)
    paragraphs = np.diff(np.flatnonzero(tokens == tokens[0]))  # the file starts with a separator
    rng = np.random.default_rng(0)
    cases = [
        ("paragraphs, rows of 256", 256, lambda: rng.choice(paragraphs)),
        ("SFT-like, rows of 512", 512, lambda: rng.lognormal(5.0, 0.8) + 10),
        ("paragraphs, rows of 2,048", 2048, lambda: rng.choice(paragraphs)),
        ("one document a row, 256", 256, lambda: 1 << 30),
    ]
    print("| rows | documents a row | masked ms | per-document ms | speed-up |")
    print("|---|---|---|---|---|")
    for name, length, draw in cases:
        positions = packed_positions(8, length, draw)
        q = torch.randn(8, 4, length, 64, requires_grad=True)
        k, v = (torch.randn(8, 2, length, 64, requires_grad=True) for _ in range(2))

        def masked():
            F.scaled_dot_product_attention(
                q, k, v, attn_mask=document_causal_mask(positions), enable_gqa=True
            ).sum().backward()

        def per_document():
            attend_documents(q, k, v, document_lengths(positions)).sum().backward()

        masked(), per_document()  # warm-up
        times = {"masked": [], "per_document": []}
        calls = 20 if length <= 512 else 3
        for _ in range(5):
            times["masked"].append(milliseconds(masked, calls))
            times["per_document"].append(milliseconds(per_document, calls))
        m, d = statistics.median(times["masked"]), statistics.median(times["per_document"])
        documents = sum(len(row) for row in document_lengths(positions)) / 8
        print(f"| {name} | {documents:.1f} | {m:.1f} | {d:.1f} | {m / d:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

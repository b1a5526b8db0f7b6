"""The cost model behind RL's rank balancing (rl.balance_ranks) against the clock: a row of length T is dealt by
T x (a + b T) FLOPs (6 N + 12 L d T per token, `tierlm.metrics.flops.flops_line`); here one forward + backward
of a row is timed at each length and the measured time, relative to the shortest row's, is set beside the model's,
and the clock is fitted as a constant a pass plus the pass's FLOPs at one rate.

    .venv/bin/python bench/rl_row_cost.py [--model runs/tiny_sft/model] [--rows 8] [--repeats 7]

Each length: `--rows` rows of T tokens in one batch (as a micro-batch carries them), the median of --repeats timed
passes after a warm-up, one thread count (OMP_NUM_THREADS as set).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tierlm.metrics.flops import flops_line
from tierlm.models import family_of, load_pretrained_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="runs/tiny_sft/model")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--lengths", default="16,32,64,128,256")
    args = p.parse_args()
    model = load_pretrained_model(args.model).train()
    family = family_of(model)
    vocab = model.get_output_embeddings().weight.shape[0] if hasattr(model, "get_output_embeddings") else 256
    lengths = [int(t) for t in args.lengths.split(",")]
    a, b = flops_line(model)
    rows = []
    for t in lengths:
        ids = torch.randint(0, vocab, (args.rows, t))
        batch = {"input_ids": ids, "labels": ids}

        def step():
            model.zero_grad(set_to_none=True)
            total, _ = family.cross_entropy(model, batch, None)
            total.backward()

        step()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        rows.append((t, statistics.median(times), t * (a + b * t)))
    t0, s0, f0 = rows[0]
    # The clock as the FLOP line plus a constant a pass: seconds = c + k x (the pass's FLOPs), least squares. The
    # constant is paid once a micro-batch, and every rank runs as many micro-batches (it keeps its number of rows),
    # so only the variable part decides the balance: the FLOP line is the cost model if c + k F fits the clock.
    flops = torch.tensor([args.rows * f for _, _, f in rows], dtype=torch.float64)
    seconds = torch.tensor([s for _, s, _ in rows], dtype=torch.float64)
    design = torch.stack([torch.ones_like(flops), flops], dim=1)
    c, k = torch.linalg.lstsq(design, seconds[:, None]).solution[:, 0].tolist()
    print(f"model {args.model}: a = {a:.3g} FLOPs/token, b = {b:.3g} FLOPs/token/position; {args.rows} rows a pass")
    print(
        f"fit: seconds a pass = {c:.4f} + FLOPs / {1 / k:.3g} (FLOP/s); the constant is {c / s0:.0%} of the T={t0} pass"
    )
    print(
        "| T | s a pass | measured vs T=%d | FLOP model vs T=%d | measured / model | fit c + kF / measured |" % (t0, t0)
    )
    print("|---|---|---|---|---|---|")
    for (t, s, f), total in zip(rows, flops.tolist()):
        print(
            f"| {t} | {s:.4f} | {s / s0:.2f}x | {f / f0:.2f}x | {(s / s0) / (f / f0):.2f} | {(c + k * total) / s:.2f} |"
        )


if __name__ == "__main__":
    main()

"""A large vocabulary: the LM head fused into the loss against logits, then the loss.

    .venv/bin/python bench/cross_entropy.py [--repeats 3] [--vocab 151936] [--steps 5]

The same native GPT (depth 2, width 512, GQA 8/4 heads, Qwen3's vocabulary of 151,936 by
default: 161 M parameters, 156 M of them embedding and head) from one seed, trained by the tier-0
backend for `--steps` AdamW steps after 2 warm-up steps on the same SFT-like batch: 2 packed rows of
512 tokens, 64% of the labels trained (as bench/sft.py's assistant share). fp32.
  - fused: `training.fused_cross_entropy=true` (the default): the head and the loss a chunk of
    rows at a time, untrained rows skipped, no (B, T, V) logits;
  - logits: `training.fused_cross_entropy=false`: (B, T, V) logits, their fp32 cross-entropy.
Reported: trained tokens/s and the process's peak resident memory.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import parser, run  # noqa: E402

ROWS, SEQ, TRAINED = 2, 512, 0.64


def step_rate(args, fused: bool) -> dict:
    from tierlm.backends import PyTorchTrainingBackend, create_adamw_optimizer
    from tierlm.backends.options import BackendOptions
    from tierlm.models import GPTConfig, build_gpt
    from tierlm.strategies import CrossEntropyStrategy

    torch.manual_seed(0)
    model = build_gpt(
        GPTConfig(depth=2, aspect_ratio=256, head_dim=64, n_kv_head=4, vocab_size=args.vocab, max_seq_len=SEQ)
    )
    backend = PyTorchTrainingBackend(
        model,
        create_adamw_optimizer(model, 1e-4),
        None,
        tempfile.mkdtemp(),
        "cpu",
        None,
        BackendOptions(fused_cross_entropy=fused),
    )
    strategy = CrossEntropyStrategy()
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, args.vocab, (ROWS, SEQ), generator=g)
    labels[torch.rand(ROWS, SEQ, generator=g) > TRAINED] = -100
    positions = torch.cat([torch.arange(200), torch.arange(312)]).expand(ROWS, -1)  # two documents a row
    batch = {
        "input_ids": torch.randint(0, args.vocab, (ROWS, SEQ), generator=g),
        "labels": labels,
        "position_ids": positions,
    }
    trained = int((labels != -100).sum())
    for step in range(2 + args.steps):
        if step == 2:
            start = time.perf_counter()
        backend.forward_backward(batch, strategy.compute_loss)
        loss = backend.optim_step().wait()["loss"]
    elapsed = time.perf_counter() - start
    return {
        "trained_tokens_per_sec": trained * args.steps / elapsed,
        "final_loss": loss,
        "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }


CONTENDERS = {"fused": lambda a: step_rate(a, fused=True), "logits": lambda a: step_rate(a, fused=False)}

if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    args = p.parse_args()
    if args.contender is None:
        print(
            f"vocab {args.vocab:,}, {ROWS} rows x {SEQ} tokens, {TRAINED:.0%} trained, {args.steps} timed steps",
            file=sys.stderr,
        )
    run(
        CONTENDERS,
        args,
        [f"--vocab={args.vocab}", f"--steps={args.steps}", f"--threads={args.threads}"],
        "trained_tokens_per_sec",
        "logits",
    )

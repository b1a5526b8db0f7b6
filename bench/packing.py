"""SFT packing: how much of each row is real data, and whether the loader keeps up with training.

    .venv/bin/python bench/packing.py [--conversations 2000] [--seq-len 2048]

Builds an SFT set with a long-tailed (log-normal) length distribution from tinyshakespeare,
then compares, over one epoch:
  - tierlm: best-fit packing into rows of seq_len + 1 tokens, padding only what nothing fits;
  - padding to the longest conversation in each batch (the usual collator), same conversations.
and prints the share of row tokens that are real (non-pad) tokens and that carry loss (assistant
tokens), plus loader tokens/s against a training step's tokens/s on the same rows.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from tierlm.data import Documents, ListExamples, PackedLoader, chat_documents, train_bpe_tokenizer
from tierlm.models import GPTConfig, build_gpt, forward_logits
from tierlm.strategies import SFTStrategy

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def long_tailed_conversations(
    text: str, count: int, seed: int, user_words: float = 60, assistant_words: float = 120
) -> list[list[dict]]:
    """User and assistant turns of log-normal length in words (median `user_words` and `assistant_words`, long tail)."""
    words, rng = text.split(), np.random.default_rng(seed)

    def span(median: float) -> str:
        n = int(min(3000, max(3, rng.lognormal(np.log(median), 1.0))))
        start = int(rng.integers(0, len(words) - n))
        return " ".join(words[start : start + n])

    conversations = []
    for _ in range(count):
        turns = int(rng.choice([1, 1, 1, 2, 3]))
        conversation = []
        for _ in range(turns):
            conversation += [
                {"role": "user", "content": span(user_words)},
                {"role": "assistant", "content": span(assistant_words)},
            ]
        conversations.append(conversation)
    return conversations


def pad_to_longest(rendered: list[tuple[list[int], list[int]]], batch_size: int, max_len: int) -> tuple[float, float]:
    real = trained = slots = 0
    for i in range(0, len(rendered), batch_size):
        batch = [(ids[:max_len], mask[:max_len]) for ids, mask in rendered[i : i + batch_size]]
        longest = max(len(ids) for ids, _ in batch)
        slots += longest * len(batch)
        real += sum(len(ids) for ids, _ in batch)
        trained += sum(sum(mask) for _, mask in batch)
    return real / slots, trained / slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--batch-size", type=int, default=8, help="rows per batch (ours) and conversations per batch (padding)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)

    text = DATA.read_text()
    tokenizer = train_bpe_tokenizer([text[i : i + 2000] for i in range(0, len(text), 2000)], vocab_size=1024)
    conversations = long_tailed_conversations(text, args.conversations, args.seed)
    rendered = [tokenizer.render_conversation(c) for c in conversations]
    lengths = np.array([len(ids) for ids, _ in rendered])
    print(
        f"{len(conversations)} conversations, tokens per conversation: median {np.median(lengths):.0f}, "
        f"p90 {np.percentile(lengths, 90):.0f}, p99 {np.percentile(lengths, 99):.0f}, max {lengths.max()}"
    )

    documents = Documents(ListExamples(conversations), chat_documents(tokenizer))
    loader = PackedLoader(
        documents,
        args.batch_size,
        args.seq_len,
        mode="pad",
        pad_id=tokenizer.pad_id,
        seed=args.seed,
        document_positions=True,
    )
    loader.repeat = False
    start = time.perf_counter()
    batches = list(loader)
    loader_s = time.perf_counter() - start
    row_tokens = sum(b["tokens"].numel() for b in batches)
    ours_real = loader.stats()["data_fill"]
    ours_trained = sum(int(SFTStrategy().prepare_batch(b)["labels"].ne(-100).sum()) for b in batches) / row_tokens
    pad_real, pad_trained = pad_to_longest(rendered, args.batch_size, args.seq_len + 1)

    print(f"\n{'':34}{'real tokens / row':>20}{'trained tokens / row':>22}")
    print(f"{'tierlm best-fit packing':34}{ours_real:>20.3f}{ours_trained:>22.3f}   (goal >= 0.97 real)")
    print(f"{'padding to the longest in batch':34}{pad_real:>20.3f}{pad_trained:>22.3f}")
    print(f"{'ratio':34}{ours_real / pad_real:>19.2f}x{ours_trained / pad_trained:>21.2f}x")
    print(f"truncated conversations: {loader.counts['truncated']} (longer than {args.seq_len + 1} tokens)")

    # The loader's speed, rendering included, against a training step on the same rows (tiny GPT, CPU).
    loader_tps = row_tokens / loader_s
    model = build_gpt(
        GPTConfig(depth=4, aspect_ratio=64, head_dim=64, vocab_size=tokenizer.vocab_size, max_seq_len=args.seq_len)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    strategy, steps, train_tokens = SFTStrategy(), 3, 0
    start = time.perf_counter()
    for batch in batches[:steps]:
        prepared = strategy.prepare_batch(batch)
        total, count = strategy.compute_loss(forward_logits(model, prepared), prepared)
        (total / count).backward()
        optimizer.step()
        optimizer.zero_grad()
        train_tokens += prepared["input_ids"].numel()
    train_tps = train_tokens / (time.perf_counter() - start)
    print(
        f"\nloader: {loader_tps:,.0f} tokens/s (render + pack, one process)   "
        f"training step (depth-4 GPT, CPU): {train_tps:,.0f} tokens/s   loader / trainer: {loader_tps / train_tps:.0f}x"
    )


if __name__ == "__main__":
    main()

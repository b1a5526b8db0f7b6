"""What the UL2 encoder's state at a sentinel holds about the text around it: linear probes, trained on
R-denoiser examples of the training text and scored on held-out ones, for the token left and right of
each sentinel (a sentinel between two uncorrupted tokens).

    .venv/bin/python bench/ul2_probe.py --out runs/ul2-long [overrides the run was trained with, e.g. model.depth=3]

Prints each probe's held-out accuracy beside the most frequent token's share.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tierlm.builders.loaders import open_splits  # noqa: E402
from tierlm.config import TierlmConfig  # noqa: E402
from tierlm.data import load_tokenizer  # noqa: E402
from tierlm.data.packing import Documents, text_documents  # noqa: E402
from tierlm.data.seq2seq_tokenizer import Qwen3EncoderDecoderTokenizer  # noqa: E402
from tierlm.data.ul2_loader import create_ul2_dataset  # noqa: E402
from tierlm.models import load_pretrained_model  # noqa: E402


@torch.no_grad()
def sentinel_states(model, tokenizer, config: TierlmConfig, examples, batches: int):
    """(encoder states at sentinels (N, C), left neighbours (N,), right neighbours (N,)) of R1 examples."""
    d = config.data
    loader = create_ul2_dataset(
        Documents(examples, text_documents(tokenizer)),
        tokenizer,
        d.max_encoder_length,
        d.max_decoder_length,
        batch_size=16,
        task_weights=[1, 0, 0, 0, 0],
        seed=3,
        shuffle=False,
    )
    loader.repeat = False
    sentinels, states, left, right = set(tokenizer.sentinel_ids), [], [], []
    for i, batch in enumerate(loader):
        if i == batches:
            break
        ids, segments = batch["input_ids"], batch["encoder_segment_ids"]
        encoded = model.encode(
            ids,
            encoder_positions=batch["encoder_positions"],
            mask=segments[:, None, :, None] == segments[:, None, None, :],
        )
        for b, t in (
            torch.isin(ids[:, 1:-1], torch.tensor(sorted(sentinels))).nonzero() + torch.tensor([0, 1])
        ).tolist():
            neighbours = int(ids[b, t - 1]), int(ids[b, t + 1])
            if not sentinels & set(neighbours) and segments[b, t - 1] == segments[b, t] == segments[b, t + 1]:
                states.append(encoded[b, t])
                left.append(neighbours[0])
                right.append(neighbours[1])
    return torch.stack(states), torch.tensor(left), torch.tensor(right)


def probe_accuracy(train_x, train_y, test_x, test_y, classes: int, steps: int = 400) -> float:
    probe = torch.nn.Linear(train_x.shape[1], classes)
    optimizer = torch.optim.Adam(probe.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(probe(train_x), train_y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return (probe(test_x).argmax(-1) == test_y).float().mean().item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/ul2-tiny", help="the trained run")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    config = TierlmConfig.load("ul2-tiny", [f"infra.output_dir={args.out}", *args.overrides])
    tokenizer = Qwen3EncoderDecoderTokenizer(load_tokenizer(Path(args.out) / "model"), config.model.num_sentinel_tokens)
    model = load_pretrained_model(Path(args.out) / "model").eval()
    trains, vals = open_splits(config, "text", tokenizer)
    train_x, train_left, train_right = sentinel_states(model, tokenizer, config, trains[0][0], 60)
    test_x, test_left, test_right = sentinel_states(model, tokenizer, config, vals[0], 20)
    print(f"{len(train_x)} training and {len(test_x)} held-out sentinels between two uncorrupted tokens")
    for side, train_y, test_y in (("left", train_left, test_left), ("right", train_right, test_right)):
        accuracy = probe_accuracy(train_x.detach(), train_y, test_x.detach(), test_y, len(tokenizer.hf))
        base = (test_y == torch.mode(train_y).values).float().mean().item()
        print(f"  {side} neighbour: linear probe {accuracy:.3f} (the most frequent token: {base:.3f})")


if __name__ == "__main__":
    main()

"""UL2 on CPU: pretrain the `ul2-tiny` encoder-decoder, then measure each denoiser's held-out loss before
and after training, and fill a masked word of held-out passages.

    .venv/bin/python bench/ul2_tiny.py [--out runs/ul2-tiny] [--steps 1500] [overrides ...]

With `model.model_name_or_path=<a transformers Qwen3 folder>` the run starts from that decoder-only model
(`initialize_from_qwen3`). Prints one line per denoiser (val loss of the initial model -> the trained one,
nats per target token)
and the infilling measures and samples (a held-out passage with one word replaced by <extra_id_0>; the rank of the
word's first token with and without the text after it).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tierlm.config import TierlmConfig  # noqa: E402
from tierlm.data import load_tokenizer  # noqa: E402
from tierlm.data.packing import Documents, text_documents  # noqa: E402
from tierlm.data.seq2seq_tokenizer import Qwen3EncoderDecoderTokenizer  # noqa: E402
from tierlm.data.ul2 import DEFAULT_DENOISERS  # noqa: E402
from tierlm.data.ul2_loader import create_ul2_dataset  # noqa: E402
from tierlm.loaders import open_splits  # noqa: E402
from tierlm.models import forward_cross_entropy, load_pretrained_model  # noqa: E402
from tierlm.primitives.losses import token_weights  # noqa: E402
from tierlm.recipes import build_model, run_stage  # noqa: E402
from tierlm.rollout.engine import Engine  # noqa: E402
from tierlm.starting_point import pretrained_location  # noqa: E402


@torch.no_grad()
def denoiser_losses(model, config: TierlmConfig, tokenizer, batches: int = 20) -> list[float]:
    """Held-out loss (nats per target token) of each denoiser alone, on the same validation documents."""
    _, vals = open_splits(config, "pretrain", tokenizer)
    docs = Documents(vals[0], text_documents(tokenizer))
    d, out = config.data, []
    model.eval()
    for which in range(len(DEFAULT_DENOISERS)):
        weights = [1.0 if i == which else 0.0 for i in range(len(DEFAULT_DENOISERS))]
        loader = create_ul2_dataset(docs, tokenizer, d.max_encoder_length, d.max_decoder_length, batch_size=16,
                                    task_weights=weights, seed=1, shuffle=False)
        loader.repeat = False
        total = count = 0.0
        for i, batch in enumerate(loader):
            if i == batches:
                break
            weights_ = token_weights(batch["labels"], None)
            loss, _ = forward_cross_entropy(model, batch, weights_)
            total, count = total + float(loss), count + float(weights_.sum())
        out.append(total / count)
    return out


@torch.no_grad()
def first_token_ranks(model, tokenizer, prompt_left: list[int], prompt_right: list[int], word: list[int]) -> tuple[int, int]:
    """Rank (0 = the decoder's top choice) of the masked word's first token right after <extra_id_0>, with the text
    after the span in the encoder's input and without it: does the model read the right-hand context?"""
    ranks = []
    for right in (prompt_right, []):
        ids = torch.tensor([[tokenizer.mode_ids["R"], *prompt_left, tokenizer.sentinel_ids[0], *right]])
        decoder = torch.tensor([[model.config.decoder_start_token_id, tokenizer.sentinel_ids[0]]])
        logits = model(input_ids=ids, decoder_input_ids=decoder)[0, -1]
        ranks.append(int((logits > logits[word[0]]).sum()))
    return ranks[0], ranks[1]


def infill(model, tokenizer, texts: list[str], seed: int = 0) -> tuple[list[str], float, float]:
    """One whole word (3+ letters, not the speaker's name) of each held-out passage replaced by
    <extra_id_0> and given to the encoder in R mode; the decoder's greedy answer up to end of text.
    Returns the filled lines, the share filled with exactly the masked word, and the share a constant
    guess of the most frequent masked word would get."""
    engine, rng = Engine(model, [tokenizer.hf.eos_token_id, tokenizer.sentinel_ids[1]], tokenizer), np.random.default_rng(seed)
    lines, hits, words, ranks = [], 0, [], []
    for text in texts:
        speaker = text.index("\n") + 1 if "\n" in text else 0
        found = list(re.finditer(r"[A-Za-z']{3,}", text[speaker:]))
        if not found:
            continue
        match = found[int(rng.integers(len(found)))]
        a, b = speaker + match.start(), speaker + match.end()
        # The masked span takes the word's leading space, as the byte-level BPE's tokens do (" you" is one
        # token); leaving a lone space before the sentinel asks for a fill no training span ever had.
        a -= a > 0 and text[a - 1] == " "
        prompt = [tokenizer.mode_ids["R"], *tokenizer.encode(text[:a]), tokenizer.sentinel_ids[0], *tokenizer.encode(text[b:])]
        out = engine.generate(prompt, 1, 12, temperature=0.0)[0].tokens
        filled = tokenizer.decode([t for t in out if t not in tokenizer.sentinel_ids and t != tokenizer.hf.eos_token_id])
        ranks.append(first_token_ranks(model, tokenizer, tokenizer.encode(text[:a]), tokenizer.encode(text[b:]), tokenizer.encode(text[a:b])))
        hits += filled.strip() == text[a:b].strip()
        words.append(text[a:b].strip())
        lines.append(f"{text[:a]}[{filled}]{text[b:]}   (original: [{text[a:b]}])")
    constant = max(words.count(w) for w in set(words)) / len(words)
    both, left = np.array(ranks).T
    print(f"the masked word's first token after <extra_id_0>: top-1 {np.mean(both == 0):.1%} / top-10 {np.mean(both < 10):.1%} "
          f"(median rank {np.median(both):.0f}) with the text after the span; top-1 {np.mean(left == 0):.1%} / top-10 "
          f"{np.mean(left < 10):.1%} (median rank {np.median(left):.0f}) with it removed")
    return lines, hits / len(words), constant


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/ul2-tiny")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--no-train", action="store_true", help="measure the run already in --out")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    overrides = [f"infra.output_dir={args.out}", *([f"training.num_train_steps={args.steps}"] if args.steps else []), *args.overrides]
    config = TierlmConfig.load("ul2-tiny", overrides)
    summary = {} if args.no_train else run_stage(config, "pretrain")
    tokenizer = Qwen3EncoderDecoderTokenizer(load_tokenizer(Path(args.out) / "model"), config.model.num_sentinel_tokens)
    trained = load_pretrained_model(Path(args.out) / "model")
    torch.manual_seed(config.training.seed)
    initial = build_model(config, tokenizer, torch.device("cpu"), pretrained_location(config))  # where training started
    before, after = denoiser_losses(initial, config, tokenizer), denoiser_losses(trained, config, tokenizer)
    done = f"the run in {args.out}" if args.no_train else f"trained {summary.get('steps', config.training.num_train_steps)} steps"
    print(f"{done}; held-out loss per denoiser (nats per target token):")
    for denoiser, a, b in zip(DEFAULT_DENOISERS, before, after):
        label = f"{denoiser.name} ({denoiser.mode}" + (f", span {denoiser.mean_span:g}, {denoiser.noise_density:.0%})" if denoiser.mode != "S" else ", prefix LM)")
        print(f"  {label:28s} {a:6.3f} -> {b:6.3f}")
    _, vals = open_splits(config, "pretrain", tokenizer)
    texts = [t for t in vals[0].fetch(range(len(vals[0]))) if 40 < len(t) < 200]
    lines, exact, constant = infill(trained.eval(), tokenizer, texts)
    print(f"one masked word in each of {len(lines)} held-out passages: filled exactly {exact:.1%} "
          f"(always guessing the most frequent masked word: {constant:.1%}); the first 10:")
    for line in lines[:10]:
        print("  " + line.replace("\n", " / "))


if __name__ == "__main__":
    main()

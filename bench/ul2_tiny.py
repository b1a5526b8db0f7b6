"""UL2 on CPU: pretrain the `ul2-tiny` encoder-decoder, then measure each denoiser's held-out loss before
and after training, and fill a masked word of held-out passages.

    .venv/bin/python bench/ul2_tiny.py [--out runs/ul2-tiny] [--steps 1500] [--no-train] [--show 10]
                                       [--judge <a character model folder>] [overrides ...]

With `model.model_name_or_path=<a transformers Qwen3 folder>` the run starts from that decoder-only model
(`initialize_from_qwen3`). Prints one line per denoiser (val loss of the initial model -> the trained one,
nats per target token), then the infilling measures and samples: a held-out passage with one word replaced
by <extra_id_0>; the rank of the word's first token with and without the text after it; with `--judge`, how
often an independent decoder-only model prefers the passage with its own fill to it with other passages'
fills (50% for fills blind to their context). The judge the README uses (2 min):

    tierlm pretrain --config gpt2-shakespeare-char data.max_seq_length=256 \
        training.per_device_train_batch_size=3 infra.output_dir=runs/judge-char
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tierlm.builders.loaders import open_splits  # noqa: E402
from tierlm.builders.model import build_model
from tierlm.builders.tokenizer import pretrained_location  # noqa: E402
from tierlm.config import TierlmConfig  # noqa: E402
from tierlm.data import load_tokenizer  # noqa: E402
from tierlm.data.packing import Documents, text_documents  # noqa: E402
from tierlm.data.seq2seq_tokenizer import Qwen3EncoderDecoderTokenizer  # noqa: E402
from tierlm.data.ul2 import DEFAULT_DENOISERS  # noqa: E402
from tierlm.data.ul2_loader import create_ul2_dataset  # noqa: E402
from tierlm.models import forward_cross_entropy, load_pretrained_model  # noqa: E402
from tierlm.primitives.losses import IGNORE_INDEX, token_weights  # noqa: E402
from tierlm.rollout.engine import Engine  # noqa: E402
from tierlm.rollout.sampling import GREEDY  # noqa: E402
from tierlm.stages import run_stage  # noqa: E402


@torch.no_grad()
def denoiser_losses(model, config: TierlmConfig, tokenizer, batches: int = 20) -> list[float]:
    """Held-out loss (nats per target token) of each denoiser alone, on the same validation documents."""
    _, vals = open_splits(config, "text", tokenizer)
    docs = Documents(vals[0], text_documents(tokenizer))
    d, out = config.data, []
    model.eval()
    for which in range(len(DEFAULT_DENOISERS)):
        weights = [1.0 if i == which else 0.0 for i in range(len(DEFAULT_DENOISERS))]
        loader = create_ul2_dataset(
            docs,
            tokenizer,
            d.max_encoder_length,
            d.max_decoder_length,
            batch_size=16,
            task_weights=weights,
            seed=1,
            shuffle=False,
        )
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


def masked_prompt(tokenizer, left: list[int], right: list[int]) -> list[int]:
    """The encoder's input for one masked span: R mode, the text before it, <extra_id_0>, the text after it."""
    return [tokenizer.mode_ids["R"], *left, tokenizer.sentinel_ids[0], *right]


@torch.no_grad()
def first_token_ranks(
    model, tokenizer, prompt_left: list[int], prompt_right: list[int], word: list[int]
) -> tuple[int, int]:
    """Rank (0 = the decoder's top choice) of the masked word's first token right after <extra_id_0>, with the text
    after the span in the encoder's input and without it: does the model read the right-hand context?"""
    ranks = []
    for right in (prompt_right, []):
        ids = torch.tensor([masked_prompt(tokenizer, prompt_left, right)])
        decoder = torch.tensor([[model.config.decoder_start_token_id, tokenizer.sentinel_ids[0]]])
        logits = model(input_ids=ids, decoder_input_ids=decoder)[0, -1]
        ranks.append(int((logits > logits[word[0]]).sum()))
    return ranks[0], ranks[1]


def infill(model, tokenizer, texts: list[str], seed: int = 0) -> list[dict]:
    """One whole word (3+ letters, not the speaker's name) of each held-out passage replaced by
    <extra_id_0> and given to the encoder in R mode: the decoder's greedy `fill` up to the next sentinel
    or end of text, and the rank of the word's first token with and without the text after the span."""
    engine, rng = (
        Engine(model, [tokenizer.hf.eos_token_id, tokenizer.sentinel_ids[1]], tokenizer),
        np.random.default_rng(seed),
    )
    out = []
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
        left, right = tokenizer.encode(text[:a]), tokenizer.encode(text[b:])
        tokens = engine.generate(masked_prompt(tokenizer, left, right), 1, 12, GREEDY)[0].tokens
        fill = tokenizer.decode(
            [t for t in tokens if t not in tokenizer.sentinel_ids and t != tokenizer.hf.eos_token_id]
        )
        ranks = first_token_ranks(model, tokenizer, left, right, tokenizer.encode(text[a:b]))
        out.append(dict(left=text[:a], word=text[a:b], right=text[b:], fill=fill, ranks=ranks))
    return out


@torch.no_grad()
def judge_logprob(judge, judge_tokenizer, left: str, middle: str, right: str, window: int = 256) -> float:
    """log P(middle + right | left) in nats under a decoder-only judge (a character model, so the three
    strings tokenize on their own), the left context cut to fit the `window` the judge was trained on."""
    context, rest = judge_tokenizer.encode(left), judge_tokenizer.encode(middle + right)
    context = context[max(0, len(context) + len(rest) - window) :]
    assert len(context) >= 1 and len(rest) >= 1, "the judge needs some left context and something to score"
    ids = torch.tensor([context + rest])
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, len(context) - 1 : -1] = ids[0, len(context) :]
    _, losses = forward_cross_entropy(judge, {"input_ids": ids, "labels": labels})
    return -float(losses.sum())


def judge_fills(judge_dir: Path, fills: list[dict], others: int = 5, seed: int = 0) -> None:
    """Are the fills plausible *here*? An independent character-level decoder-only model (trained on the
    same text, its held-out share containing these passages) scores each passage with its own fill
    against the same passage with the fills of `others` other passages: a fill that ignores its context
    wins half the time (ties count half). The masked word itself, scored the same way, is the ceiling."""
    judge, judge_tokenizer = load_pretrained_model(judge_dir).eval(), load_tokenizer(judge_dir)
    rng, n = np.random.default_rng(seed), len(fills)
    shifts = rng.choice(np.arange(1, n), size=others, replace=False)  # each a derangement: passage i gets i + shift's
    score = lambda i, middle: judge_logprob(judge, judge_tokenizer, fills[i]["left"], middle, fills[i]["right"])  # noqa: E731

    def wins(key: str) -> float:
        own = np.array([score(i, f[key]) for i, f in enumerate(fills)])
        swapped = np.array([[score(i, fills[(i + shift) % n][key]) for i in range(n)] for shift in shifts])
        return float(np.mean(own > swapped) + 0.5 * np.mean(own == swapped))

    print(
        f"judged by {judge_dir} (log-likelihood of the passage from the span on, given the text before it): the "
        f"passage "
        f"with its own fill beats it with another passage's fill {wins('fill'):.1%} of the time ({others} others each; "
        f"ties half; fills blind to their context: 50%; the masked word itself: {wins('word'):.1%})"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/ul2-tiny")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--no-train", action="store_true", help="measure the run already in --out")
    parser.add_argument("--show", type=int, default=10, help="how many filled passages to print")
    parser.add_argument(
        "--judge",
        help="a tierlm decoder-only model folder trained on the same text (a character model) to judge the fills",
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.show < 0:
        parser.error(f"--show must be >= 0, got {args.show}")
    if args.judge and not (Path(args.judge) / "config.json").is_file():  # found now, not after the training run
        parser.error(
            f"--judge {args.judge} is not a model folder (no config.json); make one with the command in this script's "
            f"docstring"
        )
    overrides = [
        f"infra.output_dir={args.out}",
        *([f"training.num_train_steps={args.steps}"] if args.steps else []),
        *args.overrides,
    ]
    config = TierlmConfig.load("ul2-tiny", overrides)
    summary = {} if args.no_train else run_stage(config, "pretrain")
    tokenizer = Qwen3EncoderDecoderTokenizer(load_tokenizer(Path(args.out) / "model"), config.model.num_sentinel_tokens)
    trained = load_pretrained_model(Path(args.out) / "model")
    torch.manual_seed(config.training.seed)
    initial = build_model(config, tokenizer, torch.device("cpu"), pretrained_location(config))  # where training started
    before, after = denoiser_losses(initial, config, tokenizer), denoiser_losses(trained, config, tokenizer)
    done = (
        f"the run in {args.out}"
        if args.no_train
        else f"trained {summary.get('steps', config.training.num_train_steps)} steps"
    )
    print(f"{done}; held-out loss per denoiser (nats per target token):")
    for denoiser, a, b in zip(DEFAULT_DENOISERS, before, after):
        label = f"{denoiser.name} ({denoiser.mode}" + (
            f", span {denoiser.mean_span:g}, {denoiser.noise_density:.0%})" if denoiser.mode != "S" else ", prefix LM)"
        )
        print(f"  {label:28s} {a:6.3f} -> {b:6.3f}")
    _, vals = open_splits(config, "text", tokenizer)
    texts = [t for t in vals[0].fetch(range(len(vals[0]))) if 40 < len(t) < 200]
    fills = infill(trained.eval(), tokenizer, texts)
    words = [f["word"].strip() for f in fills]
    both, left = np.array([f["ranks"] for f in fills]).T
    print(
        f"the masked word's first token after <extra_id_0>: top-1 {np.mean(both == 0):.1%} / top-10 "
        f"{np.mean(both < 10):.1%} "
        f"(median rank {np.median(both):.0f}) with the text after the span; top-1 {np.mean(left == 0):.1%} / top-10 "
        f"{np.mean(left < 10):.1%} (median rank {np.median(left):.0f}) with it removed"
    )
    exact = np.mean([f["fill"].strip() == w for f, w in zip(fills, words)])
    constant = max(words.count(w) for w in set(words)) / len(words)
    print(
        f"one masked word in each of {len(fills)} held-out passages: filled exactly {exact:.1%} "
        f"(always guessing the most frequent masked word: {constant:.1%}); the first {args.show}:"
    )
    for f in fills[: args.show]:
        print("  " + f"{f['left']}[{f['fill']}]{f['right']}   (original: [{f['word']}])".replace("\n", " / "))
    if args.judge:
        judge_fills(Path(args.judge), fills)


if __name__ == "__main__":
    main()

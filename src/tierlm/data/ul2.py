"""UL2's mixture of denoisers for encoder–decoder pretraining (Tay et al. 2022, "UL2: Unifying Language
Learning Paradigms", arXiv:2205.05131).

Each training example is a piece of text turned into (encoder input, decoder target) by one denoiser:

- **R** (regular span corruption, T5's): short spans, ~15% of the tokens;
- **X** (extreme): long spans and/or a high corruption rate (~50%);
- **S** (sequential, prefix LM): the text is cut at a random point; the encoder reads the prefix and
  the decoder writes the rest.

A corrupted span is replaced in the encoder input by a sentinel (`<extra_id_0>`, `<extra_id_1>`, ... in
order), and the decoder target lists each sentinel followed by the tokens it replaced (T5's format), so
every token of the piece appears exactly once across the two (`reconstruct` undoes it). The encoder
input starts with the denoiser's mode token, `[R]`, `[X]` or `[S]` (the paper's paradigm tokens), so a
model can be asked for a mode at inference.

The default mixture is five denoisers with `ul2_task_weights` [1, 1, 1, 1, 4]:

| denoiser | mode | mean span | corruption | weight |
|---|---|---|---|---|
| R1 | [R] | 3 | 15% | 1 |
| R2 | [R] | 8 | 15% | 1 |
| X1 | [X] | 3 | 50% | 1 |
| X2 | [X] | 64 | 50% | 1 |
| S  | [S] | — | the suffix (25–75% of the piece) | 4 |

(The paper's own mixture has seven: R with spans 3 and 8 at 15%, X with spans 3 and 8 at 50% and 64 at
15% and 50%, and S; this mixture keeps two of each R and X and weighs S at half the examples.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from tierlm.primitives.losses import IGNORE_INDEX

MODE_TOKENS = {"R": "[R]", "X": "[X]", "S": "[S]"}


def sentinel_token(i: int) -> str:
    return f"<extra_id_{i}>"


@dataclass(frozen=True)
class Denoiser:
    name: str
    mode: str  # "R", "X" or "S"
    mean_span: float = 3.0
    """Mean length of a corrupted span (R and X)."""
    noise_density: float = 0.15
    """Share of the piece's tokens that are corrupted (R and X)."""

    def __post_init__(self):
        assert self.mode in MODE_TOKENS, f"mode must be one of {list(MODE_TOKENS)}, got {self.mode!r}"
        assert self.mode == "S" or (self.mean_span >= 1 and 0 < self.noise_density < 1), f"bad denoiser {self}"


DEFAULT_DENOISERS = (
    Denoiser("R1", "R", 3, 0.15),
    Denoiser("R2", "R", 8, 0.15),
    Denoiser("X1", "X", 3, 0.5),
    Denoiser("X2", "X", 64, 0.5),
    Denoiser("S", "S"),
)
DEFAULT_TASK_WEIGHTS = (1, 1, 1, 1, 4)


# -- span corruption (R and X) ---------------------------------------------------------------
def span_counts(length: int, noise_density: float, mean_span: float) -> tuple[int, int]:
    """(corrupted tokens, spans) for a piece of `length` tokens: T5's rounding, at least one of each and
    at least one clean token per span.

    >>> span_counts(100, 0.15, 3), span_counts(512, 0.5, 64), span_counts(2, 0.15, 3)
    ((15, 5), (256, 4), (1, 1))
    """
    assert length >= 2, f"a piece needs at least 2 tokens to corrupt one, got {length}"
    noise = min(max(int(round(length * noise_density)), 1), length - 1)
    spans = min(max(int(round(noise / mean_span)), 1), noise, length - noise)
    return noise, spans


def _segment(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """`total` split into `parts` positive lengths, uniformly over all such splits."""
    cuts = (
        np.sort(rng.choice(np.arange(1, total), size=parts - 1, replace=False))
        if parts > 1
        else np.zeros(0, dtype=np.int64)
    )
    return np.diff(np.concatenate([[0], cuts, [total]]))


def random_spans_mask(length: int, noise_density: float, mean_span: float, rng: np.random.Generator) -> np.ndarray:
    """A boolean mask of the corrupted tokens: clean and corrupted spans alternate with random lengths
    (T5's `random_spans_noise_mask`), except that the piece may start or end with a corrupted span.

    T5's mask always starts clean and always ends corrupted, so the last sentinel of every training input
    ends the text, and a model trained on it fills a lone sentinel in the middle of a sentence with an
    ending (seen here: ", sir." for a masked noun). Here the clean text before the first span and after
    the last may be empty (uniformly over such splits), so a span can sit anywhere.

    >>> mask = random_spans_mask(100, 0.15, 3, np.random.default_rng(0))
    >>> int(mask.sum()), int((mask & ~np.concatenate([[False], mask[:-1]])).sum())  # 15 corrupted tokens in 5 spans
    (15, 5)
    """
    noise, spans = span_counts(length, noise_density, mean_span)
    noise_lengths = _segment(noise, spans, rng)
    clean_lengths = _segment(length - noise + 2, spans + 1, rng)  # spans + 1 gaps, the two outer ones may be empty
    clean_lengths[0] -= 1
    clean_lengths[-1] -= 1
    mask = np.zeros(length, dtype=bool)
    start = 0
    for clean, corrupt in zip(clean_lengths, noise_lengths):
        start += clean
        mask[start : start + corrupt] = True
        start += corrupt
    assert start + clean_lengths[-1] == length, "the spans and gaps must cover the piece"
    return mask


def corrupt_spans(tokens: Sequence[int], mask: np.ndarray, sentinel_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """(encoder input, decoder target): each corrupted span becomes the next sentinel in the input, and the
    target is each sentinel followed by the tokens it stands for.

    >>> corrupt_spans([10, 11, 12, 13, 14, 15], np.array([0, 1, 1, 0, 0, 1], bool), [900, 901])
    ([10, 900, 13, 14, 901], [900, 11, 12, 901, 15])
    """
    inputs, targets, span = [], [], -1
    for i, token in enumerate(tokens):
        if mask[i]:
            if i == 0 or not mask[i - 1]:
                span += 1
                assert span < len(sentinel_ids), f"{span + 1} spans need more than the {len(sentinel_ids)} sentinels"
                inputs.append(sentinel_ids[span])
                targets.append(sentinel_ids[span])
            targets.append(int(token))
        else:
            inputs.append(int(token))
    return inputs, targets


def reconstruct(
    inputs: Sequence[int], targets: Sequence[int], sentinel_ids: Sequence[int], mode_id: int | None = None
) -> list[int]:
    """The original piece from a span-corrupted (input, target) pair (or a prefix-LM one: input + target).

    >>> reconstruct([10, 900, 13, 14, 901], [900, 11, 12, 901, 15], [900, 901])
    [10, 11, 12, 13, 14, 15]
    """
    inputs = list(inputs[1:]) if mode_id is not None and inputs and inputs[0] == mode_id else list(inputs)
    sentinels = set(sentinel_ids)
    if not any(t in sentinels for t in inputs):  # prefix LM
        return inputs + list(targets)
    spans: dict[int, list[int]] = {}
    current = None
    for token in targets:
        if token in sentinels:
            current = spans.setdefault(token, [])
        else:
            assert current is not None, "a target must start with a sentinel"
            current.append(token)
    out = []
    for token in inputs:
        out.extend(spans[token] if token in sentinels else [token])
    return out


# -- the mixture -----------------------------------------------------------------------------
def piece_length(denoiser: Denoiser, max_encoder_length: int, max_decoder_length: int) -> int:
    """The longest piece whose encoder input (mode token included) and decoder target (end-of-sequence
    token included) fit the two lengths (for S, the longest suffix a piece can have must fit the decoder).

    >>> [piece_length(DEFAULT_DENOISERS[i], 512, 128) for i in (0, 2, 4)]
    [568, 190, 169]
    """

    def fits(n: int) -> bool:
        if denoiser.mode == "S":  # the longest prefix must fit the encoder, the longest suffix the decoder
            shortest, longest = _prefix_bounds(n)
            return 1 + longest <= max_encoder_length and n - shortest + 1 <= max_decoder_length
        noise, spans = span_counts(n, denoiser.noise_density, denoiser.mean_span)
        return 1 + n - noise + spans <= max_encoder_length and noise + spans + 1 <= max_decoder_length

    lo, hi = 2, max_encoder_length + max_decoder_length + 1
    assert fits(lo), f"{denoiser.name} cannot fit even 2 tokens in {max_encoder_length} / {max_decoder_length}"
    while lo < hi:  # the largest n that fits (fits is monotone in n up to rounding; checked below)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    while not fits(lo):
        lo -= 1
    return lo


def _prefix_bounds(n: int) -> tuple[int, int]:
    """(shortest, longest) prefix of an S piece of n tokens: the cut falls in [25%, 75%] of it."""
    return max(1, n // 4), max(1, min(n - 1, (3 * n) // 4))


class UL2Denoising:
    """The mixture: example `index` of a run is denoised by a denoiser drawn with `task_weights`, from
    randomness fixed by (seed, index), so a resumed run makes the same examples.

    `denoise(piece, index)` takes a piece of at most `lengths[choose(index)]` tokens (fewer at the end
    of a document) and returns what fits `max_encoder_length` / `max_decoder_length`.
    """

    def __init__(
        self,
        sentinel_ids: Sequence[int],
        mode_ids: dict[str, int],
        max_encoder_length: int,
        max_decoder_length: int,
        denoisers: Sequence[Denoiser] = DEFAULT_DENOISERS,
        task_weights: Sequence[float] = DEFAULT_TASK_WEIGHTS,
        seed: int = 0,
    ):
        assert len(denoisers) == len(task_weights), f"{len(denoisers)} denoisers but {len(task_weights)} task weights"
        assert all(w >= 0 for w in task_weights) and sum(task_weights) > 0, (
            f"task weights must be >= 0 with a positive sum: {task_weights}"
        )
        self.sentinel_ids, self.mode_ids, self.seed = list(sentinel_ids), dict(mode_ids), seed
        self.denoisers = list(denoisers)
        self.probabilities = np.asarray(task_weights, dtype=np.float64) / float(sum(task_weights))
        self.max_encoder_length, self.max_decoder_length = max_encoder_length, max_decoder_length
        self.lengths = [piece_length(d, max_encoder_length, max_decoder_length) for d in self.denoisers]
        for d, n in zip(self.denoisers, self.lengths):
            if d.mode != "S" and span_counts(n, d.noise_density, d.mean_span)[1] > len(self.sentinel_ids):
                raise ValueError(
                    f"{d.name} makes up to {span_counts(n, d.noise_density, d.mean_span)[1]} spans in a piece of {n} "
                    f"tokens but there are {len(self.sentinel_ids)} sentinel tokens; add sentinels or shorten the "
                    f"lengths"
                )

    def rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng((self.seed, 0x5512, index))

    def choose(self, index: int) -> int:
        """Which denoiser makes example `index`."""
        return int(self.rng(index).choice(len(self.denoisers), p=self.probabilities))

    def denoise(self, piece: Sequence[int], index: int, which: int | None = None) -> tuple[list[int], list[int], int]:
        """(encoder input, decoder target, denoiser index) of example `index` made from `piece` (by the
        denoiser `choose(index)` draws, unless `which` names one). The same (index, denoiser) always
        corrupts the same way, however the denoiser was named."""
        which = self.choose(index) if which is None else which
        rng = self.rng(index)  # afresh: choose() drew from its own copy of this stream
        denoiser, piece = self.denoisers[which], [int(t) for t in piece]
        assert len(piece) >= 2, "a piece needs at least 2 tokens"
        if denoiser.mode == "S":
            lo, hi = _prefix_bounds(len(piece))
            cut = int(rng.integers(lo, hi + 1))
            inputs, targets = piece[:cut], piece[cut:]
        else:
            mask = random_spans_mask(len(piece), denoiser.noise_density, denoiser.mean_span, rng)
            inputs, targets = corrupt_spans(piece, mask, self.sentinel_ids)
        return [self.mode_ids[denoiser.mode]] + inputs, targets, which


# -- batches ---------------------------------------------------------------------------------
class UL2DataCollator:
    """Packs (encoder input, decoder target) examples into rows of `max_encoder_length` encoder tokens and
    `max_decoder_length` decoder tokens, first fit in arrival order, each example whole in one row. The
    decoder starts from the pad token unless told otherwise (T5's convention; a tierlm encoder-decoder
    built for the run records the same id as its `decoder_start_token_id`, which generation starts from).

    A batch holds `input_ids` / `encoder_segment_ids` / `encoder_positions` (B, E) and
    `decoder_input_ids` / `labels` / `decoder_segment_ids` / `decoder_positions` (B, D). Segment ids number
    the examples of a row from 1 (0 is padding): attention stays inside an example, and cross-attention
    goes from a decoder segment to the encoder segment of the same number. The decoder input of an
    example is `decoder_start_token_id` then its target; its labels are the target then `eos_token_id`.
    `attention_mask` / `decoder_attention_mask` are the segment ids > 0. With `pack=False` each example
    gets its own row.

    >>> collate = UL2DataCollator(max_encoder_length=6, max_decoder_length=5, pad_token_id=0, eos_token_id=2,
    ...     decoder_start_token_id=0)
    >>> batch = collate([([5, 6, 7], [8]), ([9, 10], [11, 12])])
    >>> batch["input_ids"].tolist(), batch["encoder_segment_ids"].tolist()
    ([[5, 6, 7, 9, 10, 0]], [[1, 1, 1, 2, 2, 0]])
    >>> batch["decoder_input_ids"].tolist(), batch["labels"].tolist()
    ([[0, 8, 0, 11, 12]], [[8, 2, 11, 12, 2]])
    """

    def __init__(
        self,
        tokenizer=None,
        max_encoder_length: int = 512,
        max_decoder_length: int = 128,
        *,
        pad_token_id: int | None = None,
        eos_token_id: int | None = None,
        decoder_start_token_id: int | None = None,
        pack: bool = True,
    ):
        hf = getattr(tokenizer, "hf", tokenizer)
        self.pad_id = pad_token_id if pad_token_id is not None else hf.pad_token_id
        self.eos_id = eos_token_id if eos_token_id is not None else hf.eos_token_id
        self.start_id = decoder_start_token_id if decoder_start_token_id is not None else self.pad_id
        assert None not in (self.pad_id, self.eos_id), "the collator needs pad and eos token ids"
        self.max_encoder_length, self.max_decoder_length, self.pack = max_encoder_length, max_decoder_length, pack

    def rows(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[int]]:
        """Which examples share each row (indices into `examples`)."""
        rows: list[list[int]] = []
        room: list[tuple[int, int]] = []
        for i, (inputs, targets) in enumerate(examples):
            need = (len(inputs), len(targets) + 1)
            assert need[0] <= self.max_encoder_length and need[1] <= self.max_decoder_length, (
                f"example {i} needs {need} tokens, more than the row's ({self.max_encoder_length}, "
                f"{self.max_decoder_length})"
            )
            slot = next((r for r, (e, d) in enumerate(room) if self.pack and need[0] <= e and need[1] <= d), None)
            if slot is None:
                rows.append([])
                room.append((self.max_encoder_length, self.max_decoder_length))
                slot = len(rows) - 1
            rows[slot].append(i)
            room[slot] = (room[slot][0] - need[0], room[slot][1] - need[1])
        return rows

    def __call__(self, examples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict[str, torch.Tensor]:
        examples = [(e[0], e[1]) for e in examples]
        layout = self.rows(examples)
        B, E, D = len(layout), self.max_encoder_length, self.max_decoder_length
        out = {
            name: torch.full((B, E), self.pad_id if name == "input_ids" else 0, dtype=torch.long)
            for name in ("input_ids", "encoder_segment_ids", "encoder_positions")
        }
        out.update(
            {
                name: torch.full((B, D), fill, dtype=torch.long)
                for name, fill in (
                    ("decoder_input_ids", self.pad_id),
                    ("labels", IGNORE_INDEX),
                    ("decoder_segment_ids", 0),
                    ("decoder_positions", 0),
                )
            }
        )
        for row, members in enumerate(layout):
            e = d = 0
            for segment, i in enumerate(members, start=1):
                inputs, targets = examples[i]
                n, m = len(inputs), len(targets) + 1
                out["input_ids"][row, e : e + n] = torch.as_tensor(list(inputs))
                out["encoder_segment_ids"][row, e : e + n] = segment
                out["encoder_positions"][row, e : e + n] = torch.arange(n)
                out["decoder_input_ids"][row, d : d + m] = torch.as_tensor([self.start_id, *targets])
                out["labels"][row, d : d + m] = torch.as_tensor([*targets, self.eos_id])
                out["decoder_segment_ids"][row, d : d + m] = segment
                out["decoder_positions"][row, d : d + m] = torch.arange(m)
                e, d = e + n, d + m
        out["attention_mask"] = (out["encoder_segment_ids"] > 0).long()
        out["decoder_attention_mask"] = (out["decoder_segment_ids"] > 0).long()
        return out

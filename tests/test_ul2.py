"""UL2's denoisers (issue 18, first part): statistics over 10k examples against the configured values,
lossless corruption, sentinel order, the mixture's frequencies, the collator's packing against a plain
per-example layout, and the sentinel tokenizer saved and reloaded by transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import REPO
from tierlm.data.ul2 import (
    DEFAULT_DENOISERS,
    DEFAULT_TASK_WEIGHTS,
    UL2DataCollator,
    UL2Denoising,
    corrupt_spans,
    random_spans_mask,
    reconstruct,
)

SENTINELS = list(range(1000, 1100))
MODES = {"R": 990, "X": 991, "S": 992}


def _mixture(enc=512, dec=128, **kw) -> UL2Denoising:
    return UL2Denoising(SENTINELS, MODES, enc, dec, **kw)


PIECES = 2_000


def test_each_denoiser_corrupts_what_it_is_configured_to_within_5_percent():
    """2k full-length pieces per denoiser (seeded by their index: the same every run; the figures' standard errors
    are a fraction of a percent at this count): corrupted fraction and mean span length (R and X), the suffix share
    (S, uniform in [25%, 75%]), and every example within the two lengths."""
    mixture = _mixture()
    for which, denoiser in enumerate(DEFAULT_DENOISERS):
        n = mixture.lengths[which]
        corrupted = spans = targets = 0
        for index in range(PIECES):
            piece = np.arange(n) + 1
            inputs, target, _ = mixture.denoise(piece, index, which)
            assert len(inputs) <= 512 and len(target) + 1 <= 128, (denoiser.name, len(inputs), len(target))
            if denoiser.mode == "S":
                targets += len(target) / n
                continue
            is_sentinel = np.isin(target, SENTINELS)
            corrupted += int((~is_sentinel).sum())
            spans += int(is_sentinel.sum())
        if denoiser.mode == "S":
            assert abs(targets / PIECES - 0.5) < 0.5 * 0.05, denoiser
        else:
            assert abs(corrupted / (PIECES * n) - denoiser.noise_density) <= 0.05 * denoiser.noise_density, denoiser
            assert abs(corrupted / spans - denoiser.mean_span) <= 0.05 * denoiser.mean_span, denoiser


def test_corruption_is_lossless_and_sentinels_come_in_order():
    mixture = _mixture(256, 96)
    rng = np.random.default_rng(0)
    for index in range(2_000):
        which = mixture.choose(index)
        n = int(rng.integers(2, mixture.lengths[which] + 1))  # short pieces too (the end of a document)
        piece = rng.permutation(900)[:n].tolist()  # distinct tokens: "exactly once" is checkable
        inputs, target, which = mixture.denoise(piece, index)
        assert inputs[0] == MODES[DEFAULT_DENOISERS[which].mode]
        assert reconstruct(inputs, target, SENTINELS, MODES[DEFAULT_DENOISERS[which].mode]) == piece
        body = [t for t in inputs[1:] + target if t not in SENTINELS]
        assert sorted(body) == sorted(piece)  # every token exactly once across input and target
        used = [t for t in inputs if t in SENTINELS]
        assert used == SENTINELS[: len(used)] and [t for t in target if t in SENTINELS] == used
    assert mixture.denoise(list(range(50)), 7) == mixture.denoise(
        list(range(50)), 7
    )  # a pure function of (seed, index)


def test_the_spans_are_the_mask_s_runs():
    mask = random_spans_mask(40, 0.3, 4, np.random.default_rng(3))
    inputs, targets = corrupt_spans(list(range(40)), mask, SENTINELS)
    runs = np.split(np.flatnonzero(mask), np.flatnonzero(np.diff(np.flatnonzero(mask)) > 1) + 1)
    expected = [t for k, run in enumerate(runs) for t in [SENTINELS[k], *run.tolist()]]
    assert targets == expected


def test_a_span_can_start_or_end_the_piece():
    """T5's mask always starts clean and ends corrupted (so a lone sentinel meant "the rest of the text");
    here either end is corrupted in some pieces but not in most, and the middle still at the density."""
    masks = np.stack([random_spans_mask(100, 0.15, 3, np.random.default_rng(i)) for i in range(5_000)])
    first, last = masks[:, 0].mean(), masks[:, -1].mean()
    assert 0.02 < first < 0.15 and 0.02 < last < 0.15, (first, last)
    assert abs(masks.mean() - 0.15) < 1e-9 and abs(masks[:, 40:60].mean() - 0.15) < 0.02


def test_the_mixture_follows_the_task_weights():
    mixture = _mixture()
    counts = np.bincount([mixture.choose(i) for i in range(20_000)], minlength=5) / 20_000
    expected = np.asarray(DEFAULT_TASK_WEIGHTS) / sum(DEFAULT_TASK_WEIGHTS)
    assert np.abs(counts - expected).max() < 0.01, counts
    only_s = _mixture(task_weights=[0, 0, 0, 0, 1])
    assert {only_s.choose(i) for i in range(200)} == {4}
    with pytest.raises(AssertionError, match="task weights"):
        _mixture(task_weights=[1, 1])


def test_too_few_sentinels_are_refused():
    with pytest.raises(ValueError, match="sentinel tokens"):
        UL2Denoising(SENTINELS[:3], MODES, 512, 128)


def test_packed_rows_hold_what_one_row_per_example_holds():
    """Each example's tokens, positions and labels in a packed row equal its own unpacked row."""
    mixture = _mixture(128, 48)
    rng = np.random.default_rng(1)
    examples = []
    for i in range(40):
        which = mixture.choose(i)
        inputs, target, _ = mixture.denoise(
            rng.integers(0, 900, int(rng.integers(2, mixture.lengths[which] + 1))).tolist(), i
        )
        examples.append((inputs, target))
    packed = UL2DataCollator(max_encoder_length=128, max_decoder_length=48, pad_token_id=0, eos_token_id=2)(examples)
    single = UL2DataCollator(max_encoder_length=128, max_decoder_length=48, pad_token_id=0, eos_token_id=2, pack=False)(
        examples
    )
    assert packed["input_ids"].shape[0] < len(examples) == single["input_ids"].shape[0]
    seen = 0
    for row in range(packed["input_ids"].shape[0]):
        for segment in range(1, int(packed["encoder_segment_ids"][row].max()) + 1):
            enc, dec = packed["encoder_segment_ids"][row] == segment, packed["decoder_segment_ids"][row] == segment
            match = [
                i
                for i in range(len(examples))
                if torch.equal(
                    single["input_ids"][i][single["attention_mask"][i].bool()], packed["input_ids"][row][enc]
                )
            ]
            assert match, (row, segment)
            i = match[0]
            one = single["decoder_attention_mask"][i].bool()
            for key in ("decoder_input_ids", "labels", "decoder_positions"):
                assert torch.equal(packed[key][row][dec], single[key][i][one]), key
            assert torch.equal(packed["encoder_positions"][row][enc], torch.arange(int(enc.sum())))
            seen += 1
    assert seen == len(examples)
    assert (packed["labels"][packed["decoder_segment_ids"] == 0] == -100).all()


def test_the_sentinel_tokenizer_round_trips_through_transformers(tiny_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    from tierlm.data import load_tokenizer
    from tierlm.data.seq2seq_tokenizer import Qwen3EncoderDecoderTokenizer

    base = load_tokenizer(_saved(tiny_tokenizer, tmp_path / "base"))
    tok = Qwen3EncoderDecoderTokenizer(base, num_sentinel_tokens=100)
    assert len(set(tok.sentinel_ids)) == 100 and tok.vocab_size == len(tiny_tokenizer.hf) + 103
    text = "What is 2 + 3? <extra_id_0> = 5 [S]"
    ids = tok.encode(text)
    assert tok.sentinel_ids[0] in ids and tok.mode_ids["S"] in ids
    tok.save(tmp_path / "ul2")
    hf = AutoTokenizer.from_pretrained(tmp_path / "ul2")
    assert hf(text, add_special_tokens=False)["input_ids"] == ids
    again = Qwen3EncoderDecoderTokenizer.from_pretrained(tmp_path / "ul2", num_sentinel_tokens=100)
    assert (
        again.sentinel_ids == tok.sentinel_ids and again.mode_ids == tok.mode_ids and again.vocab_size == tok.vocab_size
    )


def _saved(tokenizer, folder):
    tokenizer.save(folder)
    return folder


def _ul2_loader(tiny_tokenizer, tmp_path, stream: bool = False, **kw):
    """UL2 batches of 8 kB of Shakespeare in 1.5 kB documents (longer than a piece: cut inside them), read
    from a list, or with `stream` from a 2-shard `IterableDataset` in blocks of 2 rows."""
    from datasets import Dataset

    from tierlm.data import ListExamples
    from tierlm.data.packing import Documents, text_documents
    from tierlm.data.seq2seq_tokenizer import Qwen3EncoderDecoderTokenizer
    from tierlm.data.ul2_loader import create_ul2_dataset

    tok = Qwen3EncoderDecoderTokenizer(load_copy(tiny_tokenizer, tmp_path), num_sentinel_tokens=40)
    text = (REPO / "src/tierlm/data/corpora/tinyshakespeare.txt").read_text()[:8_000]
    chunks = [text[i : i + 1500] for i in range(0, len(text), 1500)]
    docs = Documents(ListExamples(chunks), text_documents(tok))
    lengths = dict(max_encoder_length=96, max_decoder_length=40, batch_size=4)
    if stream:
        rows = Dataset.from_dict({"text": chunks}).to_iterable_dataset(num_shards=2)
        convert = text_documents(tok)
        kw.update(to_documents=lambda batch, first: convert([r["text"] for r in batch]), block_size=2)
        return tok, docs, create_ul2_dataset(rows, tok, **lengths, **kw)
    return tok, docs, create_ul2_dataset(docs, tok, **lengths, **kw)


def load_copy(tokenizer, tmp_path):
    from tierlm.data import load_tokenizer

    tokenizer.save(tmp_path / "copy")
    return load_tokenizer(tmp_path / "copy")


@pytest.mark.parametrize("stream", [False, True], ids=["indexed", "streamed"])
def test_ul2_loader_resumes_exactly(tiny_tokenizer, tmp_path, stream):
    """Batches after load_state_dict (through JSON) equal the uninterrupted run's, at cuts inside the first
    block, across blocks and after an epoch."""
    _, _, straight = _ul2_loader(tiny_tokenizer, tmp_path, stream)
    expected = [straight.next_batch() for _ in range(30)]
    assert straight.epoch >= 1, "the test must cross an epoch"
    for cut in (1, 7, 13, 24):
        _, _, first = _ul2_loader(tiny_tokenizer, tmp_path, stream)
        for _ in range(cut):
            first.next_batch()
        _, _, resumed = _ul2_loader(tiny_tokenizer, tmp_path, stream)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        for want in expected[cut:]:
            got = resumed.next_batch()
            assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("stream", [False, True], ids=["indexed", "streamed"])
def test_one_pass_of_the_ul2_loader_covers_every_token_once(tiny_tokenizer, tmp_path, stream):
    tok, docs, loader = _ul2_loader(tiny_tokenizer, tmp_path, stream, shuffle=stream)  # a stream shuffles within blocks
    loader.repeat = False
    rebuilt = []
    for batch in loader:
        assert batch["input_ids"].shape == (4, 96) and batch["labels"].shape == (4, 40)
        for row in range(4):
            for segment in range(1, int(batch["encoder_segment_ids"][row].max()) + 1):
                inputs = batch["input_ids"][row][batch["encoder_segment_ids"][row] == segment].tolist()
                labels = batch["labels"][row][batch["decoder_segment_ids"][row] == segment].tolist()[:-1]  # without EOS
                rebuilt.extend(reconstruct(inputs, labels, tok.sentinel_ids, inputs[0]))
    from collections import Counter

    original = Counter(t for d in docs.fetch(range(len(docs))) for t in d.ids[1:].tolist())
    assert not Counter(rebuilt) - original  # nothing invented or read twice
    assert sum((original - Counter(rebuilt)).values()) <= len(docs)  # at most a lone last token per document is left

"""Preference pairs for DPO, rendered through the chat template, batched as N chosen rows then N
rejected rows.

Pairs come from any source of the data pipeline (`tierlm.data.sources.open_examples` with kind
"preference"): JSONL, parquet, saved or hub datasets, folders laid out as the Hub serves them, or
`synthetic:arithmetic`. The row forms are TRL's (`tierlm.data.rows.row_to_preference`); optional
"ref_chosen_logp" / "ref_rejected_logp" carry precomputed reference log-probs, and "margin" how much better the
chosen reply is (read by reward models).

A row longer than the loader's `max_len` inputs is cut to its first tokens (`long_conversations="truncate"`, TRL's
`truncation_mode="keep_start"`; a pair whose prompt alone fills the row, no reply token left to score, is dropped
as TRL's DPOTrainer drops it) or dropped (`"drop"`, TRL's RewardTrainer); either is counted.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from tierlm.data.packing import BatchIterable
from tierlm.data.rows import PreferencePair, UnpairedExample
from tierlm.data.tokenizer import Tokenizer
from tierlm.errors import DataError
from tierlm.primitives.losses import IGNORE_INDEX

__all__ = ["PairLoader", "PreferencePair", "UnpairedExample", "UnpairedLoader"]

Row = tuple[list[int], list[int]]
_FILLED = {
    "truncate": " (data.max_seq_length) with a token of its reply: every prompt fills it",
    "drop": " (data.max_seq_length)",
}


def _cut(row: Row, max_len: int) -> Row | None:
    """A rendered (ids, mask) row as its first `max_len` + 1 tokens (`max_len` inputs once shifted), or None when
    none of the tokens it trains on is left.

    >>> _cut(([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]), 3)
    ([1, 2, 3, 4], [0, 0, 1, 1])
    >>> _cut(([1, 2, 3, 4, 5], [0, 0, 0, 1, 1]), 2) is None
    True
    """
    ids, mask = row[0][: max_len + 1], row[1][: max_len + 1]
    return (ids, mask) if any(mask[1:]) else None


def _fit(rows: list[Row], max_len: int, long_conversations: str) -> list[Row] | None:
    """`rows` (a pair's two, or one reply) fitted into `max_len` inputs by the policy; None: the example is dropped."""
    if max(len(ids) for ids, _ in rows) <= max_len + 1:
        return rows
    cut = [_cut(row, max_len) for row in rows] if long_conversations == "truncate" else [None]
    return None if None in cut else cut


def _rows_batch(sequences: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Rendered (ids, mask) rows as shifted `input_ids` / `labels` (-100 off the mask), padded on the right."""
    width = max(len(ids) for ids, _ in sequences) - 1
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), width), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, mask) in enumerate(sequences):
        n = len(ids) - 1
        input_ids[row, :n] = torch.tensor(ids[:-1])
        labels[row, :n] = torch.tensor([t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])])
    return {"input_ids": input_ids, "labels": labels}


class PairLoader(BatchIterable):
    """Batches of `batch_size` pairs, shuffled per epoch, padded to the longest row; resumable; with
    `world_size` > 1, each rank's share of a global batch (pairs are never split across ranks).

    Each row is a whole rendered conversation; labels mark only the final assistant reply (and
    its end-of-turn token). A pair longer than `max_len` tokens is truncated or dropped (`long_conversations`, the
    module's docstring) and counted.
    """

    def __init__(
        self,
        pairs: list[PreferencePair],
        tokenizer: Tokenizer,
        batch_size: int,
        max_len: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        long_conversations: Literal["truncate", "drop"] = "truncate",
    ):
        self.rows, self.dropped, self.truncated = [], 0, 0
        for pair in pairs:
            whole = [tokenizer.render_conversation(c, train_on="last_assistant") for c in (pair.chosen, pair.rejected)]
            rendered = _fit(whole, max_len, long_conversations)
            refs = (pair.ref_chosen_logp, pair.ref_rejected_logp)
            if rendered is None:
                self.dropped += 1
                continue
            if rendered is not whole:
                self.truncated += 1
                if None not in refs:
                    raise DataError(
                        f"a preference pair longer than data.max_seq_length ({max_len} tokens) carries "
                        "ref_chosen_logp / ref_rejected_logp, the log-probs of its whole replies, and would be "
                        "truncated: raise data.max_seq_length, set data.long_conversations=drop, or leave the columns "
                        "out (dpo.reference=precomputed then scores the truncated pairs itself)"
                    )
            self.rows.append((rendered, None if None in refs else refs, pair.margin))
        if not self.rows:
            raise DataError(f"no preference pair fits in {max_len} tokens{_FILLED[long_conversations]}: raise it")
        self._setup(batch_size, tokenizer.pad_id, seed, shuffle, rank, world_size)

    def _setup(
        self, batch_size: int, pad_id: int, seed: int = 0, shuffle: bool = True, rank: int = 0, world_size: int = 1
    ) -> None:
        assert 0 <= rank < world_size, f"rank {rank} not in [0, {world_size})"
        self.batch_size, self.pad_id, self.seed, self.shuffle = batch_size, pad_id, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch, self.cursor, self.repeat = 0, 0, True

    def __len__(self) -> int:
        return len(self.rows)

    def batches_per_pass(self) -> int:
        """Whole global batches in one pass (training skips the tail too short for one)."""
        return len(self.rows) // (self.batch_size * self.world_size)

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's `batch_size` pairs of the next global batch (`batch_size` x `world_size` pairs,
        the same on every rank). Training never wraps a batch across epochs: a tail too short for a
        whole global batch is skipped; a single pass (`repeat=False`) hands it out."""
        step = self.batch_size * self.world_size
        if self.cursor >= len(self.rows) or (self.repeat and self.cursor + step > len(self.rows)):
            if not self.repeat:
                raise StopIteration
            self.epoch, self.cursor = self.epoch + 1, 0
        start = self.cursor + self.rank * self.batch_size
        picked = [self.rows[i] for i in self._order()[start : start + self.batch_size]]
        self.cursor += step
        return self._batch(picked)

    def _batch(self, picked: list) -> dict[str, torch.Tensor]:
        sequences = [r[0][0] for r in picked] + [r[0][1] for r in picked]  # chosen rows, then rejected rows
        batch = _rows_batch(sequences, self.pad_id)
        if all(r[1] is not None for r in picked):
            batch["ref_logps"] = torch.tensor([r[1][0] for r in picked] + [r[1][1] for r in picked])
        if all(r[2] is not None for r in picked):
            batch["margin"] = torch.tensor([float(r[2]) for r in picked])
        return batch

    def rewind(self) -> None:
        self.epoch, self.cursor = 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]

    def passes_read(self) -> float:
        """Whole passes over the examples plus the share of this one handed out."""
        return self.epoch + self.cursor / max(1, len(self.rows))

    def stats(self) -> dict[str, float]:
        return {
            "pairs_dropped": float(self.dropped),
            "pairs_truncated": float(self.truncated),
            "epoch": self.passes_read(),
        }

    def unscored(self) -> list[int]:
        """The pairs whose data gave no reference log-probs (refused when some gave them and others not)."""
        missing = [i for i, row in enumerate(self.rows) if row[1] is None]
        if 0 < len(missing) < len(self.rows):
            raise DataError(
                f"{len(self.rows) - len(missing)} of {len(self.rows)} pairs carry ref_chosen_logp / "
                "ref_rejected_logp: give both for every pair, or for none (dpo.reference=precomputed then scores the "
                "pairs with the starting model before training)"
            )
        return missing

    def pairs(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The batch of the pairs `indices`, in their order (their chosen rows, then their rejected rows)."""
        return self._batch([self.rows[i] for i in indices])

    def set_reference(self, logps: dict[int, tuple[float, float]]) -> None:
        """Pair index -> its (chosen, rejected) reference log-probs, as if the data had carried them."""
        for i, refs in logps.items():
            rendered, _, margin = self.rows[i]
            self.rows[i] = (rendered, refs, margin)


class UnpairedLoader(PairLoader):
    """KTO's batches: `batch_size` unpaired examples (rows 0..N-1, `kto_label` 1 for a desirable reply) then, for
    KL's estimate, N mismatched rows — example i's prompt with example (i - 1) mod N's reply, TRL's KTOTrainer's
    rotation, here within the batch actually trained (TRL rotates dataset chunks before shuffling), so the
    mismatched replies are the batch's own, as the KTO paper asks. Shuffling, sharding over ranks and resuming
    are `PairLoader`'s."""

    def __init__(
        self,
        examples: list[UnpairedExample],
        tokenizer: Tokenizer,
        batch_size: int,
        max_len: int,
        kl_rows: bool = True,
        long_conversations: Literal["truncate", "drop"] = "truncate",
        **kw,
    ):
        """`kl_rows`: the batches carry the mismatched rows (KTO's); False: the replies alone (apo_zero_unpaired)."""
        assert batch_size >= 2 or not kl_rows, "KTO's KL rows pair each prompt with another reply: batch_size >= 2"
        self.tokenizer, self.max_len, self.kl_rows = tokenizer, max_len, kl_rows
        self.rows, self.dropped, self.truncated = [], 0, 0
        for example in examples:
            whole = tokenizer.render_conversation(example.conversation, train_on="last_assistant")
            rendered = _fit([whole], max_len, long_conversations)
            if rendered is None:
                self.dropped += 1
                continue
            self.truncated += rendered[0] is not whole
            self.rows.append((example.conversation, rendered[0], example.label))
        if not self.rows:
            raise DataError(f"no unpaired example fits in {max_len} tokens{_FILLED[long_conversations]}: raise it")
        self._setup(batch_size, tokenizer.pad_id, **kw)

    def _batch(self, picked: list) -> dict[str, torch.Tensor]:
        n = len(picked)
        mismatched = []
        for i, (conversation, _, _) in enumerate(picked if self.kl_rows else []):
            reply = picked[(i - 1) % n][0][-1]
            ids, mask = self.tokenizer.render_conversation(conversation[:-1] + [reply], train_on="last_assistant")
            mismatched.append((ids[: self.max_len + 1], mask[: self.max_len + 1]))
        batch = _rows_batch([r[1] for r in picked] + mismatched, self.pad_id)
        batch["kto_label"] = torch.tensor([float(r[2]) for r in picked])
        return batch

    def stats(self) -> dict[str, float]:
        return {
            "examples_dropped": float(self.dropped),
            "examples_truncated": float(self.truncated),
            "epoch": self.passes_read(),
        }

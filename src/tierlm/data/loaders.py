"""Batch loaders with exact, resumable state.

Both loaders are deterministic functions of (seed, epoch, position): `state_dict()` is that
cursor, so after `load_state_dict()` they yield exactly the batches an uninterrupted run would.
Rows are sharded by rank (row i goes to rank i % world_size).

Batches are dicts of CPU tensors: `tokens` (B, T+1) and, for SFT, `mask` (B, T+1) marking
tokens to train on. Strategies turn them into `input_ids`/`labels`.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch

from tierlm.data.tokenizer import Tokenizer
from tierlm.errors import DataError


class PretrainLoader:
    """Documents joined into one token stream per epoch (shuffled), cut into rows of T+1 tokens.

    Each document starts with the tokenizer's document separator (BOS). Consecutive rows share
    one token, so every token transition in the stream is trained once per epoch.
    """

    def __init__(
        self,
        documents: Sequence[Sequence[int]],
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ):
        assert batch_size > 0, f"batch_size must be > 0, got {batch_size}"
        assert 0 <= rank < world_size, f"rank {rank} not in [0, {world_size})"
        self.documents = [np.asarray(d, dtype=np.int64) for d in documents]
        self.batch_size, self.seq_len, self.seed, self.shuffle = batch_size, seq_len, seed, shuffle
        self.rank, self.world_size = rank, world_size
        total = sum(len(d) for d in self.documents)
        rows_per_rank = max(0, (total - 1) // seq_len) // world_size
        if rows_per_rank < batch_size:
            raise DataError(
                f"dataset has {total} tokens: not one batch of {batch_size} x {seq_len + 1} tokens per rank; "
                "use more data or a smaller batch or sequence length"
            )
        self.batches_per_epoch = rows_per_rank // batch_size
        self.epoch, self.batch_index = 0, 0
        self._stream: np.ndarray | None = None
        self._stream_epoch = -1

    def rewind(self) -> None:
        self.epoch, self.batch_index = 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])

    def _epoch_stream(self) -> np.ndarray:
        if self._stream_epoch != self.epoch:
            order = np.arange(len(self.documents))
            if self.shuffle:
                order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.documents))
            self._stream = np.concatenate([self.documents[i] for i in order])
            self._stream_epoch = self.epoch
        return self._stream

    def next_batch(self) -> dict[str, torch.Tensor]:
        if self.batch_index >= self.batches_per_epoch:
            self.epoch, self.batch_index = self.epoch + 1, 0
        stream, T = self._epoch_stream(), self.seq_len
        first_row = self.batch_index * self.batch_size
        rows = [(first_row + j) * self.world_size + self.rank for j in range(self.batch_size)]
        tokens = np.stack([stream[r * T : r * T + T + 1] for r in rows])
        self.batch_index += 1
        return {"tokens": torch.from_numpy(tokens)}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()


class SFTLoader:
    """Conversations rendered through the chat template with their loss masks, padded per batch.

    Rendering is lazy (only what is consumed) and cached. A conversation longer than
    `max_seq_len + 1` tokens is truncated or dropped (`long_conversations`), and counted.
    """

    def __init__(
        self,
        conversations: Sequence[list[dict]],
        tokenizer: Tokenizer,
        batch_size: int,
        max_seq_len: int,
        seed: int = 0,
        shuffle: bool = True,
        train_on: str = "all_assistant",
        long_conversations: str = "truncate",
        rank: int = 0,
        world_size: int = 1,
    ):
        assert long_conversations in ("truncate", "drop"), f"long_conversations must be truncate|drop, got {long_conversations!r}"
        if len(conversations) // world_size < batch_size:
            raise DataError(f"{len(conversations)} conversations are fewer than one batch of {batch_size} per rank")
        self.conversations, self.tokenizer = conversations, tokenizer
        self.batch_size, self.max_len, self.seed, self.shuffle = batch_size, max_seq_len + 1, seed, shuffle
        self.train_on, self.long_conversations = train_on, long_conversations
        self.rank, self.world_size = rank, world_size
        self.epoch, self.cursor = 0, 0
        self.num_truncated, self.num_dropped = 0, 0
        self._cache: dict[int, tuple[list[int], list[int]]] = {}
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    @property
    def batches_per_epoch(self) -> int:
        return max(1, len(self.conversations) // self.world_size // self.batch_size)

    def rewind(self) -> None:
        self.epoch, self.cursor = 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "num_truncated": self.num_truncated, "num_dropped": self.num_dropped}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.num_truncated, self.num_dropped = int(state["num_truncated"]), int(state["num_dropped"])

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = len(self.conversations)
            order = np.random.default_rng((self.seed, self.epoch)).permutation(n) if self.shuffle else np.arange(n)
            self._order = order[self.rank :: self.world_size]
            self._order_epoch = self.epoch
        return self._order

    def _render(self, index: int) -> tuple[list[int], list[int]]:
        if index not in self._cache:
            self._cache[index] = self.tokenizer.render_conversation(self.conversations[index], self.train_on)
        return self._cache[index]

    def next_batch(self) -> dict[str, torch.Tensor]:
        rows: list[tuple[list[int], list[int]]] = []
        while len(rows) < self.batch_size:
            order = self._epoch_order()
            if self.cursor >= len(order):
                self.epoch, self.cursor = self.epoch + 1, 0
                continue
            ids, mask = self._render(int(order[self.cursor]))
            self.cursor += 1
            if len(ids) > self.max_len:
                if self.long_conversations == "drop":
                    self.num_dropped += 1
                    continue
                self.num_truncated += 1
                ids, mask = ids[: self.max_len], mask[: self.max_len]
            rows.append((ids, mask))
        length = max(len(ids) for ids, _ in rows)
        tokens = torch.full((len(rows), length), self.tokenizer.pad_id, dtype=torch.long)
        masks = torch.zeros((len(rows), length), dtype=torch.long)
        for i, (ids, mask) in enumerate(rows):
            tokens[i, : len(ids)] = torch.tensor(ids)
            masks[i, : len(mask)] = torch.tensor(mask)
        return {"tokens": tokens, "mask": masks}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()


def eval_batches(loader: PretrainLoader | SFTLoader, max_batches: int) -> list[dict[str, torch.Tensor]]:
    """The first `max_batches` batches of one pass from the start: a fixed eval set."""
    loader.rewind()
    return [loader.next_batch() for _ in range(min(max_batches, loader.batches_per_epoch))]

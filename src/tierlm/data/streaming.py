"""Best-fit packing over a stream (`data.streaming`): a dataset read in order, never downloaded or
indexed up front (a hub dataset, or a folder / parquet / JSONL file through `datasets`' streaming
mode), with exact resume.

The stream is read in blocks of `block_size` rows. A block's documents are drawn in an order fixed by
(seed, block number), so shuffling is local to a block (the block is the shuffle buffer) and a pure
function of the seed. Each block is remembered by the stream state where it starts (`datasets`'
`IterableDataset.state_dict()`: shard and row within it), so the loader state is small — the block
being drawn from, the position in its order, the buffered documents as (block, row, offset) — and
`load_state_dict` rebuilds the buffer by re-reading only the blocks it references, then continues the
stream where the uninterrupted run would. (`datasets`' own shuffle buffer cannot do this: it is lost
on resume.)

Under several ranks the loader packs the global batch and each rank trains its rows (`RankSlice`),
so no row is trained twice and a checkpoint resumes at another world size; every rank reads the
stream, which costs tokenizing the global batch's documents on each.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from typing import Any, Callable

import numpy as np

from tierlm.data.packing import Document, PackedLoader, _tail
from tierlm.errors import DataError


def _close_slot(slot: list) -> None:
    if slot[0] is not None:
        slot[0][1].close()
        slot[0] = None


class StreamBlocks:
    """Reading an `IterableDataset` of rows in blocks of `block_size` rows, each block's documents drawn in
    an order fixed by (seed, block) and remembered by the stream state where it starts.

    `to_documents(rows, first_index)` turns a block of rows (the first at stream row `first_index`)
    into `Document`s. Subclasses keep `block`, `after` (the stream state after the current block; None at
    the start of an epoch), `epoch`, `epoch_docs` and `repeat`.
    """

    def _init_stream(
        self, dataset: Any, to_documents: Callable[[list[dict], int], list[Document]], block_size: int, name: str
    ) -> None:
        assert block_size > 0, f"block_size must be > 0, got {block_size}"
        self.dataset, self.to_documents, self.block_size, self.name = dataset, to_documents, block_size, name

    def passes_read(self) -> float:
        """Whole passes over the stream so far (its length is not known until it ends)."""
        return float(self.epoch)

    def _rewind_stream(self) -> None:
        self.block = -1  # the block being drawn from
        self.after: dict | None = None  # stream state after the current block (None: start of an epoch)
        self.epoch_docs = 0  # documents read in this epoch (an empty stream must not loop forever)
        if not hasattr(self, "_live_slot"):
            self._live_slot: list = [None]  # (dataset copy, iterator) being read; closed at exit at the latest
            weakref.finalize(self, _close_slot, self._live_slot)
        self._set_live(None)

    def _open(self, state: dict | None):
        """An iterator over the stream from `state` (None: its beginning), and the dataset copy it reads."""
        dataset = copy.deepcopy(self.dataset)  # its own copy: state_dict() follows the latest iterator
        if state is not None:
            dataset.load_state_dict(state)
        return dataset, iter(dataset)

    def _read(self, block: int, reader) -> tuple[list[Document], dict]:
        """Block `block`'s documents from `reader` (a dataset copy and its iterator), and the stream state after it."""
        dataset, rows_iter = reader
        rows = list(itertools.islice(rows_iter, self.block_size))
        return (self.to_documents(rows, block * self.block_size) if rows else []), dataset.state_dict()

    def _reread(self, block: int, start: dict | None) -> list[Document]:
        """Block `block` again, from the stream state where it starts."""
        reader = self._open(start)
        try:
            return self._read(block, reader)[0]
        finally:
            reader[1].close()

    def _read_next_block(
        self, at_epoch_end: Callable[[], None] = lambda: None
    ) -> tuple[list[Document], dict | None] | None:
        """The next block's documents and the stream state where it starts (a new epoch at the stream's
        end, after `at_epoch_end()`); None at the end of a single pass."""
        while True:
            if self._live is None:
                self._set_live(self._open(self.after))
            documents, after = self._read(self.block + 1, self._live)
            if documents:
                break
            if not self.repeat:
                return None
            if self.epoch_docs == 0:
                raise DataError(f"{self.name}: the stream holds no examples")
            at_epoch_end()
            self.epoch, self.epoch_docs, self.after = self.epoch + 1, 0, None
            self._set_live(None)
        self.block += 1
        start, self.after = self.after, after
        self.epoch_docs += len(documents)
        return documents, start

    def _set_live(self, live) -> None:
        """Replace the stream being read, closing the old one (an open reader left to interpreter exit
        prints tracebacks from datasets' file generators)."""
        if self._live_slot[0] is not None:
            self._live_slot[0][1].close()
        self._live_slot[0] = live

    @property
    def _live(self):
        return self._live_slot[0]

    def close(self) -> None:
        self._set_live(None)

    def _order_of(self, block: int, n: int) -> np.ndarray:
        return np.random.default_rng((self.seed, block)).permutation(n) if self.shuffle else np.arange(n)


class StreamingLoader(StreamBlocks, PackedLoader):
    """A `PackedLoader` whose documents come from a stream (`StreamBlocks`); `block_size` rows are read,
    tokenized and shuffled at a time."""

    def __init__(
        self,
        dataset: Any,
        to_documents: Callable[[list[dict], int], list[Document]],
        batch_size: int,
        seq_len: int,
        *,
        block_size: int = 1000,
        name: str = "stream",
        **packing,
    ):
        self._init_stream(dataset, to_documents, block_size, name)
        super().__init__(None, batch_size, seq_len, **packing)

    @property
    def resident_documents(self) -> int:
        return self.block_size + self.buffer_docs

    def _referenced_blocks(self) -> set[int]:
        """The blocks the buffer's documents come from, and the one being drawn from."""
        return {b for b, _ in self.buffer_ids} | {self.block}

    # -- state -----------------------------------------------------------------------------
    def rewind(self) -> None:
        super().rewind()
        self._rewind_stream()
        self.block_starts: dict[int, dict | None] = {}  # block -> stream state where it starts (None: the beginning)
        self.block_docs: dict[int, list[Document]] = {}  # the current block's and buffered documents' blocks
        self.block_order = np.zeros(0, dtype=np.int64)

    def state_dict(self) -> dict:
        referenced = self._referenced_blocks()
        return {
            "epoch": self.epoch,
            "block": self.block,
            "cursor": self.cursor,
            "after": self.after,
            "epoch_docs": self.epoch_docs,
            "block_starts": {str(b): s for b, s in self.block_starts.items() if b in referenced},
            "buffer": [list(i) for i in self.buffer_ids],
            "offsets": list(self.buffer_offsets),
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: dict) -> None:
        self.rewind()
        self.epoch, self.block, self.cursor = int(state["epoch"]), int(state["block"]), int(state["cursor"])
        self.after, self.epoch_docs = state["after"], int(state["epoch_docs"])
        self.counts = {k: int(v) for k, v in state["counts"].items()}
        self.block_starts = {int(b): s for b, s in state["block_starts"].items()}
        for block, start in self.block_starts.items():  # re-read exactly the blocks still referenced
            self.block_docs[block] = self._reread(block, start)
        if self.block >= 0:
            self.block_order = self._order_of(self.block, len(self.block_docs[self.block]))
        self.buffer_ids = [(int(b), int(i)) for b, i in state["buffer"]]
        self.buffer_offsets = [int(o) for o in state["offsets"]]
        self.buffer = [
            _tail(self._admit(self.block_docs[b][i], count=False), offset)
            for (b, i), offset in zip(self.buffer_ids, self.buffer_offsets)
        ]
        self.buffer_lengths = [len(doc.ids) for doc in self.buffer]

    # -- filling the buffer ----------------------------------------------------------------
    def _next_block(self) -> bool:
        """Move on to the next block of the stream (a new epoch at its end); False at the end of a single pass."""
        read = self._read_next_block(self._check_something_kept)
        if read is None:
            return False
        documents, self.block_starts[self.block] = read
        self.block_docs[self.block] = documents
        self.block_order, self.cursor = self._order_of(self.block, len(documents)), 0
        live = self._referenced_blocks()
        for block in [b for b in self.block_docs if b not in live]:  # keep only what the buffer still needs
            del self.block_docs[block], self.block_starts[block]
        return True

    def _refill(self) -> None:
        while len(self.buffer) < self.buffer_docs:
            if self.cursor >= len(self.block_order):
                if not self._next_block():
                    return
                continue
            row = int(self.block_order[self.cursor])
            self.cursor += 1
            self._push((self.block, row), self.block_docs[self.block][row])

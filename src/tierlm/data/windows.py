"""Windows over token streams and batches made ahead: memory-mapped token shards read as one array
(`ConcatTokens`), fixed windows of a stream as documents (`StreamWindows`), a rank's share of each batch
(`RankSlice`), the fixed held-out batches a run scores (`eval_batches`, `eval_protocol`), and batches built on a
background thread with the state that resumes them exactly (`Prefetcher`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from tierlm.data.packing import Document, PackedLoader
from tierlm.errors import DataError


class ConcatTokens:
    """Token arrays (memory-mapped shards) read as one, without copying: `len`, and slices — a short slice (a
    window) is read out as an array, a long one is a view of the same shards.

    >>> stream = ConcatTokens([np.arange(5), np.arange(5, 12)])
    >>> len(stream), stream[3:8].tolist(), len(stream[2:]), stream[2:][8:10].tolist()
    (12, [3, 4, 5, 6, 7], 10, [10, 11])
    """

    VIEW_AT = 1 << 20  # slices this long or longer stay views

    def __init__(self, parts: list[np.ndarray], start: int = 0, stop: int | None = None):
        self.parts, self.ends = parts, np.cumsum([len(p) for p in parts])
        self.start, self.stop = start, int(self.ends[-1]) if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: slice) -> np.ndarray | ConcatTokens:
        assert isinstance(index, slice) and index.step in (None, 1), "token streams are read by contiguous slices"
        lo, hi, _ = index.indices(len(self))
        lo, hi = self.start + lo, self.start + max(hi, lo)
        if hi - lo >= self.VIEW_AT:
            return ConcatTokens(self.parts, lo, hi)
        pieces, first = [], int(np.searchsorted(self.ends, lo, side="right"))
        for i in range(first, len(self.parts)):
            begin = int(self.ends[i - 1]) if i else 0
            if begin >= hi:
                break
            pieces.append(np.asarray(self.parts[i][max(lo - begin, 0) : hi - begin]))
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


class StreamWindows:
    """A token stream cut into consecutive windows of `window` tokens that overlap by one, so every
    token after the first is a target exactly once: how a plain GPT-2 script reads a text file (no
    documents, no separator per paragraph). Each window is one `Document`; a loader over them fills
    each row with exactly one window, shuffled per epoch and resumable like any other source.

    >>> windows = StreamWindows(np.arange(10), window=4)
    >>> len(windows), [d.ids.tolist() for d in windows.fetch([0, 2])]
    (3, [[0, 1, 2, 3], [6, 7, 8, 9]])
    """

    def __init__(self, tokens: np.ndarray | ConcatTokens, window: int):
        assert window >= 2, f"a window needs at least 2 tokens, got {window}"
        self.tokens, self.window = tokens, window
        self.count = (len(tokens) - 1) // (window - 1)
        if self.count < 1:
            raise DataError(
                f"the stream holds {len(tokens)} tokens: fewer than one row of {window}; lower data.max_seq_length"
            )

    def __len__(self) -> int:
        return self.count

    def fetch(self, indices: Sequence[int]) -> list[Document]:
        step = self.window - 1
        return [
            Document(np.asarray(self.tokens[int(i) * step : int(i) * step + self.window], dtype=np.int64))
            for i in indices
        ]


class RankSlice:
    """Rank `rank`'s rows of every global batch: the loader packs `world_size` x B rows, identically
    on every rank, and each rank trains on its own B.

    The data order and the loader state then depend only on the global batch, not on how many
    ranks share it: 2 ranks x 8 rows see the batches 1 process x 16 rows sees, and a checkpoint
    resumes exactly at another world size with the same global batch.

    >>> class Rows:
    ...     def next_batch(self): return {"tokens": torch.arange(8).view(4, 2)}
    >>> RankSlice(Rows(), rank=1, world_size=2).next_batch()["tokens"].tolist()
    [[4, 5], [6, 7]]
    """

    def __init__(self, loader, rank: int, world_size: int):
        assert 0 <= rank < world_size, f"rank {rank} not in [0, {world_size})"
        self.loader, self.rank, self.world_size = loader, rank, world_size

    def next_batch(self) -> dict[str, torch.Tensor]:
        batch = self.loader.next_batch()
        rows = next(iter(batch.values())).shape[0]
        assert rows % self.world_size == 0, f"a global batch of {rows} rows does not split into {self.world_size} ranks"
        per_rank = rows // self.world_size
        return {k: v[self.rank * per_rank : (self.rank + 1) * per_rank] for k, v in batch.items()}

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def stats(self) -> dict[str, float]:
        return self.loader.stats()


def eval_batches(loader: PackedLoader, max_batches: int | None) -> list[dict[str, torch.Tensor]]:
    """Up to `max_batches` batches of one unshuffled pass from the start (None: the whole pass): a fixed eval set.
    Any other iterable of batches (a list) gives its first `max_batches`."""
    if not hasattr(loader, "rewind"):
        return list(loader)[:max_batches]
    loader.rewind()
    loader.repeat = False
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == max_batches:
            break
    return batches


def eval_protocol(loader: PackedLoader, batches: list[dict[str, torch.Tensor]]) -> str:
    """What a validation loss over `batches` (`eval_batches` of `loader`) scores, in words: the protocol a reader
    needs to compare it with another library's figure.

    >>> stream = PackedLoader(StreamWindows(np.arange(43), 5), 4, 4, shuffle=False)
    >>> eval_protocol(stream, eval_batches(stream, None))
    'every held-out token once: the 40 targets of the token stream held out, in 10 windows of 4 (2 left over)'
    >>> eval_protocol(stream, eval_batches(stream, 1))
    'the first 16 of the 42 targets of the token stream held out (windows of 4; training.eval_batches=all: all)'
    """
    scored = int(sum(int(b["mask"][:, 1:].sum()) for b in batches))
    windows = loader.documents
    if isinstance(windows, StreamWindows):
        targets, width = len(windows.tokens) - 1, windows.window - 1
        if scored == len(windows) * width:
            return (
                f"every held-out token once: the {scored:,} targets of the token stream held out, in {len(windows):,} "
                f"windows of {width} ({targets - scored} left over)"
            )
        return (
            f"the first {scored:,} of the {targets:,} targets of the token stream held out (windows of {width}; "
            "training.eval_batches=all: all)"
        )
    batch_word = "batch" if len(batches) == 1 else "batches"
    return f"{scored:,} tokens in {len(batches)} {batch_word} of rows packed from held-out documents"


class Prefetcher:
    """Builds the next batches on a background thread while the model trains on the current one.

    Each queued batch carries the loader state taken right after it was made, so `state_dict()`
    describes exactly the batches handed out: resuming from it never skips or repeats one.
    The queue is bounded (`depth` batches), and an error in the thread is raised in the caller.
    """

    def __init__(self, loader: PackedLoader, depth: int = 4):
        import queue
        import threading

        assert depth > 0, f"depth must be > 0, got {depth}"
        self.loader, self._state, self._stats = loader, loader.state_dict(), loader.stats()
        self._queue: "queue.Queue" = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierlm-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self.loader.next_batch()
                self._put((batch, self.loader.state_dict(), self.loader.stats()))
        except BaseException as error:  # handed to the consumer, never lost in the thread
            self._put(error)

    def _put(self, item) -> None:
        import queue

        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next_batch(self) -> dict[str, torch.Tensor]:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        batch, self._state, self._stats = item
        return batch

    def state_dict(self) -> dict:
        return self._state

    def stats(self) -> dict[str, float]:
        return self._stats

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

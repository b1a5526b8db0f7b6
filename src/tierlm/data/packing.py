"""Best-fit packing of documents into rows, with exact resumable state.

A row holds `seq_len + 1` tokens (inputs are the first `seq_len`, labels the last `seq_len`).
Every row starts with the oldest document in the buffer, so no document waits longer than the
buffer takes to turn over (plain best-fit, which always takes the largest document first, keeps
short documents waiting and so trains on a length-biased sample until the epoch ends). The rest
of the row is filled best-fit: the largest buffered document that still fits goes in next. When
nothing fits:

- pretraining ("crop"): the shortest buffered document is cropped to fill the row exactly, and
  the cropped-off tokens are counted (nanochat's BOS-aligned best-fit); with `split_long` nothing
  is cropped: a document longer than the room fills it and its rest opens the next row, so every
  token of a small corpus (a text file of long paragraphs) is trained on once per epoch;
- SFT ("pad"): the rest of the row is padding, so no token of a conversation is ever dropped.

With `document_positions`, each row carries `position_ids` that restart at every document; the
model then keeps attention inside documents, so a packed row computes what its documents would
alone. The loader is a pure function of (seed, epoch, cursor, buffer): `state_dict()` holds those,
and after `load_state_dict()` it yields exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from tierlm.data.sources import Examples
from tierlm.data.tokenizer import Tokenizer
from tierlm.errors import DataError


@dataclass
class Document:
    ids: np.ndarray  # (L,) int64
    mask: np.ndarray | None = None  # (L,) uint8, 1 = train on this token; None = every token


class Documents:
    """Examples turned into `Document`s on demand (tokenised or rendered when fetched)."""

    def __init__(self, examples: Examples, to_documents: Callable[[list], list[Document]]):
        self.examples, self.to_documents = examples, to_documents

    def __len__(self) -> int:
        return len(self.examples)

    def fetch(self, indices: Sequence[int]) -> list[Document]:
        return self.to_documents(self.examples.fetch(indices)) if len(indices) else []


def text_documents(tokenizer: Tokenizer | None) -> Callable[[list], list[Document]]:
    """Pretraining: each text gets the document separator (BOS) in front; token arrays pass through.

    (Token files already hold their separators, so they need no tokenizer here.)
    """

    def convert(items: list) -> list[Document]:
        texts = [x for x in items if isinstance(x, str)]
        if not texts:
            return [Document(np.asarray(x, dtype=np.int64)) for x in items]
        assert tokenizer is not None, "text documents need a tokenizer"
        sep, encoded = tokenizer.document_separator_id, iter(tokenizer.encode_batch(texts))
        return [
            Document(
                np.asarray([sep] + next(encoded), dtype=np.int64)
                if isinstance(x, str)
                else np.asarray(x, dtype=np.int64)
            )
            for x in items
        ]

    return convert


def chat_documents(tokenizer: Tokenizer, train_on: str = "all_assistant") -> Callable[[list], list[Document]]:
    """SFT: each conversation rendered through the chat template, with its loss mask."""

    def convert(conversations: list) -> list[Document]:
        out = []
        for conversation in conversations:
            ids, mask = tokenizer.render_conversation(conversation, train_on)
            out.append(Document(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)))
        return out

    return convert


class Mixture:
    """Several document sources in one: `weight` passes over each per mixture epoch.

    A weight of 2 repeats a source twice; 0.5 takes a random half of it (fixed by the seed). The
    combined index is then shuffled by the loader like any other source (nanochat's TaskMixture).

    >>> from tierlm.data.sources import ListExamples
    >>> mix = Mixture([(ListExamples(list("ab")), 2.0), (ListExamples(list("xyz")), 1.0)], seed=0)
    >>> len(mix), sorted(mix.fetch(range(len(mix))))
    (7, ['a', 'a', 'b', 'b', 'x', 'y', 'z'])
    """

    def __init__(self, components: list[tuple[Documents, float]], seed: int = 0):
        assert components, "a mixture needs at least one component"
        rng = np.random.default_rng((seed, 7919))
        pairs = []
        for c, (source, weight) in enumerate(components):
            if weight <= 0:
                raise DataError(f"mixture weight of component {c} must be > 0, got {weight}")
            n, whole = len(source), int(weight)
            local = [np.arange(n)] * whole
            extra = round((weight - whole) * n)
            if extra:
                local.append(np.sort(rng.choice(n, size=extra, replace=False)))
            idx = np.concatenate(local) if local else np.zeros(0, dtype=np.int64)
            pairs.append(np.stack([np.full(len(idx), c), idx], axis=1))
        self.components = [source for source, _ in components]
        self.index = np.concatenate(pairs).astype(np.int64)  # (N, 2): component, index within it

    def __len__(self) -> int:
        return len(self.index)

    def fetch(self, indices: Sequence[int]) -> list:
        chosen = self.index[np.asarray(list(indices), dtype=np.int64)]
        out: list = [None] * len(chosen)
        for c in np.unique(chosen[:, 0]):
            positions = np.flatnonzero(chosen[:, 0] == c)
            for p, doc in zip(positions, self.components[c].fetch([int(i) for i in chosen[positions, 1]])):
                out[p] = doc
        return out


def _tail(doc: Document, offset: int) -> Document:
    """The document from token `offset` on (a split document's continuation)."""
    if offset == 0:
        return doc
    return Document(doc.ids[offset:], None if doc.mask is None else doc.mask[offset:])


class BatchIterable:
    """`for batch in loader`: `next_batch()` until it raises StopIteration (the end of a single pass)."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            try:
                yield self.next_batch()
            except StopIteration:
                return


class PackedLoader(BatchIterable):
    """Batches of best-fit packed rows: `tokens` (B, T+1), `mask` (B, T+1), optional `position_ids` (B, T+1)."""

    def __init__(
        self,
        documents: Documents | Mixture,
        batch_size: int,
        seq_len: int,
        *,
        mode: str = "crop",
        pad_id: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        buffer_docs: int = 1000,
        long_documents: str = "truncate",
        document_positions: bool = False,
        split_long: bool = False,
    ):
        assert mode in ("crop", "pad"), f"mode must be 'crop' or 'pad', got {mode!r}"
        assert long_documents in ("truncate", "drop"), f"long_documents must be truncate|drop, got {long_documents!r}"
        assert batch_size > 0 and seq_len > 0, f"batch_size and seq_len must be > 0, got {batch_size}, {seq_len}"
        assert 0 <= rank < world_size, f"rank {rank} not in [0, {world_size})"
        if documents is not None and len(documents) < world_size:  # None: a stream (tierlm.data.streaming)
            raise DataError(f"{len(documents)} documents cannot be shared by {world_size} ranks")
        self.documents, self.batch_size, self.row_len = documents, batch_size, seq_len + 1
        self.mode, self.pad_id, self.seed, self.shuffle = mode, pad_id, seed, shuffle
        self.rank, self.world_size, self.buffer_docs = rank, world_size, buffer_docs
        self.long_documents, self.document_positions = long_documents, document_positions
        assert not split_long or mode == "crop", "split_long is a pretraining (crop mode) option"
        self.split_long = (
            split_long  # crop mode: a document longer than the room goes on in the next row instead of being cut
        )
        self.repeat = True  # False: one pass, then stop (evaluation)
        self.rewind()

    @property
    def resident_documents(self) -> int:
        """Documents the loader indexes in memory (what the memory planner counts)."""
        return len(self.documents)

    # -- state -----------------------------------------------------------------------------
    def rewind(self) -> None:
        self.epoch, self.cursor = 0, 0
        self.buffer_ids: list[int] = []
        self.buffer_offsets: list[int] = []  # where each buffered document resumes (split_long continuations)
        self.buffer: list[Document] = []
        self.buffer_lengths: list[int] = []  # len(doc.ids) of each buffered document, for the best-fit search
        self.counts = {
            "tokens_in": 0,
            "tokens_cropped": 0,
            "tokens_placed": 0,
            "tokens_padding": 0,
            "truncated": 0,
            "dropped": 0,
        }
        self._order_epoch = -1

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "buffer": list(self.buffer_ids),
            "offsets": list(self.buffer_offsets),
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.counts = {k: int(v) for k, v in state["counts"].items()}
        self.buffer_ids = [int(i) for i in state["buffer"]]
        self.buffer_offsets = [int(o) for o in state.get("offsets", [0] * len(self.buffer_ids))]
        docs = [self._admit(doc, count=False) for doc in self.documents.fetch(self.buffer_ids)]
        self.buffer = [_tail(doc, offset) for doc, offset in zip(docs, self.buffer_offsets)]
        self.buffer_lengths = [len(doc.ids) for doc in self.buffer]

    def batches_per_pass(self) -> int:
        """Whole batches in one pass over the documents (the first epoch's order), counted by packing it once on a
        copy of this loader (its own position is untouched)."""
        assert self.documents is not None, "a stream has no length to count"
        counter = copy.copy(self)
        counter.rewind()
        counter.repeat, whole = False, 0
        while True:
            try:
                whole += len(counter.next_batch()["tokens"]) == self.batch_size
            except StopIteration:
                return whole

    def passes_read(self) -> float:
        """The passes over this rank's documents so far: whole epochs plus the share of this one packed into
        batches (read, less what waits in the buffer; at most one epoch's worth waits). What `epoch` in the logs
        and the trainer state says."""
        shard = max(1, len(range(self.rank, len(self.documents), self.world_size)))
        return self.epoch + (self.cursor - len(self.buffer)) / shard

    def stats(self) -> dict[str, float]:
        """Data metrics for the logs: cropped share (pretraining), padding share, long conversations, passes."""
        c = self.counts
        out = {"data_truncated": c["truncated"], "data_dropped": c["dropped"], "epoch": self.passes_read()}
        if self.mode == "crop":
            out["data_cropped_frac"] = c["tokens_cropped"] / max(1, c["tokens_in"])
        else:
            out["data_fill"] = c["tokens_placed"] / max(1, c["tokens_placed"] + c["tokens_padding"])
        return out

    # -- filling the buffer ----------------------------------------------------------------
    def _order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = len(self.documents)
            order = np.random.default_rng((self.seed, self.epoch)).permutation(n) if self.shuffle else np.arange(n)
            self._epoch_order, self._order_epoch = order[self.rank :: self.world_size], self.epoch
        return self._epoch_order

    def _check_something_kept(self) -> None:
        """At the end of a pass: if every document was dropped, no batch can ever be made."""
        if self.counts["tokens_in"] == 0 and self.counts["dropped"]:
            raise DataError(
                f"all {self.counts['dropped']} documents are longer than a row ({self.row_len} tokens) and "
                "data.long_conversations=drop drops them; raise data.max_seq_length or use truncate"
            )

    def _admit(self, doc: Document, count: bool = True) -> Document | None:
        """Apply the long-document policy (SFT rows never crop, so a too-long one is cut or dropped here)."""
        if self.mode == "pad" and len(doc.ids) > self.row_len:
            if self.long_documents == "drop":
                self.counts["dropped"] += count
                return None
            self.counts["truncated"] += count
            doc = Document(doc.ids[: self.row_len], None if doc.mask is None else doc.mask[: self.row_len])
        return doc

    def _refill(self) -> None:
        # At most one epoch's worth is buffered, so a small dataset never has a document twice in a row.
        target = min(self.buffer_docs, len(self._order()))
        while len(self.buffer) < target:
            order = self._order()
            if self.cursor >= len(order):
                self._check_something_kept()
                if not self.repeat:
                    return
                self.epoch, self.cursor = self.epoch + 1, 0
                continue
            take = [int(i) for i in order[self.cursor : self.cursor + target - len(self.buffer)]]
            self.cursor += len(take)
            for index, doc in zip(take, self.documents.fetch(take)):
                self._push(index, doc)

    def _push(self, key, doc: Document) -> None:
        """Admit a newly read document (`key`: where to read it again on resume) at the buffer's end."""
        doc = self._admit(doc)
        if doc is not None:
            self.counts["tokens_in"] += len(doc.ids)
            self.buffer_ids.append(key)
            self.buffer_offsets.append(0)
            self.buffer.append(doc)
            self.buffer_lengths.append(len(doc.ids))

    # -- rows and batches ------------------------------------------------------------------
    def _take(self, j: int, room: int) -> Document:
        """Buffered document j, to be placed in `room` tokens. Longer than the room: with split_long its
        rest goes back to the front of the buffer (it opens the next row); otherwise the rest is cropped."""
        index, offset = self.buffer_ids.pop(j), self.buffer_offsets.pop(j)
        self.buffer_lengths.pop(j)
        doc = self.buffer.pop(j)
        if len(doc.ids) > room:
            if self.split_long:
                self.buffer_ids.insert(0, index)
                self.buffer_offsets.insert(0, offset + room)
                self.buffer_lengths.insert(0, len(doc.ids) - room)
                self.buffer.insert(0, _tail(doc, room))
            else:
                self.counts["tokens_cropped"] += len(doc.ids) - room
        return doc

    def _next_row(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        tokens = np.full(self.row_len, self.pad_id, dtype=np.int64)
        mask = np.zeros(self.row_len, dtype=np.uint8)
        positions = np.zeros(self.row_len, dtype=np.int64)
        filled = 0
        while filled < self.row_len:
            self._refill()
            if not self.buffer:
                break
            room = self.row_len - filled
            lengths = np.asarray(self.buffer_lengths, dtype=np.int64)
            fits = np.flatnonzero(lengths <= room)
            if filled == 0:  # the oldest document opens the row (cropped or split if longer than a row)
                doc = self._take(0, room)
            elif len(fits):
                doc = self._take(int(fits[np.argmax(lengths[fits])]), room)
            elif self.mode == "pad":
                break
            else:  # nothing fits: the shortest document fills the row exactly (cropped, or split)
                doc = self._take(int(np.argmin(lengths)), room)
            n = min(len(doc.ids), room)
            tokens[filled : filled + n] = doc.ids[:n]
            mask[filled : filled + n] = 1 if doc.mask is None else doc.mask[:n]
            positions[filled : filled + n] = np.arange(n)
            filled += n
        if filled == 0 or (self.mode == "crop" and filled < self.row_len):
            return None  # end of a single pass (a crop-mode row is never padded)
        positions[filled:] = np.arange(self.row_len - filled)  # padding is its own "document"
        self.counts["tokens_placed"] += filled
        self.counts["tokens_padding"] += self.row_len - filled
        return tokens, mask, positions

    def next_batch(self) -> dict[str, torch.Tensor]:
        rows = []
        while len(rows) < self.batch_size:
            row = self._next_row()
            if row is None:
                break
            rows.append(row)
        if not rows:
            raise StopIteration
        tokens, mask, positions = (torch.from_numpy(np.stack(column)) for column in zip(*rows))
        batch = {"tokens": tokens, "mask": mask}
        if self.document_positions:
            batch["position_ids"] = positions
        return batch

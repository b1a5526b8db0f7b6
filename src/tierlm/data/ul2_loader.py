"""`create_ul2_dataset`: UL2 examples cut from any text source of the data pipeline, batched by the
packing `UL2DataCollator`, with exact resume.

Documents are read in an order shuffled per epoch (as `PackedLoader` reads them); example `i` is the next
piece of the current document, as long as the denoiser drawn for `i` takes (`UL2Denoising.lengths`), so
the text is cut where the example needs it and no token is read twice in an epoch. A batch is
`batch_size` rows filled first fit; the example that no longer fits waits for the next batch. The state
is the position of the first example not yet handed out — (epoch, document cursor, token offset,
example index) — and the same position gives the same examples, so a resumed run sees exactly the
batches an uninterrupted one would.

`StreamingUL2Loader` does the same over a stream (`data.streaming`): documents are drawn block by block
(`tierlm.data.streaming.StreamBlocks`), and the position adds the block and the stream state where it
starts, so a resume re-reads that one block.
"""

from __future__ import annotations

import numpy as np
import torch

from tierlm.data.packing import BatchIterable, Documents
from tierlm.data.streaming import StreamBlocks
from tierlm.data.ul2 import UL2DataCollator, UL2Denoising
from tierlm.errors import DataError


class UL2Loader(BatchIterable):
    """Batches of packed UL2 examples (`UL2DataCollator`'s keys) from `documents`."""

    def __init__(
        self,
        documents: Documents,
        mixture: UL2Denoising,
        collator: UL2DataCollator,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        skip_first: int = 1,
    ):
        assert batch_size > 0, f"batch_size must be > 0, got {batch_size}"
        if documents is not None and len(documents) == 0:  # None: a stream (StreamingUL2Loader)
            raise DataError("the UL2 source holds no documents")
        self.documents, self.mixture, self.collator, self.batch_size = documents, mixture, collator, batch_size
        self.seed, self.shuffle, self.skip_first = (
            seed,
            shuffle,
            skip_first,
        )  # skip_first: the separator (BOS) each text opens with
        self.repeat = True
        self.rewind()

    @property
    def resident_documents(self) -> int:
        return len(self.documents)

    def rewind(self) -> None:
        self.epoch, self.cursor, self.offset, self.index = 0, 0, 0, 0
        self._doc: tuple[int, int, np.ndarray] | None = None  # (epoch, cursor, ids) of the document being cut

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "offset": self.offset, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.rewind()
        self.epoch, self.cursor, self.offset, self.index = (
            int(state[k]) for k in ("epoch", "cursor", "offset", "index")
        )

    def passes_read(self) -> float:
        """Whole passes over the documents plus the share of this one cut into examples."""
        return self.epoch + self.cursor / max(1, len(self.documents))

    def stats(self) -> dict[str, float]:
        return {"ul2_examples": float(self.index), "epoch": self.passes_read()}

    # -- reading -----------------------------------------------------------------------------
    def _order(self) -> np.ndarray:
        n = len(self.documents)
        return np.random.default_rng((self.seed, self.epoch)).permutation(n) if self.shuffle else np.arange(n)

    def _document(self) -> np.ndarray | None:
        """The current document's tokens (None at the end of a single pass)."""
        while True:
            if self._doc is not None and self._doc[:2] == (self.epoch, self.cursor):
                ids = self._doc[2]
            elif self.cursor < len(self.documents):
                ids = self.documents.fetch([int(self._order()[self.cursor])])[0].ids[self.skip_first :]
                self._doc = (self.epoch, self.cursor, ids)
            else:
                if not self.repeat:
                    return None
                self.epoch, self.cursor, self.offset = self.epoch + 1, 0, 0
                continue
            if len(ids) - self.offset >= 2:
                return ids
            self.cursor, self.offset = self.cursor + 1, 0  # what is left (< 2 tokens) cannot make an example

    def _peek(self) -> tuple[list[int], list[int], int] | None:
        """The next example (encoder input, decoder target, tokens it takes), without moving on."""
        ids = self._document()
        if ids is None:
            return None
        which = self.mixture.choose(self.index)
        piece = ids[self.offset : self.offset + self.mixture.lengths[which]]
        inputs, targets, _ = self.mixture.denoise(piece, self.index, which)
        return inputs, targets, len(piece)

    def next_batch(self) -> dict[str, torch.Tensor]:
        examples: list[tuple[list[int], list[int]]] = []
        while True:
            example = self._peek()
            if example is None:
                break
            candidate = examples + [example[:2]]
            if examples and len(self.collator.rows(candidate)) > self.batch_size:
                break  # the batch is full: this example opens the next one
            examples = candidate
            self.offset += example[2]
            self.index += 1
        if not examples:
            raise StopIteration
        batch = self.collator(examples)
        rows = batch["input_ids"].shape[0]
        if rows < self.batch_size:  # a short last batch of a single pass: empty rows (all padding, no labels)
            batch = {
                k: torch.cat(
                    [
                        v,
                        torch.full(
                            (self.batch_size - rows, v.shape[1]),
                            -100
                            if k == "labels"
                            else (self.collator.pad_id if k in ("input_ids", "decoder_input_ids") else 0),
                            dtype=v.dtype,
                        ),
                    ]
                )
                for k, v in batch.items()
            }
        return batch


class StreamingUL2Loader(StreamBlocks, UL2Loader):
    """`UL2Loader` over a stream: `dataset` (an `IterableDataset` of rows) read `block_size` rows at a time,
    `to_documents(rows, first_index)` turning a block into `Document`s, each block's documents cut in an
    order fixed by (seed, block)."""

    def __init__(
        self,
        dataset,
        to_documents,
        mixture: UL2Denoising,
        collator: UL2DataCollator,
        batch_size: int,
        *,
        block_size: int = 1000,
        name: str = "stream",
        seed: int = 0,
        shuffle: bool = True,
        skip_first: int = 1,
    ):
        self._init_stream(dataset, to_documents, block_size, name)
        super().__init__(None, mixture, collator, batch_size, seed=seed, shuffle=shuffle, skip_first=skip_first)

    @property
    def resident_documents(self) -> int:
        return self.block_size

    def rewind(self) -> None:
        super().rewind()
        self._rewind_stream()
        self.block_start: dict | None = None  # the stream state where the current block starts
        self.block_docs: list = []
        self.block_order = np.zeros(0, dtype=np.int64)

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "block": self.block,
            "block_start": self.block_start,
            "after": self.after,
            "epoch_docs": self.epoch_docs,
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.block, self.block_start, self.after, self.epoch_docs = (
            int(state["block"]),
            state["block_start"],
            state["after"],
            int(state["epoch_docs"]),
        )
        if self.block >= 0:  # re-read the block being cut
            self.block_docs = self._reread(self.block, self.block_start)
            self.block_order = self._order_of(self.block, len(self.block_docs))

    def _document(self) -> np.ndarray | None:
        while True:
            if self.cursor < len(self.block_order):
                ids = self.block_docs[int(self.block_order[self.cursor])].ids[self.skip_first :]
                if len(ids) - self.offset >= 2:
                    return ids
                self.cursor, self.offset = self.cursor + 1, 0  # what is left (< 2 tokens) cannot make an example
                continue
            read = self._read_next_block()
            if read is None:
                return None
            self.block_docs, self.block_start = read
            self.block_order, self.cursor, self.offset = self._order_of(self.block, len(self.block_docs)), 0, 0


def create_ul2_dataset(
    documents,
    tokenizer,
    max_encoder_length: int = 512,
    max_decoder_length: int = 128,
    batch_size: int = 8,
    task_weights=None,
    seed: int = 0,
    shuffle: bool = True,
    *,
    to_documents=None,
    block_size: int = 1000,
    name: str = "stream",
) -> UL2Loader:
    """UL2 batches with a tokenizer that has sentinels (`Qwen3EncoderDecoderTokenizer`) from `documents`:
    any text source through `Documents` (see `tierlm.data.packing`), or with `to_documents` a stream
    (an `IterableDataset` of rows read `block_size` rows at a time; see `StreamingUL2Loader`)."""
    from tierlm.data.ul2 import DEFAULT_TASK_WEIGHTS

    mixture = UL2Denoising(
        tokenizer.sentinel_ids,
        tokenizer.mode_ids,
        max_encoder_length,
        max_decoder_length,
        task_weights=task_weights or DEFAULT_TASK_WEIGHTS,
        seed=seed,
    )
    collator = UL2DataCollator(tokenizer, max_encoder_length, max_decoder_length)
    if to_documents is not None:
        return StreamingUL2Loader(
            documents,
            to_documents,
            mixture,
            collator,
            batch_size,
            block_size=block_size,
            name=name,
            seed=seed,
            shuffle=shuffle,
        )
    return UL2Loader(documents, mixture, collator, batch_size, seed=seed, shuffle=shuffle)

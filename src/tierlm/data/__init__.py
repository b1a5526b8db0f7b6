"""Data: sources, tokenizers, chat rendering, synthetic tasks, best-fit packing with exact resume."""

from tierlm.data.packing import (
    Document,
    Documents,
    Mixture,
    PackedLoader,
    chat_documents,
    text_documents,
)
from tierlm.data.sources import Examples, Fields, ListExamples, SourceOptions, holdout_split, open_examples
from tierlm.data.tokenizer import (
    Tokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
    train_char_tokenizer,
)
from tierlm.data.windows import Prefetcher, RankSlice, StreamWindows, eval_batches
from tierlm.tasks.arithmetic import ArithmeticTask, Problem

__all__ = [
    "ArithmeticTask",
    "Document",
    "Documents",
    "Examples",
    "Fields",
    "ListExamples",
    "Mixture",
    "PackedLoader",
    "Prefetcher",
    "RankSlice",
    "StreamWindows",
    "Problem",
    "SourceOptions",
    "Tokenizer",
    "chat_documents",
    "eval_batches",
    "holdout_split",
    "load_tokenizer",
    "open_examples",
    "text_documents",
    "train_bpe_tokenizer",
    "train_char_tokenizer",
]

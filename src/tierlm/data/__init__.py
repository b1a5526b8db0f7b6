"""Data: sources, tokenizers, synthetic tasks and resumable loaders."""

from tierlm.data.loaders import PretrainLoader, SFTLoader, eval_batches
from tierlm.data.sources import Fields, load_conversations, load_documents, split_holdout
from tierlm.data.synthetic import ArithmeticTask, Problem
from tierlm.data.tokenizer import (
    Tokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
    train_char_tokenizer,
)

__all__ = [
    "ArithmeticTask",
    "Fields",
    "PretrainLoader",
    "Problem",
    "SFTLoader",
    "Tokenizer",
    "eval_batches",
    "load_conversations",
    "load_documents",
    "load_tokenizer",
    "split_holdout",
    "train_bpe_tokenizer",
    "train_char_tokenizer",
]

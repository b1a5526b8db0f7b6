"""`tierlm tokenizer train`: a byte-level BPE or character tokenizer from text, JSONL, folders or synthetic tasks."""

from __future__ import annotations

import argparse
from pathlib import Path

from tierlm.commands.options import Command, positive_int


def arguments(parser: argparse.ArgumentParser) -> None:
    tools = parser.add_subparsers(dest="tokenizer_command", required=True)
    train = tools.add_parser("train", help="train a byte-level BPE or character tokenizer")
    train.add_argument(
        "--data", required=True, action="append", help="text/JSONL file, folder or synthetic:<task> (repeatable)"
    )
    train.add_argument("--out", required=True, help="folder to save the tokenizer to")
    train.add_argument("--kind", choices=["bpe", "char"], default="bpe")
    train.add_argument("--vocab-size", type=positive_int, default=512)
    train.add_argument(
        "--num-docs",
        type=positive_int,
        default=20000,
        help="documents read from each source (generated, for synthetic tasks)",
    )


def run(args: argparse.Namespace) -> None:
    from tierlm.checkpoint.folders import check_new_folder, publish_tokenizer
    from tierlm.data import SourceOptions, open_examples, train_bpe_tokenizer, train_char_tokenizer

    check_new_folder(
        Path(args.out), [Path(spec) for spec in args.data if not spec.startswith(("synthetic:", "builtin:"))]
    )
    texts = []
    for spec in args.data:  # the first --num-docs documents of each source, never a whole corpus
        examples = open_examples(spec, SourceOptions(synthetic_count=args.num_docs))
        texts += examples.fetch(range(min(len(examples), args.num_docs)))
    tokenizer = train_char_tokenizer(texts) if args.kind == "char" else train_bpe_tokenizer(texts, args.vocab_size)
    out = publish_tokenizer(tokenizer, Path(args.out))
    print(f"{args.kind} tokenizer with {tokenizer.vocab_size} tokens saved to {out}")


COMMAND = Command(arguments, run)

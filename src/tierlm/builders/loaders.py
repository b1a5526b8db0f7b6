"""Tier 3: the data of a run as its config names it — how each source is read (`source_options`: the
stage's kind of example, the columns, splits), the sources of every stage opened through one path
(`open_splits`), and the loaders built from them: best-fit packed rows for pretraining and SFT (over
indexed sources, a token stream cut into windows with data.stream, or a dataset read as a stream with
data.streaming), UL2 examples for encoder-decoders, preference pairs for DPO."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np

from tierlm.builders.stage import Stage
from tierlm.config import TierlmConfig
from tierlm.data import (
    Documents,
    Examples,
    Fields,
    Mixture,
    PackedLoader,
    SourceOptions,
    StreamWindows,
    Tokenizer,
    chat_documents,
    holdout_split,
    open_examples,
    text_documents,
)
from tierlm.data.hub import available_splits, default_eval_split
from tierlm.data.preferences import PairLoader, UnpairedLoader
from tierlm.data.sources import TEXT_SUFFIXES, TOKEN_SUFFIXES, convert_rows, open_stream
from tierlm.data.streaming import StreamingLoader
from tierlm.data.ul2_loader import UL2Loader, create_ul2_dataset
from tierlm.data.windows import ConcatTokens
from tierlm.errors import ConfigError, DataError
from tierlm.strategies.preference_losses import preference_row
from tierlm.tasks import synthetic_name


# -- data sources, as the config names them --------------------------------------------------
def _fields(config: TierlmConfig) -> Fields:
    d = config.data
    return Fields(
        text=d.text_column,
        messages=d.messages_column,
        prompt=d.prompt_column,
        completion=d.completion_column,
        chosen=d.chosen_column,
        rejected=d.rejected_column,
        question=d.question_column,
        answer=d.answer_column,
        domain=d.domain_column,
        answer_pattern=d.answer_pattern,
        task_format=d.task_format,
        tools=d.tools_column,
    )


def source_options(config: TierlmConfig, kind: str, split: str, tokenizer: Tokenizer | None) -> SourceOptions:
    """How to read the data's sources; `split` "train" is data.split for datasets with named splits
    (synthetic tasks keep their own "train" and "val")."""
    d = config.data
    return SourceOptions(
        split=split,
        kind=kind,
        seed=config.training.seed,
        dataset_config=d.dataset_config,
        revision=d.revision,
        data_files=d.data_files,
        streaming=d.streaming,
        num_proc=d.preprocessing_num_workers,
        synthetic_count=d.num_synthetic_examples if split == "train" else d.num_synthetic_eval_examples,
        fields=_fields(config),
        on_bad_line=d.on_bad_line,
        token_dtype=d.token_dtype,
        separator_id=tokenizer.document_separator_id if tokenizer else None,
        vocab_size=tokenizer.vocab_size if tokenizer else None,
    )


def named_split(name: str, options: SourceOptions, split: str) -> SourceOptions:
    """`options` reading `split` of `name`, unless `name` is a synthetic task (its splits are its own)."""
    return options if synthetic_name(name) is not None else dataclasses.replace(options, split=split)


def data_components(config: TierlmConfig) -> list[tuple[str, float]]:
    return [(c.dataset_name, c.weight) for c in config.data.mixture] or [(config.data.dataset_name, 1.0)]


def component_options(config: TierlmConfig, index: int, options: SourceOptions) -> tuple[SourceOptions, str]:
    """(the read options, the training split) of mixture component `index` (its own split and hub config where it
    names them); data.dataset_name's without a mixture."""
    d = config.data
    if not d.mixture:
        return options, d.split
    part = d.mixture[index]
    if part.dataset_config is not None:
        options = dataclasses.replace(options, dataset_config=part.dataset_config)
    return options, part.split or d.split


def open_splits(
    config: TierlmConfig, kind: str, tokenizer: Tokenizer | None
) -> tuple[list[tuple[Examples, float]], list[Examples]]:
    """([(train, weight)] for each data source, [val sets]).

    Training reads data.split of datasets with named splits. Validation is data.eval_dataset_name
    when set (one set for the whole mixture); otherwise each source's own evaluation split
    (data.eval_split, else the first of validation / val / test it has; synthetic tasks' "val") or a
    held-out tail of its training data.
    """
    d, trains, vals = config.data, [], []
    for index, (name, weight) in enumerate(data_components(config)):
        options, split = component_options(config, index, source_options(config, kind, "train", tokenizer))
        options = named_split(name, options, split)
        train = open_examples(name, options)
        if d.eval_dataset_name:
            pass  # one shared eval set, opened below
        elif synthetic_name(name) is not None:
            vals.append(open_examples(name, source_options(config, kind, "val", tokenizer)))
        else:
            eval_split = evaluation_split(config, name, options, hold_out="data.val_fraction")
            if eval_split is not None:  # the dataset's own evaluation split
                vals.append(open_examples(name, named_split(name, options, eval_split)))
            else:  # a held-out tail of the training data, never the training rows themselves
                train, val = holdout_split(train, d.val_fraction)
                vals.append(val)
        trains.append((train, weight))
    if d.eval_dataset_name:
        options = source_options(config, kind, "val", tokenizer)
        split = evaluation_split(config, d.eval_dataset_name, options)
        vals = [
            open_examples(d.eval_dataset_name, named_split(d.eval_dataset_name, options, split) if split else options)
        ]
    return trains, vals


def evaluation_split(
    config: TierlmConfig, name: str, options: SourceOptions, hold_out: str | None = None
) -> str | None:
    """The split of `name` that evaluates, None when it has no named splits (a file or folder of files).

    The training source (`hold_out` names what evaluates instead of a split it lacks): data.eval_split,
    else the first of validation / val / test that is not data.split; None also when it has none of them,
    and data.eval_split on a source without named splits is refused. data.eval_dataset_name (`hold_out`
    None): data.eval_split, else its first of validation / val / test, else data.split.
    """
    d = config.data
    splits = available_splits(name, options)
    if splits is None:
        if hold_out is not None and d.eval_split is not None:
            raise ConfigError(
                f"data.eval_split={d.eval_split} names a split, but {name} has no named splits "
                f"(a file or folder of files): use {hold_out} or data.eval_dataset_name"
            )
        return None
    if hold_out is None:
        return d.eval_split or default_eval_split(splits) or d.split
    return d.eval_split or default_eval_split(splits, d.split)


def splits_long_documents(config: TierlmConfig) -> bool:
    """data.long_documents, with auto resolved: split when every source is plain text or tokens
    (a corpus whose "documents" are paragraphs or a stream), crop otherwise."""
    if config.data.long_documents != "auto":
        return config.data.long_documents == "split"
    return all(
        name.startswith("builtin:") or Path(name).suffix in TEXT_SUFFIXES + TOKEN_SUFFIXES
        for name, _ in data_components(config)
    )


def build_loaders(
    config: TierlmConfig, stage: Stage, tokenizer: Tokenizer, world_size: int = 1, seq2seq: bool = False
) -> tuple[PackedLoader, PackedLoader]:
    """Best-fit packed train and eval loaders: pretraining crops, SFT pads (and isolates documents).

    The train loader packs the global batch (world_size x per-device rows); see `RankSlice`.
    """
    d, tr = config.data, config.training
    if seq2seq:
        return ul2_loaders(config, tokenizer, world_size)
    if d.stream:
        if stage.packing != "crop":
            raise ConfigError("data.stream reads text as one token stream: a pretraining option")
        return stream_loaders(config, tokenizer, world_size)
    convert = text_documents(tokenizer) if stage.example_kind == "text" else chat_documents(tokenizer, d.train_on)
    if d.streaming:
        return streaming_loaders(config, stage, tokenizer, world_size, convert)
    trains, vals = open_splits(config, stage.example_kind, tokenizer)
    if len(trains) == 1 and trains[0][1] == 1.0:
        train = Documents(trains[0][0], convert)
    else:
        train = Mixture([(Documents(t, convert), w) for t, w in trains], seed=tr.seed)
    val = (
        Documents(vals[0], convert)
        if len(vals) == 1
        else Mixture([(Documents(v, convert), 1.0) for v in vals], seed=tr.seed)
    )
    common = _packing(config, stage, tokenizer)
    return (
        PackedLoader(train, tr.per_device_train_batch_size * world_size, d.max_seq_length, seed=tr.seed, **common),
        PackedLoader(val, tr.per_device_eval_batch_size, d.max_seq_length, shuffle=False, **common),
    )


def ul2_loaders(config: TierlmConfig, tokenizer, world_size: int) -> tuple[UL2Loader, UL2Loader]:
    """An encoder-decoder's UL2 batches: examples cut from the text sources (data.split, or a stream with
    data.streaming; evaluation as for pretraining), packed into rows of data.max_encoder_length /
    data.max_decoder_length tokens."""
    d, tr = config.data, config.training
    if d.stream or d.mixture:
        raise ConfigError("UL2 pretraining reads one text source: drop data.stream / data.mixture")
    common = dict(
        tokenizer=tokenizer,
        max_encoder_length=d.max_encoder_length,
        max_decoder_length=d.max_decoder_length,
        task_weights=d.ul2_task_weights,
        seed=tr.seed,
    )
    sizes = (
        dict(batch_size=tr.per_device_train_batch_size * world_size),
        dict(batch_size=tr.per_device_eval_batch_size, shuffle=False),
    )
    if d.streaming:
        streams = _streams(config, "text", tokenizer, text_documents(tokenizer))
        return tuple(
            create_ul2_dataset(
                stream, to_documents=docs, block_size=d.shuffle_buffer_size, name=docs.name, **size, **common
            )
            for (stream, docs), size in zip(streams, sizes)
        )
    trains, vals = open_splits(config, "text", tokenizer)
    convert = text_documents(tokenizer)
    return tuple(
        create_ul2_dataset(Documents(source, convert), **size, **common)
        for source, size in zip((trains[0][0], vals[0]), sizes)
    )


def _packing(config: TierlmConfig, stage: Stage, tokenizer: Tokenizer) -> dict:
    d = config.data
    assert stage.packing is not None, f"the {stage.name} stage does not train on packed rows"
    isolate = d.isolate_documents if d.isolate_documents is not None else stage.isolate_documents
    return dict(
        mode=stage.packing,
        pad_id=tokenizer.pad_id,
        buffer_docs=d.packing_buffer,
        long_documents=d.long_conversations,
        document_positions=isolate,
        split_long=stage.packing == "crop" and splits_long_documents(config),
    )


def _streams(config: TierlmConfig, kind: str, tokenizer: Tokenizer, convert):
    """data.split read as a stream and its evaluation stream: the dataset's eval split (data.eval_split,
    else the first of validation / val / test it has), data.eval_dataset_name, or the stream's first
    data.eval_stream_examples rows, which training then skips. Each with its rows -> documents function
    (`.name`: the dataset it reads)."""
    d = config.data
    options = named_split(d.dataset_name, source_options(config, kind, "train", tokenizer), d.split)
    train = open_stream(d.dataset_name, options)
    if d.eval_dataset_name:
        eval_options = source_options(config, kind, "val", tokenizer)
        eval_split = evaluation_split(config, d.eval_dataset_name, eval_options) or "train"
        val, val_name = (
            open_stream(d.eval_dataset_name, named_split(d.eval_dataset_name, eval_options, eval_split)),
            d.eval_dataset_name,
        )
    else:
        eval_split, val_name = (
            evaluation_split(config, d.dataset_name, options, hold_out="data.eval_stream_examples"),
            d.dataset_name,
        )
        if eval_split is not None:
            val = open_stream(d.dataset_name, named_split(d.dataset_name, options, eval_split))
        else:  # the stream's head evaluates; training starts after it
            val, train = train.take(d.eval_stream_examples), train.skip(d.eval_stream_examples)

    def documents_of(name: str):
        def documents(rows, first):
            return convert(convert_rows(rows, options, name, first))

        documents.name = name
        return documents

    return (train, documents_of(d.dataset_name)), (val, documents_of(val_name))


def streaming_loaders(
    config: TierlmConfig, stage: Stage, tokenizer: Tokenizer, world_size: int, convert
) -> tuple[StreamingLoader, StreamingLoader]:
    """data.streaming: best-fit packed batches from the stream and its evaluation stream (`_streams`)."""
    d, tr = config.data, config.training
    (train, train_docs), (val, val_docs) = _streams(config, stage.example_kind, tokenizer, convert)
    common = _packing(config, stage, tokenizer)
    return (
        StreamingLoader(
            train,
            train_docs,
            tr.per_device_train_batch_size * world_size,
            d.max_seq_length,
            block_size=d.shuffle_buffer_size,
            name=train_docs.name,
            seed=tr.seed,
            **common,
        ),
        StreamingLoader(
            val,
            val_docs,
            tr.per_device_eval_batch_size,
            d.max_seq_length,
            block_size=d.shuffle_buffer_size,
            name=val_docs.name,
            shuffle=False,
            **common,
        ),
    )


STREAM_MAX_TOKENS = 1 << 30  # a stream read from text is held in memory (4 bytes a token)


def source_stream(name: str, config: TierlmConfig, tokenizer: Tokenizer) -> np.ndarray | ConcatTokens:
    """One source as a token stream: a text file encoded whole, a token file as it lies (memory-mapped), a folder
    of token files one after another (memory-mapped), anything else its documents one after another (each after its
    separator token)."""
    from tierlm.data.sources import TokenFileExamples, builtin_corpus

    path = builtin_corpus(name) if name.startswith("builtin:") else Path(name)
    if path.is_dir() and (shards := token_shards(path)):
        return ConcatTokens([token_map(shard, config.data.token_dtype, tokenizer.vocab_size) for shard in shards])
    if path.is_file() and path.suffix in TOKEN_SUFFIXES:
        tokens = TokenFileExamples(path, config.data.token_dtype, tokenizer.document_separator_id, tokenizer.vocab_size)
        return tokens._map()
    if path.is_file() and path.suffix in TEXT_SUFFIXES:
        if path.stat().st_size > STREAM_MAX_TOKENS:
            raise DataError(
                f"{path} is {path.stat().st_size:,} bytes: too large to stream from text; pre-tokenize it into a .bin "
                f"file"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text near byte {e.start}") from None
        return tokenizer.encode_stream(text)
    documents = Documents(
        open_examples(name, source_options(config, "text", "train", tokenizer)), text_documents(tokenizer)
    )
    parts, total = [], 0
    for lo in range(0, len(documents), 4096):
        for doc in documents.fetch(range(lo, min(len(documents), lo + 4096))):
            parts.append(doc.ids.astype(np.int32))
            total += len(doc.ids)
        if total > STREAM_MAX_TOKENS:
            raise DataError(
                f"{name} holds over {STREAM_MAX_TOKENS:,} tokens: too many to stream in memory; pre-tokenize it into a "
                f".bin file"
            )
    return np.concatenate(parts)


def token_shards(folder: Path) -> list[Path]:
    """A folder's token files (`.bin` / `.npy`), in name order; [] when it holds anything else."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    return files if files and all(p.suffix in TOKEN_SUFFIXES for p in files) else []


def token_map(path: Path, dtype: str, vocab_size: int) -> np.ndarray:
    """A token file's tokens, memory-mapped (an llm.c shard's header skipped); its first million tokens checked to be
    ids of the run's vocabulary (a whole scan of billions would hold up the start)."""
    from tierlm.data.sources import TokenFileExamples

    kind, offset, count = TokenFileExamples._layout(path, np.dtype(dtype))
    tokens = np.memmap(path, dtype=kind, mode="r", offset=offset, shape=(count,))
    head = np.asarray(tokens[: 1 << 20])
    if len(head) and int(head.max()) >= vocab_size:
        raise DataError(
            f"{path}: token id {int(head.max())} >= vocab size {vocab_size}; the shard was made with another tokenizer"
        )
    return tokens


def stream_loaders(config: TierlmConfig, tokenizer: Tokenizer, world_size: int) -> tuple[PackedLoader, PackedLoader]:
    """`data.stream`: every source one token stream, cut into windows of a row; held out: the shards of a token folder
    named `*val*` (llm.c's and nanoGPT's FineWeb layout), else the stream's tail."""
    d, tr = config.data, config.training
    if d.mixture or d.eval_dataset_name:
        raise ConfigError(
            "data.stream reads one data.dataset_name and holds out its tail; drop data.mixture / data.eval_dataset_name"
        )
    window, path = d.max_seq_length + 1, Path(d.dataset_name)
    shards = token_shards(path) if path.is_dir() else []
    held = [s for s in shards if "val" in s.stem]
    if held and len(held) < len(shards):  # the dataset's own validation shards, whole
        maps = {s: token_map(s, d.token_dtype, tokenizer.vocab_size) for s in shards}
        train = StreamWindows(ConcatTokens([maps[s] for s in shards if s not in held]), window)
        val = StreamWindows(ConcatTokens([maps[s] for s in held]), window)
    else:
        tokens = source_stream(d.dataset_name, config, tokenizer)
        cut = int(len(tokens) * (1 - d.val_fraction))
        train, val = StreamWindows(tokens[:cut], window), StreamWindows(tokens[cut:], window)
    return (
        PackedLoader(
            train, tr.per_device_train_batch_size * world_size, d.max_seq_length, seed=tr.seed, pad_id=tokenizer.pad_id
        ),
        PackedLoader(val, tr.per_device_eval_batch_size, d.max_seq_length, shuffle=False, pad_id=tokenizer.pad_id),
    )


def build_pair_loaders(
    config: TierlmConfig, tokenizer: Tokenizer, rank: int = 0, world: int = 1, long_conversations: str | None = None
) -> tuple[PairLoader, PairLoader]:
    """Preference pairs from the data pipeline's one path (any source; data.split / data.eval_split,
    data.eval_dataset_name, or a held-out data.val_fraction tail for evaluation), rendered once; `rank`
    reads its share of `world` (data-parallel) shares of each batch. KTO (dpo.loss_type=kto) reads unpaired
    replies instead (`UnpairedLoader`). Over-long pairs are truncated or dropped by `long_conversations` (None:
    data.long_conversations)."""
    d, tr = config.data, config.training
    if d.mixture or d.streaming:
        raise ConfigError(
            "DPO reads the pairs of one data.dataset_name into memory: drop data.mixture / data.streaming"
        )
    row = preference_row(config.dpo)
    kto = not row.paired  # unpaired judged replies
    trains, vals = open_splits(config, "unpaired" if kto else "preference", tokenizer)
    train, val = (examples.fetch(range(len(examples))) for examples in (trains[0][0], vals[0]))
    what = "replies" if kto else "pairs"
    if len(train) < tr.per_device_train_batch_size * world:
        raise DataError(
            f"{len(train)} training {what} cannot fill one batch of {tr.per_device_train_batch_size} {what} x "
            f"{world} ranks; lower training.per_device_train_batch_size"
        )
    loader = functools.partial(UnpairedLoader, kl_rows=row.kl_rows) if kto else PairLoader
    loader = functools.partial(loader, long_conversations=long_conversations or d.long_conversations)
    return (
        loader(
            train,
            tokenizer,
            tr.per_device_train_batch_size,
            d.max_seq_length,
            seed=tr.seed,
            rank=rank,
            world_size=world,
        ),
        loader(val, tokenizer, tr.per_device_eval_batch_size, d.max_seq_length, shuffle=False),
    )

"""Where a run starts: the model it continues (`pretrained_location`, checked against model.architecture)
and the tokenizer it uses (`run_tokenizer`: the checkpoint's, the model's, a named one, or one trained on
the data; an encoder-decoder's gets UL2's sentinels and mode tokens)."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from tierlm.builders.loaders import data_components, named_split, source_options
from tierlm.checkpoint.folders import verified_model_location
from tierlm.config import TierlmConfig
from tierlm.data import Tokenizer, load_tokenizer, open_examples, train_bpe_tokenizer, train_char_tokenizer
from tierlm.data.chat_templates import set_chat_template
from tierlm.data.rows import example_texts
from tierlm.data.sources import convert_rows, open_stream
from tierlm.errors import ConfigError, DataError
from tierlm.models import family_for_folder, family_named, is_native_folder
from tierlm.primitives.parallel import DistributedContext


def pretrained_location(config: TierlmConfig) -> Path | str | None:
    """A local model folder (resolved from a run or checkpoint folder, verified), a hub id, or None (from
    scratch). A tierlm folder of an encoder-decoder where the config names a decoder-only architecture, or
    the other way round, is refused (it would train what the folder holds, not what the config asks)."""
    name, architecture = config.model.model_name_or_path, config.model.architecture
    if name is None:
        return None
    location = verified_model_location(name)
    saved = family_for_folder(location) if isinstance(location, Path) and is_native_folder(location) else None
    if (
        saved is not None
        and "architecture" in config.model.model_fields_set
        and saved.seq2seq != family_named(architecture).seq2seq
    ):
        raise ConfigError(
            f"{name} holds a {saved.name!r} model but model.architecture is {architecture!r}: drop model.architecture "
            f"to "
            "train the model as it is (an encoder-decoder starts from a transformers Qwen3 folder)"
        )
    return location


def existing_tokenizer(config: TierlmConfig, pretrained: Path | str | None) -> Tokenizer | None:
    m = config.model
    if m.tokenizer_name_or_path:
        return load_tokenizer(m.tokenizer_name_or_path, m.trust_remote_code)
    if pretrained is not None:
        return load_tokenizer(pretrained, m.trust_remote_code)
    return None


def train_tokenizer(config: TierlmConfig, kind: str) -> Tokenizer:
    """A new tokenizer, trained on the first tokenizer.num_train_docs examples (of `kind`: text, chat, ...) of each
    source."""
    t, texts = config.tokenizer, []
    for name, _ in data_components(config):
        if Path(name).suffix in (".bin", ".npy"):
            raise DataError(
                f"{name} is already tokenized: set model.tokenizer_name_or_path to the tokenizer that made it"
            )
        options = named_split(name, source_options(config, kind, "train", None), config.data.split)
        if config.data.streaming:  # the stream's first documents
            stream = iter(open_stream(name, options))
            rows = list(itertools.islice(stream, t.num_train_docs))
            stream.close()
            first = convert_rows(rows, options, name)
        else:
            examples = open_examples(name, options)
            first = examples.fetch(range(min(len(examples), t.num_train_docs)))
        for example in first:
            texts.extend(example_texts(example))
    return train_char_tokenizer(texts) if t.kind == "char" else train_bpe_tokenizer(texts, t.vocab_size)


def run_tokenizer(
    config: TierlmConfig, kind: str, pretrained, ctx: DistributedContext | None, latest: Path | None
) -> Tokenizer:
    """The run's tokenizer: a resumed run's own (from its checkpoint), the model's or the named one,
    or a new one trained on the data (by rank 0, read by the others from the run directory)."""
    if latest is not None:
        tokenizer = load_tokenizer(
            latest / "model", config.model.trust_remote_code
        )  # with the run's chat template and sentinels
    else:
        tokenizer = existing_tokenizer(config, pretrained)
    if tokenizer is None and ctx is None:
        tokenizer = train_tokenizer(config, kind)
    elif tokenizer is None:
        folder = Path(config.infra.output_dir) / "tokenizer"
        if ctx.is_main:
            train_tokenizer(config, kind).save(folder)
        torch.distributed.barrier()
        tokenizer = load_tokenizer(folder)
    if is_seq2seq(config, pretrained):  # UL2's sentinels and mode tokens (kept as they are when the tokenizer has them)
        from tierlm.data.seq2seq_tokenizer import Qwen3EncoderDecoderTokenizer

        tokenizer = Qwen3EncoderDecoderTokenizer(tokenizer, config.model.num_sentinel_tokens)
    return set_chat_template(tokenizer, config.data.chat_template) if config.data.chat_template else tokenizer


def is_seq2seq(config: TierlmConfig, pretrained: Path | str | None) -> bool:
    """Does the run train an encoder-decoder (the family of the tierlm model it starts from, else
    model.architecture: a transformers decoder-only folder may start an encoder-decoder)?"""
    native = isinstance(pretrained, Path) and is_native_folder(pretrained)
    family = family_for_folder(pretrained) if native else family_named(config.model.architecture)
    return family.seq2seq

"""Where examples come from, as random-access collections that never need the corpus in memory.

`open_examples(spec, ...)` takes `synthetic:<task>`, a file, or a folder of files:

| source | example | held in memory |
|---|---|---|
| synthetic task | generated from (seed, split, index) | nothing |
| .txt / .md | a paragraph (documents are split at blank lines) | byte offsets |
| .jsonl | a row, as the stage's kind of example (`tierlm.data.rows`) | byte offsets |
| .parquet, a saved HF dataset, a hub dataset name (`tierlm.data.hub`) | a row, as with JSONL | Arrow memory map |
| .bin / .npy token file | a token array (documents split at the separator token) | document offsets |

Every collection has `len()` and `fetch(indices)`, so loaders shuffle, shard by rank and resume
by index. Bad data fails at open time with one line: `file:line`, the fields that exist, ...
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tierlm.data.hub import PARQUET_SUFFIXES, has_named_splits, load_split
from tierlm.data.rows import KINDS, Fields, PreferencePair, UnpairedExample, convert_row
from tierlm.errors import DataError, first_line
from tierlm.tasks import SYNTHETIC, TaskExample, synthetic_generator, synthetic_name

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".json")
TOKEN_SUFFIXES = (".bin", ".npy")
LLMC_MAGIC = 20240520  # llm.c .bin shards: a 256 x int32 header, then uint16 tokens
LLMC_HEADER_BYTES = 256 * 4


@dataclass
class ReadStats:
    """What opening a source skipped (malformed lines when `on_bad_line="skip"`)."""

    bad_lines_skipped: int = 0


def parse_json_object(raw: bytes | str, where: str) -> dict:
    """One JSONL line as a dict, or a DataError naming `where` (bad UTF-8, bad JSON, too deeply
    nested, not an object). Every JSONL reader goes through this one.

    >>> parse_json_object(b'{"a": 1}', "f.jsonl:1")
    {'a': 1}
    >>> parse_json_object(b"[" * 100000, "f.jsonl:2")
    Traceback (most recent call last):
    ...
    tierlm.errors.DataError: f.jsonl:2: malformed JSON (nested too deeply); fix or remove that line
    """
    try:
        row = json.loads(raw)
    except UnicodeDecodeError:
        raise DataError(f"{where}: not UTF-8 text; fix or remove that line") from None
    except RecursionError:
        raise DataError(f"{where}: malformed JSON (nested too deeply); fix or remove that line") from None
    except ValueError as e:
        raise DataError(
            f"{where}: malformed JSON ({e.msg if isinstance(e, json.JSONDecodeError) else e}); fix or remove that line"
        ) from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}; fix or remove that line")
    return row


def read_jsonl(path: Path):
    """(line number, object) for each non-blank line of a JSONL file; errors name `file:line`."""
    try:
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if raw.strip():
                    yield line_no, parse_json_object(raw, f"{path}:{line_no}")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from e


# -- collections ---------------------------------------------------------------------------
class Examples:
    """A random-access collection of examples."""

    def __len__(self) -> int:
        raise NotImplementedError

    def fetch(self, indices: Sequence[int]) -> list[Any]:
        raise NotImplementedError

    def __getitem__(self, index: int) -> Any:
        return self.fetch([index])[0]


class ListExamples(Examples):
    def __init__(self, items: list):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def fetch(self, indices: Sequence[int]) -> list[Any]:
        return [self.items[i] for i in indices]


class SyntheticExamples(Examples):
    def __init__(self, task, split: str, count: int, seed: int, kind: str, name: str | None = None):
        self.task, self.split, self.count, self.seed, self.kind = task, split, count, seed, kind
        self.name = name  # the task's name: its prompts' domain

    def __len__(self) -> int:
        return self.count

    def fetch(self, indices: Sequence[int]) -> list[Any]:
        return [self._example(int(i)) for i in indices]

    def _example(self, i: int) -> Any:
        if self.kind == "text":
            return self.task.problem(self.split, i, self.seed).text
        if self.kind == "chat":
            return self.task.conversation(self.split, i, self.seed)
        if self.kind == "preference":
            return PreferencePair(*self.task.preference(self.split, i, self.seed))
        if self.kind == "unpaired":  # each problem's pair as two examples: its chosen reply, then its rejected one
            return UnpairedExample(self.task.preference(self.split, i // 2, self.seed)[i % 2], i % 2 == 0)
        problem = self.task.problem(self.split, i, self.seed)
        return TaskExample([{"role": "user", "content": problem.question}], problem.result, domain=self.name)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from e


class JSONLExamples(Examples):
    """Rows of a JSONL file, read on demand at their byte offsets (validated once, at open)."""

    def __init__(self, path: Path, kind: str, fields: Fields, on_bad_line: str, stats: ReadStats):
        self.path, self.kind, self.fields = path, kind, fields
        offsets, lines = [], []
        with open(path, "rb") as f:
            offset = 0
            for lineno, raw in enumerate(f, start=1):
                start, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    row = parse_json_object(raw, where)
                except DataError as e:
                    if on_bad_line == "skip":
                        stats.bad_lines_skipped += 1
                        continue
                    raise DataError(f"{e}, or set data.on_bad_line=skip") from None
                convert_row(row, kind, fields, where)  # every row is checked up front, not mid-run
                offsets.append(start)
                lines.append(lineno)
        self.offsets, self.lines = np.asarray(offsets, dtype=np.int64), np.asarray(lines, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offsets)

    def fetch(self, indices: Sequence[int]) -> list[Any]:
        out = []
        with open(self.path, "rb") as f:
            for i in indices:
                f.seek(int(self.offsets[i]))
                out.append(
                    convert_row(json.loads(f.readline()), self.kind, self.fields, f"{self.path}:{self.lines[i]}")
                )
        return out


class TextExamples(Examples):
    """Paragraphs of a text file (split at blank lines), read on demand."""

    def __init__(self, path: Path):
        self.path = path
        spans, start, offset = [], None, 0
        try:
            with open(path, "rb") as f:
                for raw in f:
                    if raw.strip():
                        start = offset if start is None else start
                    elif start is not None:
                        spans.append((start, offset))
                        start = None
                    offset += len(raw)
        except OSError as e:
            raise DataError(f"cannot read {path}: {e.strerror or e}") from e
        if start is not None:
            spans.append((start, offset))
        self.spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)

    def __len__(self) -> int:
        return len(self.spans)

    def fetch(self, indices: Sequence[int]) -> list[str]:
        out = []
        with open(self.path, "rb") as f:
            for i in indices:
                start, end = self.spans[i]
                f.seek(int(start))
                try:
                    out.append(f.read(int(end - start)).decode("utf-8").strip())
                except UnicodeDecodeError as e:
                    raise DataError(f"{self.path}: not UTF-8 text near byte {start}") from e
        return out


class ArrowExamples(Examples):
    """Rows of a `datasets.Dataset` (memory-mapped Arrow): parquet files, saved folders, hub datasets."""

    def __init__(self, dataset, kind: str, fields: Fields, name: str):
        self.dataset, self.kind, self.fields, self.name = dataset, kind, fields, name
        if len(dataset):
            convert_row(dataset[0], kind, fields, f"{name} row 0")  # fail at open on a missing column

    def __len__(self) -> int:
        return len(self.dataset)

    def fetch(self, indices: Sequence[int]) -> list[Any]:
        rows = self.dataset[[int(i) for i in indices]]  # columnar: {field: [values]}
        keys = list(rows)
        return [
            convert_row({k: rows[k][j] for k in keys}, self.kind, self.fields, f"{self.name} row {i}")
            for j, i in enumerate(indices)
        ]


class TokenFileExamples(Examples):
    """Documents of a pre-tokenized file: a flat uint16/uint32 array, split at `separator_id`.

    The document index is built once through short-lived memory maps, a chunk at a time. Documents
    are then read with positional reads, not through a map: on this kernel a map puts the whole
    page-cache folio (up to 2 MB) around every document touched into our resident set (measured:
    +1.3 GB for 1,000 random documents of a 2 GB file), while a read copies only the document.
    """

    CHUNK_TOKENS = 1 << 24

    def __init__(self, path: Path, dtype: str, separator_id: int, vocab_size: int):
        self.path = path
        self.dtype, self.offset, self.num_tokens = self._layout(path, np.dtype(dtype))
        starts = [np.zeros(1, dtype=np.int64)]
        for lo in range(0, self.num_tokens, self.CHUNK_TOKENS):
            chunk = np.asarray(self._map()[lo : lo + self.CHUNK_TOKENS])
            top = int(chunk.max()) if len(chunk) else 0
            if len(chunk) and int(chunk.min()) < 0:
                at = lo + int(np.argmax(chunk < 0))
                raise DataError(f"{path}: negative token id {int(chunk.min())} at position {at}; token ids are >= 0")
            if top >= vocab_size:
                at = lo + int(np.argmax(chunk >= vocab_size))
                raise DataError(
                    f"{path}: token id {top} at position {at} >= vocab size {vocab_size}; the file was made with "
                    f"another tokenizer"
                )
            starts.append(np.flatnonzero(chunk == separator_id).astype(np.int64) + lo)
        bounds = np.unique(np.concatenate(starts + [np.asarray([self.num_tokens], dtype=np.int64)]))
        self.bounds = bounds  # document i is tokens [bounds[i], bounds[i + 1])

    @staticmethod
    def _layout(path: Path, dtype: np.dtype) -> tuple[np.dtype, int, int]:
        if path.suffix == ".npy":
            try:
                array = np.load(path, mmap_mode="r", allow_pickle=False)  # never unpickle: object arrays are refused
            except (ValueError, OSError, EOFError) as e:
                raise DataError(
                    f"{path}: not a readable token array ({first_line(e)}); save a 1-D integer array with numpy.save"
                ) from None
            if array.ndim != 1 or array.dtype not in (np.uint16, np.uint32, np.int32, np.int64):
                raise DataError(
                    f"{path}: expected a 1-D integer token array, got {array.dtype} with shape {array.shape}"
                )
            return array.dtype, array.offset, len(array)
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(8), dtype=np.int32) if size >= LLMC_HEADER_BYTES else np.zeros(2, np.int32)
        if len(header) == 2 and header[0] == LLMC_MAGIC:
            return np.dtype(np.uint16), LLMC_HEADER_BYTES, (size - LLMC_HEADER_BYTES) // 2
        if size % dtype.itemsize:
            raise DataError(f"{path}: size {size} is not a whole number of {dtype} tokens; set data.token_dtype")
        return dtype, 0, size // dtype.itemsize

    def _map(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.num_tokens,))

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def fetch(self, indices: Sequence[int]) -> list[np.ndarray]:
        out, itemsize = [], self.dtype.itemsize
        with open(self.path, "rb") as f:
            for i in indices:
                start, end = int(self.bounds[i]), int(self.bounds[i + 1])
                f.seek(self.offset + start * itemsize)
                out.append(np.fromfile(f, dtype=self.dtype, count=end - start).astype(np.int64))
        return out


# -- opening -------------------------------------------------------------------------------
def _files(spec: str) -> list[Path]:
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        suffixes = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES + TOKEN_SUFFIXES
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
        if not files:
            raise DataError(f"folder {spec} has no .txt, .jsonl, .parquet, .bin or .npy files")
        return files
    raise DataError(
        f"dataset {spec!r} is neither an existing file or folder nor a hub dataset id (owner/name, e.g. "
        f"HuggingFaceH4/ultrachat_200k); check the path, or give the id (also: synthetic:<task>, "
        f"{', '.join(SYNTHETIC)})"
    )


class ConcatExamples(Examples):
    """Several collections, one after another."""

    def __init__(self, parts: list[Examples]):
        self.parts = [p for p in parts if len(p)]
        self.ends = np.cumsum([len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def fetch(self, indices: Sequence[int]) -> list[Any]:
        which = np.searchsorted(self.ends, np.asarray(indices), side="right")
        starts = np.concatenate([[0], self.ends[:-1]])
        out: list[Any] = [None] * len(indices)
        for part in np.unique(which):
            positions = np.flatnonzero(which == part)
            local = [int(indices[p] - starts[part]) for p in positions]
            for p, value in zip(positions, self.parts[part].fetch(local)):
                out[p] = value
        return out


CORPORA_DIR = Path(__file__).parent / "corpora"


def builtin_corpus(spec: str) -> Path:
    """The text shipped inside the package that `builtin:<name>` names (e.g. builtin:tinyshakespeare).

    >>> builtin_corpus("builtin:tinyshakespeare").stat().st_size
    1115394
    """
    name = spec.split(":", 1)[1]
    path = CORPORA_DIR / f"{name}.txt"
    if not path.is_file():
        known = ", ".join(f"builtin:{p.stem}" for p in sorted(CORPORA_DIR.glob("*.txt")))
        raise DataError(f"unknown corpus {spec!r}; shipped: {known}")
    return path


@dataclass
class SourceOptions:
    """How to read a source (mirrors the data section of the config)."""

    split: str = "train"
    kind: str = "text"  # what a row becomes: text, chat, preference, unpaired or task (tierlm.data.rows)
    dataset_config: str | None = None  # a hub dataset's config (subset) name
    revision: str | None = None  # a hub dataset's branch, tag or commit
    data_files: Any = None  # datasets' data_files: a pattern, a list, or {split: pattern(s)}
    streaming: bool = False  # read a dataset with named splits as a stream (an IterableDataset)
    num_proc: int | None = None  # processes datasets uses to prepare a dataset
    seed: int = 0
    synthetic_count: int = 1000
    fields: Fields = Fields()
    on_bad_line: str = "error"
    token_dtype: str = "uint16"
    separator_id: int | None = None
    vocab_size: int | None = None


def open_examples(spec: str, options: SourceOptions, stats: ReadStats | None = None) -> Examples:
    """A random-access collection of `options.kind` examples from `spec` (see the module docstring)."""
    stats = stats if stats is not None else ReadStats()
    assert options.kind in KINDS, f"kind must be one of {KINDS}, got {options.kind!r}"
    if synthetic_name(spec) is not None:
        return SyntheticExamples(
            synthetic_generator(spec),
            options.split,
            options.synthetic_count,
            options.seed,
            options.kind,
            synthetic_name(spec),
        )
    spec = str(builtin_corpus(spec)) if spec.startswith("builtin:") else spec
    if has_named_splits(
        spec, options.data_files
    ):  # a hub dataset name, a saved dataset, a Hub-layout folder, data_files
        return ArrowExamples(load_split(spec, options), options.kind, options.fields, spec)
    parts: list[Examples] = []
    for file in _files(spec):
        if file.suffix in JSONL_SUFFIXES:
            parts.append(JSONLExamples(file, options.kind, options.fields, options.on_bad_line, stats))
        elif file.suffix in PARQUET_SUFFIXES:
            parts.append(ArrowExamples(load_split(str(file), options), options.kind, options.fields, str(file)))
        elif file.suffix in TOKEN_SUFFIXES:
            if options.kind != "text":
                raise DataError(f"{file}: a token file holds pretraining documents, not {options.kind} examples")
            assert options.separator_id is not None and options.vocab_size is not None, (
                "token files need separator_id and vocab_size"
            )
            parts.append(TokenFileExamples(file, options.token_dtype, options.separator_id, options.vocab_size))
        else:
            if options.kind != "text":
                raise DataError(
                    f"{file}: {options.kind} examples come from JSONL, parquet or a dataset, not plain text"
                )
            parts.append(TextExamples(file))
    examples = parts[0] if len(parts) == 1 else ConcatExamples(parts)
    if not len(examples):
        raise DataError(f"dataset {spec} holds no examples")
    return examples


def convert_rows(rows: list[dict], options: SourceOptions, name: str, first: int = 0) -> list[Any]:
    """Rows read from a stream as `options.kind` examples; errors name the row's place in the stream."""
    return [
        convert_row(row, options.kind, options.fields, f"{name} stream row {first + i}") for i, row in enumerate(rows)
    ]


def open_stream(spec: str, options: SourceOptions) -> Any:
    """`options.split` of `spec` as a `datasets.IterableDataset` of rows, read lazily (data.streaming): a hub
    name, a folder (Hub-layout or plain, of parquet / JSONL files), a saved dataset, a parquet or JSONL file."""
    path = Path(spec)
    if synthetic_name(spec) is not None or spec.startswith("builtin:") or path.suffix in TEXT_SUFFIXES + TOKEN_SUFFIXES:
        raise DataError(
            f"data.streaming reads datasets (a hub name, a folder of parquet or JSONL files, a parquet or JSONL file); "
            f"{spec} is read in place without it: drop data.streaming"
        )
    if not path.exists() and not has_named_splits(spec, options.data_files):
        _files(spec)  # one line: neither a path nor a hub id
    return load_split(spec, options)


def holdout_split(examples: Examples, val_fraction: float) -> tuple[Examples, Examples]:
    """(train, val) views: the last `val_fraction` of the examples (at least one) is held out."""
    n = len(examples)
    if n < 2:
        raise DataError(
            f"need at least 2 examples to hold some out for validation, got {n}; set data.eval_dataset_name"
        )
    n_val = max(1, int(n * val_fraction))
    return Subset(examples, np.arange(n - n_val)), Subset(examples, np.arange(n - n_val, n))


class Subset(Examples):
    def __init__(self, base: Examples, indices: np.ndarray):
        self.base, self.indices = base, indices

    def __len__(self) -> int:
        return len(self.indices)

    def fetch(self, indices: Sequence[int]) -> list[Any]:
        return self.base.fetch([int(self.indices[i]) for i in indices])

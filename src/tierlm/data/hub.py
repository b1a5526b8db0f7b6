"""Datasets read through Hugging Face `datasets`: hub names, saved datasets, parquet files, and local
folders laid out as the Hub serves a dataset repository (README.md naming its `configs`).

Such a dataset has named splits (`available_splits`) and configs; `load_split` opens one split as a
memory-mapped `datasets.Dataset`, which `tierlm.data.sources.ArrowExamples` reads by index.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from tierlm.errors import DataError, first_line
from tierlm.primitives.hub import HubUnreachable, hub_access
from tierlm.tasks import synthetic_name

PARQUET_SUFFIXES = (".parquet",)


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file())


def _is_hub_layout(path: Path) -> bool:
    """A local folder laid out as the Hub serves a dataset repository: a README.md whose YAML header
    names its `configs` (their data files by split), read by `datasets.load_dataset` as the Hub would."""
    readme = path / "README.md"
    if not (path.is_dir() and readme.is_file()):
        return False
    head = readme.read_text(errors="replace")
    return head.startswith("---") and "\nconfigs:" in head.split("\n---", 1)[0]


def _load_dataset_dict(spec: str, options) -> Any:
    """The dataset at `spec` (saved folder, parquet file, Hub-layout folder, hub name, or a datasets
    builder such as "json" with data_files) as loaded (without datasets' progress bars: stderr stays for
    problems), once per process and version of its files: the train split, the eval split and the split
    names of one source are one load. A streamed dataset is opened lazily (nothing is read yet)."""
    data_files = json.dumps(options.data_files, sort_keys=True) if options.data_files is not None else None
    return _load_dataset_once(
        spec,
        options.dataset_config,
        options.revision,
        data_files,
        options.streaming,
        options.num_proc,
        _files_signature(spec),
    )


def _files_signature(spec: str) -> tuple[int, int]:
    """(newest modification, total size) of a local dataset's files; (0, 0) for a hub name."""
    path = Path(spec)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    stats = [f.stat() for f in files]
    return max((st.st_mtime_ns for st in stats), default=0), sum(st.st_size for st in stats)


@functools.lru_cache(maxsize=8)
def _load_dataset_once(
    spec: str,
    dataset_config: str | None,
    revision: str | None,
    data_files: str | None,
    streaming: bool,
    num_proc: int | None,
    signature: tuple[int, int],
):
    import datasets

    datasets.disable_progress_bars()
    try:
        if _is_saved_dataset(Path(spec)):
            loaded = datasets.load_from_disk(spec)
            if not streaming:
                return loaded
            if isinstance(loaded, datasets.Dataset):
                return loaded.to_iterable_dataset()
            return datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in loaded.items()})
        if Path(spec).suffix in PARQUET_SUFFIXES:
            if streaming:
                return datasets.load_dataset("parquet", data_files=spec, split="train", streaming=True)
            return datasets.Dataset.from_parquet(spec)
        if streaming and Path(spec).is_file():  # a JSONL file, streamed
            return datasets.load_dataset("json", data_files=spec, split="train", streaming=True)
        extra = {"data_files": json.loads(data_files)} if data_files is not None else {}
        if streaming:  # a stream is read where it lies: no download, no cache, nothing to force
            builder = spec in datasets.packaged_modules._PACKAGED_DATASETS_MODULES
            with contextlib.nullcontext() if builder else hub_access(spec, "dataset", repo_type="dataset"):
                return datasets.load_dataset(spec, dataset_config, revision=revision, streaming=True, **extra)
        extra["num_proc"] = num_proc
        # A local folder is re-read by each process (and when its files change) and not checked against
        # recorded split sizes: datasets' cache keys it by the folder's name, and served (or "verified"
        # against) another folder of the same name, or an earlier version of files rewritten in place (measured).
        # Its own cache folder too: with one shared by name, a folder took the column types cached for another
        # folder of the same name (a cast error, measured).
        fresh = {}
        if Path(spec).exists():
            key = hashlib.sha1(str(Path(spec).resolve()).encode()).hexdigest()[:16]
            cache = Path(datasets.config.HF_DATASETS_CACHE) / "tierlm_local" / key
            fresh = {"download_mode": "force_redownload", "verification_mode": "no_checks", "cache_dir": str(cache)}
        builder = spec in datasets.packaged_modules._PACKAGED_DATASETS_MODULES  # json, csv, parquet: local files
        with contextlib.nullcontext() if builder else hub_access(spec, "dataset", repo_type="dataset"):
            return datasets.load_dataset(spec, dataset_config, revision=revision, **fresh, **extra)
    except HubUnreachable as e:
        raise DataError(str(e)) from None
    except Exception as e:  # datasets raises many types; all mean "cannot open this"
        raise DataError(
            f"cannot open dataset {spec!r}{f' (config {dataset_config!r})' if dataset_config else ''}: {first_line(e)}"
        ) from e


def available_splits(spec: str, options) -> list[str] | None:
    """The split names of a dataset with named splits (a hub name, a Hub-layout or saved folder), else None."""
    if (
        synthetic_name(spec) is not None
        or spec.startswith("builtin:")
        or not has_named_splits(spec, options.data_files)
    ):
        return None
    import datasets

    loaded = _load_dataset_dict(spec, options)
    return list(loaded) if isinstance(loaded, (datasets.DatasetDict, datasets.IterableDatasetDict)) else None


EVAL_SPLITS = ("validation", "val", "test")
"""Splits that evaluate when data.eval_split is not set (the first one a dataset has)."""


def default_eval_split(splits: list[str], train_split: str | None = None) -> str | None:
    """The first of `EVAL_SPLITS` among `splits` that is not the training split.

    >>> default_eval_split(["train", "test", "validation"]), default_eval_split(["train_sft", "test_sft"])
    ('validation', None)
    """
    return next((s for s in EVAL_SPLITS if s in splits and s != train_split), None)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
_FILE_SUFFIXES = (".txt", ".md", ".json", ".jsonl", ".parquet", ".arrow", ".csv", ".bin", ".npy")


def is_hub_id(spec: str) -> bool:
    """Whether `spec` could name a dataset on the Hub (owner/name) rather than a missing local file.

    >>> is_hub_id("HuggingFaceH4/ultrachat_200k"), is_hub_id("data/train.jsonl"), is_hub_id("./x/y")
    (True, False, False)
    """
    return bool(_HUB_ID.fullmatch(spec)) and not spec.lower().endswith(_FILE_SUFFIXES) and ".." not in spec


def has_named_splits(spec: str, data_files: Any = None) -> bool:
    """A hub dataset name, a saved dataset, a local folder laid out as the Hub serves one, or anything
    given data_files (a folder, a hub name, or a datasets builder such as "json" / "parquet")."""
    path = Path(spec)
    if data_files is not None and not path.is_file():
        return True
    return _is_saved_dataset(path) or _is_hub_layout(path) or (not path.exists() and is_hub_id(spec))


def load_split(spec: str, options) -> Any:
    """The `datasets.Dataset` of `options.split` at `spec` (a plain parquet file is one split)."""
    import datasets

    loaded = _load_dataset_dict(spec, options)
    if isinstance(loaded, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if options.split not in loaded:
            raise DataError(
                f"dataset {spec!r} has splits {', '.join(loaded)}; there is no {options.split!r} "
                "(set data.split, or data.eval_split for evaluation)"
            )
        loaded = loaded[options.split]
    return loaded

"""Datasets read through Hugging Face `datasets`: hub names, saved datasets, parquet files, and local
folders laid out as the Hub serves a dataset repository (README.md naming its `configs`).

Such a dataset has named splits (`available_splits`) and configs; `load_split` opens one split as a
memory-mapped `datasets.Dataset`, which `tierlm.data.sources.ArrowExamples` reads by index.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from tierlm.errors import DataError, first_line

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
    """The dataset at `spec` (saved folder, parquet file, Hub-layout folder or hub name) as loaded
    (without datasets' progress bars: stderr stays for problems), once per process and version of
    its files: the train split, the eval split and the split names of one source are one load."""
    return _load_dataset_once(spec, options.dataset_config, options.revision, _files_signature(spec))


def _files_signature(spec: str) -> tuple[int, int]:
    """(newest modification, total size) of a local dataset's files; (0, 0) for a hub name."""
    path = Path(spec)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    stats = [f.stat() for f in files]
    return max((st.st_mtime_ns for st in stats), default=0), sum(st.st_size for st in stats)


@functools.lru_cache(maxsize=8)
def _load_dataset_once(spec: str, dataset_config: str | None, revision: str | None, signature: tuple[int, int]):
    import datasets

    datasets.disable_progress_bars()
    try:
        if _is_saved_dataset(Path(spec)):
            return datasets.load_from_disk(spec)
        if Path(spec).suffix in PARQUET_SUFFIXES:
            return datasets.Dataset.from_parquet(spec)
        # A local folder is re-read by each process (and when its files change) and not checked against
        # recorded split sizes: datasets' cache keys it by the folder's name, and served (or "verified"
        # against) another folder of the same name, or an earlier version of files rewritten in place (measured).
        fresh = {"download_mode": "force_redownload", "verification_mode": "no_checks"} if Path(spec).exists() else {}
        return datasets.load_dataset(spec, dataset_config, revision=revision, **fresh)
    except Exception as e:  # datasets raises many types; all mean "cannot open this"
        raise DataError(f"cannot open dataset {spec!r}{f' (config {dataset_config!r})' if dataset_config else ''}: "
                        f"{first_line(e)}") from e


def available_splits(spec: str, options) -> list[str] | None:
    """The split names of a dataset with named splits (a hub name, a Hub-layout or saved folder), else None."""
    if spec.startswith(("synthetic:", "builtin:")) or not has_named_splits(spec):
        return None
    import datasets

    loaded = _load_dataset_dict(spec, options)
    return list(loaded) if isinstance(loaded, datasets.DatasetDict) else None


EVAL_SPLITS = ("validation", "val", "test")
"""Splits that evaluate when data.eval_split is not set (the first one a dataset has)."""


def default_eval_split(splits: list[str], train_split: str | None = None) -> str | None:
    """The first of `EVAL_SPLITS` among `splits` that is not the training split.

    >>> default_eval_split(["train", "test", "validation"]), default_eval_split(["train_sft", "test_sft"])
    ('validation', None)
    """
    return next((s for s in EVAL_SPLITS if s in splits and s != train_split), None)


def has_named_splits(spec: str) -> bool:
    """A hub dataset name, a saved dataset, or a local folder laid out as the Hub serves one."""
    path = Path(spec)
    return _is_saved_dataset(path) or _is_hub_layout(path) or (not path.exists() and not spec.startswith((".", "/")) and spec.count("/") == 1)


def load_split(spec: str, options) -> Any:
    """The `datasets.Dataset` of `options.split` at `spec` (a plain parquet file is one split)."""
    import datasets

    loaded = _load_dataset_dict(spec, options)
    if isinstance(loaded, datasets.DatasetDict):
        if options.split not in loaded:
            raise DataError(f"dataset {spec!r} has splits {', '.join(loaded)}; there is no {options.split!r} "
                            "(set data.split, or data.eval_split for evaluation)")
        loaded = loaded[options.split]
    return loaded

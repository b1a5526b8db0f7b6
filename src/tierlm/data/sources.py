"""Where examples come from: the package's synthetic tasks, plain text files, JSONL files.

`dataset_name` is `synthetic:<task>`, a file, or a folder of files. Plain text is split into
documents at blank lines. JSONL rows carry a `text` field (pretraining), a `messages` list of
{role, content} turns, or a `prompt`/`completion` pair (field names configurable).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tierlm.data.synthetic import SYNTHETIC_TASKS
from tierlm.data.tokenizer import check_conversation
from tierlm.errors import DataError

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class Fields:
    """Names of the JSONL fields to read."""

    text: str = "text"
    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"


def _files(spec: str) -> list[Path]:
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES)
        if not files:
            raise DataError(f"folder {spec} has no .txt, .md or .jsonl files")
        return files
    raise DataError(f"dataset {spec!r} is neither an existing file or folder nor 'synthetic:<task>' ({', '.join(SYNTHETIC_TASKS)})")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from e


def iter_jsonl(path: Path):
    """(line number, row) for each non-empty line; a malformed line names file:line."""
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg}); fix or remove that line") from e
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        yield lineno, row


def _synthetic(spec: str):
    name = spec.split(":", 1)[1]
    if name not in SYNTHETIC_TASKS:
        raise DataError(f"unknown synthetic task {name!r}; available: {', '.join(SYNTHETIC_TASKS)}")
    return SYNTHETIC_TASKS[name]()


def load_documents(spec: str, split: str, count: int, seed: int, fields: Fields = Fields()) -> list[str]:
    """Pretraining documents. Synthetic tasks make `count` of them; files give all they hold."""
    if spec.startswith("synthetic:"):
        return [p.text for p in _synthetic(spec).problems(split, count, seed)]
    docs = []
    for path in _files(spec):
        if path.suffix in JSONL_SUFFIXES:
            for lineno, row in iter_jsonl(path):
                if fields.text not in row:
                    raise DataError(f"{path}:{lineno}: no {fields.text!r} field; fields present: {sorted(row)} (set data.text_column)")
                docs.append(str(row[fields.text]))
        else:
            docs.extend(d.strip() for d in _read_text(path).split("\n\n") if d.strip())
    if not docs:
        raise DataError(f"dataset {spec} holds no documents")
    return docs


def _conversation(row: dict, fields: Fields, where: str) -> list[dict]:
    if fields.messages in row:
        messages = row[fields.messages]
    elif fields.prompt in row and fields.completion in row:
        messages = [{"role": "user", "content": row[fields.prompt]}, {"role": "assistant", "content": row[fields.completion]}]
    else:
        raise DataError(
            f"{where}: needs a {fields.messages!r} list or {fields.prompt!r}/{fields.completion!r} fields; "
            f"fields present: {sorted(row)}"
        )
    try:
        check_conversation(messages)
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    return messages


def load_conversations(spec: str, split: str, count: int, seed: int, fields: Fields = Fields()) -> list[list[dict]]:
    """SFT conversations from a synthetic task or JSONL files."""
    if spec.startswith("synthetic:"):
        return [p.conversation for p in _synthetic(spec).problems(split, count, seed)]
    conversations = []
    for path in _files(spec):
        if path.suffix not in JSONL_SUFFIXES:
            raise DataError(f"{path}: SFT data must be JSONL with {fields.messages!r} or {fields.prompt!r}/{fields.completion!r}")
        conversations.extend(_conversation(row, fields, f"{path}:{lineno}") for lineno, row in iter_jsonl(path))
    if not conversations:
        raise DataError(f"dataset {spec} holds no conversations")
    return conversations


def split_holdout(items: list, val_fraction: float) -> tuple[list, list]:
    """(train, val): the last `val_fraction` of items (at least one) is held out."""
    if len(items) < 2:
        raise DataError(f"need at least 2 examples to hold some out for validation, got {len(items)}; set data.eval_dataset_name")
    n_val = max(1, int(len(items) * val_fraction))
    return items[:-n_val], items[-n_val:]

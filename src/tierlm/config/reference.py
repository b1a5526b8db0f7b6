"""The configuration reference, written from the typed sections themselves (every field's type, default and
docstring), so the documentation site's page can never drift from what `TierlmConfig` accepts.

>>> text = markdown()
>>> "| `training.learning_rate` |" in text and text.startswith("## model")
True
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic.fields import FieldInfo

from tierlm.config.model import Section
from tierlm.config.sections import TierlmConfig


def type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: `int`, `float | None`, `"bpe" | "char"`, `list[str]`.

    >>> type_name(typing.Literal["bpe", "char"] | None), type_name(list[str]), type_name(int)
    ('"bpe" | "char" | None', 'list[str]', 'int')
    """
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "(a section)" if isinstance(value, Section) else f"`{value!r}`"
    return f"`{field.default!r}`"


def rows(section: type[Section], prefix: str) -> list[tuple[str, str, str, str]]:
    """(key, type, default, what) of every field of `section`, nested sections flattened with dotted keys."""
    out = []
    for name, field in section.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, Section):
            out += rows(annotation, f"{prefix}{name}.")
            continue
        what = " ".join((field.description or "").split()).replace("|", "\\|")
        out.append((f"{prefix}{name}", type_name(annotation).replace("|", "\\|"), default_text(field), what))
    return out


def markdown() -> str:
    """The reference as Markdown: one table per top-level section of `TierlmConfig`."""
    parts = []
    for name, field in TierlmConfig.model_fields.items():
        section = field.annotation
        parts.append(f"## {name}\n")
        if section.__doc__:
            parts.append(" ".join(section.__doc__.split()) + "\n")
        parts.append("| key | type | default | what it does |\n|---|---|---|---|")
        parts += [f"| `{k}` | {t} | {d} | {w} |" for k, t, d, w in rows(section, f"{name}.")]
        parts.append("")
    return "\n".join(parts)

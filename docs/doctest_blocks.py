"""Griffe extension for the API reference: a docstring's doctest (`>>>` lines and the output under them) shown as
a Python console block, not as Markdown (where `>>>` would open quotes and `[0.5, 1.0]` look like a link)."""

from __future__ import annotations

from griffe import Extension


def fence_doctests(text: str) -> str:
    """`text` with each run of doctest lines (from a `>>>` line to the next blank line) inside a ```pycon fence,
    at the run's indentation."""
    out, inside, indent = [], False, ""
    for line in text.split("\n"):
        stripped = line.lstrip()
        if not inside and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
            inside = True
        elif inside and not stripped:
            out.append(f"{indent}```")
            inside = False
        out.append(line)
    if inside:
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestBlocks(Extension):
    def on_object(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)

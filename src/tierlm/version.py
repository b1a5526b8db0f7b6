"""tierlm's version, and the line `tierlm --version` prints (read without importing torch or transformers)."""

from __future__ import annotations

__version__ = "0.1.0"


def source_commit() -> str | None:
    """The short git commit of the tierlm checkout this package runs from (an editable install), or None where it runs
    from no checkout of its own: a wheel, also one installed in a virtual environment inside another project's
    repository (whose commit is not tierlm's).

    >>> source_commit() is None or len(source_commit()) >= 7
    True
    """
    import subprocess
    from pathlib import Path

    package = Path(__file__).resolve().parent
    try:
        found = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=package,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    if len(found) != 2 or Path(found[0]).resolve() / "src" / "tierlm" != package:
        return None
    return found[1]


def version_line() -> str:
    """What `tierlm --version` prints: tierlm's version (and commit), torch's, transformers' and Python's, read
    without importing them (for a bug report)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"{name} not installed"

    commit = source_commit()
    here = f"tierlm {__version__}" + (f" (commit {commit})" if commit else "")
    return f"{here}, {of('torch')}, {of('transformers')}, Python {platform.python_version()}"

"""User-facing errors.

Everything a person can fix (a bad config value, a missing file, malformed data, an unusable
checkpoint) raises a `TierlmError` subclass whose message is one line naming the problem and what
to do. The CLI prints that line and exits with code 2. Programmer errors stay `assert`s.

The subclasses also derive from the builtin exception a caller would naturally catch
(`ValueError`, `FileNotFoundError`, `RuntimeError`), so tier-1 functions behave like ordinary
Python functions when used on their own.
"""


class TierlmError(Exception):
    """Base class of every error the user can act on."""


class ConfigError(TierlmError, ValueError):
    """A config value, argument or override is invalid."""


class DataError(TierlmError, ValueError):
    """Training data is missing, malformed or unusable."""


class CheckpointError(TierlmError, RuntimeError):
    """A checkpoint or model folder cannot be written or read."""


class ModelLoadError(TierlmError, OSError):
    """A model or tokenizer cannot be loaded from the given id or path."""


class DeviceError(TierlmError, RuntimeError):
    """The requested device is not available on this machine."""


class TrainingDiverged(TierlmError, RuntimeError):
    """The loss or gradients stayed NaN/Inf for too many consecutive steps."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (or its type), for one-line user errors.

    >>> first_line(OSError("no such file\\nlong details..."))
    'no such file'
    """
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

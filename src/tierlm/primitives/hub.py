"""Reaching the Hugging Face Hub, or knowing quickly that it cannot be reached.

On a machine without the Hub (most clusters' compute nodes, an air-gapped box) `huggingface_hub` retries each
request for about a minute, printing a line per retry, before the error that names no way out. tierlm finds out
once per process, before the first request for a Hub id: the offline variables (`HF_HUB_OFFLINE`,
`TRANSFORMERS_OFFLINE`, `HF_DATASETS_OFFLINE`) say so, or else one TCP connection to the Hub's endpoint (or the
HTTPS proxy) is tried for `PROBE_TIMEOUT_S`. Unreachable, the libraries are put in their offline mode (they look
only in the local caches, without a request) and a miss becomes one line (`HubUnreachable`) naming the id and the
ways out: a local folder, `hf download` into the shared cache on a connected machine, or the offline variables.

>>> is_hub_id("Qwen/Qwen3-0.6B"), is_hub_id("gpt2"), is_hub_id("./runs/tiny_sft"), is_hub_id("/data/x")
(True, True, False, False)
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import socket
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

from tierlm.errors import ModelLoadError

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
PROBE_TIMEOUT_S = 1.5
"""How long the one probe of a process waits for the Hub (name lookup and TCP connection together)."""

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class HubUnreachable(ModelLoadError):
    """A Hub id that is not in the local cache, on a machine that cannot reach the Hub."""


def is_hub_id(spec: str | Path) -> bool:
    """Could `spec` name a Hub repository (and is not a local path)?

    >>> is_hub_id("Qwen/Qwen3-0.6B"), is_hub_id("gpt2"), is_hub_id("./runs/x"), is_hub_id("a/b/c")
    (True, True, False, False)
    """
    text = str(spec)
    return bool(HUB_ID.match(text)) and not text.startswith(".") and not Path(text).exists()


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def offline_requested() -> bool:
    """The user has said the machine is offline (one of `OFFLINE_VARIABLES`).

    >>> import unittest.mock
    >>> with unittest.mock.patch.dict(os.environ, {"HF_HUB_OFFLINE": "1"}):
    ...     offline_requested()
    True
    """
    return any(_truthy(os.environ.get(name)) for name in OFFLINE_VARIABLES)


def _probe_target() -> tuple[str, int]:
    """(host, port) a Hub request connects to first: the HTTPS proxy, else the endpoint (`HF_ENDPOINT`)."""
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy if proxy else os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)


def _connects(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to (host, port) opens within `timeout` seconds, name lookup included (which a
    socket's own timeout does not bound: it runs on a thread given up after `timeout`)."""
    answer: list[bool] = []

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=attempt, name="tierlm-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answer and answer[0])


@functools.cache
def hub_reachable() -> bool:
    """Can this process reach the Hub? Asked once: False when the offline variables say so or the probe fails, and
    the Hugging Face libraries are then put in their offline mode (no request, no retry: the local caches only)."""
    if offline_requested():
        return False
    if _connects(*_probe_target(), PROBE_TIMEOUT_S):
        return True
    go_offline()
    return False


_PROBED_OFFLINE: list[bool] = []  # set when the probe (not the user) put the libraries offline


def go_offline() -> None:
    """Put huggingface_hub, transformers and datasets in their offline mode, imported or not (each reads its
    variable when imported; huggingface_hub's constant is what the others ask later)."""
    _PROBED_OFFLINE.append(True)
    for name in OFFLINE_VARIABLES:
        os.environ[name] = "1"
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        sys.modules["datasets"].config.HF_HUB_OFFLINE = True


def cache_folder() -> str:
    """Where the Hugging Face libraries look for downloaded files (`HF_HOME`, else ~/.cache/huggingface)."""
    return os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")


def miss_line(spec: str, what: str, repo_type: str = "model") -> str:
    """The one line for a Hub id the local cache does not hold on a machine without the Hub.

    >>> miss_line("gpt2", "tokenizer").split(" and ")[0]
    "tokenizer 'gpt2' is not in the local Hugging Face cache"
    """
    flag = " --repo-type dataset" if repo_type == "dataset" else ""
    why = _why_offline()
    return (
        f"{what} {spec!r} is not in the local Hugging Face cache and {why}: give a local folder, or on a connected "
        f"machine run `hf download {spec}{flag}` into the cache this one reads (HF_HOME={cache_folder()})"
    )


def _why_offline() -> str:
    if offline_requested() and not _PROBED_OFFLINE:
        return f"{'/'.join(OFFLINE_VARIABLES)} set this machine offline"
    return f"the Hub ({os.environ.get('HF_ENDPOINT', 'https://huggingface.co')}) cannot be reached from here"


@contextlib.contextmanager
def hub_access(spec: str | Path, what: str, repo_type: str = "model"):
    """Around loading `spec` (`what`: "tokenizer", "model", "dataset", ...): a Hub id is looked up only in the local
    cache when the Hub cannot be reached, and a miss there is one `HubUnreachable` line; a local path, or a
    reachable Hub, passes as it is."""
    if not is_hub_id(spec) or hub_reachable():
        yield
        return
    try:
        yield
    except Exception as error:  # the libraries raise OSError, ValueError, their own types: all mean "not here"
        raise HubUnreachable(miss_line(str(spec), what, repo_type)) from error


def require_hub(what: str) -> None:
    """For what needs the Hub itself (uploading): one line when it cannot be reached."""
    if not hub_reachable():
        raise HubUnreachable(f"{what} needs the Hugging Face Hub and {_why_offline()}: run it where the Hub answers")

"""Tier 3: the run skeleton every stage goes through (`skeleton`: prepare, begin, train, finish) and the run
directory it owns (`directory`), and the process a run starts in (`process`: seeds, the process group)."""

from tierlm.run.process import distributed_context, seed_everything  # noqa: F401
from tierlm.run.skeleton import (  # noqa: F401
    Run,
    build_logger,
    extras_writer,
    prepare_run,
    warn_restarts,
    write_model_extras,
)

__all__ = [
    "Run",
    "build_logger",
    "distributed_context",
    "extras_writer",
    "prepare_run",
    "seed_everything",
    "warn_restarts",
    "write_model_extras",
]

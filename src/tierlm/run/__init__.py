"""Tier 3: the run skeleton every stage goes through (`skeleton`: prepare, begin, train, finish) and the run
directory it owns (`directory`)."""

from tierlm.run.skeleton import (  # noqa: F401
    Run,
    build_logger,
    distributed_context,
    extras_writer,
    prepare_run,
    seed_everything,
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

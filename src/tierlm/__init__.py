"""tierlm: train language models through every stage from one small protocol.

Tiers, each built only from those below it:
  3 application   the `tierlm` CLI (`tierlm.commands`), the stages (`tierlm.stages`), the loops (`tierlm.loops`)
  2 convenience   `tierlm.backends.create_pytorch_backend`, `create_backend_with_scheduler`
  1 primitives    `tierlm.primitives` (dtype, device, model loading, optimizers, losses, schedules)
  0 protocol      `tierlm.backends.TrainingBackend`, `TrainFuture`, `PyTorchTrainingBackend`

The folders stack in the same order (the documentation's "The library, in tiers"); import-linter's contracts in
pyproject.toml keep every import pointing down.

From Python, a whole stage is one call, as the CLI runs it:

    import tierlm
    summary = tierlm.train("tiny_pretrain", "pretrain", ["training.num_train_steps=100"])
"""

from __future__ import annotations

from tierlm.version import __version__  # noqa: F401


def train(config, stage: str = "pretrain", overrides: list[str] | None = None, callbacks: list | None = None) -> dict:
    """Run one stage (a name in `tierlm.stages.STAGES`: "pretrain" | "sft" | "dpo" | "rl") of `config` (a
    `TierlmConfig`, a YAML path or a
    preset name) with dotted `overrides`; returns the run summary. `callbacks`: objects with any of
    `on_log(record)`, `on_eval(metrics)`, `on_save(path)`, called by the loop (pretrain, SFT, DPO)."""
    from tierlm.config import TierlmConfig

    if isinstance(config, TierlmConfig):
        assert not overrides, "overrides go with a YAML path or preset name; change a TierlmConfig with model_copy"
    else:
        config = TierlmConfig.load(config, overrides or [])
    from tierlm.stages import run_stage

    return run_stage(config, stage, callbacks=callbacks)

"""tierlm: train language models through every stage from one small protocol.

Tiers, each built only from those below it:
  3 application   the `tierlm` CLI (`tierlm.commands`), the stages (`tierlm.stages`), the loops (`tierlm.loops`)
  2 convenience   `tierlm.backends.create_pytorch_backend`, `create_backend_with_scheduler`
  1 primitives    `tierlm.primitives` (dtype, device, model loading, optimizers, losses, schedules)
  0 protocol      `tierlm.backends.TrainingBackend`, `TrainFuture`, `PyTorchTrainingBackend`

The folders stack in the same order (README, "Where things live"); import-linter's contracts in
pyproject.toml keep every import pointing down.

From Python, a whole stage is one call, as the CLI runs it:

    import tierlm
    summary = tierlm.train("tiny_pretrain", "pretrain", ["training.num_train_steps=100"])
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

__version__ = "0.1.0"


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


# -- where modules moved --------------------------------------------------------------------------
# The package is laid out by tier (config/, primitives/, tasks/, data/, models/, strategies/, rollout/,
# checkpoint/, metrics/, backends/, loops/, build/, plan/, run/, stages/, commands/). The modules of the
# earlier flat layout still import from their old names: each is an alias of the module(s) that now hold
# its names (a name is looked up in them in order).
_MOVED: dict[str, tuple[str, ...]] = {
    "tierlm.ablate": ("tierlm.commands.ablate",),
    "tierlm.chat": ("tierlm.commands.chat",),
    "tierlm.cli": ("tierlm.commands.cli",),
    "tierlm.config_files": ("tierlm.config.files",),
    "tierlm.config_model": ("tierlm.config.model",),
    "tierlm.data.synthetic": ("tierlm.tasks.arithmetic", "tierlm.tasks"),
    "tierlm.harness": ("tierlm.commands.harness",),
    "tierlm.jax": ("tierlm.models.gpt.jax",),
    "tierlm.jax.gpt": ("tierlm.models.gpt.jax",),
    "tierlm.jax.gpt2": ("tierlm.models.gpt2.jax",),
    "tierlm.jax.losses": ("tierlm.primitives.jax_losses",),
    "tierlm.jax.optim": ("tierlm.primitives.optim.jax",),
    "tierlm.launchers": ("tierlm.config.launchers",),
    "tierlm.layout_plan": ("tierlm.plan.memory.layouts",),
    "tierlm.loaders": ("tierlm.build.loaders",),
    "tierlm.memory_plan": ("tierlm.plan.memory", "tierlm.plan.batch", "tierlm.plan.memory.bounds"),
    "tierlm.memory_probe": ("tierlm.commands.probe",),
    "tierlm.models.gpt2_delay": ("tierlm.models.gpt2.delay",),
    "tierlm.models.gpt2_family": ("tierlm.models.gpt2.family",),
    "tierlm.models.gpt2_kv": ("tierlm.models.gpt2.kv",),
    "tierlm.models.gpt2_ra": ("tierlm.models.gpt2.ra",),
    "tierlm.models.gpt2_rmlp": ("tierlm.models.gpt2.rmlp",),
    "tierlm.models.gpt_family": ("tierlm.models.gpt.family",),
    "tierlm.models.hf_export": ("tierlm.models.gpt.hf_export",),
    "tierlm.models.hf_pipeline": ("tierlm.models.transformers.pipeline",),
    "tierlm.models.qwen3_encdec_family": ("tierlm.models.qwen3_encdec.family",),
    "tierlm.primitives.adam": ("tierlm.primitives.optim.adam",),
    "tierlm.primitives.functional_optim": ("tierlm.primitives.optim.functional",),
    "tierlm.primitives.muon": ("tierlm.primitives.optim.muon",),
    "tierlm.primitives.prune": ("tierlm.primitives.optim.prune",),
    "tierlm.primitives.spam": ("tierlm.primitives.optim.spam",),
    "tierlm.push": ("tierlm.commands.push",),
    "tierlm.recipes": (
        "tierlm.stages",
        "tierlm.stages.with_trainer",
        "tierlm.build.model",
        "tierlm.build.backend",
        "tierlm.plan.memory.bounds",
    ),
    "tierlm.report": ("tierlm.metrics.report",),
    "tierlm.rl": ("tierlm.loops.rl",),
    "tierlm.rl.critic": ("tierlm.loops.critic",),
    "tierlm.rl.loop": ("tierlm.loops.rl",),
    "tierlm.rl.recipe": ("tierlm.stages", "tierlm.stages.rl", "tierlm.build.tasks", "tierlm.commands.evaluate"),
    "tierlm.rl.tasks": ("tierlm.tasks", "tierlm.build.tasks"),
    "tierlm.serve": ("tierlm.commands.serve",),
    "tierlm.signals": ("tierlm.loops.signals",),
    "tierlm.speedrun": ("tierlm.commands.speedrun",),
    "tierlm.starting_point": ("tierlm.build.tokenizer",),
    "tierlm.trainer": ("tierlm.loops.trainer",),
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module name as the module(s) that hold its names now (`_MOVED`)."""

    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self, is_package=True) if name in _MOVED else None

    def create_module(self, spec):
        homes = _MOVED[spec.name]
        if len(homes) == 1:
            return importlib.import_module(homes[0])  # the module itself, under its old name too
        alias = types.ModuleType(spec.name, f"Moved: its names are in {', '.join(homes)}.")

        def __getattr__(name: str):
            for home in homes:
                module = importlib.import_module(home)
                if hasattr(module, name):
                    return getattr(module, name)
            raise AttributeError(f"module {spec.name!r} (moved to {', '.join(homes)}) has no attribute {name!r}")

        alias.__getattr__ = __getattr__
        alias.__path__ = []
        return alias

    def exec_module(self, module) -> None:
        pass


sys.meta_path.append(_MovedModules())

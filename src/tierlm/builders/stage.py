"""What a training stage declares to the code below it (torchtitan's train spec, one per stage).

A stage (`tierlm.stages`: pretrain, SFT, DPO, RL) is a subclass of `Stage` with its own `run`. The
builders, the planner and the run skeleton never ask a stage's name: they ask what it declares here —
what a data row becomes, how rows are packed, what it starts from, what its micro-batch holds and what
memory it needs beside the model (a frozen reference, a generation cache). The defaults describe
next-token training on packed rows of text.

>>> stage = Stage()
>>> stage.example_kind, stage.token_rows, stage.reference_model(None)
('text', True, None)
"""

from __future__ import annotations

from typing import Any

import torch

from tierlm.config import TierlmConfig


class Stage:
    name = "stage"
    """Its name in `tierlm.stages.STAGES`, and its command (`tierlm NAME`; its help line:
    `tierlm.commands.cli.COMMANDS`)."""
    section: str | None = None
    """The config section only it reads (`rl`, `dpo`), beside the shared model, tokenizer, data, training and infra."""
    also_reads: tuple[str, ...] = ()
    """Other sections it reads (RL: `engine`, what samples its rollouts)."""
    example_kind = "text"
    """What a data row becomes (`tierlm.data.rows`): text, chat, preference or task."""
    chat = False
    """It trains a chat model: its samples, `tierlm sample` and evaluation render prompts as user turns."""
    generates = True
    """Its model writes text (training.sample_prompts are sampled at each evaluation); a reward model scores instead."""
    starts_from_trained = False
    """It needs model.model_name_or_path (a trained chat model to improve)."""
    needs_chat_template = False
    """Its tokenizer must render conversations (refused before anything is built otherwise)."""
    encoder_decoder = False
    """It can train an encoder-decoder (UL2 batches)."""
    packing: str | None = "crop"
    """Rows packed from documents: "crop" (cut to length; long documents may split), "pad" (SFT), None (not packed
    rows)."""
    isolate_documents = False
    """data.isolate_documents' default: attention kept inside each packed document."""
    token_rows = True
    """Batches are fixed rows of tokens, so training.total_batch_size and target_param_data_ratio can count them."""
    scales_from_depth = False
    """training.target_param_data_ratio derives its token horizon from the model's size (pretraining from scratch)."""
    rows_per_example = 1
    """Rows one batch item takes in a micro-batch (DPO: its chosen and rejected rows)."""
    micro_batch_key = "training.per_device_train_batch_size"
    """The setting that sizes its micro-batches (only this one takes `auto`)."""
    measures_core = True
    """training.core_bundle can measure CORE during its training (the `Trainer`'s loop, a model that writes text)."""
    no_dropout = False
    """training.disable_dropout's default: it scores the model it trains in evaluation mode (RL's old log-probs, DPO's
    reference beside it), so dropout in training would make the two forwards differ."""
    supervised = False
    """It is supervised fine-tuning: it trains with training.sft_loss, and with NEFTune's noisy embeddings when
    training.neftune_noise_alpha asks."""
    deepspeed = False
    """It trains under infra.distributed_type=deepspeed (one model, forward_backward and optim_step: no frozen
    reference or sampler beside the partitioned weights)."""

    def resolve_section(self, config: TierlmConfig) -> TierlmConfig:
        """The config with this stage's own section checked against its variant table and its defaults filled in
        (RL: the loss's row; DPO: the preference loss's); one line (a ConfigError) for what contradicts it."""
        return config

    def parallelism(self, config: TierlmConfig, launched: bool) -> TierlmConfig:
        """The config as this stage runs under torchrun (`launched`); refuse, in one line, what it cannot shard."""
        return config

    def reference_model(self, config: TierlmConfig | None) -> str | None:
        """A frozen copy of the model it holds beside the policy: None, "in step" (run inside each training
        step, DPO's) or "beside" (run before the update, KL-regularised RL's)."""
        return None

    def micro_batch(self, config: TierlmConfig, world_size: int) -> tuple[int, int]:
        """(rows, tokens per row) of one micro-batch, for the memory planner."""
        return self.rows_per_example * config.training.per_device_train_batch_size, config.data.max_seq_length

    def generation(self, config: TierlmConfig, world_size: int, row_tokens: int) -> tuple[int, int] | None:
        """(samples, tokens) of the largest generation it runs between updates (RL's rollouts), or None."""
        return None

    def trace_batch(self, config: TierlmConfig, rows: int, tokens: int) -> tuple[dict[str, torch.Tensor], Any]:
        """A micro-batch of its shape (zeros; traced under fake tensors by the memory planner) and its loss
        function (None: token cross-entropy)."""
        ids = torch.zeros(rows, tokens, dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}, None

    def memory_fixes(self, config: TierlmConfig) -> dict[str, str]:
        """What to change when a part of its memory is too large, where it differs from the planner's advice."""
        return {}

    def run(self, run: Any, callbacks: list | None = None) -> dict:
        """Train: build the model, data, strategy, backend and loop from a prepared run; return the summary."""
        raise NotImplementedError(f"{type(self).__name__} declares no run")


def resolve_config(config: TierlmConfig, stage: Stage, launched: bool) -> TierlmConfig:
    """The one place a run's config is resolved before anything is built (`tierlm.run.prepare_run`, `tierlm plan`):
    the stage's section against its variant table and the parallelism it runs under torchrun (`launched`), frozen:
    what the stage receives, nothing downstream changes in place (the scaling plan derives a new one).

    >>> resolved = resolve_config(TierlmConfig(), Stage(), launched=False)
    >>> resolved.is_frozen, resolved.training.is_frozen
    (True, True)
    """
    if config.training.core_bundle is not None:
        _check_core(config, stage)
    if config.training.neftune_noise_alpha is not None:
        _check_neftune(config, stage)
    if config.training.sft_loss != type(config.training).model_fields["sft_loss"].default and not stage.supervised:
        from tierlm.errors import ConfigError

        raise ConfigError(f"training.sft_loss is supervised fine-tuning's loss; {stage.name} does not take it: drop it")
    if config.training.profile_steps is not None and config.infra.backend == "jax":
        from tierlm.errors import ConfigError

        raise ConfigError(
            "training.profile_steps traces PyTorch's operators; the JAX backend's are JAX's (jax.profiler): drop it"
        )
    if config.training.disable_dropout is None:
        training = config.training.model_copy(update={"disable_dropout": stage.no_dropout})
        config = config.model_copy(update={"training": training})
    config = stage.parallelism(stage.resolve_section(config), launched)
    _check_reference_sync(config, stage.section, launched)
    return config.frozen()


def _check_reference_sync(config: TierlmConfig, section: str | None, launched: bool) -> None:
    """A reference that follows the policy (the stage's `<section>.reference_sync_steps`: DPO's, RL's) where it
    can: not under model.lora (the reference is the base with the adapters off, no copy), nor under torchrun where a
    rank does not hold the whole policy (only DDP's do); one line (a ConfigError) otherwise. (The JAX backend refuses
    it with its section's other PyTorch-only settings.)"""
    from tierlm.errors import ConfigError

    if section is None or getattr(getattr(config, section, None), "reference_sync_steps", None) is None:
        return
    infra, key = config.infra, f"{section}.reference_sync_steps"
    if config.model.lora.r:
        raise ConfigError(
            f"{key} moves a reference copy toward the policy; under model.lora the reference is the base with the "
            "adapters off, no copy: drop one of them"
        )
    whole = infra.distributed_type == "ddp" and not infra.model_parallel and infra.expert_parallel_size == 1
    if launched and not whole:
        raise ConfigError(
            f"{key} mixes the policy's weights into the reference on every rank, so each rank must hold them whole: "
            "set infra.distributed_type=ddp (without model or expert parallelism), or drop it"
        )


def _check_core(config: TierlmConfig, stage: Stage) -> None:
    """training.core_bundle where CORE can be measured: one line (a ConfigError) otherwise."""
    from tierlm.errors import ConfigError
    from tierlm.loops.evaluation import bundle_files
    from tierlm.models.registry import family_named

    if not stage.measures_core or not stage.generates:
        raise ConfigError(
            f"training.core_bundle measures a language model during token-row training; {stage.name} does not: "
            "drop it (tierlm eval --core scores a saved model)"
        )
    if family_named(config.model.architecture).seq2seq or config.infra.model_parallel:
        raise ConfigError(
            "training.core_bundle scores a decoder-only model, whole on each rank (no tensor, pipeline or context "
            "parallelism): drop it, or score the saved model with tierlm eval --core"
        )
    bundle_files(config.training.core_bundle)


def _check_neftune(config: TierlmConfig, stage: Stage) -> None:
    """training.neftune_noise_alpha where the noise can be added: one line (a ConfigError) otherwise."""
    from tierlm.errors import ConfigError

    if not stage.supervised:
        raise ConfigError(
            f"training.neftune_noise_alpha noises the embeddings of supervised fine-tuning; {stage.name} does not "
            "take it: drop it"
        )
    if config.infra.backend == "jax" or config.infra.model_parallel:
        raise ConfigError(
            "training.neftune_noise_alpha noises a PyTorch model's embedding table whole on each rank (no JAX "
            "backend, no tensor, pipeline or context parallelism): drop it, or train without those"
        )

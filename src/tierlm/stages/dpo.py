"""Direct Preference Optimization: a chat model learns to prefer the chosen reply of each pair over the
rejected one, against a frozen reference (or reference log-probs stored with the pairs).

    tierlm dpo --config configs/tiny_dpo.yaml
"""

from __future__ import annotations

import torch

from tierlm.backends.references import follow_policy, frozen_reference
from tierlm.builders.companions import precompute_reference
from tierlm.builders.loaders import build_pair_loaders
from tierlm.builders.model import build_model
from tierlm.builders.stage import Stage
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError
from tierlm.run import Run
from tierlm.stages.with_trainer import confirm_batch_size, train_with_trainer
from tierlm.strategies.dpo import preference_strategy
from tierlm.strategies.preference_losses import loss_name, preference_row, resolve_dpo
from tierlm.tasks import synthetic_name


def uses_frozen_reference(config: TierlmConfig) -> bool:
    return config.dpo.reference == "frozen" and preference_row(config.dpo).reference


class DPO(Stage):
    name = "dpo"
    section = "dpo"
    example_kind = "preference"
    chat = True
    starts_from_trained = True
    no_dropout = True
    packing = None
    token_rows = False
    rows_per_example = 2  # a pair's chosen and rejected rows

    def resolve_section(self, config: TierlmConfig) -> TierlmConfig:
        """dpo.* checked against its loss's row (`resolve_dpo`); the JAX backend trains the losses with a twin."""
        dpo = resolve_dpo(config.dpo, jax=config.infra.backend == "jax")
        return config.model_copy(update={"dpo": dpo})

    def parallelism(self, config: TierlmConfig, launched: bool) -> TierlmConfig:
        """Pipeline stages run the loss one micro-batch of whole pairs at a time: the pairs must split evenly, and
        KTO's KL estimate is the whole batch's."""
        infra, pairs = config.infra, config.training.per_device_train_batch_size
        if infra.pipeline_parallel_size > 1:
            pieces = infra.pipeline_pieces
            if preference_row(config.dpo).whole_batch:
                raise ConfigError(
                    f"dpo.loss_type={loss_name(config.dpo)} compares the rows of the whole batch, which pipeline "
                    "stages see one micro-batch at a time: drop infra.pipeline_parallel_size (tensor parallelism or "
                    "FSDP2 run it)"
                )
            if isinstance(pairs, int) and pairs % pieces:
                raise ConfigError(
                    f"pipeline parallelism cuts each micro-batch into infra.pipeline_microbatches={pieces} pieces of "
                    f"whole pairs: make training.per_device_train_batch_size ({pairs}) a multiple of {pieces}"
                )
        return config

    def reference_model(self, config: TierlmConfig | None) -> str | None:
        return "in step" if config is not None and uses_frozen_reference(config) else None

    def trace_batch(self, config: TierlmConfig, rows: int, tokens: int):
        batch, _ = super().trace_batch(config, rows, tokens)
        row = preference_row(config.dpo)
        if row.reference:
            batch["ref_logps"] = torch.zeros(rows)
        if not row.paired:  # one label a reply (KTO: half the rows are the KL estimate's)
            batch["kto_label"] = torch.ones(rows // 2 if row.kl_rows else rows)
        return batch, preference_strategy(config.dpo).compute_loss

    def memory_fixes(self, config: TierlmConfig) -> dict[str, str]:
        return {"reference model": "use dpo.reference=precomputed"}

    def run(self, run: Run, callbacks: list | None = None) -> dict:
        auto_rows = run.config.training.per_device_train_batch_size == "auto"
        config, tokenizer = run.choose_batch_size(), run.tokenizer
        d = config.data
        run.check_memory(
            d.num_synthetic_examples if synthetic_name(d.dataset_name) is not None else 0
        )  # before the pairs render
        model = build_model(config, tokenizer, run.device, run.pretrained)
        if auto_rows:
            confirm_batch_size(run, model)  # CUDA: halved after an out-of-memory
        train_loader, eval_loader = build_pair_loaders(
            run.config, tokenizer, run.data_rank, run.data_parallel_size
        )  # pairs stay whole
        config = run.resolve(model, train_loader)
        jax = config.infra.backend == "jax"
        frozen = uses_frozen_reference(config)  # never for simpo / orpo: they compare the policy with itself
        dpo = config.dpo  # TR-DPO (dpo.reference_sync_steps): a copy that follows the policy, kept in every checkpoint
        follows = dict(sync_every=dpo.reference_sync_steps, alpha=dpo.reference_mixup_alpha)
        reference = frozen_reference(model, run.device, **follows) if frozen and not jax else None
        strategy = preference_strategy(dpo, reference)
        if dpo.reference == "precomputed" and preference_row(dpo).reference:  # the data's, else scored here once
            if scored := precompute_reference(model, [train_loader, eval_loader], strategy, run.device):
                run.note(f"dpo.reference=precomputed: the starting model scored {scored} pairs before training")

        kept = []  # a reference that follows the policy: every checkpoint carries it

        def reference_from(backend) -> None:  # JAX's reference: the initial parameters, run by JAX too
            if frozen and jax:
                strategy.reference = backend.frozen_reference()
            kept.extend(follow_policy(reference, backend))

        return train_with_trainer(
            run, model, strategy, train_loader, eval_loader, callbacks or [], on_backend=reference_from, kept=kept
        )

"""Runs under torchrun (or in-process for the single-process reference) for tests/test_distributed.py.

    torchrun --nproc_per_node=2 tests/distributed_worker.py MODE OUT.json [--steps A:B] [--load CKPT] [--save-at N]
        [--optimizer muon] [--model gpt2]

MODE: single | ddp | fsdp | fsdp_raise (rank 1 raises at step 3) | tp (tensor parallel over the ranks, vocabulary
split) | tp_sp (and sequence parallel) | tp_dp (tensor parallel 2 x FSDP2 over the rest) | pp / pp_gpipe (2 pipeline
stages, 1F1B / GPipe) | tp_pp (tensor 2 x pipeline 2). Every run trains the same tiny GPT on the same global
batches (4 rows x 2 micro-batches per step, uneven trained tokens); rank r takes rows [2r, 2r+2) of each
micro-batch. Rank 0 writes per-step loss and grad norm. `--model gpt2`: a tiny GPT-2 (fused q/k/v, embedding tied
to the head) instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from tierlm.backends import PyTorchTrainingBackend, create_adamw_optimizer
from tierlm.backends.distributed import DDPTrainingBackend, FSDPTrainingBackend
from tierlm.backends.options import BackendOptions
from tierlm.models import GPTConfig, build_gpt
from tierlm.models.gpt2.model import GPT2Config
from tierlm.primitives.optim import RoleSettings, build_optimizer
from tierlm.primitives.optim.muon import REFINEMENTS
from tierlm.primitives.parallel import init_distributed, shutdown_distributed
from tierlm.primitives.schedules import TrainingSchedule

CONFIG = GPTConfig(depth=2, aspect_ratio=32, head_dim=16, n_kv_head=2, vocab_size=97, max_seq_len=32)
GPT2_CONFIG = GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=97, block_size=32)
GPT2_V6_CONFIG = GPT2Config(  # the research variant with the most new parameters: RA, R-MLP, its mixer and gate
    n_layer=2,
    n_head=4,
    n_embd=32,
    vocab_size=97,
    block_size=32,
    ra_r=4,
    rmlp_r_ff=64,
    rmlp_mixer=True,
    rmlp_gate_alpha=True,
)
ROWS, SEQ, ACCUM = 4, 16, 2


def global_micro_batches(step: int) -> list[dict[str, torch.Tensor]]:
    """The same data for every world size: seeded by the step, with rows of uneven trained length."""
    g = torch.Generator().manual_seed(1000 + step)
    batches = []
    for _ in range(ACCUM):
        ids = torch.randint(0, CONFIG.vocab_size, (ROWS, SEQ), generator=g)
        labels = torch.randint(0, CONFIG.vocab_size, (ROWS, SEQ), generator=g)
        valid = torch.randint(1, SEQ + 1, (ROWS, 1), generator=g)
        labels[torch.arange(SEQ).expand(ROWS, SEQ) >= valid] = -100
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def optimizer_factory(name: str, distributed: bool):
    """AdamW over everything, or Muon (hidden matrices, with every refinement: NorMuon's second moment is whole-matrix
    state each rank keeps) + AdamW (the rest) in one container."""
    if name == "muon":
        settings = RoleSettings(
            matrix_lr=0.02,
            embedding_lr=3e-3,
            unembedding_lr=3e-3,
            scalar_lr=3e-3,
            weight_decay=0.1,
            distributed=distributed,
            options={"refinements": REFINEMENTS, "beta2": 0.9},
        )
        return lambda m: build_optimizer("muon", m, settings)
    return lambda m: create_adamw_optimizer(m, lr=3e-3, weight_decay=0.1)


def build(
    mode: str,
    checkpoint_dir: Path,
    activation_checkpointing: bool = False,
    optimizer: str = "adamw",
    architecture: str = "gpt",
    async_save: bool = False,
):
    from tierlm.models.gpt2.family import GPT2_FAMILY

    torch.manual_seed(0)
    gpt2 = GPT2_V6_CONFIG if architecture == "gpt2_v6" else GPT2_CONFIG
    model = build_gpt(CONFIG) if architecture == "gpt" else GPT2_FAMILY.build_from_config(gpt2)
    with torch.no_grad():  # off the zero-initialised projections, so every weight gets a gradient
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    optimizer_fn = optimizer_factory(optimizer, distributed=mode != "single")

    def scheduler_fn(o):
        return TrainingSchedule(o, lambda s: 1.0 / (1 + s), num_training_steps=10, momentum_warmup_steps=5)

    options = BackendOptions(max_grad_norm=0.5)
    checkpointed = replace(options, activation_checkpointing=activation_checkpointing)  # tensor / pipeline, FSDP2
    common = dict(loss_fn=None, checkpoint_dir=checkpoint_dir, device="cpu", scheduler_fn=scheduler_fn)
    if mode == "single":
        optimizer = optimizer_fn(model)
        return PyTorchTrainingBackend(model, optimizer, None, checkpoint_dir, "cpu", scheduler_fn(optimizer), options)
    if mode == "ddp":
        return DDPTrainingBackend(
            model, optimizer_fn, options=replace(options, gradient_accumulation_steps=ACCUM), **common
        )
    if mode in (
        "tp",
        "tp_sp",
        "tp_dp",
        "pp",
        "pp_gpipe",
        "tp_pp",
    ):  # tensor parallel and/or 2 pipeline stages; FSDP2 over the rest
        from tierlm.backends.model_parallel import ModelParallelTrainingBackend
        from tierlm.primitives.model_parallel import ParallelDims

        sizes = (
            {"pipeline": 2}
            if mode.startswith("pp")
            else {"tensor": 2, "pipeline": 2}
            if mode == "tp_pp"
            else {"tensor": 2}
        )
        dims = ParallelDims.from_sizes(torch.distributed.get_world_size(), **sizes)
        schedule = "GPipe" if mode == "pp_gpipe" else "1F1B"
        split = replace(checkpointed, pipeline_schedule=schedule, sequence_parallel=mode == "tp_sp", dims=dims)
        return ModelParallelTrainingBackend(model, optimizer_fn, options=split, **common)
    if mode.startswith("zero"):  # DeepSpeed's engine: zero3 / zero3_offload (optimizer state on the CPU) / zero2
        from tierlm.backends.zero import DeepSpeedTrainingBackend

        zero = replace(options, zero_stage=int(mode[4]), offload_optimizer=mode.endswith("offload"))
        return DeepSpeedTrainingBackend(model, optimizer_fn, options=zero, **common)
    return FSDPTrainingBackend(model, optimizer_fn, options=replace(checkpointed, async_save=async_save), **common)


def run(
    mode: str,
    out: Path,
    first: int,
    last: int,
    load: str | None,
    save_at: int | None,
    checkpoint_dir: Path,
    activation_checkpointing: bool = False,
    optimizer: str = "adamw",
    architecture: str = "gpt",
    async_save: bool = False,
) -> None:
    distributed = mode != "single"
    ctx = init_distributed("cpu", timeout_s=60) if distributed else None
    rank, world = (ctx.rank, ctx.world_size) if ctx else (0, 1)
    backend = build(mode, checkpoint_dir, activation_checkpointing, optimizer, architecture, async_save)
    if load:
        backend.load_checkpoint(load).wait()
    share, shares = (
        getattr(backend, "data_rank", rank),
        getattr(backend, "data_world_size", world),
    )  # a TP group shares rows
    per_rank = ROWS // shares
    records = []
    for step in range(first, last):
        if mode == "fsdp_raise" and rank == 1 and step == 3:
            raise RuntimeError("injected failure on rank 1 at step 3")
        for batch in global_micro_batches(step):
            backend.forward_backward({k: v[share * per_rank : (share + 1) * per_rank] for k, v in batch.items()})
        metrics = backend.optim_step().wait()
        records.append(
            {"step": step + 1, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "lr": metrics["lr"]}
        )
        if save_at is not None and step + 1 == save_at:
            saving = backend.save_checkpoint(step + 1, {"note": "test"})
            if not async_save:  # async: written while the next steps train, sealed at the end
                saving.wait()
    backend.wait_for_save()
    memory = backend.memory_stats()
    if rank == 0:
        out.write_text(json.dumps({"steps": records, "memory": memory, "world_size": world}))


def factories(out: Path, model_folder: str) -> None:
    """The tier-2 factories: FSDP2 and DDP from a model folder, 3 steps each on the same data."""
    from tierlm.backends import create_ddp_backend, create_fsdp_backend

    losses = {}
    for name, create in (("fsdp", create_fsdp_backend), ("ddp", create_ddp_backend)):
        backend = create(
            model_folder, out.parent / f"ckpt_factory_{name}", device_type="cpu", learning_rate=1e-3, bf16=False
        )
        per_rank = ROWS // backend.world_size
        losses[name] = []
        for _ in range(3):
            batch = global_micro_batches(0)[0]  # the same batch: the loss must fall
            backend.forward_backward(
                {k: v[backend.rank * per_rank : (backend.rank + 1) * per_rank] for k, v in batch.items()}
            )
            losses[name].append(backend.optim_step().wait()["loss"])
        if backend.rank == 0:
            out.write_text(json.dumps(losses))


def rollout_batch(step: int) -> dict[str, torch.Tensor]:
    """An RL step's rollouts as the trainer document's `rl_dataloader` yields them: prompt + completion ids, the
    completion's labels (the prompt masked), one advantage per rollout, the sampler's and a reference's log-probs."""
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, CONFIG.vocab_size, (ROWS, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((ROWS, 1), -100)], dim=1)
    labels[:, : SEQ // 2] = -100  # the prompt's positions
    near = -torch.log(torch.tensor(float(CONFIG.vocab_size)))  # old / reference log-probs near the uniform policy's
    return {
        "input_ids": ids,
        "labels": labels,
        "advantages": torch.randn(ROWS, generator=g),
        "old_logprobs": (near + 0.3 * torch.randn(ROWS, SEQ, generator=g)) * (labels != -100),
        "ref_logprobs": (near + 0.3 * torch.randn(ROWS, SEQ, generator=g)) * (labels != -100),
    }


def preference_batch(step: int) -> dict[str, torch.Tensor]:
    """Two chosen rows then their two rejected rows (the reply's labels only) with precomputed reference log-probs."""
    g = torch.Generator().manual_seed(3000 + step)
    ids = torch.randint(0, CONFIG.vocab_size, (ROWS, SEQ), generator=g)
    ids[ROWS // 2 :, : SEQ // 2] = ids[: ROWS // 2, : SEQ // 2]  # each pair shares its prompt
    labels = torch.cat([ids[:, 1:], torch.full((ROWS, 1), -100)], dim=1)
    labels[:, : SEQ // 2 - 1] = -100
    ref = -(SEQ // 2) * torch.log(torch.tensor(float(CONFIG.vocab_size))) + torch.randn(ROWS, generator=g)
    return {"input_ids": ids, "labels": labels, "ref_logps": ref}


def megatron(out: Path, sizes: str, strategies: str = "pretrain,ppo,dpo") -> None:
    """Seed 001's examples: Trainer(backend=MegatronBackend(...), strategy=PretrainStrategy()), its RL example with
    PPOStrategy(kl_coef=0.1, clip_range=0.2) on rollout batches, and DPO on preference pairs, each in turn (a backend
    of its own) in one job; train_step on the same rows on every rank; rank 0 writes each one's losses."""
    from tierlm.backends import MegatronBackend
    from tierlm.loops.trainer import Trainer
    from tierlm.strategies import PPOStrategy, PretrainStrategy
    from tierlm.strategies.dpo import DPOStrategy

    examples = {
        "pretrain": PretrainStrategy,
        "ppo": lambda: PPOStrategy(kl_coef=0.1, clip_range=0.2),
        "dpo": lambda: DPOStrategy(beta=0.1),
    }

    tensor, pipeline = map(int, sizes.split("x"))
    losses: dict[str, list[float]] = {}
    for strategy in strategies.split(","):
        torch.manual_seed(0)  # each example's weights as a job of its own would draw them
        trainer = Trainer(
            backend=MegatronBackend(
                CONFIG,
                tensor_parallel_size=tensor,
                pipeline_parallel_size=pipeline,
                checkpoint_dir=out.parent / f"ckpt_megatron_{strategy}",
                learning_rate=3e-3,
                device_type="cpu",
            ),
            strategy=examples[strategy](),
        )
        model_state = trainer.backend.model_state()
        losses[strategy] = []
        for step in range(6):
            if strategy == "pretrain":
                g = torch.Generator().manual_seed(step % 2)
                batch = {"tokens": torch.randint(0, CONFIG.vocab_size, (4, SEQ + 1), generator=g)}
            else:
                batch = rollout_batch(step) if strategy == "ppo" else preference_batch(step)
            result = trainer.train_step(batch, model_state, model_state.optimizer_state)
            model_state = result.model_state
            losses[strategy].append(result.metrics["loss"])
        rank = trainer.backend.rank
        del trainer, model_state, result
    if rank == 0:
        out.write_text(json.dumps(losses))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "mode",
        choices=[
            "single",
            "ddp",
            "fsdp",
            "fsdp_raise",
            "tp",
            "tp_sp",
            "tp_dp",
            "pp",
            "pp_gpipe",
            "tp_pp",
            "zero3",
            "zero3_offload",
            "zero2",
            "factories",
            "megatron",
        ],
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", default="0:10", help="first:last optimizer steps (0-based, last excluded)")
    parser.add_argument("--load", default=None, help="checkpoint to continue from")
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument(
        "--activation-checkpointing", type=int, default=0, help="FSDP: recompute each block in backward"
    )
    parser.add_argument("--model-folder", default=None, help="factories: the model to load")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    parser.add_argument("--sizes", default="2x1", help="megatron: TENSORxPIPELINE")
    parser.add_argument("--strategies", default="pretrain,ppo,dpo", help="megatron: its examples, in turn")
    parser.add_argument("--model", default="gpt", choices=["gpt", "gpt2", "gpt2_v6"])
    parser.add_argument("--async-save", type=int, default=0, help="FSDP: DCP's async save, overlapping the steps")
    args = parser.parse_args(argv)
    if args.mode == "factories":
        factories(args.out, args.model_folder)
    elif args.mode == "megatron":
        megatron(args.out, args.sizes, args.strategies)
    else:
        first, last = map(int, args.steps.split(":"))
        run(
            args.mode,
            args.out,
            first,
            last,
            args.load,
            args.save_at,
            args.checkpoint_dir or args.out.parent / f"ckpt_{args.mode}",
            bool(args.activation_checkpointing),
            args.optimizer,
            args.model,
            bool(args.async_save),
        )
    shutdown_distributed()  # after the backends are out of scope (see its docstring)


if __name__ == "__main__":
    sys.exit(main())

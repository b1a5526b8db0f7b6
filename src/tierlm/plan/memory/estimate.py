"""Tier 3: how much memory a run takes per rank, known before anything is allocated.

The tensors come from the run itself: one training step of the config's own model, loss,
optimizer and transforms (activation checkpointing, autocast, the fused head) is traced under
`FakeTensorMode` — shapes and dtypes, no memory, no arithmetic — with PyTorch's `MemTracker`,
which reports parameters, gradients, optimizer state and activations at the step's peak. So the
estimate follows the actual layer structure of any family (native GPT, the GPT-2 variants, a
transformers Qwen3), not a formula of hidden size and depth. Around the trace come what it cannot
see: FSDP2's sharding and its gathered blocks, DDP's gradient buckets, the frozen reference of
DPO and KL-regularised RL, the generation KV cache of RL, the data loader, and on CPU the
framework's fixed cost and what the C allocator keeps resident after freeing (`CPU_RETENTION`).

The estimate is checked against measured peaks (RSS growth over the import baseline on CPU,
`torch.cuda.max_memory_allocated` on CUDA) by `tests/test_memory_plan.py` and `bench/memory.py`;
the table is in docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import os
import unittest.mock
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tierlm.backends.distributed import DDPTrainingBackend, FSDPTrainingBackend, prepare_model
from tierlm.backends.expert_parallel import ExpertParallelFSDPTrainingBackend, ExpertParallelTrainingBackend
from tierlm.backends.model_parallel import ModelParallelTrainingBackend
from tierlm.backends.pytorch import PyTorchTrainingBackend
from tierlm.backends.references import FrozenReference, frozen_reference
from tierlm.backends.zero import DeepSpeedTrainingBackend
from tierlm.builders.backend import backend_options
from tierlm.builders.model import describe_model, new_model
from tierlm.builders.optimizer import model_width, optimizer_settings
from tierlm.builders.stage import Stage
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError
from tierlm.metrics.memory import (
    available_memory_bytes,
    format_bytes,
    tracked_peak,
)
from tierlm.models import family_for_folder, family_named, family_of, unwrap_model
from tierlm.models.lora import apply_lora
from tierlm.plan.memory.traces import kept_on_disk
from tierlm.primitives import parse_dtype
from tierlm.primitives.losses import token_logprobs
from tierlm.primitives.optim import build_optimizer
from tierlm.tasks import synthetic_name

CPU_FRAMEWORK_BYTES = 48 * 2**20
"""On CPU, what a run adds beyond its tensors once everything is imported (autograd engine, OpenMP
pools, kernel workspaces, Python objects): measured, a one-layer model's run grows by 46 MB (53 MB
for an FSDP rank) over the import baseline (bench/memory.py's probe)."""
CPU_RETENTION = 0.4
"""On CPU, glibc's heap keeps freed activation memory resident (its mmap threshold rises to the
largest freed block, so later activations come from the heap and leave holes): measured over the
configs of bench/memory.py, the peak RSS exceeds the live tensors by 0.23 (GPT-2, Qwen3) to 0.5
(the native GPT, one process or an FSDP rank) of one micro-batch's activations; 0.4 centres the
estimates (run to run, the same config varies by about 5%; docs/benchmarks.md)."""
CPU_RETENTION_RECOMPUTE = 0.55
"""The same under activation checkpointing, as a share of the activations without it: the blocks
recomputed in the backward cycle that volume through the heap a second time (measured likewise)."""
BYTES_PER_DOCUMENT = 24
"""The loader's hold per document (its index; the documents are read or generated on demand):
measured, 200,000 synthetic documents add 4 MB over 2,000."""
CUDA_MARGIN = 0.10
"""On CUDA, the caching allocator's fragmentation: the pre-flight keeps this share of the device free."""

BACKENDS = {
    "none": PyTorchTrainingBackend,
    "ddp": DDPTrainingBackend,
    "fsdp": FSDPTrainingBackend,
    "deepspeed": DeepSpeedTrainingBackend,
    "model_parallel": ModelParallelTrainingBackend,
    "expert_parallel": ExpertParallelTrainingBackend,
    "expert_parallel_fsdp": ExpertParallelFSDPTrainingBackend,
}
"""The backend of each distributed kind (`tierlm.builders.backend.distributed_kind`): each says how it holds a model."""
PARTS = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer state",
    "activations",
    "FSDP gathered blocks",
    "ZeRO-3 gathered blocks",
    "DDP gradient buckets",
    "reference model",
    "generation KV cache",
    "sampler weights",
    "data loader",
    "framework",
    "allocator retention",
)


@dataclass
class MemoryEstimate:
    """Bytes per rank, by consumer, at the step's peak; `total` is what the run needs."""

    parts: dict[str, float]
    world_size: int = 1
    device_type: str = "cpu"
    micro_batch: tuple[int, int] = (0, 0)
    """(rows, tokens per row) of the traced micro-batch."""
    fixes: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))

    def largest(self) -> tuple[str, float]:
        return max(self.parts.items(), key=lambda item: item[1])

    def table(self) -> str:
        rows, tokens = self.micro_batch
        lines = [
            f"memory per rank ({self.device_type}, {self.world_size} rank{'s' if self.world_size > 1 else ''}, "
            f"micro-batch {rows} x {tokens:,} tokens):"
        ]
        lines += [f"  {name:<22} {format_bytes(b):>12}" for name, b in self.parts.items() if b > 0]
        lines.append(f"  {'total':<22} {format_bytes(self.total):>12}")
        return "\n".join(lines)

    def record(self) -> dict:
        """The estimate as JSON-ready numbers (bytes), as runs write it to memory_estimate.json."""
        rows, tokens = self.micro_batch
        return {
            "total_bytes": self.total,
            "parts_bytes": dict(self.parts),
            "world_size": self.world_size,
            "device_type": self.device_type,
            "micro_batch_rows": rows,
            "micro_batch_tokens": tokens,
        }


# -- the trace ---------------------------------------------------------------------------------
def _fake_model(config: TierlmConfig, vocab_size: int, pretrained) -> nn.Module:
    """The run's model (with its LoRA adapters), uninitialised where it can be: in fake tensors inside an
    active FakeTensorMode."""
    dtype = parse_dtype(config.model.dtype)
    if pretrained is None:
        return new_model(config, vocab_size, "cpu", dtype)
    model = family_for_folder(pretrained).build_from_folder(pretrained, dtype)
    lora = config.model.lora
    if not lora.r:
        return model
    # PEFT moves each new adapter to its base layer's device and dtype with Module.to(), which cannot swap
    # fake parameters; here every tensor is already a CPU fake one, so the moves are skipped (the adapters
    # stay fp32 under a bf16 base: a few KiB to MiB, next to the base's GiB).
    with unittest.mock.patch.object(nn.Module, "to", lambda self, *args, **kwargs: self):
        return apply_lora(model, lora.r, lora.alpha, lora.dropout, lora.target_modules)


def _trace_batch(config: TierlmConfig, stage: Stage, rows: int, tokens: int, seq2seq: bool = False):
    """A fake micro-batch of the stage's shape, and the stage's loss (None: token cross-entropy)."""
    if seq2seq:  # a UL2 batch: encoder and decoder rows
        d = config.data
        target = torch.zeros(rows, d.max_decoder_length, dtype=torch.long)
        return {
            "input_ids": torch.zeros(rows, d.max_encoder_length, dtype=torch.long),
            "decoder_input_ids": target,
            "labels": target.clone(),
        }, None
    return stage.trace_batch(config, rows, tokens)


def _label_logprobs(logits: torch.Tensor, batch) -> dict[str, torch.Tensor]:
    """What a scoring pass keeps: the labels' log-probs (a reference's, or RL's old log-probs)."""
    return {"logprobs": token_logprobs(logits, batch["labels"])}


def _in_step_reference(config: TierlmConfig, model: nn.Module, vocab_size: int, pretrained):
    """The frozen reference a step computes inside itself (DPO's): the policy with its LoRA adapters off, or a
    model of its own."""
    cpu = torch.device("cpu")
    if config.model.lora.r:
        return frozen_reference(model, cpu)
    reference = FrozenReference(_fake_model(config, vocab_size, pretrained), cpu)
    reference.model.requires_grad_(True)  # MemTracker hooks every parameter it sees; forward() runs under no_grad
    return reference


def _optimizer_state(model: nn.Module, optimizer) -> None:
    """The optimizer's state, created as its first step creates it: from zero gradients (the same shapes, without a
    traced forward and backward: half a trace's ops)."""
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@kept_on_disk
def trace_step(
    config: TierlmConfig,
    stage: Stage,
    vocab_size: int,
    rows: int,
    tokens: int,
    pretrained=None,
    generation: tuple[int, int] | None = None,
    fake: bool = True,
) -> dict[str, int]:
    """Bytes at the peak of a training step of `config`'s model on one process, by MemTracker's
    category ({"Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other"}).

    The traced step is a steady one: it holds the optimizer state a first step created.
    `generation` = (samples, length): before it, prefill a cache of that many rows of that length (RL).
    `fake=False` runs the same step on real tensors (to check the fake trace against: small configs only).
    A fake trace made before with the same inputs is read back (`tierlm.plan.memory.traces.kept_on_disk`).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    tr, infra = config.training, config.infra
    cpu = torch.device("cpu")
    with FakeTensorMode() if fake else contextlib.nullcontext():
        model = _fake_model(config, vocab_size, pretrained)
        model = prepare_model(model, cpu, infra.activation_checkpointing, compile=False)
        optimizer = build_optimizer(tr.optimizer, model, optimizer_settings(config, model_width(model)))
        # the run's own options (`backend_options`), its step traced in one process: bf16 autocast or fp32
        dtype = torch.bfloat16 if tr.bf16 else None
        options = replace(backend_options(config), compute_dtype=dtype, loss_scaling=False, async_save=False)
        backend = PyTorchTrainingBackend(model, optimizer, None, Path(os.devnull), cpu, None, options)
        batch, loss_fn = _trace_batch(config, stage, rows, tokens, family_of(model).seq2seq)
        in_step = stage.reference_model(config) == "in step"
        reference = _in_step_reference(config, model, vocab_size, pretrained) if in_step else None

        def scoring() -> None:  # the log-probs of the policy before its update (RL's old log-probs), without gradients
            backend.forward(batch, _label_logprobs)

        held_reference: dict[str, torch.Tensor] = {}

        def reference_pass() -> None:  # the reference's log-probs, computed inside the step (DPO's prepare_batch)
            held_reference["logps"] = reference.forward(batch, _label_logprobs).wait()["logprobs"].sum(-1)

        def step() -> None:
            step_batch = dict(batch)
            if reference is not None:
                if not held_reference:
                    reference_pass()
                step_batch["ref_logps"] = held_reference.pop("logps")
            backend.forward_backward(step_batch, loss_fn)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        _optimizer_state(model, optimizer)  # the tracked step holds it
        fns = [step]
        if generation is not None:  # rollouts are scored before the update
            fns = [scoring, step]
        elif reference is not None and config.model.lora.r:
            # A LoRA reference is the policy itself (adapters off): MemTracker takes one pass of a module
            # per traced call, so its pass is traced on its own, before the step.
            fns = [reference_pass, step]
        out = tracked_peak(fns, model, optimizer)
        if generation is not None:
            held = tracked_peak(_generation_passes(model, *generation), model, optimizer)
            out["Generation"] = (
                held["Total"] - held.get("Parameter", 0) - held.get("Buffer", 0) - held.get("Optstate", 0)
            )
    return out


def _generation_passes(model: nn.Module, samples: int, length: int) -> list:
    """The generation engine's largest cache: one prompt prefilled to `length` - 1 tokens, its cache
    repeated for `samples` completions, one token decoded (run inside the caller's fake mode)."""
    family, state = family_of(model), {}

    @torch.no_grad()
    def prefill() -> None:
        model.eval()
        _, state["cache"] = family.prefill(model, torch.zeros(1, max(1, length - 1), dtype=torch.long), length)
        family.repeat_cache(state["cache"], samples)

    @torch.no_grad()
    def decode() -> None:
        family.decode(model, torch.zeros(samples, dtype=torch.long), state["cache"])
        model.train()

    return [prefill, decode]


def _describe(config: TierlmConfig, vocab_size: int, pretrained) -> nn.Module:
    model = describe_model(config, vocab_size, pretrained)
    assert model is not None, "a hub id cannot be described before its download"
    return model


# -- the estimate ------------------------------------------------------------------------------
def estimate_run_memory(
    config: TierlmConfig,
    world_size: int = 1,
    stage: Stage | None = None,
    vocab_size: int | None = None,
    pretrained: Path | None = None,
    num_documents: int | None = None,
    device_type: str = "cpu",
    rows: int | None = None,
    row_tokens: int | None = None,
    distributed: str | None = None,
) -> MemoryEstimate:
    """Bytes per rank a run of `config` at `stage` (default: pretraining's token rows; `tierlm.stages.STAGES`
    has each stage) needs, by consumer (see the module docstring).

    `vocab_size` defaults to the tokenizer section's; `num_documents` to the synthetic task's
    size; a micro-batch is `rows` x `row_tokens` (default: the stage's, `Stage.micro_batch`);
    `distributed` ("none", "ddp", "fsdp", "deepspeed") defaults to what the config and `world_size` imply
    under torchrun (as the stage runs there: RL's auto is DDP).

    >>> from tierlm.config import TierlmConfig
    >>> config = TierlmConfig.model_validate({"model": {"depth": 1, "aspect_ratio": 32}, "data": {"max_seq_length": 16},
    ...                                       "training": {"per_device_train_batch_size": 2}})
    >>> estimate = estimate_run_memory(config, vocab_size=64)
    >>> sorted(name for name, b in estimate.parts.items() if b > 0)[:4]
    ['activations', 'allocator retention', 'buffers', 'data loader']
    >>> parts = estimate.parts  # AdamW: two fp32 moments (and step counts)
    >>> round(parts["optimizer state"] / parts["parameters"], 2)
    2.0
    """
    tr, d = config.training, config.data
    stage = stage or Stage()
    vocab_size = vocab_size or config.tokenizer.vocab_size
    if distributed is None:  # as a torchrun job of this (resolved: `resolve_config`) config would run
        kind = config.infra.distributed_type
        distributed = "none" if world_size == 1 else kind if kind in ("ddp", "deepspeed") else "fsdp"
        if world_size > 1 and config.infra.expert_parallel_size > 1:
            distributed = "expert_parallel_fsdp" if kind == "fsdp" else "expert_parallel"
    assert isinstance(tr.per_device_train_batch_size, int), (
        "resolve training.per_device_train_batch_size=auto before estimating"
    )
    stage_rows, stage_tokens = stage.micro_batch(config, world_size)
    family = family_for_folder(pretrained) if isinstance(pretrained, Path) else family_named(config.model.architecture)
    rows = rows or stage_rows
    row_tokens = row_tokens or (d.max_decoder_length if family.seq2seq else stage_tokens)  # the trained tokens
    generation = stage.generation(config, world_size, row_tokens)
    peak = trace_step(config, stage, vocab_size, rows, row_tokens, pretrained, generation)
    described = _describe(config, vocab_size, pretrained)
    param_bytes = sum(p.numel() * p.element_size() for p in described.parameters())

    activations = peak.get("Activation", 0) + peak.get("Temp", 0) + peak.get("Other", 0)
    parts = dict.fromkeys(PARTS, 0.0)
    parts.update(parameters=peak.get("Parameter", 0), buffers=peak.get("Buffer", 0), gradients=peak.get("Gradient", 0))
    parts.update({"optimizer state": peak.get("Optstate", 0), "activations": activations})
    layout = _layout(config, world_size)
    parts = BACKENDS[distributed].memory_per_rank(parts, unwrap_model(described), world_size, **layout)  # as it shards
    _beside_the_step(
        parts, config, stage, param_bytes, peak.get("Generation", 0) - activations, generation, distributed
    )
    if num_documents is None:
        num_documents = d.num_synthetic_examples if synthetic_name(d.dataset_name) is not None else 0
    parts["data loader"] = BYTES_PER_DOCUMENT * num_documents
    if device_type == "cpu":
        parts["framework"] = CPU_FRAMEWORK_BYTES
        parts["allocator retention"] = _cpu_retention(config, stage, vocab_size, rows, row_tokens, pretrained, peak)
    return MemoryEstimate(parts, world_size, device_type, (rows, row_tokens), _fixes(config, stage))


def _layout(config: TierlmConfig, world_size: int) -> dict[str, Any]:
    """How the run splits its model over the ranks, as the backends' `memory_per_rank` reads it."""
    infra = config.infra
    return dict(
        compute_bytes=2 if config.training.bf16 else 4,
        sharding=infra.fsdp_sharding_strategy,
        tensor=infra.tensor_parallel_size,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
        pipeline=infra.pipeline_parallel_size,
        context=infra.context_parallel_size,
        zero_stage=infra.deepspeed_zero_stage,
        expert_parallel_size=infra.expert_parallel_size,
    )


def _fixes(config: TierlmConfig, stage: Stage) -> dict[str, str]:
    tr, infra = config.training, config.infra
    if not infra.activation_checkpointing:
        act = "set infra.activation_checkpointing=true"
    elif not tr.fused_cross_entropy:
        act = "set training.fused_cross_entropy=true"
    else:
        act = (
            "lower training.per_device_train_batch_size (raise training.gradient_accumulation_steps to keep the "
            "batch) or data.max_seq_length"
        )
    shard = (
        "shard the model with FSDP across more ranks (torchrun, infra.distributed_type=fsdp), or use a smaller model"
    )
    fixes = {
        "parameters": shard,
        "gradients": shard,
        "optimizer state": shard + " or training.optimizer=muon (one moment)",
        "activations": act,
        "allocator retention": act,
        "buffers": "lower data.max_seq_length",
        "FSDP gathered blocks": "use more, smaller blocks (a deeper, narrower model)",
        "DDP gradient buckets": "use infra.distributed_type=fsdp",
        "data loader": "use less data (data.num_synthetic_examples) or data.stream=true",
        "framework": "use a machine with more memory",
    }
    return {**fixes, **stage.memory_fixes(config)}


def _beside_the_step(parts, config, stage, param_bytes: float, cache_excess: float, generation, distributed: str):
    """What a stage holds beside its traced step: a frozen reference, a generation cache, a sampler's copy."""
    reference = stage.reference_model(config)
    if config.model.lora.r:  # the reference is the base with the adapters off: no second copy
        pass
    elif reference == "in step":  # traced: its weights are among the parameters
        parts["reference model"] = param_bytes
        parts["parameters"] -= param_bytes
    elif reference == "beside":  # its forward takes turns with the policy's old-log-probs pass (traced)
        parts["reference model"] = param_bytes
    if generation is not None:  # generation and training take turns: the cache adds what exceeds the step's activations
        parts["generation KV cache"] = max(0.0, cache_excess)
        if distributed == "fsdp":  # the sharded policy's sampler is a whole copy of it
            parts["sampler weights"] = param_bytes


def _cpu_retention(config, stage, vocab_size, rows, row_tokens, pretrained, peak) -> float:
    """What CPU allocators keep of a step's activations; with activation checkpointing, the recomputed blocks cycle
    the un-checkpointed volume."""
    if not config.infra.activation_checkpointing:
        return CPU_RETENTION * peak.get("Activation", 0)
    plain = config.model_copy(update={"infra": config.infra.model_copy(update={"activation_checkpointing": False})})
    volume = trace_step(plain, stage, vocab_size, rows, row_tokens, pretrained).get("Activation", 0)
    return CPU_RETENTION_RECOMPUTE * volume


def memory_budget(device: torch.device, max_memory_gb: float | None = None, ranks: int = 1) -> float | None:
    """Bytes one rank may use: free device memory less the allocator's margin on CUDA, or on CPU
    the RAM and cgroup limit shared by the `ranks` processes of this machine; at most
    `max_memory_gb` (infra.max_memory_gb). None when nothing says (no limit is checked).

    >>> memory_budget(torch.device("cpu"), max_memory_gb=0.5)
    500000000.0
    """
    available = available_memory_bytes(device)
    if available is not None:
        available = available * (1 - CUDA_MARGIN) if device.type == "cuda" else available / ranks
    if max_memory_gb is not None:
        available = min(available, max_memory_gb * 1e9) if available is not None else max_memory_gb * 1e9
    return None if available is None else float(available)


def check_memory(estimate: MemoryEstimate, budget: float | None) -> None:
    """Refuse a run whose estimate exceeds its `budget` (`memory_budget`): one line naming the
    largest consumer and its cheapest fix.

    >>> estimate = MemoryEstimate({"activations": 3 * 2**30, "parameters": 2**29},
    ...     fixes={"activations": "set infra.activation_checkpointing=true"})
    >>> check_memory(estimate, 2**30)
    Traceback (most recent call last):
    ...
    tierlm.errors.ConfigError: this run needs about 3.5 GiB per rank but 1.0 GiB is available; the largest part is
    activations (3.0 GiB): set infra.activation_checkpointing=true
    """
    if budget is None or estimate.total <= budget:
        return
    name, largest = estimate.largest()
    raise ConfigError(
        f"this run needs about {format_bytes(estimate.total)} per rank but {format_bytes(budget)} is available; "
        f"the largest part is {name} ({format_bytes(largest)}): {estimate.fixes.get(name, 'use a smaller run')}"
    )

"""Quick bounds of a run's memory, from sizes alone: the instant first gate of every training command's
pre-flight (`memory_needs` + `check_fits`: lower bounds, so a refusal is certain) and seed-style
`estimate_model_memory` (Korthikanti et al.'s activations). The traced, exact estimate is
`tierlm.plan.memory.estimate_run_memory`."""

from __future__ import annotations

from pathlib import Path

import torch

from tierlm.builders.model import new_model
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError
from tierlm.metrics.memory import available_memory_bytes, format_bytes
from tierlm.models import family_named


def memory_needs(
    config: TierlmConfig,
    vocab_size: int,
    pretrained,
    num_documents: int,
    world_size: int = 1,
    copies: int = 1,
    rows: int | None = None,
    row_tokens: int | None = None,
) -> dict[str, tuple[float, str]]:
    """Lower bounds of what a run will hold, by consumer: the instant first gate of the pre-flight
    (`check_fits`), before the traced estimate (`Run.check_memory`), so an absurd config (a
    hundred-million-token row) is refused before anything is traced:
    training state (weights, gradients, AdamW moments; sharded under FSDP), frozen copies
    (`copies` - 1: a DPO or KL reference), buffers, one micro-batch's activations and logits, and
    the loader's document index. Each is at most what the run takes, so a refusal is certain.
    A micro-batch is `rows` x `row_tokens` (default: the training batch and data.max_seq_length)."""
    d, tr = config.data, config.training
    rows, T = rows or tr.per_device_train_batch_size, row_tokens or d.max_seq_length
    width = layers = 0
    if pretrained is None:
        meta = new_model(config, vocab_size, "meta")
        params = sum(p.numel() for p in meta.parameters())
        buffers = sum(b.numel() * b.element_size() for b in meta.buffers())
        layers, width = family_named(config.model.architecture).attention_shape(meta)
    elif isinstance(pretrained, Path):
        params, buffers = sum(f.stat().st_size for f in pretrained.glob("*.safetensors")) // 4, 0
    else:
        params, buffers = 0, 0  # a hub id: its size is not known before the download
    shard = world_size  # FSDP's share per rank; under DDP each rank holds it all, so this stays a lower bound
    needs = {
        "the weights, gradients and AdamW state": (
            16 * params / shard,
            "use a smaller model, or shard it with FSDP across more ranks",
        ),
        f"the model's buffers (rotary tables for {max(2048, T):,} positions)": (buffers, "lower data.max_seq_length"),
        f"activations of one micro-batch ({rows} x {T:,} tokens)": (
            6 * 4 * rows * T * width * layers,
            "lower data.max_seq_length or training.per_device_train_batch_size (raise gradient_accumulation_steps), "
            "or set infra.activation_checkpointing=true",
        ),
        f"the data loader's index of {num_documents:,} documents": (
            16 * num_documents,
            "lower data.num_synthetic_examples or use less data",
        ),
    }
    if copies > 1:
        needs["the frozen reference model"] = (
            4 * params * (copies - 1),
            "use dpo.reference=precomputed, or rl.kl_coef=0",
        )
    if not tr.fused_cross_entropy:
        needs[f"logits of one micro-batch ({rows} x {T:,} x {vocab_size:,})"] = (
            4 * rows * T * vocab_size,
            "set training.fused_cross_entropy=true",
        )
    return needs


def check_fits(needs: dict[str, tuple[float, str]], device: torch.device, available: int | None = None) -> None:
    """Refuse, before anything is allocated, a run whose lower-bound memory need exceeds what the
    device has: one line naming the largest consumer and the cheapest fix.

    `needs` maps a consumer ("activations of one micro-batch (8 x 512 tokens)") to (bytes, fix).

    >>> check_fits({"weights": (10 * 2**30, "use a smaller model")}, torch.device("cpu"), available=2**30)
    Traceback (most recent call last):
    ...
    tierlm.errors.ConfigError: this run needs at least 10.0 GiB but 1.0 GiB is available; the largest part is weights
    (10.0 GiB): use a smaller model
    """
    available = available_memory_bytes(device) if available is None else available
    total = sum(b for b, _ in needs.values())
    if available is None or total <= available:
        return
    name, (largest, fix) = max(needs.items(), key=lambda item: item[1][0])
    raise ConfigError(
        f"this run needs at least {format_bytes(total)} but {format_bytes(available)} is available; "
        f"the largest part is {name} ({format_bytes(largest)}): {fix}"
    )


def estimate_model_memory(
    num_params: int,
    batch_size: int,
    seq_length: int,
    hidden_size: int,
    num_layers: int,
    dtype: torch.dtype = torch.bfloat16,
    optimizer: str = "adamw",
    gradient_checkpointing: bool = True,
    vocab_size: int | None = None,
    flash_attention: bool = True,
    num_heads: int | None = None,
) -> dict[str, float]:
    """A quick estimate of training memory in GB (1e9 bytes), from sizes alone.

    Weights and gradients in `dtype`; AdamW's two fp32 moments (Muon: one; SGD and others: none);
    activations per layer as Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models") count them for a GPT block: 34 x s x b x h bytes in 16-bit (scaled for
    fp32), plus 5 x a x s^2 x b when the attention scores are materialised (no flash attention,
    `num_heads` = a); with checkpointing each layer keeps only its input (2 x s x b x h in 16-bit)
    and one layer is recomputed at a time. The logits (s x b x V, fp32, with their gradient) when
    `vocab_size` is given. For a config's exact figure, `tierlm.plan.memory.estimate_run_memory`
    traces its own step.

    >>> est = estimate_model_memory(num_params=1_000_000_000, batch_size=4, seq_length=8192, hidden_size=1024,
    ...     num_layers=28)
    >>> round(est["model_gb"], 1), round(est["optimizer_gb"], 1), round(est["activation_gb"], 1)
    (2.0, 8.0, 3.0)
    """
    bytes_per_value = 2 if dtype in (torch.float16, torch.bfloat16) else 4
    model = num_params * bytes_per_value
    moments = {"adamw": 2, "adam": 2, "adamw_spam": 2, "adamw_prune": 2.25, "muon": 1}.get(optimizer, 0)
    optimizer_bytes = num_params * 4 * moments
    gradients = num_params * bytes_per_value
    tokens = batch_size * seq_length
    per_layer = 34 * tokens * hidden_size * bytes_per_value / 2
    if not flash_attention and num_heads:
        per_layer += 5 * num_heads * seq_length * tokens * bytes_per_value / 2
    if gradient_checkpointing:
        activations = num_layers * 2 * tokens * hidden_size * bytes_per_value / 2 + per_layer
    else:
        activations = num_layers * per_layer
    if vocab_size:
        activations += 2 * 4 * tokens * vocab_size
    total = model + optimizer_bytes + gradients + activations
    return {
        "model_gb": model / 1e9,
        "optimizer_gb": optimizer_bytes / 1e9,
        "gradient_gb": gradients / 1e9,
        "activation_gb": activations / 1e9,
        "total_gb": total / 1e9,
    }

"""How a backend trains beside its model, optimizer and schedule: `BackendOptions`, one value that every backend's
constructor takes (one process, DDP, FSDP2, DeepSpeed, tensor / pipeline parallel, JAX), built once from the config
by `tierlm.builders.backend.backend_options`. Each backend reads the fields it has; the builder refuses in one line
what a backend cannot do.

>>> options = BackendOptions(max_grad_norm=0.5, compute_dtype=torch.bfloat16)
>>> options.max_grad_norm, options.sharding, options.bf16
(0.5, 'FULL_SHARD', True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from tierlm.primitives.model_parallel import ParallelDims


@dataclass(frozen=True)
class BackendOptions:
    max_grad_norm: float = 1.0
    """Clip each step's gradient norm to this (0: no clipping)."""
    compute_dtype: torch.dtype | None = None
    """bf16 / fp16 compute (None: fp32): autocast in one process and under DDP, the param dtype of FSDP2 and of the
    model-parallel backend, DeepSpeed's bf16."""
    loss_scaling: bool = False
    """fp16: losses scaled by a `torch.amp.GradScaler`, a step whose scaled gradients overflowed skipped (reported as
    `loss_scale`, not as a failure)."""
    fused_cross_entropy: bool = True
    """The LM head fused into the loss where the loss reads only the labels' cross-entropy (no (B, T, V) logits)."""
    flash_attention: bool = True
    """False keeps scaled-dot-product attention off its flash kernel (the memory-efficient or plain math kernel)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward."""
    compile: bool | Literal["model"] = False
    """True: `torch.compile` each block (`parallelize`); "model": the backend compiles its whole training forward,
    the loss with it (one process and DDP)."""
    fp8: bool = False
    """FP8 matmuls (torchao's float8 training; H100-class GPUs)."""
    async_save: bool = False
    """Checkpoints staged to CPU memory and written on a background thread."""
    gradient_accumulation_steps: int = 1
    """DDP: micro-batches per step (gradients synchronise on the last)."""
    reduce_dtype: torch.dtype | None = torch.float32
    """FSDP2: the dtype gradients are reduced in."""
    cpu_offload: bool = False
    """FSDP2: parameters, gradients and optimizer state kept in CPU memory."""
    sharding: str = "FULL_SHARD"
    """FSDP2: FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD."""
    broadcast_weights: bool = False
    """FSDP2: the model holds its weights on rank 0 only (the meta device elsewhere); the shards are filled from it."""
    zero_stage: int = 3
    """DeepSpeed: the ZeRO stage."""
    offload_optimizer: bool = False
    """DeepSpeed: the optimizer state in CPU memory."""
    offload_params: bool = False
    """DeepSpeed (ZeRO-3): the parameters in CPU memory."""
    micro_batch_size: int = 1
    """DeepSpeed: rows per micro-batch (its config's train_micro_batch_size_per_gpu)."""
    deepspeed_overrides: dict[str, Any] | None = None
    """DeepSpeed: a JSON config's keys over the ones tierlm writes."""
    pipeline_schedule: str = "1F1B"
    """Pipeline parallelism: the schedule (GPipe, 1F1B, interleaved_1F1B)."""
    pipeline_microbatches: int | None = None
    """Pipeline parallelism: pieces each micro-batch is cut into (None: twice the stages)."""
    stages_per_rank: int = 1
    """Pipeline parallelism: virtual stages per rank (interleaved schedules)."""
    vocab_parallel: bool = True
    """Tensor parallelism: the embedding and the head split by vocabulary."""
    sequence_parallel: bool = False
    """Tensor parallelism: norms and residuals split by sequence."""
    expert_parallel_size: int = 1
    """Expert parallelism: the ranks that share out each mixture-of-experts layer's experts."""
    dims: ParallelDims | None = None
    """Tensor / pipeline parallelism: how the ranks split (pipeline x data x context x tensor)."""

    @property
    def bf16(self) -> bool:
        return self.compute_dtype == torch.bfloat16

"""The infra section: where a run writes, what it runs on, how it splits over ranks and machines (DDP, FSDP2,
DeepSpeed, tensor / pipeline / context parallel), how it logs and watches itself."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from tierlm.config.model import Section, true_false_or


class InfraConfig(Section):
    output_dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/ and the final model/."""
    device_type: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """Where to train; "cuda" on a machine without a GPU is an error, not a fallback."""
    gpu_rank: int = Field(0, ge=0)
    """Which GPU, for single-device runs."""
    num_threads: int | None = Field(None, gt=0)
    """CPU threads for torch (None: torch's default)."""
    progress_bar: bool = True
    """Show a progress bar when attached to a terminal (a log line every logging_steps otherwise)."""
    peak_tflops: float | None = Field(None, gt=0)
    """Peak TFLOP/s for the MFU estimate (default: known GPUs' bf16 peak, a measured matmul rate on CPU)."""
    backend: Literal["pytorch", "jax"] = "pytorch"
    """What computes the steps: PyTorch, or JAX (jax + optax: the native GPT, AdamW, pretraining / SFT /
    DPO, fp32, one process over its local devices; checkpoints are PyTorch's files and cross over)."""
    distributed_type: Literal["auto", "none", "ddp", "fsdp", "deepspeed"] = "auto"
    """Data parallelism under torchrun: "fsdp" (FSDP2, sharded), "ddp" (replicated), "deepspeed" (ZeRO through
    DeepSpeed's engine: `pip install deepspeed`; pretraining and SFT), "none" (one process); "auto" is fsdp when
    torchrun started more than one rank, else none."""
    deepspeed_zero_stage: Literal[1, 2, 3] = 3
    """infra.distributed_type=deepspeed: ZeRO stage 3 partitions parameters, gradients and optimizer state over
    the ranks; 2 the gradients and optimizer state; 1 the optimizer state."""
    deepspeed_offload_optimizer: bool = False
    """infra.distributed_type=deepspeed: keep the optimizer state (and its step) in CPU memory."""
    deepspeed_offload_params: bool = False
    """infra.distributed_type=deepspeed, ZeRO stage 3: keep the parameter partitions in CPU memory too."""
    deepspeed_config: str | None = None
    """infra.distributed_type=deepspeed: a DeepSpeed JSON config whose settings are laid over the ones tierlm
    derives (its batch sizes and accumulation stay tierlm's: the loop owns the step)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks that split each block's attention heads and MLP (Megatron-style, DTensor plans from the model
    family; innermost mesh dimension). Data parallelism (FSDP2) takes the rest of the world size."""
    sequence_parallel: bool = False
    """Tensor parallel: the norms, residual adds and dropout run on each rank's 1/tp share of the tokens
    (Korthikanti et al. 2022): less activation memory, the same communication volume. Needs the vocabulary
    split (infra.vocab_parallel) and a native GPT."""
    vocab_parallel: bool = True
    """Tensor parallel: split the token embedding and the LM head by vocabulary, with the cross-entropy
    computed on the split logits (PyTorch's loss_parallel); false keeps them whole on every rank and the
    fused chunked head + loss. A head tied to the embedding always stays whole."""
    pipeline_parallel_size: int = Field(1, ge=1)
    """Ranks that each hold a stage of consecutive blocks (torch.distributed.pipelining)."""
    pipeline_schedule: Literal["1F1B", "interleaved_1F1B", "GPipe"] = "1F1B"
    """How the stages take turns: 1F1B (one forward, one backward), interleaved 1F1B (each rank holds
    several non-adjacent stages: a smaller bubble), or GPipe (all forwards, then all backwards)."""
    pipeline_microbatches: int | None = Field(None, gt=0)
    """Micro-batches each step's rows split into for the pipeline (default: the number of stages)."""
    stages_per_rank: int = Field(1, ge=1)
    """Pipeline stages each rank holds (interleaved_1F1B: 2 or more)."""
    context_parallel_size: int = Field(1, ge=1)
    """Ranks that split each sequence for attention (ring attention over SDPA's CUDA kernels)."""
    expert_parallel_size: int = Field(1, ge=1)
    """Ranks that share out each mixture-of-experts layer's experts (model.moe): a token's row goes to the rank
    holding its expert and back (all-to-all); DDP replicates the other weights over every rank (auto, ddp), or
    FSDP2 shards them over every rank (infra.distributed_type=fsdp). It divides the ranks and model.moe.num_experts."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward (less memory, ~1/3 more compute)."""
    compile: bool | Literal["model"] = False
    """true: torch.compile each transformer block (slow to start; worth it on GPUs; not with DeepSpeed, JAX or expert
    parallelism). "model": the whole training forward, embedding and loss with the blocks, as one graph (nanochat's way:
    46.6-48.0% MFU, 48.0% through this option, against 40.8% per block for a 478 M GPT on an H200,
    docs/benchmarks.md; one process or DDP; the first step compiles longer; evaluation and generation run the model
    as it is)."""
    cpu_offload: bool = False
    """FSDP only: keep parameter shards, gradients and optimizer state in CPU memory."""
    cpu_ram_efficient_loading: bool = False
    """FSDP only, starting from a tierlm model folder (pretraining or SFT): rank 0 alone reads the weights; the other
    ranks build the model on the meta device and take their shards by broadcast (one copy of the weights in a
    machine's memory instead of one per rank). Accelerate's fsdp_cpu_ram_efficient_loading."""
    fsdp_sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"] = "FULL_SHARD"
    """FSDP only: FULL_SHARD re-shards each block after its forward (least memory); SHARD_GRAD_OP
    keeps them gathered until the backward (no second all-gather); HYBRID_SHARD shards within each
    machine and replicates across machines (2-D mesh)."""
    num_gpus: int | None = Field(None, gt=0)
    """The ranks the run is launched with (the name Accelerate-style FSDP2 training scripts use), checked against
    what the launcher started (None: whatever it started)."""
    dist_timeout_s: float = Field(600.0, gt=0)
    """How long a collective waits for a silent rank before the job fails (instead of hanging)."""
    hang_timeout: float | None = Field(300.0, gt=0)
    """Seconds a step, an evaluation or a save may go without progress (the first step three times as long: it
    compiles and warms up) before every rank writes the stacks of all its threads to hang-rank<R>.txt in the run
    directory and exits naming the phase (`tierlm.loops.monitor`); below infra.dist_timeout_s, so the stacks come
    before a collective's own timeout. None: no watchdog."""
    max_memory_gb: float | None = Field(None, gt=0)
    """Memory each rank may use, in GB (1e9 bytes), for the pre-flight check and the automatic batch
    size (default: what the device has: free GPU memory, or RAM and the cgroup limit shared by the ranks)."""
    wandb_project: str | None = None
    """W&B project (and MLflow experiment), when training.report_to includes them (None: $WANDB_PROJECT, as W&B
    itself reads it, else tierlm)."""
    wandb_run_name: str | None = None
    """W&B run name (default: W&B picks one)."""
    wandb_entity: str | None = None
    """W&B team or user the run belongs to (default: the logged-in user's)."""

    @model_validator(mode="after")
    def _check_hang_timeout(self) -> "InfraConfig":
        if self.hang_timeout is not None and self.hang_timeout >= self.dist_timeout_s:
            raise ValueError(
                f"infra.hang_timeout={self.hang_timeout:g} must be below infra.dist_timeout_s={self.dist_timeout_s:g}: "
                "a stuck collective would fail first, without the stacks of the ranks; lower it or raise the other"
            )
        return self

    @model_validator(mode="after")
    def _check_deepspeed(self) -> "InfraConfig":
        deepspeed = self.distributed_type == "deepspeed"
        asked = [
            name
            for name in ("deepspeed_offload_optimizer", "deepspeed_offload_params", "deepspeed_config")
            if getattr(self, name)
        ]
        if asked and not deepspeed:
            raise ValueError(f"infra.{asked[0]} is a DeepSpeed setting: set infra.distributed_type=deepspeed")
        if not deepspeed:
            return self
        if self.model_parallel:
            raise ValueError(
                "infra.distributed_type=deepspeed shards by ZeRO, not by tensor / pipeline / context parallel "
                "layers: drop those sizes, or use fsdp with them"
            )
        if self.cpu_offload:
            raise ValueError(
                "infra.cpu_offload is FSDP's; with DeepSpeed use infra.deepspeed_offload_optimizer / "
                "deepspeed_offload_params"
            )
        if self.deepspeed_offload_params and self.deepspeed_zero_stage != 3:
            raise ValueError("infra.deepspeed_offload_params needs infra.deepspeed_zero_stage=3")
        if self.backend != "pytorch" or self.compile:
            raise ValueError(
                "infra.distributed_type=deepspeed runs PyTorch's eager modules: drop infra.backend=jax and "
                "infra.compile"
            )
        return self

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_scope(cls, value):
        scopes = "infra.compile is true (each block), false or model (the whole forward)"
        if value is None:
            raise ValueError(f"{scopes}, got None")
        return true_false_or(value, ("model",), scopes)

    @model_validator(mode="after")
    def _check_whole_model_compile(self) -> "InfraConfig":
        if self.compile != "model":
            return self
        sharded = {
            "infra.distributed_type=fsdp": self.distributed_type == "fsdp",
            "tensor / pipeline / context parallel sizes": self.model_parallel,
            "infra.expert_parallel_size": self.expert_parallel_size > 1,
        }
        for what, asked in sharded.items():
            if asked:
                raise ValueError(
                    f"infra.compile=model compiles the whole forward in one process or under DDP, not with {what} "
                    "(which wrap the blocks one by one): use infra.compile=true (each block), or "
                    "infra.distributed_type=ddp"
                )
        return self

    @model_validator(mode="after")
    def _check_expert_parallel(self) -> "InfraConfig":
        if self.expert_parallel_size > 1 and (self.model_parallel or self.distributed_type == "deepspeed"):
            raise ValueError(
                "infra.expert_parallel_size runs beside DDP or FSDP2 (infra.distributed_type=ddp, fsdp or auto), not "
                "with DeepSpeed or tensor / pipeline / context parallel sizes: drop one of them"
            )
        if (
            self.expert_parallel_size > 1
            and self.distributed_type == "fsdp"
            and (self.cpu_offload or self.fsdp_sharding_strategy == "HYBRID_SHARD")
        ):
            raise ValueError(
                "infra.expert_parallel_size with FSDP2 shards the dense weights over every rank in memory: drop "
                "infra.cpu_offload and infra.fsdp_sharding_strategy=HYBRID_SHARD"
            )
        return self

    @model_validator(mode="after")
    def _check_sequence_parallel(self) -> "InfraConfig":
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError(
                "infra.sequence_parallel splits the tokens over the tensor-parallel ranks: set "
                "infra.tensor_parallel_size > 1"
            )
        if self.sequence_parallel and not self.vocab_parallel:
            raise ValueError(
                "infra.sequence_parallel needs infra.vocab_parallel=true (the split embedding scatters the sequence)"
            )
        return self

    @property
    def model_parallel(self) -> bool:
        """Is the model itself split over ranks (tensor, pipeline or context parallel)?"""
        return max(self.tensor_parallel_size, self.pipeline_parallel_size, self.context_parallel_size) > 1

    @property
    def pipeline_pieces(self) -> int:
        """The micro-batches a pipelined step's rows split into: infra.pipeline_microbatches, else one per stage."""
        return self.pipeline_microbatches or self.pipeline_parallel_size * self.stages_per_rank

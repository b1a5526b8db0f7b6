"""Tier 3: the pieces a pretrain, SFT or DPO run is assembled from (model, backend, strategy; the
loaders are `tierlm.build.loaders`') and `run_stage`, which puts them on the run skeleton of `tierlm.run`."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import torch

from tierlm.backends.distributed import DDPTrainingBackend, FSDPTrainingBackend, prepare_model
from tierlm.backends.pytorch import PyTorchTrainingBackend, frozen_reference
from tierlm.checkpoint import average_checkpoints, list_checkpoints
from tierlm.config import TierlmConfig
from tierlm.data import Prefetcher, RankSlice, Tokenizer
from tierlm.errors import ConfigError
from tierlm.build.loaders import build_loaders, build_pair_loaders
from tierlm.metrics import flops_per_token, peak_flops
from tierlm.metrics.memory import auto_find_batch_size, check_fits
from tierlm.models import family_named, forward_cross_entropy, is_native_folder, load_pretrained_model, model_max_seq_len
from tierlm.models.lora import apply_lora, qlora_quantization_config
from tierlm.plan.scaling import model_width, new_model, optimizer_settings
from tierlm.primitives import create_warmup_scheduler, parse_dtype
from tierlm.primitives.optim import build_optimizer
from tierlm.primitives.parallel import DistributedContext, shutdown_distributed
from tierlm.run import Run, distributed_kind, extras_writer, prepare_run
from tierlm.strategies import PretrainStrategy, Seq2SeqStrategy, SFTStrategy
from tierlm.strategies.dpo import DPOStrategy
from tierlm.loops.trainer import Trainer


def build_model(config: TierlmConfig, tokenizer: Tokenizer, device: torch.device, pretrained) -> torch.nn.Module:
    m, dtype = config.model, parse_dtype(config.model.dtype)
    family = family_named(m.architecture)
    check_lora_request(config, device, pretrained)
    if m.load_in_4bit:
        return with_lora(config, load_4bit_model(config, pretrained, device))
    imported = None
    if pretrained is not None and family.native and isinstance(pretrained, Path) and not is_native_folder(pretrained):
        imported = family.import_transformers(pretrained, device, dtype, tokenizer.vocab_size)  # e.g. GPT-2 weights as tierlm's gpt2
    if pretrained is not None and imported is None:
        model = load_pretrained_model(pretrained, device=device, dtype=dtype, trust_remote_code=m.trust_remote_code)
    else:
        model = imported if imported is not None else new_model(config, tokenizer.vocab_size, device, dtype)
        if getattr(family, "seq2seq", False):  # the decoder starts from what UL2DataCollator starts it from: padding
            model.config.decoder_start_token_id = model.config.pad_token_id = tokenizer.pad_id
    vocab = model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings") else model.config.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary has {vocab}; use a matching tokenizer")
    max_len = model_max_seq_len(model)
    if max_len is not None and config.data.max_seq_length > max_len:
        raise ConfigError(f"data.max_seq_length ({config.data.max_seq_length}) exceeds the model's maximum ({max_len})")
    return with_lora(config, model)


def check_lora_request(config: TierlmConfig, device: torch.device, pretrained) -> None:
    """Refuse, in one line each, what LoRA and 4-bit loading cannot do."""
    m = config.model
    if m.lora.r and pretrained is None:
        raise ConfigError("model.lora trains adapters on a trained model: set model.model_name_or_path (from scratch, train the whole model)")
    if not m.load_in_4bit:
        return
    if not m.lora.r:
        raise ConfigError("model.load_in_4bit freezes 4-bit weights, which cannot train: set model.lora.r (QLoRA)")
    if device.type != "cuda":
        raise ConfigError(f"model.load_in_4bit needs a CUDA GPU (bitsandbytes' 4-bit kernels); this run is on {device.type}: "
                          "drop model.load_in_4bit and train LoRA on full-precision weights")
    if pretrained is None or is_native_folder(pretrained) or family_named(m.architecture).native:
        raise ConfigError("model.load_in_4bit loads a transformers model (hub id or folder); a tierlm-native model loads in full precision")


def load_4bit_model(config: TierlmConfig, pretrained, device: torch.device) -> torch.nn.Module:
    """A transformers model with NF4 weights (QLoRA), ready for adapters (norms in fp32, input grads on)."""
    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("model.load_in_4bit needs bitsandbytes: pip install bitsandbytes")
    from peft import prepare_model_for_kbit_training

    compute = torch.bfloat16 if config.training.bf16 else torch.float16
    model = AutoModelForCausalLM.from_pretrained(str(pretrained), quantization_config=qlora_quantization_config(compute),
                                                 device_map={"": device.index or 0}, trust_remote_code=config.model.trust_remote_code)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # tierlm's own checkpointing applies


def with_lora(config: TierlmConfig, model: torch.nn.Module) -> torch.nn.Module:
    """The model with model.lora's adapters injected (unchanged without them)."""
    lora = config.model.lora
    if not lora.r:
        return model
    return apply_lora(model, lora.r, lora.alpha, lora.dropout, lora.target_modules, base_model=config.model.model_name_or_path)


def memory_needs(config: TierlmConfig, vocab_size: int, pretrained, num_documents: int, world_size: int = 1,
                 copies: int = 1, rows: int | None = None, row_tokens: int | None = None) -> dict[str, tuple[float, str]]:
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
        "the weights, gradients and AdamW state": (16 * params / shard, "use a smaller model, or shard it with FSDP across more ranks"),
        f"the model's buffers (rotary tables for {max(2048, T):,} positions)": (buffers, "lower data.max_seq_length"),
        f"activations of one micro-batch ({rows} x {T:,} tokens)": (
            6 * 4 * rows * T * width * layers,
            "lower data.max_seq_length or training.per_device_train_batch_size (raise gradient_accumulation_steps), "
            "or set infra.activation_checkpointing=true"),
        f"the data loader's index of {num_documents:,} documents": (16 * num_documents, "lower data.num_synthetic_examples or use less data"),
    }
    if copies > 1:
        needs["the frozen reference model"] = (4 * params * (copies - 1), "use dpo.reference=precomputed, or rl.kl_coef=0")
    if not tr.fused_cross_entropy:
        needs[f"logits of one micro-batch ({rows} x {T:,} x {vocab_size:,})"] = (4 * rows * T * vocab_size, "set training.fused_cross_entropy=true")
    return needs


def build_backend(config: TierlmConfig, model: torch.nn.Module, checkpoint_dir: Path, device: torch.device,
                  ctx: DistributedContext | None) -> PyTorchTrainingBackend:
    """The tier-0 backend the config asks for: one process, DDP or FSDP2 (with AC / compile / offload)."""
    tr, infra = config.training, config.infra

    kind = distributed_kind(config, ctx)
    settings = optimizer_settings(config, model_width(model), distributed=kind != "none")  # the plan's values

    def optimizer_fn(m: torch.nn.Module) -> torch.optim.Optimizer:  # after wrapping: FSDP2's parameters are the shards
        return build_optimizer(tr.optimizer, m, settings)

    def scheduler_fn(optimizer: torch.optim.Optimizer):
        return create_warmup_scheduler(optimizer, tr.warmup_steps, tr.num_train_steps, tr.lr_scheduler_type, tr.min_lr_ratio,
                                       tr.warmdown_ratio, momentum_warmup_steps=tr.muon_momentum_warmup_steps)

    if infra.backend == "jax":
        return jax_backend(config, model, checkpoint_dir, kind, optimizer_fn, scheduler_fn)
    bf16 = torch.bfloat16 if tr.bf16 else None
    scaler = None
    if tr.fp16:
        if device.type != "cuda":
            raise ConfigError("training.fp16 (fp16 autocast with loss scaling) needs a CUDA GPU; on CPU use training.bf16=true or neither")
        if kind == "fsdp":
            raise ConfigError("training.fp16 is for one process or DDP; with FSDP use training.bf16=true")
        bf16, scaler = torch.float16, torch.amp.GradScaler(device.type)
    if kind == "model_parallel":
        return model_parallel_backend(config, model, checkpoint_dir, device, ctx, optimizer_fn, scheduler_fn, bf16)
    if kind == "fsdp":
        return FSDPTrainingBackend(
            model, optimizer_fn, None, checkpoint_dir, device, scheduler_fn, tr.max_grad_norm, param_dtype=bf16,
            activation_checkpointing=infra.activation_checkpointing, compile=infra.compile, cpu_offload=infra.cpu_offload,
            fused_cross_entropy=tr.fused_cross_entropy, fp8=tr.fp8, sharding=infra.fsdp_sharding_strategy,
            flash_attention=config.model.use_flash_attention,
        )
    if infra.cpu_offload:
        raise ConfigError("infra.cpu_offload is an FSDP option; set infra.distributed_type=fsdp (under torchrun) or turn it off")
    if kind == "ddp":
        return DDPTrainingBackend(
            model, optimizer_fn, None, checkpoint_dir, device, scheduler_fn, tr.max_grad_norm, bf16,
            tr.gradient_accumulation_steps, infra.activation_checkpointing, infra.compile, tr.fused_cross_entropy, fp8=tr.fp8,
            grad_scaler=scaler, flash_attention=config.model.use_flash_attention,
        )
    model = prepare_model(model, device, infra.activation_checkpointing, infra.compile, tr.fp8)
    optimizer = optimizer_fn(model)
    return PyTorchTrainingBackend(
        model, optimizer, None, checkpoint_dir, device, scheduler_fn(optimizer), tr.max_grad_norm, bf16, async_save=tr.async_save,
        fused_cross_entropy=tr.fused_cross_entropy, grad_scaler=scaler, flash_attention=config.model.use_flash_attention,
    )


def model_parallel_backend(config: TierlmConfig, model: torch.nn.Module, checkpoint_dir: Path, device: torch.device,
                           ctx: DistributedContext, optimizer_fn, scheduler_fn, bf16: torch.dtype | None):
    """Pipeline stages x tensor parallel (the family's plans) x FSDP2 over the data-parallel rest; what it does not do is
    refused in one line each."""
    from tierlm.backends.model_parallel import ModelParallelTrainingBackend
    from tierlm.models.lora import has_lora
    from tierlm.primitives.model_parallel import ParallelDims

    tr, infra = config.training, config.infra
    dims = ParallelDims.from_sizes(ctx.world_size, infra.tensor_parallel_size, infra.pipeline_parallel_size, infra.context_parallel_size)
    refusals = {
        "infra.context_parallel_size > 1 (ring attention needs SDPA's CUDA flash / efficient kernels; not built)": dims.cp > 1,
        "infra.stages_per_rank > 1 without infra.pipeline_schedule=interleaved_1F1B": infra.stages_per_rank > 1 and infra.pipeline_schedule != "interleaved_1F1B",
        "training.fp16 (use training.bf16)": tr.fp16, "training.fp8": tr.fp8, "infra.cpu_offload": infra.cpu_offload,
        f"training.optimizer={tr.optimizer} (AdamW only: Muon orthogonalises and AdamWPrune ranks whole matrices)": tr.optimizer != "adamw",
        "model.lora": has_lora(model), "infra.fsdp_sharding_strategy=HYBRID_SHARD": infra.fsdp_sharding_strategy == "HYBRID_SHARD",
    }
    for what, asked in refusals.items():
        if asked:
            raise ConfigError(f"model parallelism does not do {what}: drop it, or train data-parallel (tensor / pipeline sizes 1)")
    return ModelParallelTrainingBackend(
        model, optimizer_fn, None, checkpoint_dir, device, dims, scheduler_fn, tr.max_grad_norm, param_dtype=bf16,
        activation_checkpointing=infra.activation_checkpointing, compile=infra.compile, fused_cross_entropy=tr.fused_cross_entropy,
        flash_attention=config.model.use_flash_attention, schedule=infra.pipeline_schedule, microbatches=infra.pipeline_microbatches,
        stages_per_rank=infra.stages_per_rank, vocab_parallel=infra.vocab_parallel, sequence_parallel=infra.sequence_parallel,
    )


def jax_backend(config: TierlmConfig, model: torch.nn.Module, checkpoint_dir: Path, kind: str, optimizer_fn, scheduler_fn):
    """infra.backend=jax: what it does not do is refused in one line each."""
    from tierlm.backends.jax_backend import JaxTrainingBackend

    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("optax") is None:
        raise ConfigError("infra.backend=jax needs jax and optax: pip install 'tierlm[jax]' (or use infra.backend=pytorch)")

    tr, infra, m = config.training, config.infra, config.model
    refusals = {"torchrun (one JAX process uses its local devices)": kind != "none", "training.bf16 / fp16 (fp32 only)": tr.bf16 or tr.fp16,
                "training.fp8": tr.fp8, "infra.compile (jax.jit compiles)": infra.compile,
                "infra.activation_checkpointing": infra.activation_checkpointing, "model.lora": bool(m.lora.r),
                f"training.optimizer={tr.optimizer} (AdamW only)": tr.optimizer != "adamw", f"model.dtype={m.dtype} (fp32 only)": m.dtype != "float32"}
    for what, asked in refusals.items():
        if asked:
            raise ConfigError(f"infra.backend=jax does not do {what}: drop it or use infra.backend=pytorch")
    optimizer = optimizer_fn(model)
    return JaxTrainingBackend(model, optimizer, checkpoint_dir, scheduler_fn(optimizer), tr.max_grad_norm)


def eval_sampler(config: TierlmConfig, tokenizer: Tokenizer, stage: str, kind: str):
    """model -> greedy completions of training.sample_prompts (user turns for chat stages), or None
    when there is nothing to sample or the model is sharded (FSDP ranks would have to generate together)."""
    from tierlm.rollout.engine import Engine, prompt_tokens, readable_text

    tr = config.training
    if not tr.sample_prompts or kind in ("fsdp", "model_parallel"):
        return None
    chat = stage != "pretrain" and tokenizer.has_chat_template
    prompts = [(p, prompt_tokens(tokenizer, p, chat)) for p in tr.sample_prompts]

    def sample(model: torch.nn.Module) -> list[dict[str, str]]:
        engine = Engine(model, tokenizer.stop_ids, tokenizer)
        room = engine.max_len()
        return [{"prompt": text, "completion": readable_text(tokenizer, engine.generate(ids, 1, min(tr.sample_max_new_tokens, room - len(ids)),
                                                                                        temperature=0.0)[0].tokens)}
                for text, ids in prompts if len(ids) < room]

    return sample


def write_pruning_results(output_dir: Path, summary: dict, optimizer) -> None:
    """results.json of a pruned run: val loss and perplexity at the reached sparsity, the best val loss,
    parameters and the share of zero weights, CPU inference latency p50/p95 at two lengths, peak RSS."""
    import json
    import math
    import resource

    from tierlm.primitives.optim import optimizer_metrics
    from tierlm.metrics.report import model_figures

    results = {"sparsity": optimizer_metrics(optimizer).get("sparsity", 0.0), "steps": summary.get("step")}
    if "val_loss" in summary:
        results.update(val_loss=summary["val_loss"], perplexity=math.exp(min(summary["val_loss"], 50)))
    results.update(model_figures(output_dir / "model"))
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    if torch.cuda.is_available():
        results["gpu_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    (output_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")


class _TrainingLoss(torch.nn.Module):
    """The model's training loss on a batch of token ids, through the family's (fused) head."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return forward_cross_entropy(self.model, {"input_ids": input_ids, "labels": input_ids})[0]


def confirm_batch_size(run: Run, model: torch.nn.Module) -> int:
    """One real forward/backward at the planned micro-batch (`auto_find_batch_size`, the seed's
    search, started there): on CUDA an out-of-memory halves it and tries again; the run's config
    takes the size that ran. DPO's micro-batch holds two rows (chosen, rejected) per pair. (Not
    under FSDP: before sharding, each rank holds the whole model, which the sharded run does not.)"""
    tr, T = run.config.training, run.config.data.max_seq_length
    rows_per_item = 2 if run.stage == "dpo" else 1

    def sample(n: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.zeros(n * rows_per_item, T, dtype=torch.long, device=run.device)}

    rows = auto_find_batch_size(_TrainingLoss(model), sample, start_batch_size=tr.per_device_train_batch_size, predict_on_cpu=False)
    if rows != tr.per_device_train_batch_size:
        if run.is_main:
            print(f"training.per_device_train_batch_size=auto: {rows} rows (ran out of memory at {tr.per_device_train_batch_size})", flush=True)
        run.set_batch_size(rows)
    return rows


def run_stage(config: TierlmConfig, stage: str, callbacks: list | None = None) -> dict:
    """Train one stage ("pretrain" | "sft" | "dpo") as the config says; returns the run summary.

    Under torchrun every rank calls this; rank 0 writes the logs and the final model.
    """
    assert stage in ("pretrain", "sft", "dpo"), f"stage must be pretrain, sft or dpo, got {stage!r}"
    run = prepare_run(config, stage)
    summary = _train_stage(run, callbacks or [])
    if run.ctx is not None:  # only after success: a failed rank just exits, and torchrun stops the others
        shutdown_distributed()
    return summary


def _train_stage(run: Run, callbacks: list) -> dict:
    stage, tokenizer, ctx = run.stage, run.tokenizer, run.ctx
    auto_rows = run.config.training.per_device_train_batch_size == "auto"
    config = run.choose_batch_size()
    if stage == "dpo":  # pairs are rendered when opened: check the memory first
        documents = config.data.num_synthetic_examples if config.data.dataset_name.startswith("synthetic:") else 0
        copies = 2 if config.dpo.reference == "frozen" else 1
        check_fits(memory_needs(config, tokenizer.vocab_size, run.pretrained, documents, run.world_size, copies), run.device)
        run.check_memory(documents)
    else:
        train_loader, eval_loader = build_loaders(config, stage, tokenizer, run.data_parallel_size, run.seq2seq)
        check_fits(memory_needs(config, tokenizer.vocab_size, run.pretrained, train_loader.resident_documents, run.world_size), run.device)
        run.check_memory(train_loader.resident_documents)
    model = build_model(config, tokenizer, run.device, run.pretrained)
    if auto_rows and run.kind not in ("fsdp", "model_parallel") and confirm_batch_size(run, model) != config.training.per_device_train_batch_size:  # CUDA: halved after an OOM
        config = run.config
        if stage != "dpo":
            train_loader, eval_loader = build_loaders(config, stage, tokenizer, run.data_parallel_size, run.seq2seq)
    if stage == "dpo":
        train_loader, eval_loader = build_pair_loaders(config, tokenizer, run.data_rank, run.data_parallel_size)  # pairs stay whole
    config = run.resolve(model)
    if stage == "dpo":
        torch_reference = config.dpo.reference == "frozen" and config.infra.backend == "pytorch"  # (JAX's: below)
        strategy = DPOStrategy(config.dpo.beta, frozen_reference(model, run.device) if torch_reference else None)
    else:
        train_loader = RankSlice(train_loader, run.data_rank, run.data_parallel_size) if ctx else train_loader
        strategy = (Seq2SeqStrategy if run.seq2seq else PretrainStrategy if stage == "pretrain" else SFTStrategy)(tokenizer.token_bytes())
    backend = build_backend(config, model, run.checkpoint_dir, run.device, ctx)
    if stage == "dpo" and config.dpo.reference == "frozen" and config.infra.backend == "jax":
        strategy.reference = backend.frozen_reference()  # the initial parameters, computed by JAX too
    trainer = Trainer(
        backend, strategy, train_loader=train_loader, eval_loader=eval_loader, config=config.training,
        flops_per_token=flops_per_token(model, config.data.max_seq_length), peak_flops=peak_flops(run.device, config.infra.peak_tflops),
        write_extra=extras_writer(config, tokenizer, stage), progress_bar=config.infra.progress_bar,
        sampler=None if run.seq2seq else eval_sampler(config, tokenizer, stage, run.kind), callbacks=callbacks,
    )
    run.begin(trainer)
    prefetch = config.data.prefetch_batches if config.data.prefetch_batches is not None else (2 if run.device.type != "cpu" else 0)
    if prefetch and stage != "dpo":  # started after resuming, so it starts from the resumed position
        trainer.train_loader = Prefetcher(trainer.train_loader, prefetch)
    try:
        summary = run.train(trainer)
    finally:
        if isinstance(trainer.train_loader, Prefetcher):
            trainer.train_loader.close()
    run.finish(backend.model, summary, backend)
    tr = config.training
    if run.is_main and tr.optimizer == "adamw_prune":  # the pruning evaluation, beside the run's model
        write_pruning_results(run.output_dir, summary, backend.optimizer)
    if run.is_main and tr.average_last_n:
        recent = list_checkpoints(run.checkpoint_dir)[-tr.average_last_n :]
        if len(recent) >= 2:
            averaged = run.output_dir / "model_averaged"
            shutil.rmtree(averaged, ignore_errors=True)  # this run's own output, rewritten at each finish
            summary["averaged_model_dir"] = str(average_checkpoints(recent, averaged))
    return summary

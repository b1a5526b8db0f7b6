"""Typed config sections, loaded from YAML with dotted `key=value` overrides, validated once.

OmegaConf reads the YAML and merges the command-line overrides (so `${...}` interpolation works);
pydantic validates the result against the sections below. Every problem becomes one line that
names the key: `training.learning_rate must be > 0, got -1`.

>>> config = TierlmConfig.load(None, ["training.learning_rate=3e-4", "model.depth=2"])
>>> config.training.learning_rate, config.model.depth
(0.0003, 2)
>>> TierlmConfig.load(None, ["training.learnig_rate=1"])
Traceback (most recent call last):
...
tierlm.errors.ConfigError: unknown key training.learnig_rate (did you mean training.learning_rate?)
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from tierlm.config.files import describe_error, read_config
from tierlm.config.infra import InfraConfig
from tierlm.config.model import (
    ModelConfig,
    Section,
    TokenizerConfig,
)
from tierlm.config.post_training import DPOConfig, EngineConfig, RewardModelConfig, RLConfig
from tierlm.errors import ConfigError


class MixtureComponent(Section):
    dataset_name: str
    """A source, as data.dataset_name."""
    weight: float = Field(1.0, gt=0)
    """Passes over this source per mixture epoch: 2 repeats it twice, 0.5 takes a random half."""
    split: str | None = None
    """Its training split (None: data.split), e.g. MMLU's auxiliary_train."""
    dataset_config: str | None = None
    """Its hub config (None: data.dataset_config), e.g. "main" of openai/gsm8k."""


class DataConfig(Section):
    dataset_name: str = "synthetic:arithmetic"
    """Training data: "synthetic:<task>", a .txt/.jsonl/.parquet/.bin/.npy file, a folder of them, a saved HF
    dataset, or a hub dataset name."""
    mixture: list[MixtureComponent] = Field(default_factory=list)
    """Train on several sources instead of dataset_name: a list of {dataset_name, weight}."""
    dataset_config: str | None = None
    """A hub dataset's config (subset) name, e.g. "sample-10BT" of HuggingFaceFW/fineweb-edu."""
    split: str = "train"
    """The training split of a dataset with named splits (a hub name, or a folder laid out as the
    Hub serves one, e.g. train_sft of HuggingFaceH4/ultrachat_200k)."""
    eval_split: str | None = None
    """Its evaluation split (default: the first of validation / val / test it has, else a held-out
    tail of data.split of data.val_fraction)."""
    revision: str | None = None
    """A hub dataset's branch, tag or commit."""
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    """datasets' data_files: which files of a folder or hub dataset to read (a glob, a list, or
    {split: glob(s)}); with a builder name as data.dataset_name ("json", "parquet", "csv", "text") the files
    themselves."""
    streaming: bool = False
    """Read a hub dataset (or a folder or parquet file through datasets) as a stream: nothing is
    downloaded or cached up front; the position in the stream is part of the loader state (exact resume).
    Pretraining and SFT; evaluation reads the first batches of the eval split (or the stream's first
    data.eval_stream_examples rows when the dataset has no eval split, which training then skips)."""
    shuffle_buffer_size: int = Field(10000, ge=1)
    """Streaming: documents held in the shuffle buffer; each next document is drawn from it at random
    (1: stream order). Saved with the loader state."""
    eval_stream_examples: int = Field(200, gt=0)
    """Streaming without an eval split: rows at the stream's head held out for evaluation."""
    preprocessing_num_workers: int | None = Field(None, gt=0)
    """Processes datasets uses to prepare a (non-streamed) dataset on first load (the name transformers' example
    training scripts use)."""
    eval_dataset_name: str | None = None
    """Validation data; None holds out data.val_fraction of the training data (synthetic tasks have a disjoint val
    split)."""
    val_fraction: float = Field(0.05, gt=0, lt=1)
    """Share of file-based examples held out for validation when no eval dataset is given."""
    num_synthetic_examples: int = Field(50000, gt=0)
    """Training examples generated for a synthetic task."""
    num_synthetic_eval_examples: int = Field(512, gt=0)
    """Validation examples generated for a synthetic task."""
    max_encoder_length: int = Field(512, gt=2)
    """Encoder-decoder (UL2): tokens per encoder row (packed examples' inputs, mode tokens included)."""
    max_decoder_length: int = Field(128, gt=2)
    """Encoder-decoder (UL2): tokens per decoder row (packed examples' targets, end-of-sequence included)."""
    ul2_task_weights: list[float] = Field(default_factory=lambda: [1.0, 1.0, 1.0, 1.0, 4.0])
    """Encoder-decoder (UL2): how often each denoiser makes an example: R (span 3, 15%), R (span 8, 15%),
    X (span 3, 50%), X (span 64, 50%), S (prefix LM); see tierlm.data.ul2."""
    max_seq_length: int = Field(256, gt=1)
    """Tokens per training row (model inputs; the labels are the same row shifted by one)."""
    text_column: str = "text"
    """JSONL field holding a pretraining document."""
    messages_column: str = "messages"
    """JSONL field holding a conversation (a list of {role, content}, or ShareGPT's {from, value}); while it is
    "messages", a row without one is read from ShareGPT's `conversations`."""
    prompt_column: str = "prompt"
    """JSONL field holding a prompt (with completion_column, an alternative to messages): a string or messages."""
    completion_column: str = "completion"
    """JSONL field holding the completion that answers prompt_column (a string or messages); SFT trains on it
    alone (TRL's completion-only loss)."""
    chosen_column: str = "chosen"
    """DPO: the preferred reply (a string answering prompt_column, or a conversation)."""
    rejected_column: str = "rejected"
    """DPO: the dispreferred reply (same form as chosen_column)."""
    question_column: str = "question"
    """RL: the prompt (a string; else prompt_column, or messages_column as a conversation)."""
    answer_column: str = "answer"
    """RL: the reference answer, read by data.answer_pattern."""
    domain_column: str = "domain"
    """RL: the field naming a prompt's domain, which picks its teacher in multi-teacher distillation (rl.teachers);
    a synthetic task's domain is its name (arithmetic, sums, ...)."""
    answer_pattern: str | None = None
    """RL: a regex finding the reference number in answer_column (its first group, else the whole
    match); None: the number after GSM8K's '####', else the last number."""
    task_format: Literal["auto", "number", "math", "choice", "code"] = "auto"
    """RL and eval: the layout of the task rows, and so their reward (`tierlm.tasks.formats`): number (GSM8K's
    question / answer), math (MATH's problem / solution, checked by math-verify), choice (ARC, MMLU), code
    (HumanEval, MBPP: the tests run in the sandbox); auto: by the rows' columns."""
    tools_column: str = "tools"
    """SFT: the function schemas a conversation may call (a list, or it as a JSON string), rendered by
    the chat template with the assistant turns' tool_calls."""
    chat_template: str | None = None
    """The chat template to train and export with: "chatml" (Hermes/Qwen tool calls), "tierlm", or a
    Jinja file; None keeps the tokenizer's own (a tokenizer without one cannot do SFT)."""
    train_on: Literal["all_assistant", "last_assistant", "everything"] = "all_assistant"
    """SFT: which tokens carry loss."""
    long_documents: Literal["auto", "crop", "split"] = "auto"
    """Pretraining: a document longer than the room left in a row is cropped (the rest dropped,
    nanochat's BOS-aligned rows) or split (its rest opens the next row: nothing dropped). auto: split
    for plain text files, shipped corpora and token files, crop for everything else."""
    stream: bool = False
    """Pretraining: read each source as one token stream cut into consecutive windows of a row (a text
    file whole, not paragraph by paragraph; a token file as it lies), as a plain GPT-2 script does.
    The held-out data.val_fraction is the stream's tail."""
    long_conversations: Literal["truncate", "drop"] = "truncate"
    """SFT, DPO and KTO: what happens to a conversation longer than max_seq_length (counted in the metrics either
    way): truncate keeps its first tokens (TRL's truncation_mode=keep_start), drop leaves it out. A preference pair or
    KTO reply whose prompt alone fills the row is dropped (no reply token left to train on), as TRL's DPOTrainer
    drops it. Reward models (`tierlm rm`) drop every over-long pair (TRL's RewardTrainer): a reward is read at the end
    of a reply."""
    isolate_documents: bool | None = None
    """Packed documents get their own positions and never attend to each other. None: on for SFT, off for pretraining
    (nanochat)."""
    packing_buffer: int = Field(1000, gt=0)
    """Documents held for best-fit packing: more fills rows better and costs memory."""
    prefetch_batches: int | None = Field(None, ge=0)
    """Batches a background thread builds ahead of training (None: 2 on a GPU, 0 on CPU, where the
    thread would only compete with the model for the cores: -10% tokens/s, bench/pretrain.py)."""
    on_bad_line: Literal["error", "skip"] = "error"
    """A malformed JSONL line: stop with its file:line, or skip it and count it."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of headerless .bin token files (llm.c shards with a header are detected)."""

    @field_validator("answer_pattern")
    @classmethod
    def _answer_regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as e:
                raise ValueError(f"data.answer_pattern {value!r} is not a regular expression ({e})") from None
        return value

    @field_validator("ul2_task_weights")
    @classmethod
    def _task_weights(cls, value: list[float]) -> list[float]:
        if len(value) != 5 or any(w < 0 for w in value) or not sum(value) > 0:
            raise ValueError(
                f"data.ul2_task_weights must be 5 weights >= 0 (R, R, X, X, S) with a positive sum, got {value}"
            )
        return value

    @model_validator(mode="after")
    def _check_streaming(self) -> "DataConfig":
        if self.streaming and self.stream:
            raise ValueError(
                "data.stream (one token stream cut into windows) and data.streaming (a dataset read as a stream) "
                "are two ways to read: set one"
            )
        if self.streaming and self.mixture:
            raise ValueError("data.streaming reads one data.dataset_name; drop data.mixture")
        return self


class TrainingConfig(Section):
    per_device_train_batch_size: int | Literal["auto"] = 8
    """Rows per micro-batch on each device; auto: the largest power of two the memory planner
    predicts to fit (with a 20% margin), confirmed by one real forward/backward (pretrain, SFT, DPO)."""
    per_device_eval_batch_size: int = Field(16, gt=0)
    """Rows per eval batch on each device."""
    gradient_accumulation_steps: int = Field(1, gt=0)
    """Micro-batches per optimizer step."""
    optimizer: Literal["adamw", "muon", "adamw_spam", "adamw_prune"] = "adamw"
    """adamw: AdamW over every parameter; muon: Muon for the hidden matrices, AdamW for embeddings,
    the output head and scalars (norms, biases), stepped as one (nanochat); adamw_spam: AdamW with
    SPAM's momentum reset and spike clipping; adamw_prune: AdamW pruning the hidden matrices by
    scores from its own state."""
    learning_rate: float = Field(3e-4, gt=0, lt=1)
    """Peak learning rate (AdamW's; the default of every parameter role under adamw)."""
    matrix_lr: float | None = Field(None, gt=0, lt=1)
    """Peak LR of the hidden 2-D weights (None: learning_rate under adamw, 0.02 under muon)."""
    embedding_lr: float | None = Field(None, gt=0, lt=1)
    """Peak LR of the input embeddings (None: learning_rate under adamw; under muon 0.2 x (d_model/768)^-0.5,
    nanochat's)."""
    unembedding_lr: float | None = Field(None, gt=0, lt=1)
    """Peak LR of the output head (None: learning_rate under adamw; under muon 0.004 x (d_model/768)^-0.5)."""
    scalar_lr: float | None = Field(None, gt=0, lt=1)
    """Peak LR of norm gains, biases and other vectors (None: learning_rate)."""
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    """Muon: momentum after its warm-up (from 0.85 over muon_momentum_warmup_steps)."""
    muon_momentum_warmup_steps: int = Field(300, ge=0)
    """Muon: steps over which the momentum rises from 0.85 to muon_momentum."""
    muon_refinements: list[Literal["polar_express", "muoneq", "renormalize", "normuon", "cautious_wd"]] = Field(
        default_factory=list
    )
    """Muon's 2025-26 refinements, any of: polar_express (Polar Express's quintics), muoneq (rows equilibrated before
    orthogonalising), renormalize (Muon+: the update's norm snapped to sqrt(min(rows, cols))), normuon (each neuron's
    update normalised by its second moment), cautious_wd (decay only where the update points toward zero); nanochat
    runs all five (tierlm.primitives.optim.muon)."""
    muon_beta2: float = Field(0.95, ge=0, lt=1)
    """Muon with normuon: the EMA rate of each neuron's second moment."""
    spam_theta: float = Field(5000.0, gt=0)
    """adamw_spam: a gradient entry with g^2 > theta * v is clipped to sign(g) * sqrt(theta * v) (paper: 5000)."""
    spam_interval: int = Field(500, ge=0)
    """adamw_spam: both Adam moments are zeroed every this many steps (0: never; paper: 500)."""
    spam_warmup: int = Field(150, ge=0)
    """adamw_spam: after each reset the update rises from 0.01x to 1x along a cosine over this many steps."""
    prune_score: Literal["magnitude", "sqrt_momentum", "fourth_root_v", "movement"] = "fourth_root_v"
    """adamw_prune: what ranks the weights (|w|; |w| sqrt|m|; |w| v^1/4, "bitter7"; movement -sum w g)."""
    prune_sparsity: float = Field(0.5, ge=0, lt=1)
    """adamw_prune: share of the hidden matrices' entries pruned at the end."""
    prune_warmup: int = Field(1000, ge=0)
    """adamw_prune: dense steps before pruning starts."""
    prune_frequency: int = Field(50, gt=0)
    """adamw_prune: the masks are recomputed every this many steps (sparsity = final x p^3)."""
    weight_decay: float = Field(0.0, ge=0)
    """Weight decay of the hidden matrices (under muon it falls linearly to 0 over training, nanochat)."""
    decay_norms_and_embeddings: bool = False
    """Apply weight decay to biases, norms and embeddings too (off: they are exempt)."""
    target_param_data_ratio: float | None = Field(None, gt=0)
    """Pretraining from scratch: train for this many tokens per scaling parameter (hidden matrices +
    output head; 10.5 in nanochat); num_train_steps follows unless set."""
    total_batch_size: Literal["auto"] | int | None = None
    """Tokens per optimizer step over all ranks: a number (gradient_accumulation_steps follows), auto
    (predicted from the token horizon, B = 524,288 x (D / D_d12)^0.383 to a power of two; needs
    target_param_data_ratio), or None (per_device_train_batch_size x rows x ranks x accumulation)."""
    scale_hyperparameters: bool = True
    """With total_batch_size set: learning rates x sqrt(B / 524,288) and, with target_param_data_ratio,
    weight decay x sqrt(B / 524,288) x (D_d12 / D) (the given values are those of the d12 reference)."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = Field(0.95, ge=0, lt=1)
    """AdamW beta2."""
    adam_epsilon: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this; 0 disables clipping."""
    num_train_steps: int | None = Field(1000, gt=0)
    """Optimizer steps to train for (null: derived from target_param_data_ratio, as when it is not set)."""
    num_train_epochs: float | None = Field(None, gt=0)
    """Passes over the training data instead of a step count (nanochat's SFT: 1), with training.num_train_steps=null
    (or unset): the steps are the whole global batches of that many passes (counted once, by a pass of the loader),
    the last partial step dropped; each train line logs the epoch reached."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps (from training.warmup_start_factor x to 1x of the learning rate)."""
    warmup_ratio: float | None = Field(None, ge=0, lt=1)
    """The warm-up as a share of the run's optimizer steps instead (transformers' warmup_ratio: ceil(ratio x steps)),
    resolved once the steps are known (by epochs or a token horizon too) into training.warmup_steps."""
    warmup_start_factor: float = Field(0.1, ge=0, le=1)
    """The warm-up's first learning rate, as a share of training.learning_rate (0: from zero, as transformers'
    get_linear_schedule_with_warmup)."""
    lr_scheduler_type: Literal["cosine", "linear", "constant", "warmdown"] = "cosine"
    """Decay after warmup; warmdown holds the LR and decays linearly over the final warmdown_ratio."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""
    warmdown_ratio: float = Field(0.2, ge=0, le=1)
    """Warmdown: fraction of training spent decaying."""
    bf16: bool = False
    """Compute in bf16: autocast for one process and DDP; for FSDP, bf16 parameters in forward and
    backward with fp32 master shards, optimizer state and gradient reduction."""
    fp16: bool = False
    """Compute in fp16 with loss scaling (autocast and torch.amp.GradScaler; one process or DDP) on
    CUDA GPUs without bf16 (before Ampere). Refused on CPU and with FSDP (use bf16 there)."""
    fp8: bool = False
    """FP8 matmuls (torchao Float8Linear, tensorwise scaling) in the hidden linear layers on H100-class
    GPUs; evaluation runs them in bf16. Refused elsewhere."""
    disable_dropout: bool | None = None
    """Every dropout of the trained model set to 0 (TRL's disable_dropout; `tierlm.models.dropout`). None: on for dpo,
    rm and rl (TRL's DPO, KTO, reward and GRPO trainers' default: they score the policy in evaluation mode, its old
    log-probs or a reference beside it, and train it in training mode, which dropout would make another function),
    off for pretrain and sft. Only models that carry dropout change: GPT-2's family with model.dropout, transformers
    models whose configs keep some."""
    neftune_noise_alpha: float | None = Field(None, gt=0)
    """SFT: NEFTune's noise on the token embeddings while training (`tierlm.models.neftune`; TRL's name, and its
    value: the paper tries 5, 10 and 15); null: none."""
    sft_loss: str = "nll"
    """SFT: the loss, a row of `tierlm.strategies.sft.SFT_LOSSES` (TRL's SFTConfig loss_type): nll, the tokens'
    cross-entropy; dft, Dynamic Fine-Tuning (Wu et al., 2025): each token's cross-entropy weighed by its probability
    under the model, without gradient through the weight (it reads the logits: no fused LM head). DFT learns nothing
    of tokens the model gives almost no probability: start it from a model that already writes the data's format
    (docs/configuration.md has both cases measured)."""
    fused_cross_entropy: bool = True
    """Cross-entropy stages: the LM head fused into the loss, a chunk of rows at a time (trained rows
    only on CPU), so the (B, T, V) logits never exist. The native GPT, and transformers models with a
    plain head (Llama, Qwen, ...) outside DDP/FSDP; off: logits, then the loss."""
    save_steps: int = Field(0, ge=0)
    """Checkpoint every N steps (0: only at the end)."""
    save_total_limit: int = Field(0, ge=0)
    """Keep only the newest N checkpoints (0 keeps all); the best by val loss is kept as well."""
    save_best: bool = False
    """Also save a checkpoint at every evaluation that beats the best so far (val loss; RL: pass@1), so the best
    model is always on disk whatever save_steps says; the summary names it (best_checkpoint)."""
    async_save: bool = False
    """Copy the state to CPU at each save and write it on a background thread while training goes on."""
    average_last_n: int = Field(0, ge=0)
    """At the end, also write <output_dir>/model_averaged: the mean weights of the last N checkpoints (0: off)."""
    max_consecutive_nonfinite: int = Field(5, gt=0)
    """Steps whose loss or gradient norm is NaN/Inf are skipped; this many in a row stops the run."""
    eval_steps: int = Field(100, ge=0)
    """Evaluate every N steps, and before the first step and at the end (0: only before the first and at the end)."""
    eval_batches: int | Literal["all"] = 8
    """Batches per evaluation (a fixed set, the same every time); all: one whole pass over the validation data (with
    data.stream, every held-out token scored once: the figure nanoGPT's and llm.c's readers compare)."""
    eval_samples: int | None = Field(None, gt=0)
    """Examples per evaluation instead (the name Accelerate-style FSDP2 training scripts use): eval_batches becomes
    the whole batches of per_device_eval_batch_size that hold them."""
    sample_prompts: list[str] = Field(default_factory=lambda: ["The capital of France is", "What is 12 + 7?"])
    """At each evaluation, greedy completions of these prompts (user turns for chat stages) are
    written to metrics.jsonl as "sample" lines (not under FSDP, whose shards generate together)."""
    sample_max_new_tokens: int = Field(16, gt=0)
    """Tokens generated for each sample prompt."""
    core_bundle: str | None = None
    """A local CORE eval bundle (nanochat's eval_bundle layout: core.yaml, eval_data/, eval_meta_data.csv): CORE is
    then measured during training, every core_steps and at the end ("core" lines, the report's CORE curve and table),
    as nanochat's base training does. Read once when the run starts; the ranks share the items."""
    core_steps: int = Field(0, ge=0)
    """With core_bundle: CORE every N steps and at the end (0: at the end only)."""
    core_max_per_task: int | None = Field(500, gt=0)
    """With core_bundle: the first N items of each task (nanochat's in-training figure: 500; null: every item)."""
    logging_steps: int = Field(10, gt=0)
    """Write a train line to metrics.jsonl every N steps."""
    profile_steps: tuple[int, int] | None = None
    """[first, last]: trace steps first..last (inclusive) with torch.profiler, the step before warming it up:
    <output_dir>/profile/trace_rank{R}.json.gz (a timeline for https://ui.perfetto.dev) and summary_rank{R}.txt (the
    operators by time); null: no profiling."""
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=list)
    """Extra metric sinks besides metrics.jsonl (each continues the same run when the run resumes)."""
    logging_dir: str | None = None
    """Where TensorBoard writes (default: <output_dir>/tensorboard)."""
    seed: int = Field(42, ge=0, lt=2**63)
    """Seed for initialisation, data order and sampling."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the latest checkpoint in output_dir if there is one; never: refuse to reuse a run
    directory."""
    resume_from_checkpoint: str | None = None
    """Continue from this checkpoint folder (`.../checkpoints/step_N`) instead of the latest: an earlier one of this
    run, or another run's of the same stage and shape (its new checkpoints and model go to this run's output_dir)."""

    @field_validator("per_device_train_batch_size", mode="before")
    @classmethod
    def _batch_rows(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            return value
        raise ValueError(f"training.per_device_train_batch_size must be auto or a number of rows > 0, got {value!r}")

    @field_validator("total_batch_size", mode="before")
    @classmethod
    def _batch_tokens(cls, value: Any) -> Any:
        if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        raise ValueError(f"training.total_batch_size must be auto or a number of tokens, got {value!r}")

    @field_validator("eval_batches")
    @classmethod
    def _some_batches(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value <= 0:
            raise ValueError(f"training.eval_batches must be a number > 0 or all, got {value}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _eval_samples(cls, data: Any) -> Any:
        """training.eval_samples as the whole eval batches that hold them."""
        samples = data.get("eval_samples") if isinstance(data, dict) else None
        if not isinstance(samples, int) or isinstance(samples, bool) or samples <= 0:
            return data  # absent, or refused by the field's own check
        rows = data.get("per_device_eval_batch_size", cls.model_fields["per_device_eval_batch_size"].default)
        batches = math.ceil(samples / rows) if isinstance(rows, int) and rows > 0 else None
        if batches is not None and data.get("eval_batches", batches) != batches:
            raise ValueError(
                f"training.eval_samples={samples} makes {batches} eval batches but training.eval_batches is "
                f"{data['eval_batches']}: keep one"
            )
        return {**data, "eval_batches": batches} if batches is not None else data

    @model_validator(mode="after")
    def _check_schedule(self) -> "TrainingConfig":
        if self.fp16 and self.bf16:
            raise ValueError("training.fp16 and training.bf16 are two precisions: set one")
        if self.muon_refinements and self.optimizer != "muon":
            raise ValueError(
                f"training.muon_refinements refine Muon; training.optimizer is {self.optimizer}: set "
                "training.optimizer=muon or drop them"
            )
        if isinstance(self.total_batch_size, int) and self.total_batch_size <= 0:
            raise ValueError(
                f"training.total_batch_size must be auto or a number of tokens > 0, got {self.total_batch_size}"
            )
        if self.total_batch_size == "auto" and self.target_param_data_ratio is None:
            raise ValueError(
                "training.total_batch_size=auto predicts the batch from the token horizon: "
                "set training.target_param_data_ratio (10.5 in nanochat) or give a number of tokens"
            )
        if self.warmup_ratio is not None and self.warmup_steps:
            raise ValueError(
                f"training.warmup_ratio and training.warmup_steps ({self.warmup_steps}) each set the warm-up: keep one "
                "(training.warmup_steps=0 with the ratio)"
            )
        if self.profile_steps is not None and not 1 <= self.profile_steps[0] <= self.profile_steps[1]:
            raise ValueError(
                f"training.profile_steps is [first, last] of the steps to trace, 1 <= first <= last; got "
                f"{list(self.profile_steps)}"
            )
        if self.num_train_epochs is not None:
            if self.target_param_data_ratio is not None:
                raise ValueError(
                    "training.num_train_epochs and training.target_param_data_ratio each set the length of the run: "
                    "keep one"
                )
            return self  # the steps (and the warm-up against them) are checked once an epoch is counted
        derived = self.target_param_data_ratio is not None and (
            self.num_train_steps is None or "num_train_steps" not in self.model_fields_set
        )
        if self.num_train_steps is None and self.target_param_data_ratio is None:
            raise ValueError(
                "training.num_train_steps=null derives the steps from the token horizon: set "
                "training.target_param_data_ratio"
            )
        if not derived and self.profile_steps is not None and self.profile_steps[1] > self.num_train_steps:
            raise ValueError(
                f"training.profile_steps ends at step {self.profile_steps[1]}, after the run's last "
                f"(training.num_train_steps={self.num_train_steps})"
            )
        if not derived and self.warmup_steps >= self.num_train_steps:  # a derived horizon is checked once known
            raise ValueError(
                f"training.warmup_steps ({self.warmup_steps}) must be < training.num_train_steps "
                f"({self.num_train_steps})"
            )
        return self


class AblationConfig(Section):
    """What `tierlm ablate --config <this>` runs when the command names no variants (a preset's ablation)."""

    variants: list[str] = Field(default_factory=list)
    """V-steps ("V3") or "name:section.key=value,section.key=value" override sets; the first is the baseline."""
    seeds: list[int] = Field(default_factory=lambda: [0])
    """One replicate per seed (training.seed): the same initial draw and data order for every variant."""


class TierlmConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    infra: InfraConfig = Field(default_factory=InfraConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    rm: RewardModelConfig = Field(default_factory=RewardModelConfig)
    ablation: AblationConfig = Field(default_factory=AblationConfig)

    @classmethod
    def load(cls, path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> "TierlmConfig":
        """Read `path` (YAML or a preset name; None for the defaults), apply `key=value` overrides, validate."""
        return cls.from_dict(read_config(path, overrides))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TierlmConfig":
        from tierlm.config.aliases import translate_aliases

        try:
            return cls.model_validate(translate_aliases(raw))
        except ValidationError as e:
            raise ConfigError(describe_error(e.errors()[0], cls)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "TierlmConfig":
        return cls.load(path)

    def to_yaml(self, path: str | Path | None = None) -> str:
        text = yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text


FullConfig = TierlmConfig
"""The complete configuration under the name Accelerate-style training scripts use (`FullConfig.from_yaml(path)`,
`config.to_yaml(path)`)."""

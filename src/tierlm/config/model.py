"""The model and tokenizer sections of the config (`tierlm.config` holds the rest and the loading), and
`Section`, the base of every section: unknown keys refused, field docstrings kept, assignments validated."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr


def true_false_or(value, choices: tuple, message: str):
    """A setting that is a boolean or one of `choices` (infra.compile's model, rl.normalize_std's group / batch), as a
    `mode="before"` validator reads it: "true" / "false" and 1 / 0 (an override's spellings) as booleans, None
    as it is, anything else a ValueError of `message` and the value.

    >>> true_false_or("False", ("model",), "infra.compile is ..."), true_false_or("model", ("model",), "...")
    (False, 'model')
    """
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if value is None or value in choices:
        return value
    raise ValueError(f"{message}, got {value!r}")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
    _frozen: bool = PrivateAttr(False)

    def frozen(self):
        """This section as a run receives it once resolved (`tierlm.builders.stage.resolve_config`): a copy, its
        sections too, that no assignment changes; derive another with `model_copy(update=...)`.

        >>> class Seeds(Section):
        ...     seed: int = 0
        >>> seeds = Seeds().frozen()
        >>> seeds.seed = 1
        Traceback (most recent call last):
        TypeError: Seeds is a resolved run's config, frozen: derive another with model_copy(update=...)
        """
        copy = self.model_copy(update={k: v.frozen() for k, v in self if isinstance(v, Section)})
        copy.__pydantic_private__ = {**(copy.__pydantic_private__ or {}), "_frozen": True}
        return copy

    @property
    def is_frozen(self) -> bool:
        return bool((self.__pydantic_private__ or {}).get("_frozen"))

    def __setattr__(self, name: str, value: Any) -> None:
        if self.is_frozen and not name.startswith("_"):
            raise TypeError(
                f"{type(self).__name__} is a resolved run's config, frozen: derive another with model_copy(update=...)"
            )
        super().__setattr__(name, value)


class RAConfig(Section):
    """GPT-2 attention variants (None: what model.variant says, off without one)."""

    r: int | None = Field(None, ge=0)
    """Unified RA: reciprocal dimensions of each head (0: plain attention)."""
    per_head_gates: bool | None = None
    """Unified RA: one (w_std, w_rec) gate pair per head instead of per layer."""
    self_restart: bool | None = None
    """Self-restart: each head mixes back a learned share (init 0.05, at most 0.5) of its value vector."""


class RMLPConfig(Section):
    """GPT-2 MLP variant (None: what model.variant says, off without one)."""

    r_ff: int | None = Field(None, ge=0)
    """R-MLP: reciprocal hidden units (0: plain MLP)."""
    mixer: bool | None = None
    """R-MLP: a learned R_ff x R_ff map on the reciprocal units."""
    gate_alpha: bool | None = None
    """R-MLP: one more learned scalar on the reciprocal units."""
    attention_aware: bool | None = None
    """R-MLP: the reciprocal units also read the block's attention output."""


class DelayConfig(Section):
    """GPT-2 delayed activation of the reciprocal gates (None: what model.variant says, off without one)."""

    mode: Literal["none", "step", "ramp", "loss_stability"] | None = None
    """When the reciprocal gates come on: at a step, over a ramp, or once the loss has settled."""
    start_step: int | None = Field(None, ge=0)
    """step: the step they come on at; ramp: the step they start rising at (default 75)."""
    ramp_steps: int | None = Field(None, gt=0)
    """ramp: steps from off to full (default 100)."""
    window: int | None = Field(None, gt=1)
    """loss_stability: training losses in the window (default 50)."""
    cv_threshold: float | None = Field(None, gt=0)
    """loss_stability: come on when std / mean of the window falls below this (default 0.05)."""


class KVPruningConfig(Section):
    """GPT-2 causal KV pruning (None: what model.variant says, off without one)."""

    enabled: bool | None = None
    """Each query attends only to its most important earlier keys (see tierlm.models.gpt2.kv)."""
    keep_ratio: float | None = Field(None, gt=0, le=1)
    """Share of visible keys each query keeps (default 0.382)."""
    recency: int | None = Field(None, ge=0)
    """The newest keys always kept (default 64)."""
    learned: bool | None = None
    """Learn the keep ratio (soft selection, so it gets a gradient)."""
    values_only: bool | None = None
    """Keep every key in the softmax; drop only the pruned keys' values."""


class LoraConfig(Section):
    r: int = Field(0, ge=0)
    """LoRA rank; 0: no adapters (the whole model trains)."""
    alpha: float = Field(16.0, gt=0)
    """Scale of the update: W + (alpha / r) B A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training."""
    target_modules: str | list[str] = "all-linear"
    """Which linear layers get adapters: "all-linear" (every linear layer of the repeated blocks; not the
    embeddings or the output head), or module names as PEFT matches them (["q_proj", "v_proj"])."""


FROM_SCRATCH_FIELDS = (
    "depth",
    "aspect_ratio",
    "head_dim",
    "dropout",
    "bias",
    "variant",
    "ra",
    "rmlp",
    "delay",
    "kv_pruning",
    "n_kv_head",
    "mlp_ratio",
    "rope_theta",
    "tie_embeddings",
    "window_pattern",
    "short_window",
    "moe",
    "hf_config",
)
"""The model settings that only shape a model built from scratch: a run that starts from model.model_name_or_path
trains the model that folder holds, as it is."""


class MoESettings(Section):
    """Native GPT: a mixture of experts for every block's feed-forward (`tierlm.models.moe`, transformers' Qwen3-MoE
    layout: a softmax router picks each token's experts_per_token of num_experts SwiGLU experts)."""

    num_experts: int = Field(0, ge=0)
    """Experts per layer; 0: a dense SwiGLU."""
    experts_per_token: int = Field(2, gt=0)
    """Experts each token goes through (the router's top-k)."""
    expert_width: int | None = Field(None, gt=0)
    """Each expert's hidden width; None: the dense SwiGLU's over experts_per_token (rounded up to a multiple of 32),
    so a token meets as many feed-forward weights as in the dense model of the same shape."""
    normalize_top_k: bool = True
    """Renormalise the picked experts' router weights to sum to 1 (Qwen3-MoE's norm_topk_prob)."""
    bias_update_rate: float = Field(1e-3, ge=0)
    """DeepSeek-V3's auxiliary-loss-free balancing: after every optimizer step each expert's selection bias moves by
    this much toward balance (up if it got fewer tokens than the mean, down if more; 0: off)."""
    aux_loss_coef: float = Field(0.0, ge=0)
    """The classic load-balancing loss (Switch's, each layer's) added to the training loss with this weight (Qwen3-MoE
    trains with 0.001)."""
    z_loss_coef: float = Field(0.0, ge=0)
    """The router z-loss (ST-MoE's) added to the training loss with this weight."""


class ModelConfig(Section):
    model_name_or_path: str | None = None
    """Start from this model: a hub id, a transformers folder, or a tierlm run/checkpoint folder. None trains from
    scratch."""
    architecture: str = "gpt"
    """From scratch: a tierlm family ("gpt": the native GPT, "gpt2": GPT-2, "qwen3_encdec": the Qwen3 encoder-decoder
    trained with UL2) or a transformers model_type such as "qwen3" or "llama"."""
    depth: int = Field(4, gt=0)
    """Native families: number of blocks; the width follows as depth * aspect_ratio."""
    aspect_ratio: int = Field(64, gt=0)
    """Native families: model width per block of depth (rounded up to whole heads)."""
    head_dim: int = Field(64, gt=0)
    """Native families: attention head width."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """GPT-2: dropout on embeddings, attention weights and residual branches while training."""
    bias: bool = True
    """GPT-2: biases in linear layers and LayerNorms (off: no transformers twin; saved as a tierlm folder)."""
    variant: str | None = None
    """GPT-2: a step of the GPT-2 research V-series, V0-V19; model.ra.*, model.rmlp.*, model.delay.*,
    model.kv_pruning.* and model.mlp_ratio override it."""
    ra: RAConfig = Field(default_factory=RAConfig)
    """GPT-2: Unified RA and self-restart (see tierlm.models.gpt2.ra)."""
    rmlp: RMLPConfig = Field(default_factory=RMLPConfig)
    """GPT-2: R-MLP (see tierlm.models.gpt2.rmlp)."""
    delay: DelayConfig = Field(default_factory=DelayConfig)
    """GPT-2: delayed activation of the reciprocal gates (see tierlm.models.gpt2.delay)."""
    kv_pruning: KVPruningConfig = Field(default_factory=KVPruningConfig)
    """GPT-2: causal KV pruning (see tierlm.models.gpt2.kv)."""
    n_kv_head: int | None = Field(None, gt=0)
    """Native GPT: key/value heads (grouped-query attention); None gives one per query head."""
    mlp_ratio: float | None = Field(None, gt=0)
    """MLP hidden width as a multiple of the model width (None: the family's own: 8/3 for the native
    GPT's SwiGLU, 4 for GPT-2)."""
    rope_theta: float = Field(10000.0, gt=0)
    """Native GPT: rotary embedding base."""
    tie_embeddings: bool = False
    """Native GPT: share the input embedding with the output head."""
    window_pattern: str = "L"
    """Native GPT: attention span per layer, tiled over the depth (last layer always L): L full
    context, S a sliding window of model.short_window tokens; nanochat's "SSSL"."""
    short_window: int | None = Field(None, gt=0)
    """Native GPT: tokens an S layer's query sees, itself included (None: half of data.max_seq_length)."""
    moe: MoESettings = Field(default_factory=MoESettings)
    """Native GPT: a mixture of experts instead of each block's SwiGLU (model.moe.num_experts > 0)."""
    hf_config: dict[str, Any] = Field(default_factory=dict)
    """From scratch with a transformers architecture: config fields (hidden_size, num_hidden_layers, ...)."""
    tokenizer_name_or_path: str | None = None
    """Tokenizer to use; None takes the model's own, or trains one (see the tokenizer section) from scratch."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype. For mixed precision keep float32 and set training.bf16."""
    use_flash_attention: bool = True
    """Let scaled-dot-product attention use its flash kernel (CUDA's, or the CPU one); false keeps it
    to the memory-efficient or the plain math kernel (which materialises the T x T scores)."""
    trust_remote_code: bool = False
    """Allow a hub model to run its own Python code. Off unless you trust the source."""
    num_sentinel_tokens: int = Field(100, gt=0)
    """qwen3_encdec: UL2's span sentinels <extra_id_0..N-1> added to the tokenizer (with the mode tokens [R], [X],
    [S])."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """Parameter-efficient fine-tuning with LoRA adapters (PEFT): model.lora.r > 0 freezes the model and
    trains the adapters; the final model folder holds the merged weights and the adapter alone in adapter/."""
    load_in_4bit: bool = False
    """QLoRA: load a transformers model's frozen weights in 4-bit NF4 (bitsandbytes, CUDA only) under LoRA adapters."""


class TokenizerConfig(Section):
    kind: Literal["bpe", "char"] = "bpe"
    """Tokenizer trained when training from scratch without one: byte-level BPE or characters."""
    vocab_size: int = Field(512, gt=0)
    """BPE vocabulary size (includes 256 byte tokens and the special tokens)."""
    num_train_docs: int = Field(20000, gt=0)
    """How many training documents the tokenizer is trained on."""

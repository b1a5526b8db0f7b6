"""Per-rank memory of model-parallel layouts (`tierlm plan --layouts`): every way `world_size` ranks split into
pipeline x tensor x data parallel that the model's shape allows, with what one rank holds in each.

The model is tierlm's (`infra.tensor_parallel_size` / `pipeline_parallel_size`, FSDP2 over the rest):

- weights, gradients and AdamW's two moments are fp32, sharded over the data-parallel ranks (FSDP2); a block's
  projections split over the tensor-parallel ranks, and so do an untied embedding and head (`infra.vocab_parallel`),
  else they stay whole on each; a pipeline stage holds depth / pp blocks, the first the embedding, the last the head;
- FSDP2 gathers a block (and prefetches the next) in the compute dtype: 2 blocks' worth of it;
- activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
  Models", table 2) with flash attention (no s x s scores): s*b*h*(10 + 24/t) bytes per block in 16-bit
  compute, s*b*h*34/t with sequence parallelism, or with full activation checkpointing 2*s*b*h per block
  (its input; /t with sequence parallelism) plus one block recomputed; under 1F1B the first stage keeps `pp`
  micro-batches in flight, so it holds activations for `depth` blocks' worth whatever `pp` is;
- the loss: the fused head + cross-entropy keeps one ~128 MB chunk of fp32 logits; unfused, s*b*V*4 bytes; split by
  vocabulary (loss parallel), s*b*V/t*4;
- a fixed `runtime` (CUDA context, allocator slack, communication buffers) per rank.

An estimate to choose a layout by, not a promise; `tierlm pretrain` on the real machine measures.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierlm.errors import ConfigError
from tierlm.primitives.model_parallel import ParallelDims, check_tensor_parallel_shape

GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    """What the memory of a layout depends on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    block_params: int
    """Parameters of one block."""
    embedding_params: int
    head_params: int
    """0 when the head is the embedding (tied)."""
    pipeline: bool = True
    """Whether the model's family splits into pipeline stages."""
    tensor: bool = True
    """Whether it has a tensor-parallel plan."""
    tensor_with_data: bool = True
    """Whether its tensor-parallel shards take FSDP2 over the data-parallel rest (not a fused q/k/v: GPT-2)."""
    vocab_parallel: bool = False
    """Whether tensor parallelism splits its embedding and head by vocabulary (untied, with a plan for them)."""

    @classmethod
    def of(cls, model) -> "ModelShape":
        """The shape of a model (on the meta device is enough) through its family's blocks."""
        from tierlm.models import family_of

        family = family_of(model)
        blocks = family.blocks(model)
        config = model.config
        get = lambda *names: next(getattr(config, n) for n in names if getattr(config, n, None) is not None)  # noqa: E731
        hidden = get("n_embd", "hidden_size")
        heads = get("n_head", "num_attention_heads")
        embed, head = family.input_embedding(model), family.output_head(model)
        tied = head.weight is embed.weight
        try:
            plan = family.tensor_parallel_plan(model, 1)
        except ConfigError:
            plan = None
        try:
            vocab_parallel = "vocab_head" in family.tensor_parallel_model_plan(model, False).values()
        except ConfigError:
            vocab_parallel = False
        try:
            pipeline = (
                family.pipeline_stage(model, [0], True, False) is not None
            )  # a view of the model's modules: nothing allocated
        except ConfigError:
            pipeline = False
        return cls(
            layers=len(blocks),
            hidden=hidden,
            heads=heads,
            kv_heads=get("num_kv_heads", "num_key_value_heads", "n_head", "num_attention_heads"),
            ffn=get("intermediate_size", "mlp_hidden"),
            vocab=embed.weight.shape[0],
            block_params=sum(p.numel() for p in blocks[0].parameters()),
            embedding_params=embed.weight.numel(),
            head_params=0 if tied else head.weight.numel(),
            pipeline=pipeline,
            tensor=plan is not None,
            tensor_with_data=plan is not None and "colwise_qkv" not in plan.values(),
            vocab_parallel=vocab_parallel,
        )


@dataclass(frozen=True)
class LayoutMemory:
    dims: ParallelDims
    parts: dict[str, float]
    """Bytes per rank, by consumer (the busiest rank: the first or the last stage)."""

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def name(self) -> str:
        return f"TP {self.dims.tp} x PP {self.dims.pp} x DP {self.dims.dp}"


def layout_memory(
    shape: ModelShape,
    dims: ParallelDims,
    rows: int,
    seq_len: int,
    compute_bytes: int = 2,
    activation_checkpointing: bool = False,
    fused_cross_entropy: bool = True,
    runtime_bytes: float = 2 * GB,
    vocab_parallel: bool = True,
    sequence_parallel: bool = False,
) -> LayoutMemory:
    """Bytes one rank needs for `rows` x `seq_len` micro-batches of a model of `shape` laid out as `dims`.

    >>> shape = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100, block_params=41_000,
    ...     embedding_params=6_400, head_params=6_400)
    >>> layouts = [ParallelDims.from_sizes(n, tensor=n) for n in (1, 2)]
    >>> one, split = (layout_memory(shape, dims, 2, 16, runtime_bytes=0) for dims in layouts)
    >>> split.parts["weights, gradients, AdamW (fp32)"] < one.parts["weights, gradients, AdamW (fp32)"]
    True
    """
    tp, pp, dp = dims.tp, dims.pp, dims.dp
    blocks_per_stage = -(-shape.layers // pp)
    split_block = (
        shape.block_params / tp
    )  # the projections split; the norms are a few thousand parameters: counted split too
    vocab_split = tp if shape.vocab_parallel and vocab_parallel and tp > 1 else 1
    embedding, head = shape.embedding_params / vocab_split, shape.head_params / vocab_split
    first = blocks_per_stage * split_block + embedding + (head if pp == 1 else 0)
    last = blocks_per_stage * split_block + (head or (embedding if pp > 1 else 0))
    held = max(first, last)
    parts = {"weights, gradients, AdamW (fp32)": 16 * held / dp}
    if dp > 1:
        parts["FSDP gathered blocks"] = 2 * split_block * compute_bytes
    s, b, h = seq_len, rows, shape.hidden
    sequence = tp if sequence_parallel else 1
    per_block = (
        s * b * h * (34 / tp if sequence_parallel else 10 + 24 / tp) * compute_bytes / 2
    )  # Korthikanti et al.: 16-bit bytes
    if activation_checkpointing:
        activations = shape.layers * 2 * s * b * h / sequence * compute_bytes / 2 + per_block
    else:
        activations = shape.layers * per_block
    parts["activations"] = activations  # pp micro-batches in flight x layers / pp on the first stage
    if vocab_split > 1:  # loss parallel: each rank's share of the fp32 logits, whole
        parts["logits"] = 4 * s * b * shape.vocab / vocab_split
    else:
        parts["logits"] = (
            min(128e6, 4 * s * b * shape.vocab) if fused_cross_entropy else 4 * s * b * shape.vocab
        )  # fused: ~128 MB chunks
    parts["runtime"] = runtime_bytes
    return LayoutMemory(dims, parts)


def candidate_layouts(shape: ModelShape, world_size: int, max_tensor: int = 8) -> list[ParallelDims]:
    """Every tensor x pipeline split of `world_size` the shape allows (a family with a tensor-parallel plan,
    whole heads per tensor-parallel rank, at least one block per stage and a family with pipeline stages,
    tensor parallel within `max_tensor` ranks: one machine's)."""
    out = []
    for tp in (d for d in range(1, min(world_size, max_tensor) + 1) if world_size % d == 0):
        if tp > 1 and (not shape.tensor or check_tensor_parallel_shape(shape.heads, shape.kv_heads, shape.ffn, tp)):
            continue
        for pp in (
            d
            for d in range(1, world_size // tp + 1)
            if (world_size // tp) % d == 0 and d <= shape.layers and (d == 1 or shape.pipeline)
        ):
            dims = ParallelDims.from_sizes(world_size, tensor=tp, pipeline=pp)
            if dims.tp == 1 or dims.dp == 1 or shape.tensor_with_data:
                out.append(dims)
    return out


def layouts_table(
    shape: ModelShape, world_size: int, rows: int, seq_len: int, budget_bytes: float | None, **options
) -> str:
    """The layouts of `world_size` ranks, smallest per-rank memory first, against `budget_bytes` per rank."""
    estimates = sorted(
        (layout_memory(shape, dims, rows, seq_len, **options) for dims in candidate_layouts(shape, world_size)),
        key=lambda e: e.total,
    )
    names = list(dict.fromkeys(n for e in estimates for n in e.parts))
    lines = [
        f"per-rank memory of {world_size} ranks (micro-batch {rows} x {seq_len} tokens; GB = 1e9 bytes):",
        "  " + f"{'layout':22s}" + "".join(f"{n[:18]:>20s}" for n in names) + f"{'total':>10s}",
    ]
    for e in estimates:
        fits = "" if budget_bytes is None else ("  fits" if e.total <= budget_bytes else "  too big")
        lines.append(
            "  "
            + f"{e.name:22s}"
            + "".join(f"{e.parts.get(n, 0.0) / GB:20.1f}" for n in names)
            + f"{e.total / GB:10.1f}{fits}"
        )
    return "\n".join(lines)

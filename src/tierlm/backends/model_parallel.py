"""Tier 0: a Megatron-style layout on PyTorch's own engine — pipeline stages (`torch.distributed.pipelining`)
and tensor parallelism (DTensor) composed with FSDP2 over the data-parallel rest of the world, on one
`DeviceMesh`.

The arithmetic is the other backends': each rank back-propagates the *sum* of its micro-batches' losses
and `optim_step` divides by the step's trained tokens, counted once per data-parallel rank (the ranks of
a model-parallel group read the same rows). The gradient norm is taken over parameters that live on
different meshes (tensor-parallel shards, FSDP shards, both, or whole). Checkpoints are DCP's sharded
ones, so they load at any layout and in one process.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from tierlm.backends.distributed import DistributedTrainingBackend
from tierlm.backends.options import BackendOptions
from tierlm.backends.parallelize import parallelize
from tierlm.backends.protocol import Batch, TrainFuture
from tierlm.backends.pytorch import loss_sum_and_count
from tierlm.errors import ConfigError
from tierlm.models import family_of, lora
from tierlm.models.lora import has_lora
from tierlm.primitives.dtype_device import move_to
from tierlm.primitives.losses import (
    cross_entropy_sum,
    get_labels,
    reads_label_cross_entropy_only,
    row_blocks,
    token_weights,
)
from tierlm.primitives.model_parallel import (
    ParallelDims,
    apply_tensor_parallel,
    apply_vocab_parallel,
    clip_grad_norm,
    sum_gradients,
)
from tierlm.primitives.models import tied_names
from tierlm.primitives.optim import inner_optimizers
from tierlm.primitives.parallel import apply_fsdp


class ModelParallelTrainingBackend(DistributedTrainingBackend):
    """Pipeline stages over `dims.pp` ranks, tensor parallel over `dims.tp` (the family's plans), FSDP2 over
    `dims.dp` (when > 1).

    Build it under torchrun after `init_distributed`; `dims.world_size` must be the job's. Under pipeline
    parallelism `model` is the module holding this rank's stages (the model's own parameter names: its
    state dict is a slice of the whole model's), `export_model` the whole model's description, and a
    step's micro-batch is split into `microbatches` pieces that flow through the stages by `schedule`.
    """

    def _refuse(self, model: nn.Module, options: BackendOptions) -> None:
        """What cannot split, in one line, before any process group is needed (`_plans`)."""
        assert options.dims is not None, "the model-parallel backend splits by options.dims"
        assert options.dims.cp == 1, "context parallelism is refused before this backend (it needs SDPA's CUDA kernels)"
        self._plans(model, family_of(model), options.dims, options)

    def _wrap(
        self, model: nn.Module, device: torch.device, options: BackendOptions
    ) -> tuple[nn.Module, BackendOptions]:
        """This rank's stages of `model`, split by `options.dims` (tensor parallel, checkpointing, compile, FSDP2 over
        the data-parallel ranks), and what the single-process part keeps of `options`: the compute dtype (FSDP2's
        param dtype with data-parallel ranks, else autocast's), the pipeline's schedule, pieces and stages per rank,
        the vocabulary and sequence splits, checkpointing, compile, clipping."""
        o, dims = options, options.dims
        family = family_of(model)
        plan, outer = self._plans(model, family, dims, o)
        self.vocab_parallel = "vocab_head" in outer.values()
        self.dims, self.mesh = dims, dims.build_mesh(device.type)
        self.whole_model = model
        model = move_to(model, device)
        parts, held = self._stage_modules(model, family, o.stages_per_rank) if dims.pp > 1 else ([model], model)
        self.tp_summed: list[nn.Parameter] = []

        def split(part: nn.Module, blocks: nn.ModuleList) -> None:
            self.tp_summed.extend(apply_tensor_parallel(self.mesh["tp"], blocks, plan, o.sequence_parallel))
            apply_vocab_parallel(self.mesh["tp"], part, outer, o.sequence_parallel)

        def shard(part: nn.Module, block_list) -> None:
            dtype, blocks = o.compute_dtype, block_list()
            apply_fsdp(part, dims.dp, device.type, dtype, torch.float32, blocks=blocks, mesh=self.mesh["dp"])

        for part in parts:  # each stage's part in the one order: tensor parallel, checkpointing, compile, FSDP2
            parallelize(
                part,
                device,
                tensor_parallel=split if dims.tp > 1 else None,
                activation_checkpointing=o.activation_checkpointing,
                compile=o.compile,
                data_parallel=shard if dims.dp > 1 else None,
                blocks=family.blocks(part),
            )
        self.dp_group = self.mesh["dp"].get_group() if dims.dp > 1 else None
        self.pp_group = self.mesh["pp"].get_group() if dims.pp > 1 else None
        self.stage_shared, self.uncounted = [], set()
        self._rows: PackedRows | None = None  # a step's rows while a loss other than the cross-entropy runs them
        self._inferring = False  # while the pipeline schedule infers its shapes
        if dims.pp > 1:
            self.parts, self.schedule_name = parts, o.pipeline_schedule
            self.microbatches = o.pipeline_microbatches or dims.pp * o.stages_per_rank
            self.has_first, self.has_last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
            self._shape = None
            self._embedding_group(held)
        # without FSDP's mixed precision (no data-parallel ranks), autocast computes in the compute dtype
        return held, replace(o, compute_dtype=o.compute_dtype if dims.dp == 1 else None, loss_scaling=False)

    def _after_init(self) -> None:
        self._step_parameter_by_parameter()
        self._split_orthogonalisations()

    @staticmethod
    def _plans(model: nn.Module, family, dims: ParallelDims, o: BackendOptions) -> tuple[dict, dict]:
        """(the blocks' tensor-parallel plan, the embedding / head plan), refusing in one line what cannot split."""
        plan = (
            family.tensor_parallel_plan(model, dims.tp) if dims.tp > 1 else {}
        )  # a ConfigError, before anything moves
        if plan and has_lora(model):
            plan = lora.tensor_parallel_plan(next(family.blocks(model).children()), plan, o.sequence_parallel)
        vocab = dims.tp > 1 and o.vocab_parallel
        outer = family.tensor_parallel_model_plan(model, o.sequence_parallel) if vocab else {}
        if o.sequence_parallel and dims.pp > 1:
            raise ConfigError(
                "sequence parallelism runs without pipeline stages (the stages send whole sequences): "
                "drop infra.sequence_parallel or infra.pipeline_parallel_size"
            )
        if "colwise_qkv" in plan.values() and dims.dp > 1:
            raise ConfigError(
                "a fused q/k/v projection (GPT-2's c_attn) splits over tensor-parallel ranks as a strided shard, which "
                "FSDP2 cannot shard again: give the other ranks pipeline stages (infra.pipeline_parallel_size) or "
                "drop infra.tensor_parallel_size"
            )
        return plan, outer

    def _split_orthogonalisations(self) -> None:
        """Muon orthogonalises each matrix once, on one of the ranks holding it: under pipeline parallelism the ranks
        of one stage, a group of their own (every rank makes every stage's group, as `new_group` asks)."""
        if self.dims.pp == 1:
            return
        from tierlm.primitives.optim.muon import Muon

        mesh, pp_rank = self.mesh.mesh, self.mesh["pp"].get_local_rank()
        groups = [dist.new_group(mesh[p].flatten().tolist()) for p in range(self.dims.pp)]
        for optimizer in inner_optimizers(self.optimizer):
            if isinstance(optimizer, Muon):
                optimizer.group = groups[pp_rank]

    # -- pipeline ----------------------------------------------------------------------------------
    @classmethod
    def memory_per_rank(
        cls,
        parts: dict[str, float],
        model: nn.Module,
        world_size: int,
        tensor: int = 1,
        pipeline: int = 1,
        context: int = 1,
        **layout,
    ) -> dict[str, float]:
        """The blocks split over the tensor x pipeline ranks, the rest whole on each; then FSDP2 over the data-parallel
        rest of the world."""
        model_ranks = tensor * pipeline
        blocks = sum(p.numel() for p in family_of(model).blocks(model).parameters())
        total = sum(p.numel() for p in model.parameters())
        share = (blocks / model_ranks + (total - blocks)) / total / max(1, world_size // (model_ranks * context))
        for name in ("parameters", "gradients", "optimizer state"):
            parts[name] *= share
        return parts

    def _stage_modules(self, model: nn.Module, family, stages_per_rank: int) -> tuple[list[nn.Module], nn.Module]:
        """This rank's stages (loop order: rank r holds stages r, r + pp, ...) and one module holding them all."""
        blocks = len(family.blocks(model))
        self.num_stages, pp_rank = self.dims.pp * stages_per_rank, self.mesh["pp"].get_local_rank()
        if blocks < self.num_stages:
            raise ConfigError(
                f"{blocks} blocks cannot fill {self.num_stages} pipeline stages (pipeline_parallel_size x "
                f"stages_per_rank)"
            )
        bounds = [round(i * blocks / self.num_stages) for i in range(self.num_stages + 1)]
        self.stage_ids = [pp_rank + k * self.dims.pp for k in range(stages_per_rank)]
        last = self.num_stages - 1
        parts = [
            family.pipeline_stage(model, list(range(bounds[i], bounds[i + 1])), i == 0, i == last)
            for i in self.stage_ids
        ]
        mine = [b for i in self.stage_ids for b in range(bounds[i], bounds[i + 1])]
        held = family.pipeline_stage(model, mine, 0 in self.stage_ids, last in self.stage_ids)
        return parts, held

    def _embedding_group(self, held: nn.Module) -> None:
        """An embedding tied to the head (GPT-2) lives on the first and the last stage: each copy gets its
        stage's share of the gradient, summed over the pair of ranks before the update (Megatron's embedding
        group), so both take the same step; the norm counts it once (on the first stage)."""
        tied = {n for group in tied_names(self.whole_model) for n in group}
        if not tied:
            return
        mesh = self.mesh.mesh  # (pp, ...): the first and the last stage's ranks at each other coordinate
        pairs = torch.stack([mesh[0].flatten(), mesh[(self.num_stages - 1) % self.dims.pp].flatten()], dim=1).tolist()
        self.tied_group, _ = dist.new_subgroups_by_enumeration(pairs)
        self.stage_shared = [p for n, p in held.named_parameters() if n in tied]  # each once, under its first name
        if not self.has_first:
            self.uncounted = {id(p) for p in self.stage_shared}

    def _schedule_for(self, shape: tuple[int, ...]):
        """The schedule over this rank's stages, (re)built when the batch shape changes (between training and
        evaluation batches): the stages infer the shapes they send from the first batch they run."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        if shape == self._shape:
            return self.schedule
        stages = [
            PipelineStage(part, i, self.num_stages, self.device, group=self.pp_group)
            for part, i in zip(self.parts, self.stage_ids)
        ]
        loss = self._stage_loss  # and scale_grads=False: the gradient of the summed loss, as every backend's
        if self.schedule_name == "interleaved_1F1B":
            self.schedule = ScheduleInterleaved1F1B(stages, self.microbatches, loss_fn=loss, scale_grads=False)
        else:
            assert len(stages) == 1, (
                f"the {self.schedule_name} schedule runs one stage per rank; interleaved_1F1B runs several"
            )
            self.schedule = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[self.schedule_name](
                stages[0], self.microbatches, loss_fn=loss, scale_grads=False
            )
        self._shape = shape
        initialize = self.schedule._initialize_pp_stages

        def inferring(*args, **kwargs):  # the schedule's first pass infers shapes, calling the loss once more
            self._inferring = True
            try:
                return initialize(*args, **kwargs)
            finally:
                self._inferring = False

        self.schedule._initialize_pp_stages = inferring
        return self.schedule

    def _stage_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch: its token cross-entropy, or — while `_rows` holds a step's loss
        function — that function on the micro-batch's rows (a shape-inferring call gets the cross-entropy: it must
        not count, nor touch a strategy's statistics)."""
        if self._rows is None:
            return summed_cross_entropy(logits, target)
        batch = self._rows.unpack(target)
        if self._inferring:
            return summed_cross_entropy(logits, get_labels(batch))
        total, count = loss_sum_and_count(self._on_logits(self._rows.fn), logits, batch)
        self._rows.counts.append(count.detach())
        return total

    def _pipeline_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[tuple, torch.Tensor]:
        """(the first stage's inputs, the last stage's targets); rows added with nothing to train (labels -100)
        until the rows split into the pipeline's micro-batches."""
        pad = -batch["input_ids"].shape[0] % self.microbatches
        if pad:
            batch = {
                k: torch.cat([v, v[-1:].expand(pad, *v.shape[1:])]) if isinstance(v, torch.Tensor) and v.dim() else v
                for k, v in batch.items()
            }
            batch["labels"] = get_labels(batch).clone()
            batch["labels"][-pad:] = -100
        labels = get_labels(batch).masked_fill(token_weights(get_labels(batch), batch.get("loss_mask")) == 0, -100)
        return self._first_stage_inputs(batch), labels

    def _first_stage_inputs(self, batch: dict[str, torch.Tensor]) -> tuple:
        """What the first stage reads (the ids and their positions); nothing on the other stages' ranks."""
        if not self.has_first:
            return ()
        ids, positions = batch["input_ids"], batch.get("position_ids")
        positions = positions if positions is not None else torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return ids, positions.float()

    def _run_pipeline(
        self, batch: dict[str, torch.Tensor], train: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One pass of the schedule: (the batch's summed loss, on every rank of the pipeline; its trained tokens;
        the logits, on the last stage's rank)."""
        inputs, labels = self._pipeline_inputs(batch)
        schedule = self._schedule_for(tuple(labels.shape))
        losses: list[torch.Tensor] = []
        with (
            self._autocast(),
            self._loss_parallel(),
        ):  # the last stage's loss reads its split logits, forward and backward
            logits = (schedule.step if train else schedule.eval)(
                *inputs, target=labels if self.has_last else None, losses=losses if self.has_last else None
            )
        total = torch.stack(losses).sum().detach().float() if self.has_last else torch.zeros((), device=self.device)
        dist.all_reduce(total, group=self.pp_group)  # the last stage's loss, known to every stage
        return total, token_weights(get_labels(batch), batch.get("loss_mask")).sum(), logits

    # -- vocabulary-parallel logits -------------------------------------------------------------
    def _loss_parallel(self):
        """PyTorch's `loss_parallel()` when the head splits the vocabulary (the cross-entropy of split logits,
        forward and backward), else nothing."""
        import contextlib

        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel() if self.vocab_parallel else contextlib.nullcontext()

    def _on_logits(self, fn: Callable | None) -> Callable | None:
        """`fn` as it can read split logits: the token cross-entropy reads them as they are (`loss_parallel`); any
        other function gets them gathered whole (DPO, RL, metrics beyond the loss)."""
        if not self.vocab_parallel or fn is None or reads_label_cross_entropy_only(fn):
            return fn
        return lambda logits, batch: fn(logits.full_tensor() if hasattr(logits, "full_tensor") else logits, batch)

    def _fuses(self, model: nn.Module, fn: Callable) -> bool:
        return not self.vocab_parallel and super()._fuses(model, fn)  # a split head has no whole matrix to fuse

    def forward_backward(self, batch: Batch, loss_fn: Callable | None = None) -> TrainFuture[dict[str, float]]:
        if self.dims.pp == 1:
            with self._loss_parallel():
                return super().forward_backward(batch, self._on_logits(loss_fn or self.loss_fn))
        loss_fn = loss_fn or self.loss_fn
        self.model.train()
        batch = self._to_device(batch)
        if reads_label_cross_entropy_only(loss_fn):
            total, count, _ = self._run_pipeline(batch, train=True)
        else:
            total, count = self._run_pipeline_rows(batch, loss_fn)
        return self._accumulate(total, count)

    def _run_pipeline_rows(self, batch: dict[str, torch.Tensor], fn: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """One training pass of a loss that splits by rows (`splits_by_rows`: DPO's pairs, the policy-gradient
        losses): the rows reordered so each pipeline micro-batch takes the same slice of every block (whole pairs),
        the batch's per-row tensors sent to the last stage as the schedule's target, `fn` run there on each
        micro-batch's rows. (The summed loss and its count, on every rank of the pipeline.)"""
        blocks, rows, pieces = row_blocks(fn), batch["input_ids"].shape[0], self.microbatches
        if blocks is None:
            raise ConfigError(
                "pipeline parallelism runs a loss one micro-batch of rows at a time: the token cross-entropy, DPO's "
                "pairs and the policy-gradient losses split so, this loss does not say it does (mark it with "
                "tierlm.primitives.losses.splits_by_rows): use tensor parallelism or FSDP2"
            )
        if rows % (blocks * pieces):
            unit = "pairs" if blocks == 2 else "rows"
            raise ConfigError(
                f"pipeline parallelism cuts each micro-batch into infra.pipeline_microbatches={pieces} pieces of whole "
                f"{unit}: {rows // blocks} {unit} do not split evenly; make the micro-batch size a multiple of {pieces}"
            )
        order = torch.arange(rows, device=self.device).view(blocks, pieces, -1).transpose(0, 1).reshape(-1)
        batch = {k: v[order] if _is_row_tensor(v, rows) else v for k, v in batch.items()}
        self._rows = PackedRows(batch, rows, fn)
        schedule, losses = self._schedule_for(tuple(batch["input_ids"].shape)), []
        try:
            with self._autocast(), self._loss_parallel():
                schedule.step(
                    *self._first_stage_inputs(batch),
                    target=self._rows.packed if self.has_last else None,
                    losses=losses if self.has_last else None,
                )
            counts = self._rows.counts
        finally:
            self._rows = None
        sums = torch.zeros(2, device=self.device)
        if self.has_last:
            sums = torch.stack([torch.stack(losses).sum().detach().float(), torch.stack(counts).sum().float()])
        dist.all_reduce(sums, group=self.pp_group)  # the last stage's, known to every stage
        return sums[0], sums[1]

    @torch.no_grad()
    def forward(self, batch: Batch, fn: Callable | None = None) -> TrainFuture[dict[str, float]]:
        """Evaluation through the stages: `fn(logits, batch)` runs where the logits are (the last stage) and
        its numbers are sent to every rank."""
        if self.dims.pp == 1:
            with self._loss_parallel():
                return super().forward(batch, self._on_logits(fn))
        was_training = self.model.training
        self.model.eval()
        batch = self._to_device(batch)
        total, count, logits = self._run_pipeline(batch, train=False)
        self.model.train(was_training)
        metrics = [None]
        if self.has_last:
            logits = logits[: batch["input_ids"].shape[0]]  # without the rows added to fill the micro-batches
            with self._loss_parallel():
                out = self._on_logits(fn)(logits, batch) if fn is not None else {"loss_sum": total, "num_tokens": count}
            metrics = [{k: float(v) for k, v in out.items()}]
        last = dist.get_global_rank(self.pp_group, (self.num_stages - 1) % self.dims.pp)
        dist.broadcast_object_list(metrics, src=last, group=self.pp_group)
        return TrainFuture.ready(metrics[0])

    @property
    def export_model(self) -> nn.Module:
        return self.whole_model

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's weights on rank 0's CPU — each stage's gathered over its tensor- and
        data-parallel ranks, then the stages' gathered over the pipeline ranks that hold global rank 0."""
        keeper = self.mesh["dp"].get_local_rank() == 0 and (self.dims.tp == 1 or self.mesh["tp"].get_local_rank() == 0)
        state = {}
        for name, value in self.model.state_dict().items():  # one whole tensor at a time on the device, then the CPU
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            if keeper:
                state[name] = whole.detach().cpu()
        if self.dims.pp == 1:
            return state if self.rank == 0 else None
        if keeper:
            parts = [None] * self.dims.pp if self.rank == 0 else None
            dist.gather_object(state, parts, dst=0, group=self.pp_group)
            if self.rank == 0:
                state = {name: value for part in parts for name, value in part.items()}
                for first, *others in tied_names(self.whole_model):  # one tensor again, as the model's own state dict
                    state.update({name: state[first] for name in others})
                return state
        return None

    def _step_parameter_by_parameter(self) -> None:
        """A parameter group mixes split and whole parameters (DTensors on different meshes, plain tensors),
        which the fused and foreach kernels refuse: step parameter by parameter. (Regrouping by mesh would
        change the groups a checkpoint records, and checkpoints must load at every layout.)"""
        for inner in inner_optimizers(self.optimizer):
            for group in inner.param_groups:
                group.update({key: False for key in ("foreach", "fused") if key in group})

    def load_checkpoint(self, path: str | Path | None = None) -> TrainFuture[dict]:
        future = super().load_checkpoint(path)
        self._step_parameter_by_parameter()  # a checkpoint of another layout brings its groups' kernel choice
        return future

    def _place(self, model: nn.Module) -> nn.Module:
        return model  # placed (and sharded) above

    @property
    def data_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def data_world_size(self) -> int:
        return self.dims.dp

    def reduce_step_totals(self, totals: torch.Tensor) -> torch.Tensor:
        if self.dp_group is not None:  # a tensor-parallel group shares its rows: count them once
            dist.all_reduce(totals, group=self.dp_group)
        return totals

    def all_reduce_sums(self, values: dict[str, float]) -> dict[str, float]:
        """Sums over the data-parallel ranks (every rank of a model-parallel group holds the same totals)."""
        summed = super().all_reduce_sums(values)
        copies = self.world_size // self.dims.dp
        return {k: v / copies for k, v in summed.items()}

    def _grad_divisor(self, num_tokens: torch.Tensor) -> torch.Tensor:
        # FSDP2 averages gradients over the data-parallel ranks; ours are sums, so undo its 1/dp.
        return num_tokens.clamp(min=1.0) / self.dims.dp

    def _clip_gradients(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if self.tp_summed:  # first complete the gradients each rank holds only its heads' share of
            sum_gradients(self.tp_summed, self.mesh["tp"].get_group())
        if self.stage_shared:  # and the tied embedding's, of which the first and last stage each hold a share
            sum_gradients(self.stage_shared, self.tied_group)
        counted = [p.grad for p in grads if id(p) not in self.uncounted]
        return clip_grad_norm(
            counted,
            self.max_grad_norm,
            extra_group=self.pp_group,  # stages hold different blocks
            also_scale=[p.grad for p in grads if id(p) in self.uncounted],
        )


class PackedRows:
    """A batch's per-row tensors packed side by side into one float64 (rows, width) tensor — the pipeline schedule's
    target, which it splits by rows into micro-batches and hands the last stage's loss — and each piece unpacked
    into a batch again (exact: float64 holds every id, mask and fp32 value). Tensors not per row go as they are."""

    def __init__(self, batch: dict[str, torch.Tensor], rows: int, fn: Callable):
        self.fn, self.counts = fn, []
        per_row = {k: v for k, v in batch.items() if _is_row_tensor(v, rows)}
        self.constants = {k: v for k, v in batch.items() if k not in per_row}
        self.layout = [(k, v.shape[1:], v.dtype) for k, v in per_row.items()]
        self.packed = torch.cat([v.reshape(rows, -1).double() for v in per_row.values()], dim=1)

    def unpack(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        out, at = dict(self.constants), 0
        for name, shape, dtype in self.layout:
            width = shape.numel()
            out[name] = packed[:, at : at + width].reshape(-1, *shape).to(dtype)
            at += width
        return out


def _is_row_tensor(value, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The pipeline's loss of one micro-batch (the schedule's `loss_fn(output, target)`): `cross_entropy_sum`'s
    total."""
    return cross_entropy_sum(logits, labels)[0]

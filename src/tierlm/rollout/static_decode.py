"""The native GPT's decode step with shapes that never change, launched once per token on a GPU.

An eager decode step of a 20-layer model is some 600 kernel launches, and on a GPU the host cannot issue them as fast
as the GPU runs them (13.3 ms of host time against 1.9 ms of GPU time per step, docs/benchmarks.md). The cure vLLM,
SGLang and transformers' static cache share: give the step fixed shapes — the batch rounded up to a bucket, a KV
cache of a fixed length written in place at a position held in a tensor, attention over the whole buffer with the
later positions masked — and capture it in a CUDA graph, which replays every kernel with one launch.

`StaticDecoder(model, rows, length)` holds such a step for one bucket: `load` copies prefilled caches into its
buffers (prompts of different lengths right-aligned, so several prompts decode as one batch), `step(tokens)` feeds
one token per row and returns the next logits (a view into its output buffer, valid until the next step). Off CUDA
the same fixed-shape step runs eagerly (what the tests compare with the slicing step, token for token). The engine
keeps a few buckets (`Decoders`) and uses them for the native GPT on CUDA, and everywhere for several prompts
decoded together (`tierlm.rollout.together`); the server's continuous batch keeps `FixedStep`s over its own cache.

With `pack`, each layer's q, k and v weights are one matrix and its gate and up weights another, so each trio and
pair is one matmul (vLLM's `QKVParallelLinear` and `MergedColumnParallelLinear`): at batch 1 a GPU runs a small
matmul far below its memory bandwidth (a 1280 x 1280 projection at 0.7 TB/s on an H200, docs/benchmarks.md), and
three make three kernels' fixed cost. The model's own weights become views of the packed matrices (`pack`): the same
memory, and an optimizer step or a loaded state dict writing them in place writes what the step reads.

With `compile`, the step is `torch.compile`d before it is captured (SGLang's way: Inductor's fused kernels inside
the engine's own graph). A graph replays every kernel with one launch, but each kernel still costs the GPU a few
microseconds however little it reads, and a 20-layer step is some 600 of them; Inductor fuses each norm, rotary
turn, residual add and activation with its neighbours. The first step of a new shape compiles (tens of seconds),
later buckets recompile once with dynamic shapes. `compile` may name a set of Inductor's options instead
(`COMPILE_OPTIONS`), for bench/inference_card.py to time against the default: "coordinate-descent" (gpt-fast's
setting: a matmul of one row becomes Inductor's own reduction kernel, tuned, which can take the norm before it and the
residual add after it — where the graph knows the batch is 1: a step compiled first for one row, not one recompiled
with a dynamic batch) and "max-autotune" (that, and Triton's matmul templates timed against cuBLAS for each shape:
the longest compile).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections import OrderedDict

import torch
from torch import nn

from tierlm.models.gpt.model import GPT, turn_keys
from tierlm.models.kv_cache import KVCache
from tierlm.models.moe import SwiGLU

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LENGTH_BUCKET = 128
"""Cache lengths are rounded up to a multiple of this (capped at the model's context): prompts of nearby lengths
share one captured graph."""


def supports(model: nn.Module) -> bool:
    """Whether `model` takes the fixed-shape step: the native GPT without sliding-window layers (whose band mask
    assumes the keys end at the query) nor experts, its weights plain tensors (not a sharded policy's DTensors)."""
    return (
        isinstance(model, GPT)
        and model.config.moe is None  # routing sizes each expert's batch on the host: no fixed shapes
        and all(window is None for window in model.config.layer_windows())
        and all(type(p.data) is torch.Tensor for p in model.parameters())
    )


COMPILE_BACKEND = "inductor"
"""`torch.compile`'s backend for a compiled step (the tests trace with a cheaper one)."""


def decode_step(model: GPT, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One token per row (B,) at the cache's tensor position; the next logits (B, V). Moves the position on."""
    logits = model(tokens[:, None], cache=cache)[:, -1]
    cache.position.add_(1)
    return logits


COMPILE_OPTIONS = {
    "default": {},
    "coordinate-descent": {"coordinate_descent_tuning": True},
    "max-autotune": {"max_autotune": True, "coordinate_descent_tuning": True},  # torch.compile's mode of the name,
}  # less its CUDA graphs (the step is captured in the engine's own)
"""Inductor's options for a compiled step, by the name `compile` gives (True: "default")."""


@functools.cache
def compiled_decode_step(backend: str, options: str = "default"):
    """`decode_step` compiled whole (one graph, no breaks) with Inductor's `COMPILE_OPTIONS[options]`, shared by every
    bucket and engine."""
    return torch.compile(decode_step, backend=backend, fullgraph=True, options=COMPILE_OPTIONS[options] or None)


def pack(linears: list[nn.Linear]) -> torch.Tensor:
    """The `linears`' weights as one matrix, their rows stacked, that the weights are views of: their own storage
    where they already lie one after another in one, else a new one they move into (their values kept). Written in
    place — an optimizer step, `load_state_dict` — the weights write it; moved or replaced (`.to()`), they leave it.

    >>> a, b = nn.Linear(4, 2, bias=False), nn.Linear(4, 3, bias=False)
    >>> w = pack([a, b])
    >>> w.shape, torch.equal(w[2:], b.weight), pack([a, b]).data_ptr() == w.data_ptr()
    (torch.Size([5, 4]), True, True)
    >>> with torch.no_grad():
    ...     _ = a.weight.mul_(2)
    >>> torch.equal(w[:2], a.weight)
    True
    """
    weights = [linear.weight for linear in linears]
    rows, columns = sum(w.shape[0] for w in weights), weights[0].shape[1]
    start, storage = weights[0].storage_offset(), weights[0].untyped_storage().data_ptr()
    offsets = itertools.accumulate((w.numel() for w in weights), initial=start)
    if all(
        w.is_contiguous() and w.untyped_storage().data_ptr() == storage and w.storage_offset() == offset
        for w, offset in zip(weights, offsets)
    ):
        return weights[0].detach().as_strided((rows, columns), (columns, 1), start)
    with torch.inference_mode(False), torch.no_grad():  # under inference mode the weights would stop training
        packed = torch.cat([w.detach() for w in weights])
        for w, part in zip(weights, packed.split([w.shape[0] for w in weights])):
            w.data = part
    return packed


def projections(model: GPT) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(module, attribute, packed weights) for each layer's q/k/v and gate/up (`pack`): what `packed` sets while a
    step runs. Only plain bias-free linears of their full shapes pack (not LoRA's, nor a partitioned weight)."""
    groups = []
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        groups.append((attn, "qkv_weight", [attn.q_proj, attn.k_proj, attn.v_proj]))
        if isinstance(mlp, SwiGLU):
            groups.append((mlp, "gate_up_weight", [mlp.gate_proj, mlp.up_proj]))
    return [(module, name, pack(linears)) for module, name, linears in groups if _packable(linears)]


def _packable(linears: list[nn.Module]) -> bool:
    first = linears[0].weight
    return all(
        type(linear) is nn.Linear
        and linear.bias is None
        and linear.weight.shape == (linear.out_features, linear.in_features)
        and (linear.weight.dtype, linear.weight.device, linear.in_features)
        == (first.dtype, first.device, first.shape[1])
        for linear in linears
    )


@contextlib.contextmanager
def packed(packs: list[tuple[nn.Module, str, torch.Tensor]]):
    """The modules' packed weights set inside the `with` (`projections`), so their forwards use them."""
    for module, name, weight in packs:
        setattr(module, name, weight)
    try:
        yield
    finally:
        for module, name, _ in packs:
            setattr(module, name, None)


def bucket(rows: int, length: int, context: int) -> tuple[int, int]:
    """The (rows, cache length) bucket holding `rows` rows of up to `length` positions.

    >>> bucket(3, 40, 1024), bucket(16, 200, 1024), bucket(300, 1000, 1024)
    ((4, 128), (16, 256), (300, 1024))
    """
    rows = next((b for b in ROW_BUCKETS if b >= rows), rows)
    return rows, min(-(-length // LENGTH_BUCKET) * LENGTH_BUCKET, context)


class FixedStep:
    """`decode_step` over buffers that never move — `tokens` (B,) and a `cache` at a tensor position, its own or views
    of a larger one — on CUDA captured in a CUDA graph (after compiling, with `compile`; with `pack`, q/k/v and
    gate/up packed; `compile` a name in `COMPILE_OPTIONS`: with those options). `run()`: the next logits (B, V), a
    view valid until the next run."""

    def __init__(
        self,
        model: GPT,
        tokens: torch.Tensor,
        cache: KVCache,
        graph: bool,
        compile: bool | str = False,
        pack: bool = True,
    ):
        self.model, self.tokens, self.cache = model, tokens, cache
        options = compile if isinstance(compile, str) else "default"
        self.fn = compiled_decode_step(COMPILE_BACKEND, options) if compile else decode_step
        self.packs = projections(model) if pack else []
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        if graph:
            self._capture()

    @torch.no_grad()
    def _forward(self) -> torch.Tensor:
        with packed(self.packs):
            return self.fn(self.model, self.tokens, self.cache)

    def _capture(self) -> None:
        """Warm up on a side stream (cuBLAS and the allocator settle), then capture one step (PyTorch's recipe,
        `torch.cuda.graphs`). The warm-up runs the step at the position the cache is at, from the tokens there: it
        writes what the first run writes (capturing runs nothing)."""
        position = self.cache.position
        start = position.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                position.copy_(start)
                self._forward()
        torch.cuda.current_stream().wait_stream(side)
        position.copy_(start)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # its own memory pool: one graph's scratch never holds another's output
            self.logits = self._forward()

    @torch.no_grad()
    def run(self) -> torch.Tensor:
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.logits


class StaticDecoder:
    """One bucket's fixed-shape decode step (`rows` rows, a cache of `length` positions): a `FixedStep` over buffers
    of its own."""

    def __init__(self, model: GPT, rows: int, length: int, graph: bool, compile: bool | str = False, pack: bool = True):
        assert supports(model), "the fixed-shape decode step needs the native GPT without sliding windows"
        parameter = next(model.parameters())
        self.model, self.rows, self.length = model, rows, length
        self.cache = KVCache(model.config, rows, length, parameter.device, parameter.dtype)
        self.position = torch.zeros(1, dtype=torch.long, device=parameter.device)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=parameter.device)
        self.mask = torch.ones(rows, length, dtype=torch.bool, device=parameter.device)
        """Each row's own positions (prompts of different lengths end together: `load`)."""
        self.cache.position = self.position  # this cache only ever decodes at the tensor position
        for layer in self.cache.layers:
            layer.mask = self.mask
        self.fixed = FixedStep(model, self.tokens, self.cache, graph, compile, pack)

    @torch.no_grad()
    def load(self, prefilled: list[tuple[KVCache, int]]) -> None:
        """Take over prefilled caches, each `(cache, rows)` given the next `rows` rows (its one row copied to each: a
        prompt sampled many ways, or its own rows: continued rollouts); decoding continues after the longest. A
        shorter prompt's keys are right-aligned to it, turned as if it had started later (`turn_keys`), the positions
        before it masked off, so each row computes what it would alone (to float rounding; exactly for one prompt)."""
        end = max(cache.length for cache, _ in prefilled)
        assert end < self.length, f"a cache of {end} positions leaves no room in a bucket of {self.length}"
        self.mask.zero_()
        row = 0
        for cache, rows in prefilled:
            size = cache.length
            turn = turn_keys(self.model, end - size)
            for mine, theirs in zip(self.cache.layers, cache.layers):
                k, v = theirs.k[:, :, :size], theirs.v[:, :, :size]
                mine.k[row : row + rows, :, end - size : end] = turn(k).expand(rows, -1, -1, -1)
                mine.v[row : row + rows, :, end - size : end] = v.expand(rows, -1, -1, -1)
            self.mask[row : row + rows, end - size :] = True  # its positions, and those decoding will write
            row += rows
        self.mask[row:] = True  # rows past the requests' (the bucket's padding): any keys, nobody reads them
        self.position.fill_(end)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row in use (B,); the next logits (B, V), a view valid until the next step."""
        self.tokens[: tokens.shape[0]].copy_(tokens)
        return self.fixed.run()[: tokens.shape[0]]


class Decoders:
    """The fixed-shape decode steps an engine keeps, one per (rows, length) bucket, the least recently used dropped
    past `keep` (each holds a KV cache of its size)."""

    def __init__(self, model: GPT, graph: bool, keep: int = 4, compile: bool | str = False, pack: bool = True):
        self.model, self.graph, self.keep, self.compile, self.pack = model, graph, keep, compile, pack
        self.decoders: OrderedDict[tuple[int, int], StaticDecoder | FixedStep] = OrderedDict()
        self.weights: tuple[int, ...] = ()

    def get(self, rows: int, length: int) -> StaticDecoder:
        """The decoder of the bucket holding `rows` rows of up to `length` positions."""
        self.check_weights()
        key = bucket(rows, length, self.model.config.max_seq_len)
        return self.kept(key, lambda: StaticDecoder(self.model, *key, self.graph, self.compile, self.pack))

    def check_weights(self) -> None:
        """Drop every step kept if the weights moved since the last look. A graph reads the weights where they were at
        its capture: weights moved or replaced (`.to()`, a new dtype, assigned tensors) drop every step captured
        before; loading in place (`load_state_dict`) keeps them. Walking the parameters costs ~0.8 ms at 220 of them
        (this CPU): `get` looks each generation, a continuous batch when sequences join (not every step)."""
        weights = tuple(p.data_ptr() for p in self.model.parameters())
        if weights != self.weights:
            self.decoders.clear()
            if self.pack:  # the weights move into their packed matrices now, not in the first step made
                projections(self.model)
                weights = tuple(p.data_ptr() for p in self.model.parameters())
            self.weights = weights

    def kept(self, key, make):
        """The step kept under `key`, made by `make()` where there is none (`tierlm.rollout.batching` keeps its
        steps over its own cache here too); `check_weights` first where the weights may have moved."""
        if key not in self.decoders:
            while len(self.decoders) >= self.keep:
                self.decoders.popitem(last=False)
            with torch.inference_mode(False):  # its buffers, written in place by every later step, are ordinary
                self.decoders[key] = make()
        self.decoders.move_to_end(key)
        return self.decoders[key]

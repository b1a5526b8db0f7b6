"""Continuous batching for the native GPT: sequences join a running batch between decode steps and leave it when they
finish, so one forward pass per step serves every request in flight (`tierlm serve`'s crowd).

The rows share one timeline of cache positions. A sequence that joins when the timeline is at L is prefilled (with
those joining at the same step, right-padded: `BatchedDecoder.join_many`) and its keys placed at positions [L - P,
L), the positions before them masked off for that row; every row then decodes at L, L + 1, ... together. Rotary
embeddings make attention depend only on the distance between a query and a key, so a key computed at position p and
turned by d more (one more rotation: R(p + d) = R(d) R(p)) is the key the row would hold had it started d later — a
row's logits are what it computes alone (to float rounding). When the timeline reaches the model's context, or once
most of it is positions no row uses (which every step would attend over for nothing), it is compacted: every row's
keys move left by the room nobody uses, turned back by as much. A sequence longer than the timeline so far pushes
everyone right the same way.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from tierlm.models import unwrap_model
from tierlm.models.gpt.model import GPT, turn_keys
from tierlm.models.kv_cache import KVCache, LayerCache
from tierlm.rollout import static_decode, together
from tierlm.rollout.engine import Completion, ToolCalls
from tierlm.rollout.sampling import sample_rows

POSITION_STEP = 16
"""A compiled CPU step's positions are those in use rounded up to a multiple of this (a new step object each time they
cross one, not each token)."""


class BatchedDecoder:
    """The KV cache of every sequence in flight and the model step over them. `join(prompt)` returns the logits of
    its first new token and gives it the next row (`join_many(prompts)`: several, prefilled together); `step(tokens)`
    feeds one token per row and returns each row's next logits; `leave(rows)` drops rows. The cache is allocated once
    for `max_rows` rows: the rows in flight are its first ones, so joining writes one row and leaving moves the last
    rows into the freed places (never the whole cache)."""

    def __init__(self, model: torch.nn.Module, max_rows: int = 32, static: bool | None = None, compile: bool = False):
        self.model = unwrap_model(model)
        assert isinstance(self.model, GPT), "continuous batching needs the native GPT (rotary positions)"
        assert all(w is None for w in self.model.config.layer_windows()), "sliding-window layers are not batched"
        assert max_rows >= 1, f"max_rows must be >= 1, got {max_rows}"
        config, self.max_rows = self.model.config, max_rows
        self.capacity = config.max_seq_len
        parameter = next(self.model.parameters())
        self.cache = KVCache(config, max_rows, self.capacity, parameter.device, parameter.dtype)
        self.full = [(layer.k, layer.v) for layer in self.cache.layers]  # every row's place
        self.full_mask = torch.zeros(max_rows, self.capacity, dtype=torch.bool, device=parameter.device)
        self.rows = 0
        self.starts: list[int] = []  # where each row's keys begin on the timeline (its mask's first True)
        self.high = 0
        """The furthest the timeline has reached: no row holds anything at or past it (all zeros), so clearing and
        moving rows touches the positions before it, not the whole context."""
        self._views()
        on_cuda = parameter.device.type == "cuda"
        fixed = ((on_cuda or bool(compile)) if static is None else static) and static_decode.supports(self.model)
        self.steps = static_decode.Decoders(self.model, on_cuda, compile=compile) if fixed else None
        """With fixed shapes (on CUDA, when compiled, or `static`): a step per (rows, positions) bucket over views of
        the cache, each one CUDA graph on CUDA (`tierlm.rollout.static_decode`); None: the step slices the cache to
        the rows and the positions in use."""
        self.buckets = fixed and (on_cuda or not compile)
        """Fixed steps round the rows and positions up to `static_decode.bucket`s (a CUDA graph each: few of them).
        Compiled on a CPU they take the rows in flight and the positions in use to `POSITION_STEP`: dynamo makes the
        step's shapes dynamic after its first few compiles, and attention reads every padded row and position (at
        32 rows it is most of the compiled step)."""
        self.position = torch.zeros(1, dtype=torch.long, device=parameter.device)
        self.tokens = torch.zeros(max_rows, dtype=torch.long, device=parameter.device)

    @property
    def length(self) -> int:
        return self.cache.length

    @torch.no_grad()
    def join(self, prompt_ids: list[int]) -> torch.Tensor:
        """Prefill `prompt_ids`, add its row; the logits (V,) of its first new token."""
        return self.join_many([prompt_ids])[0]

    @torch.no_grad()
    def join_many(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill `prompts` and add a row for each, in order; the logits (len(prompts), V) of their first new tokens.
        Prompts of like lengths are prefilled as one batch, right-padded to the longest (`together.prefill`: each
        computes what it computes alone)."""
        assert self.rows + len(prompts) <= self.max_rows, f"the batch is full ({self.max_rows} rows)"
        for prompt in prompts:
            assert 0 < len(prompt) < self.capacity, f"a prompt of {len(prompt)} tokens does not fit {self.capacity}"
        if self.steps is not None:  # the weights a step reads are looked at as sequences join, not every step
            self.steps.check_weights()
        device = self.full_mask.device
        prefilled = together.prefill(self.model, [torch.tensor([prompt], device=device) for prompt in prompts])
        for (_, cache), prompt in zip(prefilled, prompts):  # the rows in the prompts' order
            self._place(cache, len(prompt))
        return torch.cat([logits for logits, _ in prefilled])

    def _place(self, prefilled: KVCache, size: int) -> None:
        """A prefill's one-row cache (its first `size` positions) as the batch's next row, its keys ending where the
        timeline is."""
        if self.rows == 0:
            self._set_length(0)
        if size > self.length:
            self._shift(size - self.length)  # everyone right, so the new row's keys end where the timeline is
        if self.length + 1 > self.capacity:  # no room left to decode even one token: compact first
            self._compact()
        start, row, turn = self.length - size, self.rows, turn_keys(self.model, self.length - size)
        high = self.high
        for (k, v), mine in zip(self.full, prefilled.layers):
            k[row, :, :high].zero_()
            v[row, :, :high].zero_()
            k[row, :, start : self.length] = turn(mine.k[0, :, :size])
            v[row, :, start : self.length] = mine.v[0, :, :size]
        self.full_mask[row] = False
        self.full_mask[row, start : self.length] = True
        self.starts.append(start)
        self.rows += 1
        self._views()

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (B,); the next logits of every row (B, V) (with fixed shapes a view valid until the
        next step: a CUDA graph's output)."""
        assert tokens.shape == (self.rows,), f"one token per row: {self.rows} rows, got {tuple(tokens.shape)}"
        unused = self._unused()
        if self.length + 1 > self.capacity or (unused >= 64 and unused >= self.length // 2):
            self._compact()  # at the context, or once most of the timeline is positions no row uses
        if self.steps is None:
            first, length = self._unused(), self.length
            alone = max(self.starts) == first  # every row holds every position from `first` (one row, say)
            mask = None if alone else self.full_mask[: self.rows]  # then attention reads no mask
            for layer in self.cache.layers:  # attention skips the positions no row uses
                layer.first, layer.mask = first, mask
            logits = self.model(tokens[:, None].to(self.full_mask.device), cache=self.cache)[:, -1]
            if alone:
                self.full_mask[: self.rows, length] = True  # the new token's place, as the cache marks with a mask
            self.high = max(self.high, self.length)
            return logits
        length = self.length
        if self.buckets:
            rows, positions = static_decode.bucket(self.rows, length + 1, self.capacity)
            rows = min(rows, self.max_rows)
        else:
            rows, positions = self.rows, min(-(-(length + 1) // POSITION_STEP) * POSITION_STEP, self.capacity)
        self.full_mask[:rows, length] = True  # the new token's place, in the bucket's padding rows too (none empty)
        self.position.fill_(length)
        self.tokens[: self.rows].copy_(tokens)
        logits = self.steps.kept((rows, positions), lambda: self._fixed_step(rows, positions)).run()[: self.rows]
        self._set_length(length + 1)
        return logits

    def _fixed_step(self, rows: int, positions: int) -> static_decode.FixedStep:
        """The fixed-shape step over the first `rows` rows and `positions` positions of the cache (views: the cache is
        written in place, never moved, so a graph captured over them stays valid)."""
        layers = [
            LayerCache.over(
                k[:rows, :, :positions], v[:rows, :, :positions], self.full_mask[:rows, :positions], self.position
            )  # fmt: skip
            for k, v in self.full
        ]
        return static_decode.FixedStep(
            self.model, self.tokens[:rows], KVCache.over(layers), self.steps.graph, self.steps.compile, self.steps.pack
        )

    @torch.no_grad()
    def leave(self, rows: list[int]) -> list[int]:
        """Drop `rows` (indices into the current batch), each place taken by the last row; returns, for each row now,
        the index it had before."""
        order = list(range(self.rows))
        for row in sorted(set(rows), reverse=True):
            last = self.rows - 1
            if row != last:
                high = self.high
                for k, v in self.full:
                    k[row, :, :high], v[row, :, :high] = k[last, :, :high], v[last, :, :high]
                self.full_mask[row] = self.full_mask[last]
                order[row], self.starts[row] = order[last], self.starts[last]
            order.pop()
            self.starts.pop()
            self.rows -= 1
        self._views()
        if self.rows == 0:
            self._set_length(0)
        return order

    # -- moving the timeline ---------------------------------------------------------------------
    def _views(self) -> None:
        """The model sees the rows in flight: the first `rows` of every place."""
        for layer, (k, v) in zip(self.cache.layers, self.full):
            layer.k, layer.v, layer.mask = k[: self.rows], v[: self.rows], self.full_mask[: self.rows]

    def _shift(self, offset: int) -> None:
        """Every row's keys `offset` positions later (negative: earlier), the timeline with them."""
        turn, length, n = turn_keys(self.model, offset), self.length, self.rows
        lo, high = max(0, -offset), self.high
        for k, v in self.full:
            moved_k, moved_v = turn(k[:n, :, lo:length]), v[:n, :, lo:length].clone()
            k[:n, :, :high].zero_()
            v[:n, :, :high].zero_()
            k[:n, :, lo + offset : length + offset], v[:n, :, lo + offset : length + offset] = moved_k, moved_v
        moved = self.full_mask[:n, lo:length].clone()
        self.full_mask[:n] = False
        self.full_mask[:n, lo + offset : length + offset] = moved
        self.starts = [start + offset for start in self.starts]
        self._set_length(length + offset)

    def _unused(self) -> int:
        """Positions at the start of the timeline that no row uses (kept per row: no look at the mask, no host
        sync, every step)."""
        return min(self.starts) if self.starts else self.length

    def _compact(self) -> None:
        """Move everyone left by the positions no row uses (at the start of the timeline)."""
        unused = self._unused()
        assert unused > 0, f"the rows fill the model's context of {self.capacity}: finish the longest first"
        self._shift(-unused)

    def _set_length(self, length: int) -> None:
        self.high = max(self.high, length)
        for layer in self.cache.layers:
            layer.length = length


@dataclass
class Request:
    """One sequence to generate through a `BatchScheduler`: its prompt and sampling, `on_token(completion)` after
    each token it gets, `should_stop()` naming a reason to end it early, and, once `done` is set, its `completion`
    and `reason` ("stop", "length", or should_stop's)."""

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    generator: torch.Generator | None = None
    on_token: Callable[[Completion], None] | None = None
    should_stop: Callable[[], str | None] | None = None
    ignore_eos: bool = False
    """A stop token does not end it (it runs to `max_new_tokens` or `should_stop`)."""
    completion: Completion = field(default_factory=Completion)
    reason: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    calls: ToolCalls = field(default_factory=ToolCalls)
    error: str | None = None
    """Why the model failed on the batch it was in (reason "error")."""


class BatchScheduler:
    """Requests from any thread generated together by one thread: each joins the running batch between decode steps
    (up to `max_rows` at once; the rest wait), leaves when it ends, and gets its tokens as they come. `engine` (the
    model's `Engine`) lends its stop tokens and its tools (a calculator call answered mid-sequence, as alone)."""

    def __init__(self, engine, max_rows: int = 16):
        decoders = getattr(engine, "decoders", None)
        compile = decoders is not None and decoders.compile  # engine.compile: the batch's step too
        self.engine, self.decoder = engine, BatchedDecoder(engine.model, max_rows, compile=compile)
        engine.model.eval()
        self.waiting: deque[Request] = deque()
        self.rows: list[Request] = []  # in flight, in the decoder's row order
        self.wake, self.closed = threading.Condition(), False
        self.handing: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        """The context a step's tokens are handed out in (every row's `on_token`): a server holds its event loop's
        wake-ups there, to send the step's pieces with one."""
        self.thread = threading.Thread(target=self._run, daemon=True, name="tierlm-batch")
        self.thread.start()

    @staticmethod
    def supports(engine) -> bool:
        """Can `engine`'s model be batched (the native GPT without sliding windows)?"""
        model = unwrap_model(getattr(engine, "model", None)) if getattr(engine, "model", None) is not None else None
        return isinstance(model, GPT) and all(w is None for w in model.config.layer_windows())

    def submit(self, request: Request) -> Request:
        assert 0 < len(request.prompt_ids) < self.decoder.capacity, "the caller checks the prompt fits the context"
        with self.wake:
            self.waiting.append(request)
            self.wake.notify()
        return request

    def close(self) -> None:
        with self.wake:
            self.closed = True
            self.wake.notify()
        self.thread.join(timeout=10)

    # -- the one thread that runs the model -----------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                self._serve()
                return
            except Exception as e:  # the model failed on this batch: its requests end with the error, the rest go on
                for request in self.rows:
                    request.reason, request.error = "error", f"{type(e).__name__}: {e}"
                    request.done.set()
                self.decoder.leave(list(range(self.decoder.rows)))
                self.rows = []

    def _serve(self) -> None:
        logits: torch.Tensor | None = None
        while True:
            with self.wake:
                while not self.closed and not self.rows and not self.waiting:
                    self.wake.wait()
                if self.closed:
                    for request in [*self.rows, *self.waiting]:
                        request.reason = request.reason or "cancelled"
                        request.done.set()
                    return
                arrivals = []
                while self.waiting and len(self.rows) + len(arrivals) < self.decoder.max_rows:
                    arrivals.append(self.waiting.popleft())
            arrivals = [r for r in arrivals if not self._stopped(r)]
            if arrivals:  # they join between two steps, prefilled together; their first logits join the batch's
                firsts = self.decoder.join_many([request.prompt_ids for request in arrivals])
                logits = firsts if logits is None else torch.cat([logits, firsts])
                self.rows = self.rows + arrivals
            if not self.rows:
                logits = None
                continue
            assert logits is not None and logits.shape[0] == len(self.rows), "one row of logits per request"
            sampled = self._sample(logits)
            with self.handing():
                tokens = [self._next(request, sampled[i]) for i, request in enumerate(self.rows)]
            ended = [i for i, request in enumerate(self.rows) if request.reason is not None]
            if ended:
                order = self.decoder.leave(ended)  # the rows left, in the decoder's new order
                for i in ended:
                    self.rows[i].done.set()
                self.rows, tokens = [self.rows[i] for i in order], [tokens[i] for i in order]
            logits = self.decoder.step(torch.tensor(tokens)) if self.rows else None

    def _stopped(self, request: Request) -> bool:
        reason = request.should_stop() if request.should_stop is not None else None
        if reason is not None:
            request.reason = reason
            request.done.set()
        return reason is not None

    def _sample(self, logits: torch.Tensor) -> list[int | None]:
        """Each row's sampled token, the batch's in one call (None where a tool's result is forced); each row draws
        what it would alone, from its own generator when it has one."""
        rows, out = self.rows, [None] * len(self.rows)
        drawn = [i for i, r in enumerate(rows) if not r.calls.forced]
        if drawn:
            tokens = sample_rows(
                logits[drawn], [rows[i].temperature for i in drawn], [rows[i].generator for i in drawn]
            )
            for i, token in zip(drawn, tokens):
                out[i] = token
        return out

    def _next(self, request: Request, sampled: int | None) -> int:
        """The row's next token (`sampled`, or a forced tool result), recorded; sets `reason` when the row ends."""
        completion = request.completion
        token = self.engine.take_token(completion, sampled, 0.0, request.calls)
        if completion.finished and request.ignore_eos:
            completion.finished = False
        if completion.finished:
            request.reason = "stop"
        if request.on_token is not None:
            request.on_token(completion)
        full = len(request.prompt_ids) + len(completion.tokens) >= self.decoder.capacity
        if request.reason is None and (len(completion.tokens) >= request.max_new_tokens or full):
            request.reason = "length"
        if request.reason is None:
            self._stopped(request)
        return token

"""How `tierlm serve` answers a request: admitted by the `Gate` (or told when to retry), its choices generated on
a thread of their own (`Job`), handed to the event loop (`Outbox`), then streamed, or whole, or the error in
OpenAI's body (`Answers`)."""

# No `from __future__ import annotations`, as in serve.py: FastAPI reads annotations at run time.
import asyncio
import contextlib
import json
import math
import threading
import time
from collections import deque
from typing import Any

from tierlm.commands.generation import Busy
from tierlm.commands.openai_api import Bodies
from tierlm.errors import DataError


class Gate:
    """Admission: how many requests are in (running or waiting), the recent mean reply time, and the figures
    /metrics exports (prometheus_client, a registry of the app's own)."""

    def __init__(self, max_queue: int, running: int = 1):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.max_queue, self.running_at_once, self.inside, self.lock = max_queue, running, 0, threading.Lock()
        self.recent: deque[float] = deque(maxlen=20)
        self.tokens: deque[tuple[float, int]] = deque(maxlen=1000)  # (finish time, completion tokens)
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tierlm_requests", "Chat completion requests by outcome", ["outcome"], registry=self.registry
        )
        self.waiting = Gauge("tierlm_queue_depth", "Requests waiting for the model", registry=self.registry)
        self.running = Gauge("tierlm_running_requests", "Requests generating", registry=self.registry)
        self.generated = Counter("tierlm_generated_tokens", "Completion tokens generated", registry=self.registry)
        self.latency = Histogram(
            "tierlm_request_seconds",
            "Seconds from a request's arrival to its last token",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.first_token = Histogram(
            "tierlm_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
            registry=self.registry,
        )
        Gauge(
            "tierlm_tokens_per_second", "Completion tokens per second over the last minute", registry=self.registry
        ).set_function(self.tokens_per_second)

    def admit(self) -> int | None:
        """Let a request in (None), or say in how many seconds to retry."""
        with self.lock:
            if self.inside >= self.max_queue + self.running_at_once:
                mean = sum(self.recent) / len(self.recent) if self.recent else 1.0
                ahead = (self.inside - self.max_queue) / self.running_at_once
                return max(1, math.ceil(mean * ahead))
            self.inside += 1
            self.publish()
            return None

    def publish(self) -> None:
        self.waiting.set(self.queue_depth)
        self.running.set(self.inside - self.queue_depth)

    @property
    def queue_depth(self) -> int:
        return max(self.inside - self.running_at_once, 0)

    def leave(self, seconds: float, outcome: str, tokens: int) -> None:
        with self.lock:
            self.inside -= 1
            self.publish()
            self.recent.append(seconds)
            self.tokens.append((time.monotonic(), tokens))
        self.requests.labels(outcome).inc()
        self.generated.inc(tokens)
        self.latency.observe(seconds)

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        return sum(n for t, n in list(self.tokens) if now - t <= 60) / 60.0


class Outbox:
    """Pieces handed from generating threads to the event loop's queues with one wake-up for all that arrive
    together (a batched step hands one piece per reply: one `call_soon_threadsafe` each would wake the loop as many
    times), or, while `held`, for all that arrive until `release()`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.scheduled, self.held = loop, deque(), False, False

    def put(self, queue: asyncio.Queue, item) -> None:
        self.items.append((queue, item))
        if not self.scheduled and not self.held:  # read after the append: a flush or release has not drained it yet
            self._schedule()

    def release(self) -> None:
        """End a hold: what arrived meanwhile goes with one wake-up."""
        self.held = False
        if self.items and not self.scheduled:
            self._schedule()

    def _schedule(self) -> None:
        self.scheduled = True
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        self.scheduled = False
        while self.items:
            queue, item = self.items.popleft()
            queue.put_nowait(item)


class Job:
    """One request's generation, run on a thread of its own: its deadline, whether its client went away, and the
    pieces of text (then the reply, or the error) it hands the response."""

    def __init__(self, timeout_s: float, outbox: Outbox):
        self.start, self.deadline = time.monotonic(), time.monotonic() + timeout_s
        self.cancelled, self.first_token_at = False, None
        self.outbox, self.pieces = outbox, asyncio.Queue()

    def stop_reason(self) -> str | None:
        if self.cancelled:
            return "cancelled"
        return "timeout" if time.monotonic() > self.deadline else None

    def put(self, kind: str, value) -> None:
        if kind == "text" and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.outbox.put(self.pieces, (kind, value))

    def generate(self, produce, gate: Gate) -> None:
        """The choices (on this job's own thread): `produce(on_text, should_stop, wait_s)` streams their text piece
        by piece (`on_text(index, piece)`) and returns them; then the choices or what went wrong. The gate is told
        how it ended."""
        outcome, tokens = "error", 0
        try:
            replies = produce(
                lambda index, piece: self.put("text", (index, piece)),
                self.stop_reason,
                self.deadline - time.monotonic(),
            )
            outcome, tokens = replies[0].finish_reason, sum(r.completion_tokens for r in replies)
            self.put("done", replies)
        except Busy as e:
            outcome = "timeout"
            self.put("busy", str(e))
        except DataError as e:
            outcome = "invalid"
            self.put("error", str(e))
        except Exception as e:  # the model failed: the client gets a 500, the server goes on
            self.put("failed", f"{type(e).__name__}: {e}")
        finally:
            if self.first_token_at is not None:
                gate.first_token.observe(self.first_token_at - self.start)
            gate.leave(time.monotonic() - self.start, outcome, tokens)

    async def events(self, bodies: Bodies, choices: int):
        """The streamed choices as server-sent events: (chat) each choice's role once the first text is there, then
        their text (what came meanwhile for a choice in one event, not one per token), each choice's end (finish
        reason, log-probs when asked for) and the usage when asked for, or an error, then [DONE]."""
        try:
            pending, opened = None, bodies.kind != "chat"
            while True:
                kind, value = pending or await self.pieces.get()
                pending = None
                if not opened and kind in ("text", "done"):  # the roles come with the first text, as vLLM's do:
                    opened = True  # a client timing its first token is not told of one while the request waits
                    for index in range(choices):
                        yield bodies.chunk(index, "")
                if kind == "text":
                    index, text = value[0], [value[1]]
                    while not self.pieces.empty():
                        pending = self.pieces.get_nowait()
                        if pending[0] != "text" or pending[1][0] != index:
                            break
                        text.append(pending[1][1])
                        pending = None
                    yield bodies.chunk(index, "".join(text))
                    continue
                if kind == "done":
                    for index, reply in enumerate(value):
                        yield bodies.chunk(index, None, reply.finish_reason, reply)
                    if bodies.usage_in_stream:
                        yield bodies.usage_chunk(value)
                else:
                    failure = "server_error" if kind != "error" else "invalid_request_error"
                    yield f"data: {json.dumps({'error': {'message': value, 'type': failure}})}\n\n"
                break
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): stop generating at the next token
            self.cancelled = True

    async def outcome(self, request) -> tuple[str, Any]:
        """How a plain (not streamed) request ended: its last piece, waited for; a client that disconnects meanwhile
        stops the generation."""
        while True:
            try:
                kind, value = await asyncio.wait_for(self.pieces.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.cancelled = True
                continue
            if kind != "text":
                return kind, value


def error(status: int, message: str, kind: str, headers: dict | None = None):
    """A JSON response with OpenAI's error body."""
    from fastapi.responses import JSONResponse

    body = {"error": {"message": message, "type": kind, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class Answers:
    """How a request is answered: admitted by the gate (else 429), its choices generated on a thread of their own
    (`Job`), then streamed, or whole, or the error (400 / 500 / 504) in OpenAI's body."""

    def __init__(self, gate: Gate, max_queue: int, timeout_s: float):
        self.gate, self.max_queue, self.timeout_s = gate, max_queue, timeout_s
        self.outboxes: dict[
            asyncio.AbstractEventLoop, Outbox
        ] = {}  # one per event loop (a test client may run several)

    @contextlib.contextmanager
    def holding(self):
        """Pieces put meanwhile reach each event loop with one wake-up at the end (a batched step's, one per reply:
        `BatchScheduler.handing`)."""
        outboxes = list(self.outboxes.values())
        for outbox in outboxes:
            outbox.held = True
        try:
            yield
        finally:
            for outbox in outboxes:
                outbox.release()

    async def __call__(self, request, bodies: Bodies, produce, choices: int, stream: bool):
        from fastapi.responses import StreamingResponse

        retry = self.gate.admit()
        if retry is not None:
            self.gate.requests.labels("rejected").inc()
            message = f"{self.max_queue} requests are waiting already: retry in {retry} s"
            return error(429, message, "rate_limit_exceeded", {"Retry-After": str(retry)})
        loop = asyncio.get_running_loop()
        if loop not in self.outboxes:
            self.outboxes[loop] = Outbox(loop)
        job = Job(self.timeout_s, self.outboxes[loop])
        threading.Thread(target=job.generate, args=(produce, self.gate), daemon=True, name="tierlm-generate").start()
        if stream:
            return StreamingResponse(job.events(bodies, choices), media_type="text/event-stream")
        kind, value = await job.outcome(request)
        if kind == "error":
            return error(400, value, "invalid_request_error")
        timed_out = kind == "done" and value[0].finish_reason == "timeout" and not value[0].completion_tokens
        if kind == "busy" or timed_out:
            return error(504, f"no reply within the server's {self.timeout_s:g} s timeout", "timeout")
        if kind == "failed":
            return error(500, value, "server_error")
        return bodies.whole(value)

"""Tier 3: `tierlm serve` — a trained chat model behind an OpenAI-compatible HTTP API (FastAPI + uvicorn)
and a one-page chat UI, for a small crowd.

    POST /v1/chat/completions   {messages, temperature, max_tokens, stream, seed}: a chat.completion, or
                                with "stream": true server-sent chat.completion.chunk events, then [DONE]
    GET  /v1/models             the one model served
    GET  /health                {status, model, running, waiting}
    GET  /metrics               Prometheus text: requests by outcome, queue depth, tokens, latency
    GET  /                      the chat page (it streams from the endpoint above)

Any OpenAI client works: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")`. Requests generate
together, up to the bot's batch rows (continuous batching: each joins between decode steps); the rest wait their
turn, at most `max_queue` of them: one more is answered 429 with Retry-After (the replies ahead of it times the
recent mean). A request that has not finished after `timeout_s` (waiting included)
ends: 504 before its first token, else the text so far with finish_reason "timeout". A client that disconnects
stops its generation at the next token. With `api_key`, the /v1 endpoints want `Authorization: Bearer <key>`.
"""

# No `from __future__ import annotations` here: FastAPI reads the endpoint's request model from its
# annotation, which must be the class itself (it is defined inside create_app).
import argparse
import asyncio
import html
import json
import math
import os
import threading
import time
import uuid
from collections import deque
from importlib import resources
from typing import Any

from tierlm.commands.chat import Busy, Chatbot
from tierlm.commands.options import DEVICE_TYPES, ENGINE_KINDS, Command, positive_int
from tierlm.errors import ConfigError, DataError


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
    times)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.scheduled = loop, deque(), False

    def put(self, queue: asyncio.Queue, item) -> None:
        self.items.append((queue, item))
        if not self.scheduled:  # read after the append: a flush that cleared the flag has not drained yet
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

    def generate(self, bot: Chatbot, gate: Gate, messages: list[dict], settings: dict) -> None:
        """The reply (on this job's own thread): its text piece by piece, then the reply or what went wrong; the
        gate is told how it ended."""
        outcome, tokens = "error", 0
        try:
            reply = bot.reply(
                messages,
                on_text=lambda text: self.put("text", text),
                should_stop=self.stop_reason,
                wait_s=self.deadline - time.monotonic(),
                **settings,
            )
            outcome, tokens = reply.finish_reason, reply.completion_tokens
            self.put("done", reply)
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

    async def events(self, chunk: "Chunks"):
        """The streamed reply as server-sent events: the role, the text (the pieces that came meanwhile in one event,
        not one per token), the finish reason or an error, then [DONE]."""
        try:
            yield chunk({"role": "assistant", "content": ""})
            pending = None
            while True:
                kind, value = pending or await self.pieces.get()
                pending = None
                if kind == "text":
                    text = [value]
                    while not self.pieces.empty():
                        pending = self.pieces.get_nowait()
                        if pending[0] != "text":
                            break
                        text.append(pending[1])
                        pending = None
                    yield chunk({"content": "".join(text)})
                    continue
                if kind == "done":
                    yield chunk({}, value.finish_reason)
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


class Chunks:
    """One reply's OpenAI bodies: `chunk(delta, finish_reason)` a streamed chat.completion.chunk event, and
    `completion(reply)` the whole chat.completion."""

    def __init__(self, model: str):
        self.ident, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), model

    def __call__(self, delta: dict, finish_reason: str | None = None) -> str:
        data = {
            "id": self.ident,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }
        return f"data: {json.dumps(data)}\n\n"

    def completion(self, reply) -> dict:
        return {
            "id": self.ident,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply.text},
                    "finish_reason": reply.finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": reply.prompt_tokens,
                "completion_tokens": reply.completion_tokens,
                "total_tokens": reply.prompt_tokens + reply.completion_tokens,
            },
        }


def chat_request_model():
    """The body of a chat completion request (pydantic: a field out of range is a 422 naming it)."""
    from pydantic import BaseModel, Field

    class Message(BaseModel):
        role: str
        content: str

    class ChatRequest(BaseModel):
        model: str | None = None
        messages: list[Message]
        temperature: float = Field(0.7, ge=0, le=5)
        max_tokens: int = Field(128, ge=1, le=8192)
        stream: bool = False
        seed: int | None = None

    return ChatRequest


def page_html(model: str, keyed: bool) -> str:
    """The chat page served at /, naming `model` (`keyed`: it asks for the API key)."""
    page = (resources.files("tierlm.commands") / "chat_page.html").read_text(encoding="utf-8")
    return page.replace("{{MODEL}}", html.escape(model)).replace("{{KEY}}", "true" if keyed else "false")


def error(status: int, message: str, kind: str, headers: dict | None = None):
    """A JSON response with OpenAI's error body."""
    from fastapi.responses import JSONResponse

    body = {"error": {"message": message, "type": kind, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(bot: Chatbot, max_queue: int = 16, timeout_s: float = 120.0, api_key: str | None = None):
    """The FastAPI app answering for `bot`."""
    try:
        from fastapi import Depends, FastAPI, HTTPException, Request
        from fastapi.responses import HTMLResponse, Response, StreamingResponse
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    except ImportError:
        raise ConfigError(
            "tierlm serve needs fastapi, uvicorn and prometheus_client: pip install 'tierlm[serve]'"
        ) from None

    ChatRequest = chat_request_model()
    gate = Gate(max_queue, bot.batch_rows)
    app = FastAPI(title="tierlm", version="0.1.0")

    def authorized(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise HTTPException(status_code=401, detail="a valid API key is needed: Authorization: Bearer <key>")

    @app.exception_handler(HTTPException)
    async def openai_error(request: Request, exc: HTTPException):  # OpenAI's error body
        return error(exc.status_code, str(exc.detail), "invalid_request_error", exc.headers)

    chat_page = page_html(bot.name, api_key is not None)

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return chat_page

    @app.get("/health")
    def health() -> dict:
        running = gate.inside - gate.queue_depth
        return {"status": "ok", "model": bot.name, "running": running, "waiting": gate.queue_depth}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(gate.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    def models() -> dict:
        return {"object": "list", "data": [{"id": bot.name, "object": "model", "created": 0, "owned_by": "tierlm"}]}

    outboxes: dict[asyncio.AbstractEventLoop, Outbox] = {}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatRequest, request: Request):
        retry = gate.admit()
        if retry is not None:
            gate.requests.labels("rejected").inc()
            message = f"{max_queue} requests are waiting already: retry in {retry} s"
            return error(429, message, "rate_limit_exceeded", {"Retry-After": str(retry)})
        loop = asyncio.get_running_loop()
        if loop not in outboxes:  # one per event loop (one in a server; a test client may run several)
            outboxes[loop] = Outbox(loop)
        job = Job(timeout_s, outboxes[loop])
        settings = dict(temperature=body.temperature, max_new_tokens=body.max_tokens, seed=body.seed)
        messages = [m.model_dump() for m in body.messages]
        generating = threading.Thread(target=job.generate, args=(bot, gate, messages, settings), daemon=True)
        generating.name = "tierlm-generate"
        generating.start()
        chunk = Chunks(bot.name)
        if body.stream:
            return StreamingResponse(job.events(chunk), media_type="text/event-stream")
        kind, value = await job.outcome(request)
        if kind == "error":
            return error(400, value, "invalid_request_error")
        if kind == "busy" or (kind == "done" and value.finish_reason == "timeout" and not value.completion_tokens):
            return error(504, f"no reply within the server's {timeout_s:g} s timeout", "timeout")
        if kind == "failed":
            return error(500, value, "server_error")
        return chunk.completion(value)

    return app


def check_port(port: int) -> None:
    """A TCP port (0: any free one); checked before the model is loaded."""
    if not 0 <= port < 65536:
        raise ConfigError(f"--port must be in [0, 65535], got {port}")


def check_serving(host: str, max_queue: int, timeout_s: float, api_key: str | None) -> None:
    """The serving settings, checked before the model is loaded; opening the server beyond this machine without a
    key is said out loud."""
    if max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0 (waiting requests), got {max_queue}")
    if not timeout_s > 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {timeout_s}")
    if api_key is not None and not api_key.strip():
        raise ConfigError("--api-key is empty: give a key, or drop it to serve without one")
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        import sys

        print(
            f"tierlm: warning: serving on {host} without --api-key: anyone who reaches it can use the model",
            file=sys.stderr,
        )


def fastest_threads(model, cores: int, repeats: int = 5, rows: int = 8) -> tuple[int, dict[int, float]]:
    """Set and return the intra-op thread count, of 1, 2, 4, ... up to `cores - 1`, whose forward of `rows` one-token
    rows is fastest (best of `repeats`; the fewest threads within 5% of the fastest), with each count's milliseconds
    (none when there is one count to take).

    Below `cores - 1`: a core is left to the event loop, since the model's OpenMP threads spin while they wait for
    work and took the cores the HTTP side needed (2 cores, 8 clients: 1.5x one at a time with 2 threads, 2.7x with
    1). Measured, not a fixed rule: on 16 cores the tiny model's 8-row step took 1.72 ms on 4 threads and 2.90 on
    15 (waking threads costs more than a width-128 layer gains), while a larger model wants more.
    OMP_NUM_THREADS set by the caller wins (this is not called)."""
    import torch

    top = max(1, cores - 1)
    counts = sorted({top} | {1 << i for i in range(top.bit_length())})
    if len(counts) == 1:
        torch.set_num_threads(top)
        return top, {}
    parameter = next(model.parameters())
    tokens = torch.zeros(rows, 1, dtype=torch.long, device=parameter.device)
    times = {}
    with torch.no_grad():
        for count in counts:
            torch.set_num_threads(count)
            model(tokens)  # the first call at a count wakes its threads
            best = math.inf
            for _ in range(repeats):
                start = time.perf_counter()
                model(tokens)
                best = min(best, time.perf_counter() - start)
            times[count] = 1000 * best
    fastest = min(times.values())
    choice = min(count for count, ms in times.items() if ms <= 1.05 * fastest)
    torch.set_num_threads(choice)
    return choice, times


def serve(
    bot: Chatbot,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_queue: int = 16,
    timeout_s: float = 120.0,
    api_key: str | None = None,
) -> None:
    """Serve until interrupted."""
    try:
        import uvicorn
    except ImportError:
        raise ConfigError("tierlm serve needs fastapi and uvicorn: pip install 'tierlm[serve]'") from None
    check_port(port)
    check_serving(host, max_queue, timeout_s, api_key)
    import os
    import sys

    # The model's thread and the event loop's take turns at the GIL, each token a handoff. A short slice bounds the
    # wait of a handoff but makes the model thread queue for the GIL between its many small ops: bench/serve_load.py
    # on 2 cores, 8 clients batched: 2,941 tokens/s at 0.5 ms, 3,009 at 1 ms, 3,212-3,327 at 2 ms, 3,333 at Python's
    # 5 ms; one at a time and single-client latency no worse at 2 ms.
    sys.setswitchinterval(0.002)
    from tierlm.rollout.engine import Engine  # tierlm's engine (vLLM's generates in vLLM's own process)

    engine = bot.engine
    if isinstance(engine, Engine) and engine.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        threads, times = fastest_threads(engine.model, os.cpu_count() or 1)
        if len(times) > 1:
            tried = ", ".join(f"{n}: {ms:.2f} ms" for n, ms in times.items())
            print(f"tierlm: {threads} intra-op threads, the fastest of (threads: 8 rows' next token) {tried}")
    print(
        f"serving {bot.name}: chat page http://{host}:{port}/ , API http://{host}:{port}/v1 , health /health, "
        f"metrics /metrics (Ctrl-C stops)",
        flush=True,
    )
    uvicorn.run(create_app(bot, max_queue, timeout_s, api_key), host=host, port=port, log_level="warning")


# -- the command ----------------------------------------------------------------------------
def arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--checkpoint", required=True, help="a run directory, checkpoint or model folder")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--device-type", default="auto", choices=DEVICE_TYPES)
    serve.add_argument(
        "--engine",
        default="native",
        choices=ENGINE_KINDS,
        help="what generates: tierlm's engine (streams token by token), or vLLM (as engine.kind=vllm: in this process "
        "from .venv-vllm, or the server at --vllm-url; a reply arrives whole)",
    )
    serve.add_argument("--vllm-url", default=None, help="--engine vllm: a vLLM server (scripts/vllm_server.sh)")
    serve.add_argument(
        "--max-batch",
        type=positive_int,
        default=8,
        help="replies generated together (continuous batching on tierlm's engine, native GPT; 1: one at a time)",
    )
    serve.add_argument("--max-queue", type=int, default=16, help="requests that may wait; one more is answered 429")
    serve.add_argument("--timeout", type=float, default=120.0, help="seconds a request may take, waiting included")
    serve.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 (default: $TIERLM_API_KEY, or none)"
    )


def run(args: argparse.Namespace) -> None:
    api_key = args.api_key if args.api_key is not None else os.environ.get("TIERLM_API_KEY")
    check_port(args.port)  # before the model loads
    check_serving(args.host, args.max_queue, args.timeout, api_key)
    bot = Chatbot(
        args.checkpoint, args.device_type, engine=args.engine, vllm_url=args.vllm_url, batch_rows=args.max_batch
    )
    try:
        serve(bot, args.host, args.port, args.max_queue, args.timeout, api_key)
    finally:
        bot.close()


COMMAND = Command(arguments, run)

"""Tier 3: `tierlm serve` — a trained model behind the OpenAI API (FastAPI + uvicorn) and a one-page chat UI, for a
small crowd.

    POST /v1/completions        {prompt (text, token ids, or a list of them), max_tokens, temperature, top_p, n, stop,
                                seed, logprobs, echo, stream, stream_options}: a text_completion (any causal LM, chat
                                template or not)
    POST /v1/chat/completions   {messages, max_tokens, temperature, top_p, n, stop, seed, logprobs, top_logprobs,
                                stream, stream_options}: a chat.completion (a chat model), or with "stream": true
                                server-sent chunks
    GET  /v1/models             the one model served
    GET  /health                {status, model, running, waiting}
    GET  /metrics               Prometheus text: requests by outcome, queue depth, tokens, latency
    GET  /                      the chat page (it streams from the chat endpoint)

Any OpenAI client works: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")`. A field the server does
not honour is a 400 naming it (`tierlm.commands.openai_api`). Requests generate together, up to the bot's batch rows
(continuous batching: each joins between decode steps); the rest wait their turn, at most `max_queue` of them: one
more is answered 429 with Retry-After (the replies ahead of it times the recent mean). A request that has not
finished after `timeout_s` (waiting included) ends: 504 before its first token, else the text so far with
finish_reason "timeout". A client that disconnects stops its generation at the next token. With `api_key`, the /v1
endpoints want `Authorization: Bearer <key>`.
"""

# No `from __future__ import annotations` here: FastAPI reads the endpoint's request model from its
# annotation, which must be the class itself (made inside create_app).
import argparse
import html
import math
import os
import time
from importlib import resources

from tierlm.commands.admission import Answers, Gate, error
from tierlm.commands.chat import Chatbot
from tierlm.commands.openai_api import (
    Bodies,
    ChatRequest,
    CompletionRequest,
    chat_sampling,
    completion_sampling,
    completions_of,
    prompt_ids,
    validation_message,
)
from tierlm.commands.options import COMPILE_HELP, DEVICE_TYPES, ENGINE_KINDS, Command, positive_int
from tierlm.errors import ConfigError


def page_html(model: str, keyed: bool) -> str:
    """The chat page served at /, naming `model` (`keyed`: it asks for the API key)."""
    page = (resources.files("tierlm.commands") / "chat_page.html").read_text(encoding="utf-8")
    return page.replace("{{MODEL}}", html.escape(model)).replace("{{KEY}}", "true" if keyed else "false")


def add_pages(app, bot: Chatbot, gate: Gate, api_key: str | None, authorized) -> None:
    """The chat page (/), /health, /metrics and /v1/models."""
    from fastapi import Depends
    from fastapi.responses import HTMLResponse, Response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

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


def create_app(bot: Chatbot, max_queue: int = 16, timeout_s: float = 120.0, api_key: str | None = None):
    """The FastAPI app answering for `bot`."""
    try:
        from fastapi import Depends, FastAPI, HTTPException, Request
        from fastapi.exceptions import RequestValidationError
        from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (the serving extra is installed)
    except ImportError:
        raise ConfigError(
            "tierlm serve needs fastapi, uvicorn and prometheus_client: pip install 'tierlm[serve]'"
        ) from None

    gate = Gate(max_queue, bot.batch_rows)
    app = FastAPI(title="tierlm", version="0.1.0")

    def authorized(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise HTTPException(status_code=401, detail="a valid API key is needed: Authorization: Bearer <key>")

    @app.exception_handler(HTTPException)
    async def openai_error(request: Request, exc: HTTPException):  # OpenAI's error body
        return error(exc.status_code, str(exc.detail), "invalid_request_error", exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):  # a 400 naming the field, as OpenAI's
        return error(400, validation_message(exc.errors()), "invalid_request_error")

    add_pages(app, bot, gate, api_key, authorized)

    answer = Answers(gate, max_queue, timeout_s)
    if bot.scheduler is not None:  # a batched step's pieces, one per reply, reach the event loop with one wake-up
        bot.scheduler.handing = answer.holding

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatRequest, request: Request):
        sampling = chat_sampling(body)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]

        def produce(on_text, should_stop, wait_s):
            return bot.chat_choices(messages, sampling, on_text, should_stop, wait_s)

        bodies = Bodies("chat", bot.name, sampling, body.usage_in_stream())
        return await answer(request, bodies, produce, sampling.n, body.stream)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        try:
            prompts = [prompt_ids(bot.tokenizer, p) for p in body.prompts()]
        except ValueError as e:
            return error(400, f"prompt: {e}", "invalid_request_error")
        sampling = completion_sampling(body)

        def produce(on_text, should_stop, wait_s):
            return completions_of(bot, prompts, sampling, on_text, should_stop, wait_s)

        bodies = Bodies("completions", bot.name, sampling, body.usage_in_stream())
        return await answer(request, bodies, produce, sampling.n * len(prompts), body.stream)

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
    serve.add_argument("--compile", action="store_true", help=COMPILE_HELP)
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
        args.checkpoint,
        args.device_type,
        engine=args.engine,
        vllm_url=args.vllm_url,
        batch_rows=args.max_batch,
        chat_only=False,  # a base model serves /v1/completions
        compile=args.compile,
    )
    try:
        serve(bot, args.host, args.port, args.max_queue, args.timeout, api_key)
    finally:
        bot.close()


COMMAND = Command(arguments, run)

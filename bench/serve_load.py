"""`tierlm serve` under load: 1, 8 and 32 concurrent streamed clients against one server on 127.0.0.1, with replies
generated one at a time (`--max-batch 1`) and together (continuous batching), side by side.

    .venv/bin/python bench/serve_load.py --checkpoint runs/tiny_sft [--clients 1,8,32] [--requests 4]
                                         [--max-tokens 64] [--batch 32] [--random-weights] [--client raw|httpx]
                                         [--device-type cpu|cuda] [--decode-step]

Each client sends `--requests` streamed chat completions one after another (a short arithmetic question,
temperature 0.7, `--max-tokens`); a server is started per setting (`tierlm serve` in its own process, loopback only)
and stopped after. Printed per setting: requests that failed (any non-200 or an error event), completion tokens per
second over the whole load (the server's own `tierlm_generated_tokens_total`, before and after), and each
request's latency (send to the last event) at p50 and p95, then the batched server's tokens/s over the
one-at-a-time server's. The clients are bare asyncio sockets (`--client raw`, the default: one connection per
request, read to its end) or httpx (`--client httpx`); on a machine of 2 cores the load generator's CPU is CPU the
server does not get, and httpx's per-line parsing took more of it. `--random-weights` serves the checkpoint's model
with random weights: a trained tiny model answers in a few tokens, and requests that short measure HTTP more than
generation. `--decode-step` times the batched decode step alone (no HTTP) at 1, 8 and 32 rows instead: the capacity the
server's model thread has.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def random_model(checkpoint: str):
    """The checkpoint's model architecture with random weights (seed 0)."""
    import torch

    from tierlm.checkpoint.folders import verified_model_location
    from tierlm.models import build_gpt, load_pretrained_model

    config = load_pretrained_model(verified_model_location(checkpoint)).config
    torch.manual_seed(0)
    return build_gpt(config)


def random_weights(checkpoint: str, folder: Path) -> str:
    """The checkpoint's model with random weights (same architecture, tokenizer and chat template): its replies seldom
    end early, so every request generates its whole max_tokens (throughput, not quality)."""
    from tierlm.checkpoint.folders import verified_model_location
    from tierlm.data import load_tokenizer
    from tierlm.models.io import save_model_folder

    save_model_folder(random_model(checkpoint), folder)
    load_tokenizer(verified_model_location(checkpoint)).save(folder)
    return str(folder)


def decode_step(checkpoint: str, device: str) -> None:
    """The continuous-batching decode step alone at 1, 8 and 32 rows (random weights, a 7-token prompt per row, each
    step's tokens read back on the host as the server reads them): milliseconds per step, 50 steps after 5."""
    import torch

    from tierlm.rollout.batching import BatchedDecoder

    model = random_model(checkpoint).to(device).eval()
    for rows in (1, 8, 32):
        decoder = BatchedDecoder(model, 32)
        for row in range(rows):
            decoder.join([1, 5, 9, 13 + row, 40, 41, 42])
        tokens = torch.zeros(rows, dtype=torch.long, device=device)
        for _ in range(5):
            decoder.step(tokens).argmax(-1).tolist()  # the host waits for the device before the clock starts
        start, steps = time.perf_counter(), 50
        for _ in range(steps):
            tokens = decoder.step(tokens).argmax(-1)
            tokens.tolist()
        milliseconds = 1000 * (time.perf_counter() - start) / steps
        print(f"{device}, {torch.get_num_threads()} threads, {rows:>2} rows: {milliseconds:.2f} ms a step")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generated_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return next(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("tierlm_generated_tokens_total")
    )


async def client(url: str, requests: int, max_tokens: int, seed: int, latencies: list, failures: list) -> None:
    async with httpx.AsyncClient(timeout=600) as http:
        for r in range(requests):
            body = {
                "messages": [{"role": "user", "content": f"What is {seed + r} + {7 * r + 3}?"}],
                "temperature": 0.7,
                "max_tokens": max_tokens,
                "stream": True,
                "seed": seed * 1000 + r,
            }
            start = time.perf_counter()
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    failures.append(response.status_code)
                    await response.aread()
                    continue
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"error"' in line:
                        failures.append(json.loads(line[6:])["error"]["message"])
            latencies.append(time.perf_counter() - start)


async def raw_client(url: str, requests: int, max_tokens: int, seed: int, latencies: list, failures: list) -> None:
    """`client` over a bare asyncio socket (HTTP/1.1, one connection per request, the reply read to its end): a
    fraction of httpx's CPU per streamed line, which on a small machine is CPU the server does not get."""
    host, port = url.removeprefix("http://").split(":")
    for r in range(requests):
        body = json.dumps(
            {
                "messages": [{"role": "user", "content": f"What is {seed + r} + {7 * r + 3}?"}],
                "temperature": 0.7,
                "max_tokens": max_tokens,
                "stream": True,
                "seed": seed * 1000 + r,
            }
        ).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        start = time.perf_counter()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head + body)
        reply = await reader.read()  # to the end: the server closes the connection after the last event
        writer.close()
        status = reply.split(b" ", 2)[1] if reply.startswith(b"HTTP/1.1 ") else b"?"
        if status != b"200":
            failures.append(status.decode())
            continue
        if b'"error"' in reply or b"data: [DONE]" not in reply:
            failures.append("an error event, or no [DONE]")
        latencies.append(time.perf_counter() - start)


def measure(
    checkpoint: str, batch: int, clients: int, requests: int, max_tokens: int, raw: bool = True, device: str = "cpu"
) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "tierlm", "serve", "--checkpoint", checkpoint, "--port", str(port)]
    command += ["--max-batch", str(batch), "--max-queue", "64", "--timeout", "600", "--device-type", device]
    server = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.time() < deadline, server.stderr.read() if server.stderr else ""
            time.sleep(0.2)
        before, start = generated_tokens(url), time.perf_counter()
        latencies: list[float] = []
        failures: list = []

        async def load() -> None:
            send = raw_client if raw else client
            await asyncio.gather(*(send(url, requests, max_tokens, c, latencies, failures) for c in range(clients)))

        asyncio.run(load())
        seconds = time.perf_counter() - start
        tokens = generated_tokens(url) - before
    finally:
        server.terminate()
        server.wait(timeout=30)
    ordered = sorted(latencies)
    return {
        "failed": len(failures),
        "tokens_per_s": tokens / seconds,
        "p50": statistics.median(ordered),
        "p95": ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))],
        "requests": len(latencies) + len(failures),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a chat model (a run directory, e.g. runs/tiny_sft)")
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--requests", type=int, default=4, help="requests each client sends, one after another")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="--max-batch of the batched server")
    parser.add_argument(
        "--client", default="raw", choices=["raw", "httpx"], help="the load generator: bare sockets, or httpx"
    )
    parser.add_argument("--device-type", default="cpu", choices=["cpu", "cuda"], help="where the server generates")
    parser.add_argument(
        "--random-weights", action="store_true", help="serve the checkpoint's model with random weights (long replies)"
    )
    parser.add_argument("--decode-step", action="store_true", help="time the batched decode step alone, then stop")
    args = parser.parse_args()
    if args.decode_step:
        return decode_step(args.checkpoint, args.device_type)
    if args.random_weights:
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="tierlm-serve-load-")) / "model"
        args.checkpoint = random_weights(args.checkpoint, folder)
        print(f"serving {args.checkpoint}: the checkpoint's model with random weights")
    print(f"{'clients':>8} {'server':>14} {'requests':>9} {'failed':>7} {'tokens/s':>9} {'p50 s':>7} {'p95 s':>7}")
    for clients in map(int, args.clients.split(",")):
        results = {}
        for name, batch in (("one at a time", 1), (f"batched ({args.batch})", args.batch)):
            r = results[name] = measure(
                args.checkpoint, batch, clients, args.requests, args.max_tokens, args.client == "raw", args.device_type
            )
            print(
                f"{clients:>8} {name:>14} {r['requests']:>9} {r['failed']:>7} {r['tokens_per_s']:>9.1f} "
                f"{r['p50']:>7.2f} {r['p95']:>7.2f}",
                flush=True,
            )
        one, together = results["one at a time"], results[f"batched ({args.batch})"]
        ratio = together["tokens_per_s"] / one["tokens_per_s"]
        print(f"{clients:>8} {'batched / one':>14} {'':>9} {'':>7} {ratio:>9.2f}x")


if __name__ == "__main__":
    main()

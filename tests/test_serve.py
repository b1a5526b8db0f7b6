"""Talking to a model (issue 20): the terminal chat, the OpenAI-compatible server through the `openai`
client (plain and streamed), and the chat page in a real browser (Playwright driving the system's
Chromium)."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from conftest import free_port, live_server
from tierlm.commands.chat import Chatbot, terminal_chat

QUESTION = "What is 2 + 3?"


@pytest.fixture(scope="module")
def bot(tiny_runs):
    return Chatbot(tiny_runs / "sft", "cpu")


def test_a_streamed_reply_is_the_reply(bot):
    pieces = []
    reply = bot.reply(
        [{"role": "user", "content": QUESTION}], temperature=0.0, max_new_tokens=24, on_text=pieces.append
    )
    assert "".join(pieces) == reply.text and reply.completion_tokens > 0 and reply.finish_reason in ("stop", "length")
    again = bot.reply([{"role": "user", "content": QUESTION}], temperature=0.0, max_new_tokens=24)
    assert again.text == reply.text  # greedy: the same answer


def _chat_in_terminal(bot, lines: list[str], **options) -> tuple[str, list[list[dict]]]:
    """`terminal_chat` fed `lines`: what it wrote, and the messages each reply was asked for."""
    out: list[str] = []
    seen: list[list[dict]] = []
    reply, typed = bot.reply, iter(lines)

    def recording_reply(messages, *args, **kwargs):
        seen.append([dict(m) for m in messages])
        return reply(messages, *args, **kwargs)

    bot.reply = recording_reply
    try:
        terminal_chat(bot, temperature=0.0, read=lambda prompt: next(typed), write=out.append, **options)
    finally:
        del bot.reply
    return "".join(out), seen


def test_the_terminal_chat_keeps_the_conversation_and_its_commands(bot):
    lines = [QUESTION, "/temperature 0", "/temperature hot", "and 4 + 4?", "/reset", "/bogus", "/quit"]
    text, seen = _chat_in_terminal(bot, lines, max_new_tokens=8)
    assert text.count("assistant> ") == 2 and "(temperature 0.0)" in text and "usage: /temperature" in text
    assert "(new conversation)" in text and "unknown command" in text
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]  # the second turn sees the first


def test_a_system_message_opens_every_terminal_conversation(bot):
    """`tierlm chat --system TEXT`: the message opens the conversation and the one after /reset."""
    _, seen = _chat_in_terminal(bot, [QUESTION, "/reset", QUESTION, "/quit"], max_new_tokens=4, system="Be brief.")
    assert seen == [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]] * 2


def test_the_terminal_chat_draws_with_its_filters_and_penalty(bot):
    """`tierlm chat --top-p / --min-p / --repetition-penalty`: every reply of the conversation asks for them, and
    a penalised greedy reply is the engine's penalised draw, not the plain one."""
    asked = []
    reply = bot.reply

    def recording(messages, *args, **kwargs):
        asked.append(kwargs)
        return reply(messages, *args, **kwargs)

    bot.reply = recording
    try:
        filters = {"top_p": 0.9, "min_p": 0.05, "repetition_penalty": 2.0}
        typed = iter([QUESTION, QUESTION, "/quit"])
        terminal_chat(bot, 0.0, 12, read=lambda prompt: next(typed), write=lambda text: None, filters=filters)
    finally:
        del bot.reply
    assert [{k: a[k] for k in filters} for a in asked] == [filters, filters]
    question = [{"role": "user", "content": QUESTION}]
    plain, penalised = (bot.reply(question, 0.0, 24, repetition_penalty=p).text for p in (1.0, 2.0))
    assert penalised != plain


def test_sample_renders_the_system_message_before_the_prompt(tiny_runs, capsys):
    """`tierlm sample --system TEXT` samples what the chat engine answers to [system, user] (greedy); a model
    sampled as plain text refuses it in one line."""
    from tierlm.commands.cli import main

    want = Chatbot(tiny_runs / "sft", "cpu").reply(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}], 0.0, 12
    )
    args = ["sample", "--checkpoint", str(tiny_runs / "sft"), "--prompt", QUESTION, "--max-new-tokens", "12"]
    assert main([*args, "--system", "Be brief.", "--device-type", "cpu"]) == 0
    assert capsys.readouterr().out.strip() == want.text.strip()
    assert main([*args, "--system", "Be brief.", "--raw"]) == 2
    assert "--system is a chat model's system message" in capsys.readouterr().err


@pytest.fixture(scope="module")
def server(bot):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from tierlm.commands.serve import create_app

    with live_server(create_app(bot)) as url:
        yield url


def test_the_openai_client_talks_to_the_server(bot, server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused") as client:  # its connections closed after
        want = bot.reply([{"role": "user", "content": QUESTION}], temperature=0.0, max_new_tokens=24)
        assert [m.id for m in client.models.list().data] == [bot.name]
        response = client.chat.completions.create(
            model=bot.name, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=24
        )
        assert (
            response.choices[0].message.content == want.text and response.choices[0].finish_reason == want.finish_reason
        )
        assert response.usage.completion_tokens == want.completion_tokens
        stream = client.chat.completions.create(
            model=bot.name, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=24, stream=True
        )
        chunks = list(stream)
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
            and chunks[-1].choices[0].finish_reason == want.finish_reason
        )
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=bot.name, messages=[{"role": "robot", "content": "hi"}])


def test_the_chat_page_names_the_model_as_text(bot):
    import copy

    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from tierlm.commands.serve import create_app

    odd = copy.copy(bot)
    odd.name = "run<script>alert(1)</script>"  # a run directory may be called anything
    page = TestClient(create_app(odd, api_key="k")).get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<title>tierlm chat: run&lt;script&gt;alert(1)&lt;/script&gt;</title>" in page.text
    assert "<script>alert" not in page.text and "const key = true ?" in page.text  # the key asked for


def _chromium() -> str | None:
    for name in (os.environ.get("TIERLM_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def test_the_chat_page_in_a_real_browser(bot, server):
    playwright = pytest.importorskip("playwright.sync_api")
    executable = _chromium()
    if executable is None:
        pytest.skip("no Chromium on this machine: apt-get install chromium (scripts/setup.sh installs it where it can)")
    want = bot.reply([{"role": "user", "content": QUESTION}], temperature=0.0, max_new_tokens=128)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(server + "/")
            page.fill("#temperature", "0")
            page.fill("#input", QUESTION)
            page.click("#send")
            page.wait_for_selector('.assistant[data-done="true"]', timeout=60_000)
            assert page.inner_text(".user") == QUESTION
            assert page.text_content(".assistant") == want.text  # streamed into the page, chunk by chunk
        finally:
            browser.close()


@pytest.fixture
def guarded(bot):
    """The server for a crowd: one request may wait (--max-queue 1), 1.5 s per request, an API key; each token takes
    20 ms more (a slow model, so a stream can be left mid-reply)."""
    pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    from tierlm.commands.serve import create_app

    decode = bot.engine._decode

    def slow(tokens, cache):
        time.sleep(0.02)
        return decode(tokens, cache)

    bot.engine._decode = slow
    port = free_port()
    instance = uvicorn.Server(
        uvicorn.Config(create_app(bot, max_queue=1, timeout_s=1.5, api_key="k"), port=port, log_level="warning")
    )
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    while not instance.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    instance.should_exit = True
    thread.join(timeout=10)
    del bot.engine._decode


def _outcomes(httpx, url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        line.split('"')[1]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("tierlm_requests_total{")
    }


def test_pieces_put_while_held_reach_the_event_loop_with_one_wake_up():
    """A batched step's pieces (one per reply, `BatchScheduler.handing` = `Answers.holding`) wait while held, even
    with the event loop free to take them, then go with one wake-up; a piece put outside a hold wakes the loop."""
    import asyncio

    from tierlm.commands.admission import Answers, Outbox

    async def main():
        loop = asyncio.get_running_loop()
        answers = Answers(None, 1, 1.0)
        outbox = answers.outboxes[loop] = Outbox(loop)
        queue, wakes, schedule = asyncio.Queue(), [], loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda callback, *args: wakes.append(callback) or schedule(callback, *args)
        put, released = threading.Event(), threading.Event()

        def step():
            with answers.holding():
                for piece in range(5):
                    outbox.put(queue, piece)
                put.set()
                released.wait()

        worker = threading.Thread(target=step)
        worker.start()
        await asyncio.to_thread(put.wait)
        await asyncio.sleep(0.05)
        held = (queue.qsize(), wakes.count(outbox._flush))
        released.set()
        await asyncio.to_thread(worker.join)
        await asyncio.sleep(0.01)
        after = (queue.qsize(), wakes.count(outbox._flush))
        await asyncio.to_thread(outbox.put, queue, 5)
        await asyncio.sleep(0.01)
        return held, after, (queue.qsize(), wakes.count(outbox._flush))

    assert asyncio.run(main()) == ((0, 0), (5, 1), (6, 2))


def test_a_crowd_is_queued_refused_timed_out_and_cancelled(bot, guarded):
    httpx = pytest.importorskip("httpx")
    key = {"Authorization": "Bearer k"}
    ask = {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 8}
    assert httpx.post(f"{guarded}/v1/chat/completions", json=ask).status_code == 401
    assert httpx.get(f"{guarded}/v1/models").json()["error"]["code"] == 401
    assert httpx.get(f"{guarded}/health").json() == {"status": "ok", "model": bot.name, "running": 0, "waiting": 0}

    # The model busy (its lock held here): one request generates-to-be, one waits, the next is refused with
    # Retry-After; the two admitted time out (504, JSON) once the lock has been held past their 1.5 s.
    results: list = []
    with bot.lock:
        threads = [
            threading.Thread(
                target=lambda: results.append(
                    httpx.post(f"{guarded}/v1/chat/completions", json=ask, headers=key, timeout=30)
                )
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        while httpx.get(f"{guarded}/health").json()["waiting"] < 1:
            time.sleep(0.02)
        refused = httpx.post(f"{guarded}/v1/chat/completions", json=ask, headers=key)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_exceeded"
        for t in threads:
            t.join(timeout=30)
    assert [r.status_code for r in results] == [504, 504] and all(
        r.json()["error"]["type"] == "timeout" for r in results
    )

    # A streamed reply left after its first words: its generation stops at the next token and frees the model.
    long = {**ask, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{guarded}/v1/chat/completions", json=long, headers=key, timeout=30) as response:
        for line in response.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                break
    deadline = time.time() + 60  # a guard against a hang, not a speed: the count moves only on a cancellation
    while _outcomes(httpx, guarded).get("cancelled", 0) < 1:
        assert time.time() < deadline, _outcomes(httpx, guarded)
        time.sleep(0.05)
    answered = httpx.post(f"{guarded}/v1/chat/completions", json=ask, headers=key, timeout=30)
    assert answered.status_code == 200 and answered.json()["choices"][0]["message"]["content"]
    outcomes = _outcomes(httpx, guarded)
    assert outcomes["rejected"] == 1 and outcomes["timeout"] == 2 and outcomes["cancelled"] == 1
    metrics = httpx.get(f"{guarded}/metrics").text
    for name in (
        "tierlm_queue_depth",
        "tierlm_tokens_per_second",
        "tierlm_request_seconds_bucket",
        "tierlm_generated_tokens_total",
    ):
        assert name in metrics, name

    # A streamed reply that waits for the model sends nothing before its first text (as vLLM's: a client timing
    # its first token, `vllm bench serve`'s TTFT, is not told of one early): here the model stays busy past the
    # request's timeout, so the first event is that error.
    with (
        bot.lock,
        httpx.stream("POST", f"{guarded}/v1/chat/completions", json={**ask, "stream": True}, headers=key) as r,
    ):
        first = next(line for line in r.iter_lines() if line.startswith("data:"))
    assert '"error"' in first and '"role"' not in first, first


def test_a_reply_stopped_midway_keeps_its_text_and_says_why(bot):
    count = iter(range(1000))
    reply = bot.reply(
        [{"role": "user", "content": QUESTION}],
        temperature=0.0,
        max_new_tokens=24,
        should_stop=lambda: "timeout" if next(count) >= 2 else None,
    )
    assert reply.finish_reason == "timeout" and reply.completion_tokens == 3
    assert not bot.lock.locked() and not bot.engine.model.training


def test_concurrent_requests_are_generated_together_and_answer_as_alone(bot, tiny_runs):
    """A bot with batch rows: four clients at once through the server get, greedy, what each gets one at a time
    (continuous batching: each request joins the running batch between decode steps)."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from tierlm.commands.serve import create_app

    questions = [QUESTION, "What is 10 + 7?", "What is 3 + 3?", "What is 41 + 1?"]
    alone = [bot.reply([{"role": "user", "content": q}], temperature=0.0, max_new_tokens=24).text for q in questions]
    batched = Chatbot(tiny_runs / "sft", "cpu", batch_rows=4)
    assert batched.scheduler is not None and batched.batch_rows == 4
    widest, step = [0], batched.scheduler.decoder.step
    batched.scheduler.decoder.step = lambda tokens: (widest.append(len(tokens)), step(tokens))[1]
    answers: dict[int, str] = {}
    try:
        with live_server(create_app(batched)) as url:

            def ask(i: int) -> None:
                body = {"messages": [{"role": "user", "content": questions[i]}], "temperature": 0, "max_tokens": 24}
                response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
                answers[i] = response.json()["choices"][0]["message"]["content"]

            clients = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
            for c in clients:
                c.start()
            for c in clients:
                c.join(timeout=60)
        assert [answers[i] for i in range(4)] == alone
        assert max(widest) > 1  # decode steps served several requests at once
    finally:
        batched.close()


def test_the_server_takes_the_thread_count_its_model_steps_fastest_on(tiny_gpt_config, monkeypatch):
    import types

    import torch

    from tierlm.commands import serve
    from tierlm.commands.serve import fastest_threads
    from tierlm.models import build_gpt

    clock = [0.0]  # the timings on a clock of their own: the machine's load cannot reorder them

    class Timed(torch.nn.Module):  # a forward taking the given milliseconds at the thread count it runs on
        def __init__(self, milliseconds):
            super().__init__()
            self.weight, self.milliseconds = torch.nn.Parameter(torch.zeros(1)), milliseconds

        def forward(self, tokens):
            assert tokens.shape == (8, 1)
            clock[0] += self.milliseconds[torch.get_num_threads()] / 1000

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(serve, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
        more_is_slower = {1: 10, 2: 20, 4: 30, 8: 40, 15: 50}
        assert fastest_threads(Timed(more_is_slower), cores=16, repeats=2)[0] == 1
        assert list(fastest_threads(Timed(more_is_slower), cores=16, repeats=2)[1]) == [1, 2, 4, 8, 15]
        assert torch.get_num_threads() == 1
        assert fastest_threads(Timed({1: 50, 2: 40, 4: 30, 8: 20, 15: 10}), cores=16, repeats=2)[0] == 15
        assert torch.get_num_threads() == 15
        # the fewest threads within 5% of the fastest: 4 (20 ms) against 8 (19.5 ms)
        assert fastest_threads(Timed({1: 40, 2: 30, 4: 20, 8: 19.5, 15: 30}), cores=16, repeats=2)[0] == 4
        assert fastest_threads(Timed({}), cores=2) == (1, {})  # one core left to the model: nothing to measure
        monkeypatch.undo()
        threads, times = fastest_threads(build_gpt(tiny_gpt_config).eval(), cores=4, repeats=2)  # the real forward
        assert list(times) == [1, 2, 3] and all(ms > 0 for ms in times.values()) and threads in times
    finally:
        torch.set_num_threads(before)


def test_sample_says_why_a_base_model_printed_nothing(tiny_runs, capsys, monkeypatch):
    """A base model whose first token ends the document prints an empty line; `tierlm sample` says why on stderr, and
    only then."""
    from tierlm.commands.cli import main
    from tierlm.data import load_tokenizer
    from tierlm.rollout.engine import Completion, Engine

    bos = load_tokenizer(tiny_runs / "pre" / "model").bos_id
    answers = iter([[bos], [bos + 1, bos]])
    monkeypatch.setattr(Engine, "generate", lambda *a, **k: [Completion(tokens=next(answers), finished=True)])
    args = ["sample", "--checkpoint", str(tiny_runs / "pre"), "--prompt", "ROMEO:", "--device-type", "cpu"]
    assert main(args) == 0
    assert "the model ended the text at once (its first token, <|bos|>, ends a document)" in capsys.readouterr().err
    assert main(args) == 0
    assert "ended the text at once" not in capsys.readouterr().err

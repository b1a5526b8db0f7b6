"""Talking to a model (issue 20): the terminal chat, the OpenAI-compatible server through the `openai`
client (plain and streamed), and the chat page in a real browser (Playwright driving the system's
Chromium)."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time

import pytest

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


def test_the_terminal_chat_keeps_the_conversation_and_its_commands(bot):
    lines = iter([QUESTION, "/temperature 0", "/temperature hot", "and 4 + 4?", "/reset", "/bogus", "/quit"])
    out: list[str] = []
    seen: list[list[dict]] = []
    reply = bot.reply

    def recording_reply(messages, *args, **kwargs):
        seen.append([dict(m) for m in messages])
        return reply(messages, *args, **kwargs)

    bot.reply = recording_reply
    try:
        terminal_chat(bot, temperature=0.0, max_new_tokens=8, read=lambda prompt: next(lines), write=out.append)
    finally:
        del bot.reply
    text = "".join(out)
    assert text.count("assistant> ") == 2 and "(temperature 0.0)" in text and "usage: /temperature" in text
    assert "(new conversation)" in text and "unknown command" in text
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]  # the second turn sees the first


@pytest.fixture(scope="module")
def server(bot):
    pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    from tierlm.commands.serve import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(create_app(bot), host="127.0.0.1", port=port, log_level="warning")
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not instance.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    instance.should_exit = True
    thread.join(timeout=10)


def test_the_openai_client_talks_to_the_server(bot, server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    want = bot.reply([{"role": "user", "content": QUESTION}], temperature=0.0, max_new_tokens=24)
    assert [m.id for m in client.models.list().data] == [bot.name]
    response = client.chat.completions.create(
        model=bot.name, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=24
    )
    assert response.choices[0].message.content == want.text and response.choices[0].finish_reason == want.finish_reason
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

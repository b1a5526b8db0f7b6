"""Tier 3: talking to a trained chat model — `tierlm chat` in a terminal, and the `Chatbot` that
`tierlm serve` answers HTTP requests with.

A reply streams: the engine calls back after every token, and the text shown so far is the completion
made readable (`readable_text`: a calculator call appears as `[calculator: 23 + 45 -> 68]` as it runs),
so each callback hands on only what was added.
"""

from __future__ import annotations

import argparse
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tierlm.commands.options import DEVICE_TYPES, Command, positive_int, temperature
from tierlm.errors import DataError


@dataclass
class Reply:
    text: str
    finish_reason: str  # "stop" (the end-of-turn token), "length" (max_new_tokens ran out), or why it was stopped
    prompt_tokens: int
    completion_tokens: int


class Busy(Exception):
    """The model stayed busy with other replies for longer than this one could wait."""


class _Stopped(Exception):
    def __init__(self, reason: str, completion):
        super().__init__(reason)
        self.reason, self.completion = reason, completion


class Chatbot:
    """A chat model (a run directory, checkpoint or model folder) with its tokenizer, the calculator when
    the tokenizer has the tool tokens, and a lock: one generation at a time."""

    def __init__(
        self,
        checkpoint: str | Path,
        device_type: str = "cpu",
        tools: bool = True,
        engine: str = "native",
        vllm_url: str | None = None,
        batch_rows: int = 1,
    ):
        """`batch_rows` > 1: replies asked for at once are generated together, up to that many (continuous batching,
        `tierlm.rollout.batching`; the native GPT on tierlm's engine), else one at a time."""
        import tempfile

        from tierlm.builders.engine import ENGINES, EngineSettings, build_engine
        from tierlm.checkpoint.folders import verified_model_location
        from tierlm.config import EngineConfig
        from tierlm.data import load_tokenizer
        from tierlm.errors import ConfigError
        from tierlm.models import load_pretrained_model
        from tierlm.primitives import resolve_device
        from tierlm.rollout.tools import TOOL_CALL_START

        location = verified_model_location(str(checkpoint))
        self.name = Path(str(checkpoint)).name or str(checkpoint)
        self.tokenizer = load_tokenizer(location)
        if not self.tokenizer.has_chat_template:
            raise DataError(
                f"{checkpoint} has no chat template: chat with a model after `tierlm sft` (a base model: `tierlm "
                f"sample --raw`)"
            )
        model = load_pretrained_model(location, device=resolve_device(device_type)).eval()
        with_tools = tools and TOOL_CALL_START in self.tokenizer.hf.get_vocab()
        if vllm_url is not None and (engine != "vllm" or not vllm_url.startswith(("http://", "https://"))):
            raise ConfigError(f"--vllm-url names a vLLM server (http://host:port) for --engine vllm, got {vllm_url!r}")
        section = EngineConfig(kind=engine, vllm_url=vllm_url)  # the engine section, from the flags
        choice = EngineSettings.from_section(section, tools=("calculator",) if with_tools else ())
        kind = ENGINES[choice.kind]
        # --engine vllm: the model folder vLLM loads (tierlm's engine samples the loaded model itself)
        self.folder = tempfile.TemporaryDirectory(prefix="tierlm-sampler-") if kind.needs_folder else None
        try:
            self.engine = build_engine(choice, model, self.tokenizer, Path(self.folder.name) if self.folder else None)
        except BaseException:
            self.close_folder()
            raise
        self.lock = threading.Lock()
        self.scheduler = None
        if batch_rows > 1 and kind.batches_replies:
            from tierlm.rollout.batching import BatchScheduler

            if BatchScheduler.supports(self.engine):
                self.scheduler = BatchScheduler(self.engine, batch_rows)

    @property
    def batch_rows(self) -> int:
        """How many replies are generated at once."""
        return self.scheduler.decoder.max_rows if self.scheduler is not None else 1

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        self.engine.close()
        self.close_folder()

    def close_folder(self) -> None:
        if self.folder is not None:
            self.folder.cleanup()

    def reply(
        self,
        messages: list[dict],
        temperature: float = 0.7,
        max_new_tokens: int = 128,
        on_text: Callable[[str], None] | None = None,
        seed: int | None = None,
        should_stop: Callable[[], str | None] | None = None,
        wait_s: float | None = None,
    ) -> Reply:
        """The assistant's next turn after `messages` (OpenAI role/content dicts); `on_text(piece)` streams it.
        `should_stop()`, asked after every token, names a reason to stop early ("cancelled", "timeout"): the reply so
        far comes back with that finish reason. `wait_s`: how long to wait for the model (busy with other replies)
        before raising `Busy`."""
        from tierlm.rollout.engine import readable_text

        check_messages(messages, temperature)
        prompt = self.tokenizer.render_for_completion(messages)
        room = self.engine.max_len() - len(prompt)
        if room < 1:
            raise DataError(
                f"the conversation is {len(prompt)} tokens, the model's context is {self.engine.max_len()}: start a "
                f"new one"
            )
        shown = [""]

        def emit(text: str) -> None:  # hand on what was added to the text shown so far
            if on_text is not None and text.startswith(shown[0]) and len(text) > len(shown[0]):
                on_text(text[len(shown[0]) :])
                shown[0] = text

        import torch

        generator = torch.Generator(device=self.engine.device).manual_seed(seed) if seed is not None else None
        budget = min(max_new_tokens, room)
        if self.scheduler is not None:  # joins the replies in flight; waits for a free row within its should_stop
            completion, reason = self._batched(prompt, budget, temperature, generator, emit, should_stop)
        else:
            completion, reason = self._alone(prompt, budget, temperature, generator, emit, should_stop, wait_s)
        text = readable_text(self.tokenizer, completion.tokens)
        emit(text)
        return Reply(text, reason, len(prompt), len(completion.tokens))

    def _alone(self, prompt, max_new_tokens, temperature, generator, emit, should_stop, wait_s) -> tuple[Any, str]:
        """(the completion, its finish reason) from the engine, one reply at a time (`wait_s` for the lock)."""
        from tierlm.rollout.engine import readable_text

        def stream(row: int, completion) -> None:
            emit(readable_text(self.tokenizer, completion.tokens))
            reason = should_stop() if should_stop is not None else None
            if reason is not None:
                raise _Stopped(reason, completion)

        if not self.lock.acquire(timeout=-1 if wait_s is None else max(wait_s, 0.0)):
            raise Busy(f"the model stayed busy for {wait_s:.0f} s")
        try:
            completion = self.engine.generate(
                prompt, 1, max_new_tokens, temperature, generator=generator, on_token=stream
            )[0]
            return completion, "stop" if completion.finished else "length"
        except _Stopped as stopped:
            return stopped.completion, stopped.reason
        finally:
            self.lock.release()

    def _batched(self, prompt, max_new_tokens, temperature, generator, emit, should_stop) -> tuple[Any, str]:
        """(the completion, its finish reason) from the batching scheduler, streaming through `emit`."""
        from tierlm.rollout.batching import Request
        from tierlm.rollout.engine import readable_text

        def on_token(completion) -> None:
            emit(readable_text(self.tokenizer, completion.tokens))

        request = Request(prompt, max_new_tokens, temperature, generator, on_token=on_token, should_stop=should_stop)
        self.scheduler.submit(request).done.wait()
        if request.reason == "error":
            raise RuntimeError(f"the model failed: {request.error}")
        if request.reason == "timeout" and not request.completion.tokens:
            raise Busy("the model stayed busy until the request's time ran out")
        return request.completion, request.reason

    def history_entry(self, reply: Reply) -> dict:
        return {"role": "assistant", "content": reply.text}


def check_messages(messages: list[dict], temperature: float) -> None:
    """A `DataError` naming what is wrong with a conversation or a temperature.

    >>> check_messages([{"role": "user", "content": "hi"}], 0.7)
    >>> check_messages([{"role": "robot", "content": "hi"}], 0.7)
    Traceback (most recent call last):
    ...
    tierlm.errors.DataError: messages must be a non-empty list of {role: system|user|assistant|tool, content: text}
    """
    if not messages or any(
        not isinstance(m, dict)
        or m.get("role") not in ("system", "user", "assistant", "tool")
        or not isinstance(m.get("content"), str)
        for m in messages
    ):
        raise DataError("messages must be a non-empty list of {role: system|user|assistant|tool, content: text}")
    if temperature < 0:
        raise DataError(f"temperature must be >= 0, got {temperature}")


HELP = "commands: /reset (new conversation), /temperature T, /quit"


def terminal_chat(
    bot: Chatbot,
    temperature: float = 0.7,
    max_new_tokens: int = 128,
    read: Callable[[str], str] = input,
    write: Callable[[str], None] | None = None,
) -> None:
    """The terminal loop: each answer streams as it is generated; /reset, /temperature T, /quit."""

    def out(text: str) -> None:
        (write or (lambda t: (sys.stdout.write(t), sys.stdout.flush())))(text)

    messages: list[dict] = []
    out(f"chatting with {bot.name} (temperature {temperature}); {HELP}\n")
    while True:
        try:
            line = read("you> ").strip()
        except EOFError:
            out("\n")
            return
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return
        if line == "/reset":
            messages = []
            out("(new conversation)\n")
            continue
        if line.startswith("/temperature"):
            try:
                value = float(line.split()[1])
                assert value >= 0
            except (IndexError, ValueError, AssertionError):
                out("usage: /temperature T (a number >= 0; 0 is greedy)\n")
                continue
            temperature = value
            out(f"(temperature {temperature})\n")
            continue
        if line.startswith("/"):
            out(f"unknown command; {HELP}\n")
            continue
        messages.append({"role": "user", "content": line})
        out("assistant> ")
        try:
            reply = bot.reply(messages, temperature, max_new_tokens, on_text=out)
        except DataError as e:
            messages.pop()
            out(f"\n({e})\n")
            continue
        out("\n" if reply.finish_reason == "stop" else " [...]\n")
        messages.append(bot.history_entry(reply))


# -- the command ----------------------------------------------------------------------------
def arguments(chat: argparse.ArgumentParser) -> None:
    chat.add_argument("--checkpoint", required=True, help="a run directory, checkpoint or model folder")
    chat.add_argument("--temperature", type=temperature, default=0.7, help="0 is greedy (/temperature T changes it)")
    chat.add_argument("--max-new-tokens", type=positive_int, default=128)
    chat.add_argument("--device-type", default="auto", choices=DEVICE_TYPES)


def run(args: argparse.Namespace) -> None:
    terminal_chat(Chatbot(args.checkpoint, args.device_type), args.temperature, args.max_new_tokens)


COMMAND = Command(arguments, run)

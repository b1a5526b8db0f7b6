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
from pathlib import Path
from typing import Callable

from tierlm.commands.generation import Reply, Sampling
from tierlm.commands.options import COMPILE_HELP, DEVICE_TYPES, Command, positive_int, sampling_filters, temperature
from tierlm.errors import DataError


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
        chat_only: bool = True,
        compile: bool = False,
    ):
        """`batch_rows` > 1: replies asked for at once are generated together, up to that many (continuous batching,
        `tierlm.rollout.batching`; the native GPT on tierlm's engine), else one at a time. `chat_only` False: a model
        without a chat template (a base model) is served too, for plain completions (`complete`). `compile`: tierlm's
        engine compiles its decode step (engine.compile)."""
        import tempfile

        from tierlm.builders.engine import ENGINES, EngineSettings, build_engine
        from tierlm.checkpoint.folders import verified_model_location
        from tierlm.config import EngineConfig
        from tierlm.data import load_tokenizer
        from tierlm.errors import ConfigError
        from tierlm.models import load_pretrained_model
        from tierlm.primitives import resolve_device

        if compile and engine != "native":
            raise ConfigError(f"--compile compiles tierlm's own decode step, not --engine {engine}'s: drop it")
        location = verified_model_location(str(checkpoint))
        self.name = Path(str(checkpoint)).name or str(checkpoint)
        self.tokenizer = load_tokenizer(location)
        self.chat = self.tokenizer.has_chat_template
        if chat_only and not self.chat:
            raise DataError(
                f"{checkpoint} has no chat template: chat with a model after `tierlm sft` (a base model: `tierlm "
                f"sample --raw`)"
            )
        model = load_pretrained_model(location, device=resolve_device(device_type)).eval()
        with_tools = tools and self.tokenizer.tool_ids() is not None
        if vllm_url is not None and (engine != "vllm" or not vllm_url.startswith(("http://", "https://"))):
            raise ConfigError(f"--vllm-url names a vLLM server (http://host:port) for --engine vllm, got {vllm_url!r}")
        section = EngineConfig(kind=engine, vllm_url=vllm_url, compile=compile)  # the engine section, from the flags
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
        self.samples_each_token = kind.samples_each_token
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
        **filters,
    ) -> Reply:
        """The assistant's next turn after `messages` (OpenAI role/content dicts); `on_text(piece)` streams it.
        `should_stop()`, asked after every token, names a reason to stop early ("cancelled", "timeout"): the reply so
        far comes back with that finish reason. `wait_s`: how long to wait for the model (busy with other replies)
        before raising `Busy`. `filters`: `Sampling`'s top_p, top_k, min_p and penalties."""
        sampling = Sampling(max_new_tokens, temperature, seed=seed, **filters)
        stream = (lambda index, piece: on_text(piece)) if on_text is not None else None
        return self.chat_choices(messages, sampling, stream, should_stop, wait_s)[0]

    def chat_choices(self, messages: list[dict], sampling: Sampling, on_text=None, should_stop=None, wait_s=None):
        """The assistant's next turn after `messages`, `sampling.n` times (`Reply` each; `on_text(index, piece)`
        streams them): the conversation rendered by the model's chat template, the turns as people read them."""
        from tierlm.rollout.text import readable_text

        if not self.chat:
            raise DataError(f"{self.name} has no chat template: send its prompts to /v1/completions")
        check_messages(messages)
        prompt = self.tokenizer.render_for_completion(messages)
        return self.complete(
            prompt, sampling, lambda ids: readable_text(self.tokenizer, ids), on_text, should_stop, wait_s
        )

    def complete(self, prompt: list[int], sampling: Sampling, decode=None, on_text=None, should_stop=None, wait_s=None):
        """`sampling.n` choices continuing the tokens `prompt` (`Reply` each, in order): streamed through
        `on_text(index, piece)`, cut at `sampling.stop`, scored when `sampling.top_logprobs` is set. `decode` turns a
        choice's tokens into its text (default: the tokenizer's, special tokens dropped)."""
        from dataclasses import replace

        from tierlm.commands import generation

        decode = decode or (lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        if sampling.temperature < 0:
            raise DataError(f"temperature must be >= 0, got {sampling.temperature}")
        room = self.engine.max_len() - len(prompt)
        if room < 1 or not prompt:
            raise DataError(
                f"the prompt is {len(prompt)} tokens, the model's context is {self.engine.max_len()}: shorten it"
            )
        if sampling.top_logprobs is not None and not hasattr(self.engine, "model"):
            raise DataError("log-probs are scored by tierlm's engine: serve with --engine native to ask for them")
        if sampling.ignore_eos and not self.samples_each_token:  # vLLM's replies come back whole, ended
            raise DataError("ignore_eos is honoured by tierlm's engine: serve with --engine native to ask for it")
        s = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room))
        choices = [generation.Choice(i, decode, s.stop, on_text) for i in range(s.n)]
        if s.max_new_tokens == 0:  # echo alone: the prompt scored, nothing generated
            from tierlm.rollout.engine import Completion

            ended = [(Completion(), "length") for _ in choices]
        elif self.scheduler is not None and s.plain:  # joins the replies in flight
            ended = generation.batched(self.scheduler, prompt, s, choices, should_stop)
        else:
            ended = generation.alone(self.engine, self.lock, prompt, s, choices, should_stop, wait_s)
        replies = []
        for choice, (completion, reason) in zip(choices, ended):
            choice.update(completion.tokens, final=True)
            tokens = choice.kept(completion.tokens)
            scored = None
            if s.top_logprobs is not None:
                start = 0 if s.echo else len(prompt)
                scored = generation.score(self.engine.model, self.tokenizer, prompt + tokens, start, s.top_logprobs)
            finish = "stop" if choice.stopped else reason
            replies.append(Reply(choice.text, finish, len(prompt), len(tokens), tokens, scored))
        return replies

    def history_entry(self, reply: Reply) -> dict:
        return {"role": "assistant", "content": reply.text}


def check_messages(messages: list[dict]) -> None:
    """A `DataError` naming what is wrong with a conversation (the temperature is checked by `Chatbot.complete`).

    >>> check_messages([{"role": "user", "content": "hi"}])
    >>> check_messages([{"role": "robot", "content": "hi"}])
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


HELP = "commands: /reset (new conversation), /temperature T, /quit"


def terminal_chat(
    bot: Chatbot,
    temperature: float = 0.7,
    max_new_tokens: int = 128,
    read: Callable[[str], str] = input,
    write: Callable[[str], None] | None = None,
    system: str | None = None,
    filters: dict | None = None,
) -> None:
    """The terminal loop: each answer streams as it is generated; /reset, /temperature T, /quit. A `system` message
    opens every conversation (a /reset one too); `filters` (top_p, min_p, repetition_penalty) shape every draw."""

    def out(text: str) -> None:
        (write or (lambda t: (sys.stdout.write(t), sys.stdout.flush())))(text)

    opening = [{"role": "system", "content": system}] if system is not None else []
    messages: list[dict] = list(opening)
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
            messages = list(opening)
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
            reply = bot.reply(messages, temperature, max_new_tokens, on_text=out, **(filters or {}))
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
    sampling_filters(chat)
    chat.add_argument("--system", default=None, help="a system message that opens each conversation")
    chat.add_argument("--device-type", default="auto", choices=DEVICE_TYPES)
    chat.add_argument("--compile", action="store_true", help=COMPILE_HELP)


def run(args: argparse.Namespace) -> None:
    bot = Chatbot(args.checkpoint, args.device_type, compile=args.compile)
    filters = dict(top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty)
    terminal_chat(bot, args.temperature, args.max_new_tokens, system=args.system, filters=filters)


COMMAND = Command(arguments, run)

"""The OpenAI API as `tierlm serve` speaks it: the request bodies of /v1/completions and /v1/chat/completions (every
field honoured, or refused with a 400 naming it: `Unsupported`), and the response bodies (`Bodies`: whole, or as
server-sent chunks; log-probs in OpenAI's two shapes).

What each field does (the docs' serving page has the table):

- `n` choices sampled together; `seed` makes a request's choices the same each time; `temperature`, `top_p`;
- `stop` (up to 4 strings): a choice ends before the first one its text contains (`finish_reason: "stop"`), and a
  streamed choice never shows text that may yet become one;
- `logprobs`: completions' `logprobs: k` (0-5 alternatives) and chat's `logprobs: true` + `top_logprobs: k` (0-20),
  the model's own log-probabilities (temperature 1), from one scoring pass over the prompt and the completion;
- `echo` (completions): the prompt's text (and its tokens' log-probs) before the completion's;
- `stream_options: {include_usage: true}`: a streamed reply's last event before [DONE] carries the usage (the other
  events `usage: null`), as OpenAI's does;
- chat messages' `content` as a string or a list of text parts (joined by newlines, as vLLM joins them), and the
  `developer` role as the system turn it replaces;
- `presence_penalty`, `frequency_penalty` (-2 to 2, on the tokens generated so far, as OpenAI's and vLLM's);
- vLLM's extensions: `ignore_eos` (a choice runs to `max_tokens` or a stop string), `repetition_penalty` (CTRL's,
  on the prompt's and the generated tokens), and its sampling filters `top_k` (-1 or 0: off) and `min_p` (0: off);
- `best_of`: its no-op value only;
  `tools`, `logit_bias`, `suffix`, `response_format`, ...: refused (a 400 naming the field), never silently dropped.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tierlm.commands.generation import Sampling

MAX_STOP = 4
MAX_TOP_LOGPROBS = {"completions": 5, "chat": 20}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class Common(BaseModel):
    """What both bodies take. A field a body does not name is refused (extra="forbid"): a client is never silently
    given something other than what it asked for."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0, le=8192)
    temperature: float = Field(1.0, ge=0, le=5)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's and SGLang's extension: -1 or 0 is off
    min_p: float | None = Field(None, ge=0, le=1)  # theirs too: 0 is off
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)  # vLLM's and SGLang's extension (CTRL's penalty)
    ignore_eos: bool = False  # theirs too: `vllm bench serve` sends true with its random prompts
    user: str | None = None  # the caller's name for its end user: nothing to do with it

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOP} non-empty strings")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _with_a_stream(cls, value, info):
        if value is not None and not info.data.get("stream"):
            raise ValueError("only with stream: true")
        return value

    def stops(self) -> list[str]:
        return list(self.stop or [])

    def penalties(self) -> dict[str, float]:
        return dict(
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
        )

    def usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=0, le=8192)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS["completions"])
    echo: bool = False
    best_of: int | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported: sample n choices and pick among them")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 returns nothing without echo")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts (texts or token ids), one batch of choices each."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        return list(p)

    def top_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """A chat turn as OpenAI's clients send it, made what the chat template takes: text parts joined, the `developer`
    role (OpenAI's name for the system turn since its o1 models) as `system`.

    >>> Message(role="developer", content=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Exact."}])
    Message(role='system', content='Be brief.\\nExact.', name=None)
    """

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    @model_validator(mode="after")
    def _as_the_template_takes_it(self):
        if not isinstance(self.content, str):
            self.content = "\n".join(part.text for part in self.content)
        if self.role == "developer":
            self.role = "system"
        return self


class ChatRequest(Common):
    messages: list[Message]
    temperature: float = Field(0.7, ge=0, le=5)
    max_tokens: int | None = Field(None, ge=1, le=8192)
    max_completion_tokens: int | None = Field(None, ge=1, le=8192)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS["chat"])

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 128

    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def validation_message(errors: list[dict]) -> str:
    """A pydantic validation error as OpenAI's one-line message naming the field.

    >>> validation_message([{"loc": ("body", "tools"), "msg": "Extra inputs", "type": "extra_forbidden"}])
    'tools is not supported by this server (tierlm serve): drop it'
    >>> validation_message([{"loc": ("body", "n"), "msg": "Input should be less than or equal to 16"}])
    'n: Input should be less than or equal to 16'
    """
    first = errors[0]
    field = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or "the body"
    if first.get("type") == "extra_forbidden":
        return f"{field} is not supported by this server (tierlm serve): drop it"
    message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    return f"{field}: {message}"


# -- requests as the bot takes them --------------------------------------------------------------------------
def chat_sampling(body) -> Sampling:
    """A chat request's sampling."""
    top_p = body.top_p if body.top_p < 1 else None
    return Sampling(
        body.budget(),
        body.temperature,
        top_p,
        body.n,
        tuple(body.stops()),
        body.seed,
        body.top_logprobs_count(),
        ignore_eos=body.ignore_eos,
        top_k=body.top_k,
        min_p=body.min_p,
        **body.penalties(),
    )


def completion_sampling(body) -> Sampling:
    """A completions request's sampling."""
    top_p = body.top_p if body.top_p < 1 else None
    stops = tuple(body.stops())
    return Sampling(
        body.max_tokens,
        body.temperature,
        top_p,
        body.n,
        stops,
        body.seed,
        body.logprobs,
        body.echo,
        body.ignore_eos,
        body.top_k,
        body.min_p,
        **body.penalties(),
    )


def prompt_ids(tokenizer, prompt) -> list[int]:
    """A completions prompt as the model is fed it: token ids as they are (each a token of the vocabulary), or a
    text after the document separator (as tierlm pretrains and `tierlm sample` prompts a base model)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("an empty text")
        return [tokenizer.document_separator_id, *tokenizer.encode(prompt)]
    if not prompt or any(not 0 <= t < tokenizer.vocab_size for t in prompt):
        raise ValueError(f"token ids must be in [0, {tokenizer.vocab_size}) and not empty")
    return list(prompt)


def completions_of(bot, prompts: list[list[int]], sampling: Sampling, on_text, should_stop, wait_s) -> list:
    """Every prompt's choices, prompt after prompt (choice j of prompt i is choice i * n + j); with echo, each
    choice's text starts with its prompt's."""
    replies = []
    for number, prompt in enumerate(prompts):
        base = number * sampling.n
        echoed = bot.tokenizer.decode(prompt, skip_special_tokens=True) if sampling.echo else ""
        if echoed:
            for j in range(sampling.n):
                on_text(base + j, echoed)
        choices = bot.complete(prompt, sampling, None, lambda i, piece: on_text(base + i, piece), should_stop, wait_s)
        for reply in choices:
            reply.text = echoed + reply.text
        replies += choices
    return replies


# -- response bodies -------------------------------------------------------------------------------------------
def completion_logprobs(choice) -> dict:
    """A completion choice's log-probs in the completions shape: tokens, token_logprobs, top_logprobs,
    text_offset."""
    scored = choice.scored
    offsets, at = [], 0
    for token in scored.tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": scored.tokens,
        "token_logprobs": scored.logprobs,
        "top_logprobs": scored.top if scored.top is not None else None,
        "text_offset": offsets,
    }


def chat_logprobs(choice) -> dict:
    """A chat choice's log-probs in the chat shape: content = [{token, logprob, bytes, top_logprobs}]."""
    scored = choice.scored

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    content = []
    for i, (token, logprob) in enumerate(zip(scored.tokens, scored.logprobs)):
        alternatives = scored.top[i] if scored.top is not None else {}
        content.append({**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in alternatives.items()]})
    return {"content": content}


class Bodies:
    """One request's OpenAI bodies, for the completions (`kind` "completions") or the chat endpoint: the whole
    response, or its server-sent chunks."""

    def __init__(self, kind: str, model: str, sampling: Sampling, usage_in_stream: bool = False):
        prefix, self.kind = ("cmpl" if kind == "completions" else "chatcmpl"), kind
        self.ident, self.created, self.model = f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time()), model
        self.object = "text_completion" if kind == "completions" else "chat.completion"
        self.logprobs, self.n = sampling.top_logprobs is not None, sampling.n
        self.usage_in_stream = usage_in_stream

    def _choice(self, index: int, choice) -> dict:
        body: dict[str, Any] = {"index": index, "finish_reason": choice.finish_reason}
        if self.kind == "completions":
            body["text"] = choice.text
            body["logprobs"] = completion_logprobs(choice) if self.logprobs else None
        else:
            body["message"] = {"role": "assistant", "content": choice.text}
            body["logprobs"] = chat_logprobs(choice) if self.logprobs else None
        return body

    def usage(self, choices: list) -> dict:
        prompt_tokens = sum(c.prompt_tokens for c in choices[:: self.n])  # each prompt once, not once per choice
        completion_tokens = sum(c.completion_tokens for c in choices)
        total = prompt_tokens + completion_tokens
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}

    def whole(self, choices: list) -> dict:
        return {
            "id": self.ident,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(i, c) for i, c in enumerate(choices)],
            "usage": self.usage(choices),
        }

    def chunk(self, index: int, text: str | None = None, finish_reason: str | None = None, choice=None) -> str:
        """One server-sent event: a piece of choice `index`'s text, or its end (`finish_reason`, with its log-probs
        when asked for); a chat stream's first event per choice gives the role."""
        if self.kind == "completions":
            body: dict[str, Any] = {"index": index, "text": text or "", "finish_reason": finish_reason}
            if self.logprobs:
                body["logprobs"] = completion_logprobs(choice) if choice is not None else None
        else:
            delta = {"content": text} if text is not None else {}
            if text == "" and finish_reason is None:
                delta = {"role": "assistant", "content": ""}
            body = {"index": index, "delta": delta, "finish_reason": finish_reason}
            if self.logprobs and choice is not None:
                body["logprobs"] = chat_logprobs(choice)
        return self._event([body], None)

    def usage_chunk(self, choices: list) -> str:
        """The stream's last event before [DONE] when `stream_options.include_usage` asked for it: no choices, the
        request's usage."""
        return self._event([], self.usage(choices))

    def _event(self, choices: list[dict], usage: dict | None) -> str:
        kind = "text_completion" if self.kind == "completions" else "chat.completion.chunk"
        data = {"id": self.ident, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if self.usage_in_stream:
            data["usage"] = usage
        return f"data: {json.dumps(data)}\n\n"

"""A request's choices, as `tierlm chat` and `tierlm serve` generate them: `n` samples of one prompt together, each
ending at a stop token, at the first of its stop strings (cut before it) or at its budget, streamed piece by piece
(text that may yet become a stop string is held back), and, when asked, scored: each token's log-probability under
the model (temperature 1) with its most likely alternatives, from one forward pass over the prompt and the choice.

The generation itself is the engine's: on the continuous batch of the server (`tierlm.rollout.batching`, one
request per choice, each joining between decode steps) or one prompt at a time (`Engine.generate`, the `n` rows
together, under the bot's lock).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Sampling:
    """How a request's choices are sampled and what comes back with them."""

    max_new_tokens: int = 128
    temperature: float = 0.7
    top_p: float | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    """Strings that end a choice (not included in its text)."""
    seed: int | None = None
    """The same seed, the same choices (choice i samples from the seed's stream i)."""
    top_logprobs: int | None = None
    """None: no log-probs; k >= 0: each token's log-prob with its k most likely alternatives."""
    echo: bool = False
    """Scored log-probs cover the prompt's tokens too (the first has none)."""
    ignore_eos: bool = False
    """A stop token ends nothing: each choice runs to `max_new_tokens` or a stop string (what load generators ask for,
    so every reply is as long as they planned)."""
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def params(self):
        """The engine's `SamplingParams` (a filter at its no-op value is off)."""
        from tierlm.rollout.sampling import SamplingParams

        top_k = self.top_k if self.top_k and self.top_k > 0 else None
        top_p = self.top_p if self.top_p is not None and self.top_p < 1 else None
        penalties = (self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        return SamplingParams(self.temperature, top_k, top_p, self.min_p or None, *penalties)

    @property
    def plain(self) -> bool:
        """Temperature alone, no filter and no penalty: what the continuous batch samples (each row at its own
        temperature); a request with more is generated on its own."""
        params = self.params()
        return params == type(params)(params.temperature)


@dataclass
class Scored:
    """Log-probs of a choice's tokens (with `echo`, the prompt's first): each token's text, its log-prob under the
    model (None for the very first token), and its `k` most likely alternatives ({text: log-prob}) when asked."""

    tokens: list[str]
    logprobs: list[float | None]
    top: list[dict[str, float]] | None = None


@dataclass
class Reply:
    text: str
    finish_reason: str  # "stop" (a stop token or string), "length" (max_new_tokens ran out), or why it was stopped
    prompt_tokens: int
    completion_tokens: int
    tokens: list[int] = field(default_factory=list)
    """The choice's tokens (up to its stop string's)."""
    scored: Scored | None = None


class Busy(Exception):
    """The model stayed busy with other replies for longer than this one could wait."""


class _Stopped(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Choice:
    """One choice's text as it grows: cut at the first stop string, and handed on (`on_text(index, piece)`) only as
    far as it can no longer turn into one."""

    def __init__(self, index: int, decode: Callable[[list[int]], str], stops: tuple[str, ...], on_text=None):
        self.index, self.decode, self.stops, self.on_text = index, decode, stops, on_text
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text, self.shown, self.stopped = "", "", False

    def update(self, tokens: list[int], final: bool = False) -> bool:
        """The choice is now `tokens` (`final`: it has ended): True once a stop string has appeared in its text.

        >>> pieces = []
        >>> choice = Choice(0, lambda ids: "".join(map(chr, ids)), ("=",), lambda i, p: pieces.append(p))
        >>> [choice.update([ord(c) for c in "2 + 3 = 5"[:n]]) for n in (3, 5, 7)], choice.text, pieces
        ([False, False, True], '2 + 3 ', ['2 +', ' 3', ' '])
        """
        if not self.stopped:
            text = self.decode(tokens)
            cuts = [text.find(s) for s in self.stops if s in text]
            self.stopped = bool(cuts)
            self.text = text[: min(cuts)] if cuts else text
        visible = self.text if final or self.stopped else self.text[: max(len(self.text) - self.hold, 0)]
        if self.on_text is not None and visible.startswith(self.shown) and len(visible) > len(self.shown):
            self.on_text(self.index, visible[len(self.shown) :])
            self.shown = visible
        return self.stopped

    def kept(self, tokens: list[int]) -> list[int]:
        """The fewest of `tokens` whose text holds the choice's (all of them unless a stop string cut it)."""
        if not self.stopped:
            return tokens
        for count in range(len(tokens) + 1):
            if len(self.decode(tokens[:count])) >= len(self.text):
                return tokens[:count]
        return tokens


def generators(device, seed: int | None, n: int) -> list:
    """Choice i's random stream (a `torch.Generator`): seeded from (`seed`, i), or none."""
    import torch

    if seed is None:
        return [None] * n
    return [torch.Generator(device=device).manual_seed(seed * 1_000_003 + i) for i in range(n)]


def batched(scheduler, prompt: list[int], s: Sampling, choices: list[Choice], should_stop) -> list[tuple[Any, str]]:
    """(completion, finish reason) of each choice, generated on the continuous batch (one request each)."""
    from tierlm.rollout.batching import Request

    requests = []
    for choice, generator in zip(choices, generators(scheduler.engine.device, s.seed, s.n)):

        def stop_check(choice=choice) -> str | None:
            return "stop" if choice.stopped else should_stop() if should_stop is not None else None

        def on_token(completion, choice=choice) -> None:
            choice.update(completion.tokens)

        request = Request(prompt, s.max_new_tokens, s.temperature, generator, on_token, stop_check, s.ignore_eos)
        requests.append(scheduler.submit(request))
    out = []
    for request in requests:
        request.done.wait()
        if request.reason == "error":
            raise RuntimeError(f"the model failed: {request.error}")
        if request.reason == "timeout" and not request.completion.tokens:
            raise Busy("the model stayed busy until the request's time ran out")
        out.append((request.completion, request.reason))
    return out


def alone(engine, lock, prompt: list[int], s: Sampling, choices: list[Choice], should_stop, wait_s) -> list:
    """(completion, finish reason) of each choice, the `n` rows generated together by the engine (under `lock`,
    waited for `wait_s` seconds at most)."""
    seen: dict[int, Any] = {}

    def stream(row: int, completion) -> None:
        seen[row] = completion
        if s.ignore_eos:  # the engine marked a stop token finished just now: the row goes on
            completion.finished = False
        if choices[row].update(completion.tokens):
            completion.finished = True  # the engine samples no more for this row
        reason = should_stop() if should_stop is not None else None
        if reason is not None:
            raise _Stopped(reason)

    if not lock.acquire(timeout=-1 if wait_s is None else max(wait_s, 0.0)):
        raise Busy(f"the model stayed busy for {wait_s:.0f} s")
    try:
        generator = generators(engine.device, s.seed, 1)[0]
        out = engine.generate(prompt, s.n, s.max_new_tokens, s.params(), generator, on_token=stream)
        return [(c, "stop" if c.finished else "length") for c in out]
    except _Stopped as stopped:
        from tierlm.rollout.engine import Completion

        return [(seen.get(row, Completion()), stopped.reason) for row in range(s.n)]
    finally:
        lock.release()


def score(model, tokenizer, ids: list[int], start: int, k: int | None) -> Scored:
    """Log-probs of `ids[start:]` under `model` (each given the tokens before it), with the `k` most likely
    alternatives at each when `k` is given."""
    import torch

    from tierlm.models import forward_logits

    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    first = max(start, 1)  # the first token of all has nothing before it to be scored by
    with torch.no_grad():
        logits = forward_logits(model, {"input_ids": x})[0, first - 1 : -1]  # position i scores token i + 1
    logp = logits.float().log_softmax(-1)
    unscored = [None] * (first - start)
    chosen = [*unscored, *logp.gather(1, x[0, first:, None]).squeeze(1).tolist()]
    top = None
    if k is not None:
        values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)
        rows = [{tokenizer.decode([i]): v for i, v in zip(ix, vs)} for ix, vs in zip(indices.tolist(), values.tolist())]
        top = [{} for _ in unscored] + rows
    return Scored([tokenizer.decode([i]) for i in ids[start:]], chosen, top)

"""Batched generation with a KV cache, for the native GPT and transformers models.

`Engine.generate(prompt_ids, num_samples)` prefills the prompt once, copies its cache to
`num_samples` rows, then decodes one token per row per step (`SamplingParams`: temperature, top-k, top-p, min-p),
stop tokens, and the log-probability of every sampled token under the distribution it was
drawn from. A row that calls a tool (`<|tool_call_start|> 23 + 45 <|tool_call_end|>`) gets the
result spliced in as forced tokens (`<|tool_start|>68<|tool_end|>`), marked so training masks
them. All rows advance together (forced tokens replace samples), so the cache stays rectangular.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from tierlm.errors import ConfigError, DataError
from tierlm.models import family_of, unwrap_model
from tierlm.models.lora import is_adapter_key
from tierlm.rollout import static_decode, together
from tierlm.rollout.adapters import ADAPTER_VERSION, stamped_adapters
from tierlm.rollout.sampling import Penalties, SamplingParams, default_generator, sample_groups, sample_next_token
from tierlm.rollout.tools import (
    Tool,
    call_tool,
)

SAMPLE_AHEAD = 8
"""On CUDA, the decode steps run before the host reads their tokens: one device-to-host copy per 8 steps, so the GPU
does not wait for Python between steps (vLLM and SGLang read their samples a step or more late for the same reason).
A row that stops inside such a run costs the run's remaining steps of compute, never a different token. Off CUDA
reading is free and a stopped row's extra steps are not: 1."""


@dataclass
class ToolCalls:
    """A row's tool calls in flight: where its open call began, and the result tokens still to force."""

    open_at: int | None = None
    forced: list[int] = field(default_factory=list)


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    tokens: list[int] = field(default_factory=list)
    """New tokens, up to and including the stop token; tool results included."""
    logprobs: list[float] = field(default_factory=list)
    """Sampler log-prob of each token (0.0 for forced tool-result tokens)."""
    mask: list[int] = field(default_factory=list)
    """1 where the model chose the token (trained), 0 where the engine forced it (tool result)."""
    finished: bool = False
    """True when a stop token ended it (False: it ran out of budget)."""
    tool_calls: int = 0
    weight_version: int = 0
    """The optimizer steps behind the weights that sampled it (a partial rollout's: its oldest token's)."""
    versions: list[int] = field(default_factory=list)
    """The weight version that sampled each token: one value unless a partial rollout (`tierlm.loops.partial`) went
    on under newer weights."""
    forced: list[int] = field(default_factory=list)
    """Tool-result tokens still to force: a partial rollout's chunk ended inside a result."""
    routes: torch.Tensor | None = field(default=None, compare=False)
    """A mixture-of-experts sampler's experts for each token it ran — the prompt's, then each completion token fed
    back — (prompt + tokens - 1, MoE layers, k), int16: what the trainer replays (rollout routing replay). None
    when the model routes nothing or the engine does not say (vLLM)."""


@dataclass
class Rollout:
    """A completion of a prompt with its reward (and the answer text the reward read). With a reward model or added
    reward functions, `reward` weighs its `score` and the functions' `terms` against the task's own (`task_reward`)."""

    prompt_ids: list[int]
    completion: Completion
    reward: float
    text: str
    task_reward: float | None = None
    score: float | None = None
    domain: str | None = None  # its prompt's domain (`TaskExample.domain`): which teacher scores it
    terms: dict[str, float] = field(default_factory=dict)  # rl.reward_terms' values, before their weights


class SamplingEngine(Protocol):
    """What the RL loop, `tierlm eval` and `tierlm chat` / `serve` ask of a rollout engine (`Engine`, tierlm's own;
    `tierlm.rollout.vllm.VLLMEngine`)."""

    device: torch.device  # where the callers' generators live
    weight_version: int  # the optimizer steps behind the weights it samples with
    needs_state: bool  # True: every sync hands it the policy's whole state (it holds weights of its own)

    def load_weights(self, state: dict[str, torch.Tensor] | None, version: int) -> None: ...

    def max_len(self) -> int: ...

    def generate(
        self, prompt_ids, num_samples=1, max_new_tokens=64, params=SamplingParams(), generator=None, on_token=None
    ) -> list[Completion]: ...

    def generate_many(self, requests, max_new_tokens, params) -> list[list[Completion]]: ...

    def extend_many(self, requests, max_new_tokens, params, budget=None) -> None: ...

    def close(self) -> None: ...


def check_compile(model: nn.Module) -> None:
    """Refuse in one line to compile a decode step `model` lacks (engine.compile, `--compile`)."""
    if not static_decode.supports(unwrap_model(model)):
        raise ConfigError(
            "engine.compile (--compile) compiles the native GPT's fixed-shape decode step, which this model lacks "
            "(another family, experts or sliding-window layers): drop it"
        )


class Engine:
    """Sampling for one model of any family (the family's KV cache: ours for native models, transformers' own).

    `tokenizer` is needed only for tools (to read the call and encode the result). `static`: decode with fixed shapes
    (`tierlm.rollout.static_decode`; on CUDA each step one CUDA graph); None: where the model takes them, on CUDA
    always, elsewhere for several prompts decoded together (`generate_many`: one step for all of them) while one
    prompt takes the slicing step, the faster one off CUDA (attention over the positions so far, not the whole
    buffer); False: never. `compile`: `torch.compile` the fixed-shape step (fused kernels; tens of seconds to compile
    a new shape), used for one prompt too; a string: with those Inductor options (`static_decode.COMPILE_OPTIONS`).
    """

    needs_state = False  # it samples from a module: the policy's own, or a copy it is given weights for
    takes_adapters = True  # a copy of a LoRA policy keeps its base: each sync may send the adapters alone

    def __init__(
        self,
        model: nn.Module,
        stop_ids: list[int] | tuple[int, ...] = (),
        tokenizer=None,
        tools: list[Tool] = (),
        static: bool | None = None,
        compile: bool | str = False,
    ):
        if compile:
            check_compile(model)
            assert compile is True or compile in static_decode.COMPILE_OPTIONS, f"no compile options named {compile}"
        self.model = unwrap_model(model)
        self.family = family_of(self.model)
        self.device = next(self.model.parameters()).device
        on_cuda = self.device.type == "cuda"
        assert not static or static_decode.supports(self.model), "static decoding needs the native GPT (no windows)"
        fixed = static_decode.supports(self.model) if static is None else static
        self.decoders = static_decode.Decoders(self.model, on_cuda, compile=compile) if fixed else None
        self.fixed_alone = fixed and (on_cuda or compile if static is None else static)
        """One prompt decodes with fixed shapes too (on CUDA, compiled, or asked); else the decoders serve only
        several prompts decoded together (`generate_many`), and one prompt takes the slicing step."""
        self.ahead = SAMPLE_AHEAD if on_cuda else 1
        """Decode steps sampled and fed back on the device before the host reads their tokens (`_decode_rows`)."""
        self.stop_ids = set(stop_ids)
        self.tokenizer, self.tools = tokenizer, {t.name: t for t in tools}
        self.weight_version = 0
        """The optimizer steps behind the weights it samples with (recorded with every rollout batch)."""
        if self.tools:
            assert tokenizer is not None, "tools need the tokenizer to read calls and write results"
            ids = tokenizer.tool_ids()
            assert ids is not None, "the tokenizer lacks the tool tokens"
            self.call_start, self.call_end, self.result_start, self.result_end = ids

    def load_weights(self, state: dict[str, torch.Tensor] | None, version: int) -> None:
        """The policy after `version` optimizer steps: `state` (its whole weights, or a LoRA policy's adapters alone
        stamped with their version: `adapter_payload`) is copied in when the engine samples from a copy of its
        own; None when it reads the policy's live weights."""
        if state is not None and ADAPTER_VERSION in state:
            self._load_adapters(state, version)
        elif state is not None:
            self.model.load_state_dict(state)
        self.weight_version = version

    def _load_adapters(self, state: dict[str, torch.Tensor], version: int) -> None:
        """A LoRA policy's adapters, in place (the base weights this copy holds never change): refused unless
        stamped with `version` (`stamped_adapters`) and naming every adapter tensor."""
        state = stamped_adapters(state, version)
        expected = {key for key in self.model.state_dict() if is_adapter_key(key)}
        if set(state) != expected:
            raise RuntimeError(f"the adapters offered differ from the sampler's: {sorted(set(state) ^ expected)[:3]}")
        self.model.load_state_dict(state, strict=False)

    # -- the model step, with a cache (the model's family knows its cache) -----------------------
    def _prefill(self, ids: torch.Tensor, num_samples: int, max_len: int):
        if self.fixed_alone:  # prefilled as long as the prompt, then copied into a fixed-shape bucket
            logits, cache = self.family.prefill(self.model, ids, ids.shape[1])
            decoder = self.decoders.get(ids.shape[0] * num_samples, max_len)
            decoder.load([(cache, ids.shape[0] * num_samples)])
            return logits.repeat_interleave(num_samples, dim=0), decoder
        logits, cache = self.family.prefill(self.model, ids, max_len)
        if num_samples == 1:  # each row its own (one sample, or a partial rollout's rows): nothing to copy
            return logits, cache
        self.family.repeat_cache(cache, num_samples)
        return logits.repeat_interleave(num_samples, dim=0), cache

    def _decode(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        if isinstance(cache, static_decode.StaticDecoder):
            return cache.step(tokens)
        return self.family.decode(self.model, tokens, cache)

    def _routes(self, rows: int) -> torch.Tensor | None:
        """The experts the last model call sent its tokens to, (rows, tokens, MoE layers, k) on the device; None
        for a model that routes nothing."""
        routes = self.family.last_routes(self.model)
        return None if routes is None else routes.view(rows, -1, *routes.shape[1:])

    @staticmethod
    def _keep_routes(rows: list[Completion], prefix: torch.Tensor | None, fed: list[torch.Tensor], prompt: int):
        """Each row's `routes`: its `prefix`'s (the prompt's, shared by the samples of one prefill, or the row's own
        prompt and earlier tokens when a partial rollout's chunk prefilled them) then those of the tokens it fed
        back (`fed`, one (rows, 1, L, k) a step), cut to the positions a trainer's forward runs."""
        if prefix is None:
            return
        prefix = prefix.to("cpu", torch.int16).expand(len(rows), -1, -1, -1)
        steps = torch.cat(fed, dim=1).to("cpu", torch.int16) if fed else prefix[:, :0]
        for row, completion in enumerate(rows):
            completion.routes = torch.cat([prefix[row], steps[row]])[: prompt + len(completion.tokens) - 1].clone()

    def max_len(self) -> int:
        """The longest sequence (prompt + completion) the model takes."""
        return self.family.max_seq_len(self.model) or 1 << 30

    # -- tools -----------------------------------------------------------------------------
    def _tool_result(self, call_tokens: list[int]) -> list[int]:
        """The forced tokens answering a call (`tierlm.rollout.tools.call_tool`)."""
        result = call_tool(self.tools, self.tokenizer.decode(call_tokens, skip_special_tokens=True))
        return [self.result_start, *self.tokenizer.encode(result), self.result_end]

    def take_token(self, completion: Completion, sampled: int, logprob: float, calls: ToolCalls) -> int:
        """Append a row's next token to `completion` and return it: the next forced token of a tool's result when
        one is queued in `calls`, else `sampled` (with its log-prob) — which may end the row (a stop token), open a
        tool call, or close one (the call's result queued). The one place this bookkeeping lives: the engine's own
        loop and the server's continuous batch (`tierlm.rollout.batching`) both step rows through it."""
        completion.versions.append(self.weight_version)
        if calls.forced:
            token = calls.forced.pop(0)
            completion.tokens.append(token)
            completion.logprobs.append(0.0)
            completion.mask.append(0)
            return token
        completion.tokens.append(sampled)
        completion.logprobs.append(logprob)
        completion.mask.append(1)
        if sampled in self.stop_ids:
            completion.finished = True
        elif self.tools and sampled == self.call_start:
            calls.open_at = len(completion.tokens)
        elif self.tools and sampled == self.call_end and calls.open_at is not None:
            calls.forced = self._tool_result(completion.tokens[calls.open_at : -1])
            calls.open_at = None
            completion.tool_calls += 1
        return sampled

    # -- generation ------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        num_samples: int = 1,
        max_new_tokens: int = 64,
        params: SamplingParams = SamplingParams(),
        generator: torch.Generator | None = None,
        on_token=None,
    ) -> list[Completion]:
        """`num_samples` completions of `prompt_ids`. `on_token(row, completion)`, when given, is called
        after each token a row gets (sampled or a forced tool result): streaming."""
        assert prompt_ids, "the prompt is empty"
        assert num_samples >= 1 and max_new_tokens >= 1, f"num_samples={num_samples}, max_new_tokens={max_new_tokens}"
        max_len = min(len(prompt_ids) + max_new_tokens, self.max_len())
        if len(prompt_ids) >= max_len:
            raise DataError(
                f"the prompt is {len(prompt_ids)} tokens, longer than the model's context of {self.max_len()} "
                "leaves room for; shorten it"
            )
        was_training = self.model.training
        self.model.eval()
        try:
            return self._generate(prompt_ids, num_samples, max_len, params, generator, on_token)
        finally:  # also when on_token stops it (a server's cancelled request)
            self.model.train(was_training)

    def _generate(self, prompt_ids, num_samples, max_len, params, generator, on_token):
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        logits, cache = self._prefill(ids, num_samples, max_len)
        prefix = self._routes(1)
        out = [Completion(weight_version=self.weight_version) for _ in range(num_samples)]
        calls = [ToolCalls() for _ in range(num_samples)]
        penalties = (
            Penalties(params, prompt_ids, num_samples, logits.shape[-1], self.device) if params.penalised else None
        )
        fed = self._decode_rows(
            logits, cache, out, calls, max_len - len(prompt_ids), params, generator, on_token, penalties=penalties
        )
        self._keep_routes(out, prefix, fed, len(prompt_ids))
        for completion, pending in zip(out, calls):  # a result the budget cut: a partial rollout forces it next
            completion.forced = pending.forced
        return out

    def _decode_rows(
        self, logits, cache, out, calls, steps, params, generator, on_token=None, groups=None, penalties=None
    ):
        """Up to `steps` tokens for every unfinished row of `out` (its `calls` in flight), from the next-token
        `logits` and the `cache` behind them. Returns the experts of each token fed back, one (rows, 1, L, k) a step
        (empty for a model that routes nothing). `groups`: `(rows, generator)` of consecutive rows, each group
        drawing from its own generator as it would alone, and no more once its rows have stopped (prompts decoded
        together: `generate_many`); None: one group, every row, `generator`. `penalties`: the counts a penalised
        draw reads (`Penalties`: one prompt's rows, `generate`'s), fed each token as the model is.

        Steps go in runs of `ahead` (one with tools, whose forced tokens must be known before the next step):
        each step's tokens fed back on the device, read by the host once per run. A group whose rows all stop inside
        a run gets its generator put back where a step-by-step loop leaves it, so the tokens, log-probs and later
        draws are the same whatever `ahead` is."""
        fed: list[torch.Tensor] = []
        ahead, done = (1 if self.tools else self.ahead), 0
        groups = groups or [(len(out), generator)]
        starts = [sum(rows for rows, _ in groups[:g]) for g in range(len(groups) + 1)]
        live = [True] * len(groups)
        rngs = [g if g is not None or ahead == 1 else default_generator(self.device) for _, g in groups]
        assert penalties is None or len(groups) == 1, "penalties count one prompt's rows"
        while True:
            run = min(ahead, steps - done)
            sampled, logprobs, states = [], [], []
            for j in range(run):
                if j:  # the run's earlier token, fed back without leaving the device
                    logits = self._decode(self._fed(sampled[-1], penalties), cache)
                    self._feed_routes(fed, len(out))
                drawn = penalties.apply(logits) if penalties is not None else logits
                if len(groups) == 1:  # its generator may be None, torch's own (to sample_groups None draws nothing)
                    sampled.append(sample_next_token(drawn, params, groups[0][1]))
                else:
                    drawing = [(rows, g if alive else None) for (rows, g), alive in zip(groups, live)]
                    sampled.append(sample_groups(drawn, params, drawing))
                scaled = logits.float() / params.temperature if not params.greedy else logits.float()
                logprobs.append(torch.log_softmax(scaled, dim=-1).gather(1, sampled[-1][:, None]).squeeze(1))
                if run > 1:
                    states.append([rng.get_state() if alive else None for rng, alive in zip(rngs, live)])
            tokens = torch.stack(sampled).tolist()  # one host sync per run, not one per step or row
            logprob_rows = torch.stack(logprobs).tolist()
            for j in range(run):
                step = list(tokens[j])
                for row, completion in enumerate(out):
                    if completion.finished:
                        continue
                    step[row] = self.take_token(completion, step[row], logprob_rows[j][row], calls[row])
                    if on_token is not None:
                        on_token(row, completion)
                for g in range(len(groups)):
                    if live[g] and all(c.finished for c in out[starts[g] : starts[g + 1]]):
                        live[g] = False  # it draws no more, and the draws of its steps nobody needed are taken back
                        if run > 1:
                            rngs[g].set_state(states[j][g])
                if not any(live):
                    return fed
            done += run
            if done == steps:
                return fed
            # The sampled ids stay on the device unless a forced tool token replaced one (no copy from the host).
            last = sampled[-1] if step == tokens[-1] else torch.tensor(step, device=self.device)
            logits = self._decode(self._fed(last, penalties), cache)
            self._feed_routes(fed, len(out))

    @staticmethod
    def _fed(tokens: torch.Tensor, penalties) -> torch.Tensor:
        """`tokens`, fed to the model next, counted by the `penalties` (if any) first."""
        if penalties is not None:
            penalties.add(tokens)
        return tokens

    def _feed_routes(self, fed: list[torch.Tensor], rows: int) -> None:
        routes = self._routes(rows)
        if routes is not None:
            fed.append(routes)

    @torch.no_grad()
    def extend(self, prompt_ids, rows, max_new_tokens, params=SamplingParams(), generator=None):
        """Continue `rows` — unfinished completions of `prompt_ids` sampled together, so of one length — by up to
        `max_new_tokens` tokens each, in place, under the weights loaded now (a partial rollout's next chunk,
        `tierlm.loops.partial`). The prompt and each row's tokens are prefilled afresh: a cache made by older
        weights is not reused. A tool result the last chunk cut is forced first; an open call stays open.

        >>> from tierlm.models import build_gpt
        >>> from tierlm.models.gpt import GPTConfig
        >>> engine = Engine(build_gpt(GPTConfig(depth=1, aspect_ratio=16, head_dim=16, vocab_size=10, max_seq_len=8)))
        >>> rows = engine.generate([1, 2], num_samples=2, max_new_tokens=3)
        >>> engine.load_weights(None, 1); engine.extend([1, 2], rows, max_new_tokens=2)
        >>> [len(r.tokens) for r in rows], rows[0].versions
        ([5, 5], [0, 0, 0, 1, 1])
        """
        assert not params.penalised, "penalties are for one prompt's generation (serve, sample), not rollouts"
        assert rows and all(not r.finished for r in rows), "extend unfinished rows"
        if self.family.seq2seq:
            raise DataError("partial rollouts continue a decoder's own sequence; an encoder-decoder's is not one")
        length = len(rows[0].tokens)
        assert all(len(r.tokens) == length for r in rows), "the rows of a group are sampled together: one length"
        max_len = min(len(prompt_ids) + length + max_new_tokens, self.max_len())
        if len(prompt_ids) + length >= max_len:
            return
        was_training = self.model.training
        self.model.eval()
        try:
            ids, calls = self._continuation(prompt_ids, rows)
            logits, cache = self._prefill(ids, 1, max_len)
            prefix = self._routes(len(rows))  # the earlier tokens rerouted by these weights, as they are now cached
            steps = max_len - len(prompt_ids) - length
            fed = self._decode_rows(logits, cache, rows, calls, steps, params, generator)
            self._keep_routes(rows, prefix, fed, len(prompt_ids))
            for r, c in zip(rows, calls):
                r.forced = c.forced
        finally:
            self.model.train(was_training)

    def _continuation(self, prompt_ids, rows: list[Completion]) -> tuple[torch.Tensor, list[ToolCalls]]:
        """What continuing `rows` prefills — the prompt and each row's tokens (rows, T) — and each row's tool calls
        in flight (a call still open, a result the last chunk cut)."""
        ids = torch.tensor([list(prompt_ids) + r.tokens for r in rows], dtype=torch.long, device=self.device)
        return ids, [ToolCalls(self._open_call(r.tokens), r.forced) for r in rows]

    def _open_call(self, tokens: list[int]) -> int | None:
        """Where a tool call still open at the end of `tokens` began (after its start marker), else None."""
        if not self.tools or self.call_start not in tokens:
            return None
        start = len(tokens) - 1 - tokens[::-1].index(self.call_start)
        return None if self.call_end in tokens[start:] else start + 1

    def extend_many(self, requests, max_new_tokens, params, budget=None) -> None:
        """`extend` every `(prompt_ids, rows, generator)`, none past `budget` tokens in all (None: no bound). With the
        fixed-shape decoder, consecutive groups taking the same steps continue as one batch (`tierlm.rollout.together`):
        each row gets what it gets alone."""
        assert not params.penalised, "penalties are for one prompt's generation (serve, sample), not rollouts"
        todo = []
        for prompt, rows, generator in requests:
            room = max_new_tokens if budget is None else min(max_new_tokens, budget - len(rows[0].tokens))
            prefix = len(prompt) + len(rows[0].tokens)
            steps = min(prefix + room, self.max_len()) - prefix  # as `extend` counts them
            if room > 0 and steps > 0:
                todo.append((prompt, rows, generator, room, steps))
        items = [(len(p) + len(rows[0].tokens), len(rows), steps, g) for p, rows, g, _, steps in todo]
        for run in self._runs(items, params):
            if len(run) == 1:
                prompt, rows, generator, room, _ = todo[run[0]]
                self.extend(prompt, rows, room, params, generator)
                continue
            parts = []
            for prompt, rows, generator, _, _ in (todo[i] for i in run):
                assert all(not r.finished for r in rows), "extend unfinished rows"
                ids, calls = self._continuation(prompt, rows)
                parts.append(together.Part(ids, rows, calls, generator))
            together.decode(self, parts, todo[run[0]][4], params)

    def generate_many(self, requests, max_new_tokens, params) -> list[list[Completion]]:
        """Completions of every `(prompt_ids, num_samples, generator)`. With the fixed-shape decoder, consecutive
        prompts decode as one batch (`tierlm.rollout.together`): each prompt's samples are what it gets alone — its
        generator drawn as alone, its logits to float rounding — for one step of the model where it took one per
        prompt. Without it, one prompt at a time (each has its cache)."""
        assert not params.penalised, "penalties are for one prompt's generation (serve, sample), not rollouts"
        out: list[list[Completion]] = []
        items = [(len(prompt), n, max_new_tokens, generator) for prompt, n, generator in requests]
        for run in self._runs(items, params):
            if len(run) == 1:
                prompt, n, generator = requests[run[0]]
                out.append(self.generate(prompt, n, max_new_tokens, params, generator))
                continue
            parts = []
            for prompt, n, generator in (requests[i] for i in run):
                assert prompt and n >= 1, f"an empty prompt or {n} samples"
                ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
                rows = [Completion(weight_version=self.weight_version) for _ in range(n)]
                parts.append(together.Part(ids, rows, [ToolCalls() for _ in range(n)], generator))
            together.decode(self, parts, max_new_tokens, params)
            out.extend(part.rows for part in parts)
        return out

    def _runs(self, items, params: SamplingParams) -> list[list[int]]:
        """`tierlm.rollout.together.runs` with this engine's context; each alone without the fixed-shape decoder."""
        if self.decoders is None:
            return [[i] for i in range(len(items))]
        return together.runs(items, self.max_len(), params.greedy)

    def close(self) -> None:
        pass

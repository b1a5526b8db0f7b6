"""Multi-turn episodes, sampled in rounds: every running episode gets its next assistant turn from one
`generate_many` call (vLLM batches them; tierlm's engine runs them one after another), episodes of different
lengths dropping out as they end.

The model's own tokens are kept exactly as sampled; the tokens between its turns (the environment's message and
the next assistant header, as the chat template renders them) join the completion as forced tokens, masked from
the loss. An episode ends when the environment says so, when a turn does not finish (it hit the token budget),
after `rl.max_turns` assistant turns, past `rl.max_episode_tokens`, or when the context is full. A task is the
one-turn case (`tierlm.tasks.SingleTurn`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from tierlm.config import RLConfig
from tierlm.rollout.engine import Completion, Rollout, SamplingEngine
from tierlm.rollout.sampling import SamplingParams
from tierlm.rollout.text import answer_text
from tierlm.tasks import Environment


@dataclass
class _Episode:
    env: Environment
    messages: list[dict]
    prompt: list[int]
    generator: torch.Generator
    sequence: list[int] = field(default_factory=list)
    completion: Completion = field(default_factory=Completion)
    reward: float = 0.0
    turns: int = 0
    done: bool = False


def episode_generators(generator: torch.Generator, count: int) -> list[torch.Generator]:
    """`count` generators drawn from one (a prompt's): each episode of its group samples with its own stream.

    >>> a = episode_generators(torch.Generator().manual_seed(0), 2)
    >>> b = episode_generators(torch.Generator().manual_seed(0), 2)
    >>> [torch.rand(1, generator=g).item() for g in a] == [torch.rand(1, generator=g).item() for g in b]
    True
    """
    seeds = torch.randint(0, 2**62, (count,), generator=generator, device=generator.device).tolist()
    return [torch.Generator(device=generator.device).manual_seed(seed) for seed in seeds]


def run_episodes(
    engine: SamplingEngine,
    tokenizer,
    rl: RLConfig,
    starts: list[tuple[Environment, int, torch.Generator]],
    temperature: float,
) -> list[Rollout]:
    """One episode per (environment, index, generator) — each on its own copy of the environment, which holds
    one episode's state — sampled in rounds; the rollouts in the order of `starts`."""
    episodes = []
    for env, index, generator in starts:
        env = copy.deepcopy(env)
        messages = env.reset(index)
        prompt = tokenizer.render_for_completion(messages)
        episodes.append(_Episode(env, messages, prompt, generator, list(prompt)))
    budget = rl.max_episode_tokens if rl.max_episode_tokens is not None else engine.max_len()

    def room(e: _Episode) -> int:  # tokens its next turn may take, plus one
        return min(engine.max_len() - len(e.sequence), budget - len(e.completion.tokens) + 1)

    while True:
        for e in episodes:
            e.done = e.done or room(e) < 2
        active = [e for e in episodes if not e.done]
        if not active:
            break
        max_new = min(rl.max_new_tokens, min(map(room, active)) - 1)
        turns = engine.generate_many(
            [(e.sequence, 1, e.generator) for e in active], max_new, SamplingParams.of(rl, temperature)
        )
        for e, [turn] in zip(active, turns):
            for name in ("tokens", "logprobs", "mask"):
                getattr(e.completion, name).extend(getattr(turn, name))
            e.completion.tool_calls += turn.tool_calls
            e.completion.weight_version = turn.weight_version
            e.sequence += turn.tokens
            observation, reward = e.env.step(answer_text(tokenizer, turn.tokens))
            e.reward, e.turns = e.reward + reward, e.turns + 1
            if observation is None or not turn.finished or e.turns >= rl.max_turns:
                e.done = True
                continue
            history = e.messages + [{"role": "assistant", "content": tokenizer.decode(turn.tokens[:-1])}]
            bridge = tokenizer.continuation_ids(history, [observation])
            e.completion.tokens += bridge
            e.completion.logprobs += [0.0] * len(bridge)
            e.completion.mask += [0] * len(bridge)
            e.sequence += bridge
            e.messages = history + [observation]
    rollouts = []
    for e in episodes:
        e.completion.finished = True
        text = tokenizer.decode(e.completion.tokens, skip_special_tokens=True)
        rollouts.append(Rollout(e.prompt, e.completion, e.reward, text))
    return rollouts

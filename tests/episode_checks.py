"""Token in, token out, checked the same way for every engine (tierlm's, vLLM in process, a vLLM server): no pytest
here, so vLLM's own environment (.venv-vllm) imports it too."""

from __future__ import annotations

import copy

import torch

from tierlm.config import RLConfig
from tierlm.loops.episodes import run_episodes
from tierlm.loops.policy_update import rollout_batch
from tierlm.rollout.text import answer_text


def episodes_train_the_ids_sampled(engine, tok, env, max_new_tokens=12) -> tuple[int, int, int]:
    """Run two-turn episodes of `env` with `engine`, every engine call recorded, and check token in, token out:
    every turn was sampled after exactly the ids trained before it, and the trained rows are the prompt, the
    sampled turns, the tool results and the environment's ids (its chat-template bridge), never a reply re-encoded
    from its text. Returns (two-turn episodes, turns with a tool call, replies that are not
    the tokenizer's own encoding of their text)."""
    calls = []  # (the ids a turn was sampled after, the turn)
    sample = engine.generate_many

    def recording(requests, *args, **kwargs):
        turns = sample(requests, *args, **kwargs)
        calls.extend((list(prefix), out[0]) for (prefix, _, _), out in zip(requests, turns))
        return turns

    engine.generate_many = recording
    starts = [(env, i, torch.Generator().manual_seed(i)) for i in range(len(env))]
    rollouts = run_episodes(engine, tok, RLConfig(max_new_tokens=max_new_tokens, max_turns=2), starts, 1.0)
    batch = rollout_batch(rollouts, torch.zeros(len(rollouts)), tok.pad_id)
    two_turns = tools = non_canonical = 0
    for row, (r, (env, index, _)) in enumerate(zip(rollouts, starts)):
        mine = [(prefix, turn) for prefix, turn in calls if prefix[: len(r.prompt_ids)] == r.prompt_ids]
        assert mine and mine[0][0] == r.prompt_ids
        peek = copy.deepcopy(env)
        messages, expected = peek.reset(index), list(r.prompt_ids)
        for k, (prefix, turn) in enumerate(mine):
            assert prefix == expected  # sampled after exactly what is trained before it
            expected += turn.tokens
            reply = turn.tokens[:-1] if turn.finished else turn.tokens
            text = tok.decode(reply)
            non_canonical += tok.encode(text) != reply
            tools += turn.tool_calls > 0
            if k + 1 < len(mine):  # the environment's ids: the template's bridge to its next message, from its text
                observation, _ = peek.step(answer_text(tok, turn.tokens))
                history = messages + [{"role": "assistant", "content": text}]
                bridge = tok.continuation_ids(history, [observation])
                assert r.completion.tokens[len(expected) - len(r.prompt_ids) :][: len(bridge)] == bridge
                expected += bridge
                messages = history + [observation]
        two_turns += len(mine) == 2
        assert r.prompt_ids + r.completion.tokens == expected
        trained = batch["input_ids"][row, : len(expected) - 1].tolist()
        assert trained == expected[:-1] and len(mine) <= 2
    return two_turns, tools, non_canonical

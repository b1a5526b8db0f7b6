"""What the RL loop reads off its rollouts' rewards: the task's rewards of a batch at once, what the config adds to
them (a reward model's score, rl.reward_terms), and a reward model's figures (its mean score, and how often it
orders a group's rollouts as the task's verifier does)."""

from __future__ import annotations

from typing import Any

import torch

from tierlm.rollout.engine import Rollout
from tierlm.tasks import Task, reward_values


def score(task: Task, items: list[tuple[str, str, Any]]) -> list[float]:
    """The task's rewards of (prompt, completion, reference) items, in one call where it scores batches."""
    many = getattr(task, "rewards", None)
    return many(items) if many is not None else [task.reward(*item) for item in items]


def shape_rewards(groups: list[list[Rollout]], examples: list, loop: Any) -> list[list[Rollout]]:
    """The task's rewards with what the config adds, the parts kept apart for the logs: each reward becomes
    rl.task_reward_weight x the task's + rl.reward_model_weight x the reward model's score of the prompt and
    completion (rl.reward_model) + each rl.reward_terms function's value of (prompt, answer, reference) x its
    weight. `loop` is the RL loop (its `rl`, `reward_model` and `reward_terms`)."""
    rl, reward_model, terms = loop.rl, loop.reward_model, loop.reward_terms
    if reward_model is None and not terms:
        return groups
    rollouts = [r for g in groups for r in g]
    for r in rollouts:
        r.task_reward, r.reward = r.reward, rl.task_reward_weight * r.reward
    if reward_model is not None:
        scores = reward_model.score([r.prompt_ids + r.completion.tokens for r in rollouts])
        for r, value in zip(rollouts, scores):
            r.score, r.reward = value, r.reward + rl.reward_model_weight * value
    items = [(e.prompt, r.text, e.reference) for e, group in zip(examples, groups) for r in group]
    for spec, (function, weight) in (terms or {}).items():
        for r, value in zip(rollouts, reward_values(function, items)):  # code: the batch in the sandbox's pool
            r.terms[spec], r.reward = value, r.reward + weight * value
    return groups


def reward_model_sums(groups: list[list[Rollout]]) -> dict[str, float]:
    """Summable figures of a reward model's scores: their sum, and within each group, over the pairs whose task
    rewards differ, how often the reward model ranks them the same way (its accuracy against the task's verifier).

    >>> from tierlm.rollout.engine import Completion
    >>> g = [Rollout([], Completion(), 1.0, "", 1.0, 0.5), Rollout([], Completion(), 0.0, "", 0.0, 0.9)]
    >>> reward_model_sums([g])
    {'rm_score': 1.4, 'rm_pairs': 1.0, 'rm_agree': 0.0}
    """
    score = pairs = agree = 0.0
    for group in groups:
        score += sum(r.score for r in group)
        for a in group:
            for b in group:
                if a.task_reward > b.task_reward:
                    pairs += 1
                    agree += float(a.score > b.score) + 0.5 * float(a.score == b.score)
    return {"rm_score": score, "rm_pairs": pairs, "rm_agree": agree}


def reward_model_figures(totals: dict[str, float]) -> dict[str, float]:
    """The train line's reward-model figures from the step's summed `reward_model_sums` (none without one)."""
    if "rm_score" not in totals:
        return {}
    out = {"rm_score_mean": totals["rm_score"] / totals["rows"]}
    if totals["rm_pairs"]:
        out["rm_accuracy"] = totals["rm_agree"] / totals["rm_pairs"]
    return out


def reward_term_sums(rollouts: list[Rollout], terms: dict | None) -> dict[str, float]:
    """Each rl.reward_terms function's summed values over `rollouts` (before its weight), keyed `term:<spec>`.

    >>> from tierlm.rollout.engine import Completion
    >>> rows = [Rollout([], Completion(), 1.2, "", terms={"m:fmt": 1.0}),
    ...         Rollout([], Completion(), 0.0, "", terms={"m:fmt": 0.0})]
    >>> reward_term_sums(rows, {"m:fmt": (None, 0.2)})
    {'term:m:fmt': 1.0}
    """
    return {f"term:{spec}": float(sum(r.terms[spec] for r in rollouts)) for spec in terms or {}}


def reward_term_figures(totals: dict[str, float]) -> dict[str, float]:
    """The train line's mean of each added reward function, `reward_<module.function>` (`reward_term_sums`)."""
    return {
        f"reward_{key.removeprefix('term:').replace(':', '.')}": value / totals["rows"]
        for key, value in totals.items()
        if key.startswith("term:")
    }


def reward_components(rollouts: list[Rollout], shaping: list[float], rl) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rollout's rewards apart (N, K) and their weights (K,), what GDPO normalises one by one: the task's
    (rl.task_reward_weight), a reward model's score (rl.reward_model_weight), each rl.reward_terms function's, and
    DAPO's overlong penalty (`shaping`, weight 1) when rl.overlong_buffer is set.

    >>> from tierlm.config import RLConfig
    >>> from tierlm.rollout.engine import Completion
    >>> rows = [Rollout([], Completion(), 1.5, "", task_reward=1.0, terms={"m:f": 1.0})]
    >>> reward_components(rows, [0.0], RLConfig(reward_terms={"m:f": 0.5}))
    (tensor([[1., 1.]]), tensor([1.0000, 0.5000]))
    """
    columns = [[r.reward if r.task_reward is None else r.task_reward for r in rollouts]]
    weights = [rl.task_reward_weight]
    if rl.reward_model is not None:
        columns.append([r.score for r in rollouts])
        weights.append(rl.reward_model_weight)
    for spec, weight in rl.reward_terms.items():
        columns.append([r.terms[spec] for r in rollouts])
        weights.append(weight)
    if rl.overlong_buffer:
        columns.append(shaping)
        weights.append(1.0)
    return torch.tensor(columns).T, torch.tensor(weights)

"""What a task is: a random-access set of prompts with a reward, or an environment that answers each
assistant turn.

A reward function scores one completion: `reward(prompt, completion, reference) -> float`.
A task is a random-access set of `TaskExample`s (prompt messages, reference) with its reward function.
An environment is the multi-turn form: it answers each assistant turn with an observation (a new user
turn) or ends the episode with a reward; `SingleTurn` wraps a task as one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from tierlm.tasks.answers import exact_number_reward

RewardFn = Callable[[str, str, Any], float]


@dataclass(frozen=True)
class TaskExample:
    messages: list[dict]
    """The conversation so far (ends with a user turn); the model writes the assistant turn."""
    reference: Any
    """What the reward compares against (e.g. the exact answer)."""
    format: str = "number"
    """Its layout's reward (`tierlm.tasks.formats`): number, math, choice or code."""
    domain: str | None = None
    """Where the prompt comes from (a synthetic task's name, a row's domain column): picks its teacher in
    multi-teacher distillation (rl.teachers)."""

    @property
    def prompt(self) -> str:
        return self.messages[-1]["content"]


class WorkedProblem:
    """A generated problem with a `question` and its worked `answer` (subclasses define both), as every stage reads
    it: plain text for pretraining, a chat for SFT."""

    question: str
    answer: str

    @property
    def text(self) -> str:
        """The problem as plain text, for pretraining."""
        return f"{self.question} {self.answer}"

    @property
    def conversation(self) -> list[dict]:
        """The problem as a chat, for SFT."""
        return [{"role": "user", "content": self.question}, {"role": "assistant", "content": self.answer}]


@runtime_checkable
class Task(Protocol):
    def __len__(self) -> int: ...

    def example(self, index: int) -> TaskExample: ...

    def reward(self, prompt: str, completion: str, reference: Any) -> float: ...


@runtime_checkable
class Environment(Protocol):
    """Multi-turn episodes: `reset` gives the opening messages; `step` takes the assistant's reply
    and returns (next user message or None when the episode ends, reward for this turn). The
    episode's reward is the sum of its turns'. One episode at a time per instance."""

    def __len__(self) -> int: ...

    def reset(self, index: int) -> list[dict]: ...

    def step(self, reply: str) -> tuple[dict | None, float]: ...


def is_environment(task: Task | Environment) -> bool:
    """Is `task` multi-turn (an `Environment`) rather than a `Task`?"""
    return isinstance(task, Environment)


class ExamplesTask:
    """A task over `TaskExample`s from any data source (JSONL, parquet, hub or Hub-layout datasets, read by
    `tierlm.data`: the question and answer columns and the extraction rule of `tierlm.tasks.answers`, or a layout
    of `tierlm.tasks.formats`); the reward is `reward` (by default exact match of the completion's final number).
    A reward with a `many(items)` method scores a batch at once (`rewards`: code run in the sandbox's pool).

    >>> task = ExamplesTask([TaskExample([{"role": "user", "content": "2 + 2?"}], 4.0)])
    >>> len(task), task.reward(task.example(0).prompt, "it is 4", task.example(0).reference)
    (1, 1.0)
    """

    def __init__(self, examples: Sequence[TaskExample], reward: RewardFn = exact_number_reward):
        self.examples, self._reward = examples, reward

    def __len__(self) -> int:
        return len(self.examples)

    def example(self, index: int) -> TaskExample:
        return self.examples[index]

    def reward(self, prompt: str, completion: str, reference: Any) -> float:
        return self._reward(prompt, completion, reference)

    def rewards(self, items: list[tuple[str, str, Any]]) -> list[float]:
        """The rewards of (prompt, completion, reference) items, at once where the reward can."""
        return reward_values(self._reward, items)


def reward_values(reward: RewardFn, items: list[tuple[str, str, Any]]) -> list[float]:
    """`reward` of each (prompt, completion, reference) item, in one call where it scores batches (a `many(items)`
    method: code run in the sandbox's pool).

    >>> reward_values(exact_number_reward, [("", "it is 4", 4.0), ("", "5", 4.0)])
    [1.0, 0.0]
    """
    many = getattr(reward, "many", None)
    return many(items) if many is not None else [reward(*item) for item in items]


class SingleTurn:
    """A task as a one-turn environment: the reply is scored and the episode ends."""

    def __init__(self, task: Task):
        self.task, self.current = task, None

    def __len__(self) -> int:
        return len(self.task)

    def reset(self, index: int) -> list[dict]:
        self.current = self.task.example(index)
        return list(self.current.messages)

    def step(self, reply: str) -> tuple[dict | None, float]:
        assert self.current is not None, "reset() before step()"
        return None, self.task.reward(self.current.prompt, reply, self.current.reference)

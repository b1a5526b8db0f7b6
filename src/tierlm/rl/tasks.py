"""Tasks, rewards and environments for reinforcement learning.

A reward function scores one completion: `reward(prompt, completion, reference) -> float`.
A task is a random-access set of (prompt messages, reference) with its reward function.
An environment is the multi-turn form: it answers each assistant turn with an observation (a
new user turn) or ends the episode with a reward; `SingleTurn` wraps a task as one.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Protocol

from tierlm.data.rows import TaskExample, extract_final_number
from tierlm.data.sources import Examples, SourceOptions, open_examples
from tierlm.data.synthetic import ArithmeticTask
from tierlm.errors import DataError

RewardFn = Callable[[str, str, Any], float]


class Task(Protocol):
    def __len__(self) -> int: ...

    def example(self, index: int) -> TaskExample: ...

    def reward(self, prompt: str, completion: str, reference: Any) -> float: ...


def exact_number_reward(prompt: str, completion: str, reference: Any) -> float:
    """1.0 when the completion's final number equals the reference number, else 0.0."""
    answer = extract_final_number(completion)
    return float(answer is not None and abs(answer - float(reference)) < 1e-6)


class ExamplesTask:
    """A task over `TaskExample`s from any data source (JSONL, parquet, hub or Hub-layout datasets: the
    question and answer columns and the extraction rule of `tierlm.data.rows.row_to_task`); the reward
    is exact match of the completion's final number."""

    def __init__(self, examples: Examples):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def example(self, index: int) -> TaskExample:
        return self.examples[index]

    def reward(self, prompt: str, completion: str, reference: Any) -> float:
        return exact_number_reward(prompt, completion, reference)


class Environment(Protocol):
    """Multi-turn episodes: `reset` gives the opening messages; `step` takes the assistant's reply
    and returns (next user message or None when the episode ends, reward for this turn). The
    episode's reward is the sum of its turns'. One episode at a time per instance."""

    def __len__(self) -> int: ...

    def reset(self, index: int) -> list[dict]: ...

    def step(self, reply: str) -> tuple[dict | None, float]: ...


def is_environment(task) -> bool:
    return hasattr(task, "reset") and hasattr(task, "step")


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


class ArithmeticChain:
    """A two-turn environment: "What is a + b?", then "Now subtract c. What do you get?".

    The episode's reward is the mean correctness of the two replies (the second must carry on
    from the true first result).
    """

    def __init__(self, split: str, count: int, seed: int):
        self.task, self.split, self.count, self.seed = ArithmeticTask(), split, count, seed
        self.turn, self.expected = 0, []

    def __len__(self) -> int:
        return self.count

    def reset(self, index: int) -> list[dict]:
        first = self.task.problem(self.split, index, self.seed)
        c = random.Random(f"{self.seed}/chain/{self.split}/{index}").randint(0, 9)
        self.turn, self.expected, self.next_question = 0, [first.result, first.result - c], f"Now subtract {c}. What do you get?"
        return [{"role": "user", "content": first.question}]

    def step(self, reply: str) -> tuple[dict | None, float]:
        correct = exact_number_reward("", reply, self.expected[self.turn]) / len(self.expected)
        self.turn += 1
        if self.turn == len(self.expected):
            return None, correct
        return {"role": "user", "content": self.next_question}, correct


def open_task(spec: str, split: str, count: int, seed: int) -> Task | Environment:
    """`synthetic:arithmetic`, `synthetic:arithmetic_chain` (two turns), or any data source of question /
    answer rows with the default columns (a recipe opens a config's with its columns: `tierlm.rl.recipe.open_tasks`)."""
    if spec == "synthetic:arithmetic_chain":
        return ArithmeticChain(split, count, seed)
    if spec.startswith("synthetic:") and spec != "synthetic:arithmetic":  # that one is the data pipeline's (kind "task")
        raise DataError(f"unknown synthetic task {spec!r}; the RL tasks are synthetic:arithmetic, synthetic:arithmetic_chain "
                        "or question/answer data")
    return ExamplesTask(open_examples(spec, SourceOptions(split=split, kind="task", synthetic_count=count, seed=seed)))

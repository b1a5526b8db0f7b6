"""Tasks, rewards and environments for reinforcement learning.

A reward function scores one completion: `reward(prompt, completion, reference) -> float`.
A task is a random-access set of (prompt messages, reference) with its reward function.
An environment is the multi-turn form: it answers each assistant turn with an observation (a
new user turn) or ends the episode with a reward; `SingleTurn` wraps a task as one.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from tierlm.data.sources import read_jsonl
from tierlm.data.synthetic import ArithmeticTask
from tierlm.errors import DataError

RewardFn = Callable[[str, str, Any], float]


@dataclass(frozen=True)
class TaskExample:
    messages: list[dict]
    """The conversation so far (ends with a user turn); the model writes the assistant turn."""
    reference: Any
    """What the reward compares against (e.g. the exact answer)."""

    @property
    def prompt(self) -> str:
        return self.messages[-1]["content"]


class Task(Protocol):
    def __len__(self) -> int: ...

    def example(self, index: int) -> TaskExample: ...

    def reward(self, prompt: str, completion: str, reference: Any) -> float: ...


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_final_number(text: str) -> float | None:
    """The answer a completion commits to: the number after '####' if present (GSM8K style), else the last number.

    >>> extract_final_number("She has 3 + 4 = 7 apples. #### 7"), extract_final_number("so 1,250 in total")
    (7.0, 1250.0)
    >>> extract_final_number("no idea") is None
    True
    """
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    numbers = _NUMBER.findall(tail)
    if not numbers:
        return None
    try:
        return float(numbers[-1].replace(",", ""))
    except ValueError:
        return None


def exact_number_reward(prompt: str, completion: str, reference: Any) -> float:
    """1.0 when the completion's final number equals the reference number, else 0.0."""
    answer = extract_final_number(completion)
    return float(answer is not None and abs(answer - float(reference)) < 1e-6)


class ArithmeticRLTask:
    """The synthetic arithmetic problems (the SFT split) as prompts with exact-match reward."""

    def __init__(self, split: str, count: int, seed: int, task: ArithmeticTask | None = None):
        self.split, self.count, self.seed, self.task = split, count, seed, task or ArithmeticTask()

    def __len__(self) -> int:
        return self.count

    def example(self, index: int) -> TaskExample:
        problem = self.task.problem(self.split, index, self.seed)
        return TaskExample([{"role": "user", "content": problem.question}], problem.result)

    def reward(self, prompt: str, completion: str, reference: Any) -> float:
        return exact_number_reward(prompt, completion, reference)


class MathJSONLTask:
    """GSM8K-style JSONL: `{"question": ..., "answer": "...reasoning... #### 72"}` per line.

    The reference is the answer's final number; the reward is exact match on the completion's.
    """

    def __init__(self, path: str | Path, question_field: str = "question", answer_field: str = "answer"):
        self.path, self.examples = Path(path), []
        if not self.path.is_file():
            raise DataError(f"{self.path} does not exist")
        for line_no, row in read_jsonl(self.path):
            if not isinstance(row.get(question_field), str) or answer_field not in row:
                raise DataError(f"{self.path}:{line_no}: expected a '{question_field}' string and an '{answer_field}'; fields present: {sorted(row)}")
            reference = extract_final_number(str(row[answer_field]))
            if reference is None:
                raise DataError(f"{self.path}:{line_no}: the answer has no final number")
            self.examples.append(TaskExample([{"role": "user", "content": row[question_field]}], reference))
        if not self.examples:
            raise DataError(f"{self.path} holds no examples")

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
    """`synthetic:arithmetic`, `synthetic:arithmetic_chain` (two turns) or a GSM8K-style JSONL file."""
    if spec == "synthetic:arithmetic":
        return ArithmeticRLTask(split, count, seed)
    if spec == "synthetic:arithmetic_chain":
        return ArithmeticChain(split, count, seed)
    if spec.startswith("synthetic:"):
        raise DataError(f"unknown synthetic task {spec!r}; the RL tasks are synthetic:arithmetic, synthetic:arithmetic_chain "
                        "or a question/answer JSONL file")
    return MathJSONLTask(spec)


class TaskSubset:
    """Examples [start, stop) of a task, with its reward."""

    def __init__(self, task: Task, start: int, stop: int):
        assert 0 <= start < stop <= len(task), f"bad range [{start}, {stop}) of {len(task)}"
        self.task, self.start, self.stop = task, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def example(self, index: int) -> TaskExample:
        assert 0 <= index < len(self), f"index {index} out of range {len(self)}"
        return self.task.example(self.start + index)

    def reward(self, prompt: str, completion: str, reference: Any) -> float:
        return self.task.reward(prompt, completion, reference)


def split_task(task: Task, val_fraction: float) -> tuple[Task, Task]:
    """(train, held-out tail) of a file-based task."""
    n_val = max(1, int(len(task) * val_fraction))
    if n_val >= len(task):
        raise DataError(f"{len(task)} examples are too few to hold out {n_val} for evaluation; set data.eval_dataset_name")
    return TaskSubset(task, 0, len(task) - n_val), TaskSubset(task, len(task) - n_val, len(task))

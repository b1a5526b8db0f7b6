"""Synthetic arithmetic generated on the machine, so the main job needs no download.

`ArithmeticTask` makes addition/subtraction problems with exact answers, as text (pretraining), chats
(SFT, half of them through the calculator), preference pairs (DPO) and rewarded prompts (RL). The
validation split is a fixed tenth of all possible problems, chosen by a stable hash, so validation
problems never appear in training: val loss and pass@k measure generalisation, not recall.
`ArithmeticChain` is the two-turn environment built on the same problems.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tierlm.special_tokens import TOOL_CALL_END, TOOL_CALL_START, TOOL_RESULT_END, TOOL_RESULT_START
from tierlm.tasks.answers import exact_number_reward
from tierlm.tasks.base import WorkedProblem


@dataclass(frozen=True)
class Problem(WorkedProblem):
    a: int
    op: str
    b: int

    @property
    def result(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"

    @property
    def answer(self) -> str:
        return f"{self.a} {self.op} {self.b} = {self.result}"

    @property
    def tool_conversation(self) -> list[dict]:
        """The chat where the assistant asks the calculator first, then answers (nanochat's tool
        format: the call is trained, the result between <|tool_start|> and <|tool_end|> is not)."""
        expression = f"{self.a} {self.op} {self.b}"
        call, result = (
            f"{TOOL_CALL_START}{expression}{TOOL_CALL_END}",
            f"{TOOL_RESULT_START}{self.result}{TOOL_RESULT_END}",
        )
        content = f"{call}{result}{self.answer}"
        return [{"role": "user", "content": self.question}, {"role": "assistant", "content": content}]


@dataclass(frozen=True)
class ArithmeticTask:
    """Problems `a op b` with 0 <= a, b <= max_operand and op in `ops`.

    >>> task = ArithmeticTask(max_operand=9)
    >>> [p.text for p in task.problems("train", 2, seed=0)]
    ['What is 4 - 7? 4 - 7 = -3', 'What is 2 + 7? 2 + 7 = 9']
    """

    max_operand: int = 99
    ops: str = "+-"
    val_modulus: int = 10
    tool_fraction: float = 0.5
    """Share of chat examples that use the calculator tool (the rest answer directly)."""

    def is_validation(self, problem: Problem) -> bool:
        # A stable hash (Python's hash() of str is salted per process).
        key = (problem.a * 7919 + problem.b * 104729 + ord(problem.op) * 1299709) % 2147483647
        return key % self.val_modulus == 0

    def problem(self, split: str, index: int, seed: int) -> Problem:
        """Problem `index` of `split` ("train" | "val"): a pure function of (seed, split, index)."""
        assert split in ("train", "val"), f"split must be 'train' or 'val', got {split!r}"
        rng = random.Random(f"{seed}/{split}/{index}")  # str seeds hash with SHA-512: stable everywhere
        while True:
            problem = Problem(rng.randint(0, self.max_operand), rng.choice(self.ops), rng.randint(0, self.max_operand))
            if self.is_validation(problem) == (split == "val"):
                return problem

    def conversation(self, split: str, index: int, seed: int) -> list[dict]:
        """Problem `index` as a chat; a stable `tool_fraction` of them call the calculator."""
        problem = self.problem(split, index, seed)
        uses_tool = random.Random(f"{seed}/{split}/{index}/tool").random() < self.tool_fraction
        return problem.tool_conversation if uses_tool else problem.conversation

    def preference(self, split: str, index: int, seed: int) -> tuple[list[dict], list[dict]]:
        """(chosen, rejected) for problem `index`: the answer checked with the calculator preferred over a
        direct one that is off by 1..10. (The calculator's result inside the chosen reply is masked, as
        in SFT: the preference is for calling the tool and answering with its result.)"""
        problem = self.problem(split, index, seed)
        rng = random.Random(f"{seed}/dpo/{split}/{index}")
        wrong = problem.result + rng.choice([-1, 1]) * rng.randint(1, 10)
        rejected = [
            {"role": "user", "content": problem.question},
            {"role": "assistant", "content": f"{problem.a} {problem.op} {problem.b} = {wrong}"},
        ]
        return problem.tool_conversation, rejected

    def problems(self, split: str, count: int, seed: int) -> list[Problem]:
        """The first `count` problems of `split`."""
        return [self.problem(split, i, seed) for i in range(count)]


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
        self.turn, self.expected, self.next_question = (
            0,
            [first.result, first.result - c],
            f"Now subtract {c}. What do you get?",
        )
        return [{"role": "user", "content": first.question}]

    def step(self, reply: str) -> tuple[dict | None, float]:
        correct = exact_number_reward("", reply, self.expected[self.turn]) / len(self.expected)
        self.turn += 1
        if self.turn == len(self.expected):
            return None, correct
        return {"role": "user", "content": self.next_question}, correct


@dataclass(frozen=True)
class SumProblem(WorkedProblem):
    terms: tuple[int, ...]

    @property
    def result(self) -> int:
        return sum(self.terms)

    @property
    def expression(self) -> str:
        return " + ".join(map(str, self.terms))

    @property
    def question(self) -> str:
        return f"What is {self.expression}?"

    @property
    def answer(self) -> str:
        return f"{self.expression} = {self.result}"

    @property
    def tool_conversation(self) -> list[dict]:
        """The chat where the assistant adds the terms one calculator call at a time (a running sum), then answers:
        its length grows with the number of terms."""
        steps, total = [], self.terms[0]
        for term in self.terms[1:]:
            steps.append(
                f"{TOOL_CALL_START}{total} + {term}{TOOL_CALL_END}{TOOL_RESULT_START}{total + term}{TOOL_RESULT_END}"
            )
            total += term
        content = "".join(steps) + self.answer
        return [{"role": "user", "content": self.question}, {"role": "assistant", "content": content}]


@dataclass(frozen=True)
class SumChainTask:
    """Sums of 2 to `max_terms` numbers whose count has a heavy tail (P(k) proportional to k^-2: 60% of the problems
    have 2 or 3 terms, 8% 10 or more), answered through one calculator call per addition, so the
    answers' lengths have the heavy tail partial rollouts are for (`bench/rl.py`).

    >>> task = SumChainTask()
    >>> [p.question for p in task.problems("train", 2, seed=0)]
    ['What is 61 + 7?', 'What is 94 + 40 + 16 + 48?']
    >>> counts = [len(task.problem("train", i, seed=0).terms) for i in range(2000)]
    >>> round(sum(k <= 3 for k in counts) / 2000, 2), round(sum(k >= 10 for k in counts) / 2000, 2), max(counts)
    (0.6, 0.08, 16)
    """

    max_operand: int = 99
    max_terms: int = 16
    val_modulus: int = 10

    def problem(self, split: str, index: int, seed: int) -> SumProblem:
        """Problem `index` of `split` ("train" | "val"), a pure function of (seed, split, index); the validation split
        is a stable tenth of the problems (by a hash of the terms)."""
        assert split in ("train", "val"), f"split must be 'train' or 'val', got {split!r}"
        rng = random.Random(f"{seed}/sums/{split}/{index}")
        sizes = range(2, self.max_terms + 1)
        while True:
            k = rng.choices(sizes, weights=[1 / s**2 for s in sizes])[0]
            terms = tuple(rng.randint(0, self.max_operand) for _ in range(k))
            key = sum((t + 1) * 7919**i for i, t in enumerate(terms)) % 2147483647
            if (key % self.val_modulus == 0) == (split == "val"):
                return SumProblem(terms)

    def conversation(self, split: str, index: int, seed: int) -> list[dict]:
        return self.problem(split, index, seed).tool_conversation

    def preference(self, split: str, index: int, seed: int) -> tuple[list[dict], list[dict]]:
        """(chosen, rejected): the sum through the calculator over a direct answer off by 1..10."""
        problem = self.problem(split, index, seed)
        rng = random.Random(f"{seed}/sums/dpo/{split}/{index}")
        wrong = problem.result + rng.choice([-1, 1]) * rng.randint(1, 10)
        rejected = [problem.conversation[0], {"role": "assistant", "content": f"{problem.expression} = {wrong}"}]
        return problem.tool_conversation, rejected

    def problems(self, split: str, count: int, seed: int) -> list[SumProblem]:
        return [self.problem(split, i, seed) for i in range(count)]

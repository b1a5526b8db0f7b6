"""Tasks: what a model is asked and how its answer is scored — for RL, pass@k evaluation, and the
synthetic data every stage can train on.

- `base`: `TaskExample`, the `Task` and `Environment` protocols, `ExamplesTask` (a task over examples
  read from any data source), `SingleTurn`;
- `answers`: the one answer extractor and the exact-number reward;
- `arithmetic`: the synthetic arithmetic problems (every kind of example) and its two-turn environment;
- `spelling`: counting letters in words (nanochat's SpellingBee), every kind of example;
- `formats`, `rewards`, `code`, `sandbox`: the layouts of real task data, their rewards, code run in a sandbox.

`SYNTHETIC` is the one registry of tasks generated on the machine, by the name in `synthetic:<name>`.

>>> sorted(SYNTHETIC), synthetic_name("synthetic:arithmetic"), synthetic_name("data.jsonl")
(['arithmetic', 'arithmetic_chain', 'spelling', 'sums'], 'arithmetic', None)
"""

from __future__ import annotations

from tierlm.errors import DataError
from tierlm.tasks.answers import exact_number_reward, extract_answer, extract_final_number
from tierlm.tasks.arithmetic import ArithmeticChain, ArithmeticTask, Problem, SumChainTask
from tierlm.tasks.base import (
    Environment,
    ExamplesTask,
    RewardFn,
    SingleTurn,
    Task,
    TaskExample,
    is_environment,
    reward_values,
)
from tierlm.tasks.spelling import SpellingTask

SYNTHETIC: dict[str, type] = {
    "arithmetic": ArithmeticTask,
    "arithmetic_chain": ArithmeticChain,
    "spelling": SpellingTask,
    "sums": SumChainTask,
}
"""Tasks generated from (seed, split, index): a generator of examples of every kind, or an environment (RL only)."""
PREFIX = "synthetic:"


def synthetic_name(spec: str) -> str | None:
    """The task a data spec names (`synthetic:<name>` -> name), None for any other source."""
    return spec[len(PREFIX) :] if spec.startswith(PREFIX) else None


def synthetic_task(spec: str) -> type:
    """The registered class of a `synthetic:<name>` spec; an unknown name is refused in one line."""
    name = synthetic_name(spec)
    assert name is not None, f"{spec!r} does not name a synthetic task"
    if name not in SYNTHETIC:
        raise DataError(f"unknown synthetic task {name!r}; available: {', '.join(PREFIX + n for n in SYNTHETIC)}")
    return SYNTHETIC[name]


def synthetic_generator(spec: str) -> ArithmeticTask | SpellingTask:
    """The generator behind `synthetic:<name>` data (text, chats, pairs, prompts); an environment is refused."""
    task = synthetic_task(spec)
    if issubclass(task, Environment):
        raise DataError(f"{spec} is a multi-turn environment: it trains with `tierlm rl`, not as data of this stage")
    return task()


__all__ = [
    "ArithmeticChain",
    "ArithmeticTask",
    "Environment",
    "ExamplesTask",
    "PREFIX",
    "Problem",
    "RewardFn",
    "SYNTHETIC",
    "SumChainTask",
    "SingleTurn",
    "Task",
    "TaskExample",
    "exact_number_reward",
    "extract_answer",
    "extract_final_number",
    "is_environment",
    "reward_values",
    "synthetic_generator",
    "synthetic_name",
    "synthetic_task",
]

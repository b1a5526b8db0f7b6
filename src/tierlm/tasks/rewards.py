"""The rewards of the task formats (`tierlm.tasks.formats`), by name: `number`, `math` (math-verify), `choice` and
`code` (the tests run in the sandbox). `rl.reward: module:function` adds the user's own
(`tierlm.builders.tasks.user_reward`)."""

from __future__ import annotations

import threading
from typing import Any

from tierlm.errors import ConfigError
from tierlm.tasks.answers import exact_number_reward
from tierlm.tasks.code import extract_code, run_many_with_tests, run_with_tests
from tierlm.tasks.formats import choice_reward
from tierlm.tasks.sandbox import Limits, Sandbox


def math_reward(prompt: str, completion: str, reference: Any) -> float:
    r"""1.0 when the completion's answer (its last \boxed{}, else its last expression) equals the reference by
    math-verify, equivalent forms included.

    >>> math_reward("", r"so the answer is \boxed{\frac{1}{2}}", "0.5"), math_reward("", r"\boxed{3}", "4")
    (1.0, 0.0)
    """
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ConfigError("the math reward checks answers with math-verify: pip install 'tierlm[math]'") from None
    main = threading.current_thread() is threading.main_thread()  # its timeouts use signals: the main thread only
    timeout = 5 if main else None
    gold = parse(f"${reference}$", parsing_timeout=timeout)
    answer = parse(completion, parsing_timeout=timeout)
    return float(bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=timeout))


class CodeReward:
    """1.0 when the completion's code passes the reference's tests in the sandbox; a batch runs in its pool."""

    def __init__(self, limits: Limits = Limits(), workers: int = 4):
        self.limits, self.workers, self._sandbox = limits, workers, None

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:  # started on first use: a task that is never scored starts no pool
            self._sandbox = Sandbox(self.limits, self.workers)
        return self._sandbox

    def _program(self, completion: str, reference: dict) -> tuple[str, str]:
        return reference["setup"] + "\n" + extract_code(completion), reference["tests"]

    def __call__(self, prompt: str, completion: str, reference: dict) -> float:
        return float(run_with_tests(self.sandbox, *self._program(completion, reference))[0])

    def many(self, items: list[tuple[str, str, dict]]) -> list[float]:
        programs = [self._program(completion, reference) for _, completion, reference in items]
        return [float(passed) for passed in run_many_with_tests(self.sandbox, programs)]


REWARDS = {"number": exact_number_reward, "math": math_reward, "choice": choice_reward}


def format_reward(name: str, workers: int = 4):
    """The reward of a task format."""
    if name == "code":
        return CodeReward(workers=workers)
    assert name in REWARDS, f"unknown reward {name!r}"
    return REWARDS[name]

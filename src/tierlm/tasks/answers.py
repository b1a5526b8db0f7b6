"""The one answer extractor: the number a text commits to, for rewards (what a completion answered) and
for data (the reference an answer column holds).

>>> exact_number_reward("", "so 3 + 4 = 7", 7), exact_number_reward("", "#### 8", 7)
(1.0, 0.0)
"""

from __future__ import annotations

import re
from typing import Any

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


def extract_answer(text: str, pattern: str | None = None) -> float | None:
    r"""The reference number of an answer column: `pattern`'s first group (or whole match), read as a
    number; without a pattern, `extract_final_number`'s rule.

    >>> extract_answer("Final: 42 (checked 3 times)", r"Final: (\S+)"), extract_answer("3 + 4 = 7\n#### 7")
    (42.0, 7.0)
    """
    if pattern is None:
        return extract_final_number(text)
    found = re.search(pattern, text)
    if found is None:
        return None
    return extract_final_number(found.group(1) if found.groups() else found.group(0))


def exact_number_reward(prompt: str, completion: str, reference: Any) -> float:
    """1.0 when the completion's final number equals the reference number, else 0.0."""
    answer = extract_final_number(completion)
    return float(answer is not None and abs(answer - float(reference)) < 1e-6)

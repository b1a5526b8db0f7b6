"""The task layouts people train and evaluate on, read from a row as the Hub serves them, each with its reward:

- number — GSM8K: `question`, `answer` ending `#### N`; the reference is the number, the reward exact match;
- math — MATH: `problem`, `solution` with `\\boxed{...}` (or an `answer` column); the reference is the answer's
  LaTeX, checked by `math-verify` (equivalent forms count);
- choice — ARC: `question`, `choices` {`text`, `label`}, `answerKey`; MMLU: `question`, `choices` [...], `answer`
  (an index); the reference is the option's letter, the reward the reply's final letter;
- code — HumanEval: `prompt`, `test`, `entry_point`; MBPP: `text`, `test_list`, `test_setup_code`; the reference
  is the tests, the reward whether they pass in the sandbox (`tierlm.tasks.code`).

`detect_format` picks the format from a row's columns (`data.task_format: auto`). `task_conversation` turns a
row of any of these layouts into an SFT conversation (the reply: GSM8K's worked answer with its `<<a*b=c>>`
calculator annotations as tool calls, as nanochat trains it; the option's letter; the boxed solution; the code).
"""

from __future__ import annotations

import re
import string
from typing import Any

from tierlm.errors import DataError
from tierlm.special_tokens import TOOL_CALL_END, TOOL_CALL_START, TOOL_RESULT_END, TOOL_RESULT_START
from tierlm.tasks.base import TaskExample

FORMATS = ("number", "math", "choice", "code")


def detect_format(row: dict) -> str:
    """The layout a row has, by its columns.

    >>> detect_format({"question": "q", "choices": ["a", "b"], "answer": 1}), detect_format({"question": "q"})
    ('choice', 'number')
    >>> detect_format({"prompt": "def f():", "test": "...", "entry_point": "f"}), detect_format({"test_list": []})
    ('code', 'code')
    >>> detect_format({"problem": "p", "solution": "s"})
    'math'
    """
    if "choices" in row:
        return "choice"
    if ("test" in row and "entry_point" in row) or "test_list" in row:
        return "code"
    if "problem" in row and ("solution" in row or "answer" in row):
        return "math"
    return "number"


# -- math ----------------------------------------------------------------------------------------------------------
def last_boxed(text: str) -> str | None:
    r"""The content of the last \boxed{...} (or \fbox{...}) in `text`, braces balanced.

    >>> last_boxed(r"so \boxed{\frac{1}{2}} and finally \boxed{3}"), last_boxed("none") is None
    ('3', True)
    """
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, out = 1, []
    while i < len(text):
        ch = text[i]
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return "".join(out)
        out.append(ch)
        i += 1
    return None


def math_example(row: dict, where: str) -> TaskExample:
    problem = _text(row, "problem", where)
    answer = row.get("answer")
    if answer is None:
        answer = last_boxed(_text(row, "solution", where))
        if answer is None:
            raise DataError(f"{where}: the solution has no \\boxed{{...}} answer and the row no 'answer' column")
    prompt = f"{problem}\nPut the final answer in \\boxed{{}}."
    return TaskExample([{"role": "user", "content": prompt}], str(answer), "math")


# -- multiple choice -------------------------------------------------------------------------------------------------
def choice_prompt(question: str, options: list[str], labels: list[str]) -> str:
    """The question with its lettered options and the instruction to answer with a letter.

    >>> print(choice_prompt("2 + 2?", ["3", "4"], ["A", "B"]))
    2 + 2?
    A. 3
    B. 4
    Answer with the letter of the correct option.
    """
    lines = [question, *(f"{label}. {text}" for label, text in zip(labels, options))]
    return "\n".join(lines + ["Answer with the letter of the correct option."])


_OPTION = re.compile(r"^[A-Z]\. ", re.MULTILINE)


def chance_level(example: TaskExample) -> float:
    """The accuracy of guessing: 1 / the options `choice_prompt` listed for a multiple-choice example, 0 for an open
    answer.

    >>> chance_level(TaskExample([{"role": "user", "content": choice_prompt("?", ["a", "b", "c", "d"], list("ABCD"))}],
    ...     "B", "choice"))
    0.25
    """
    if example.format != "choice":
        return 0.0
    return 1.0 / max(len(_OPTION.findall(example.prompt)), 1)


def choice_example(row: dict, where: str) -> TaskExample:
    """ARC (`choices` {text, label}, `answerKey` a letter or a digit) or MMLU (`choices` a list, `answer` an index)."""
    question, choices = _text(row, "question", where), row["choices"]
    if isinstance(choices, dict):  # ARC
        options, labels = list(choices.get("text") or []), [str(x) for x in choices.get("label") or []]
        key = str(row.get("answerKey", ""))
        if key not in labels:
            raise DataError(f"{where}: answerKey {key!r} is not one of the labels {labels}")
        index = labels.index(key)
    elif isinstance(choices, list):  # MMLU
        options = [str(x) for x in choices]
        index = row.get("answer")
        if not isinstance(index, int) or not 0 <= index < len(options):
            raise DataError(f"{where}: answer must index choices (0..{len(options) - 1}), got {index!r}")
    else:
        raise DataError(
            f"{where}: choices must be a list (MMLU) or {{text, label}} (ARC), got {type(choices).__name__}"
        )
    if not 2 <= len(options) <= 26:
        raise DataError(f"{where}: {len(options)} choices; multiple choice needs 2 to 26")
    letters = list(string.ascii_uppercase[: len(options)])  # ARC's digit labels become letters too
    content = choice_prompt(question, options, letters)
    return TaskExample([{"role": "user", "content": content}], letters[index], "choice")


_LETTER = re.compile(r"\b([A-Z])\b")


def extract_choice(completion: str, letters: str = string.ascii_uppercase) -> str | None:
    """The option a reply commits to: the letter after "answer is", else its last standalone capital letter.

    >>> extract_choice("The answer is (B), not A."), extract_choice("I think C"), extract_choice("no idea")
    ('B', 'C', None)
    """
    said = re.search(r"answer is:?\s*\(?([A-Z])\b", completion)
    if said and said.group(1) in letters:
        return said.group(1)
    found = [x for x in _LETTER.findall(completion) if x in letters]
    return found[-1] if found else None


def choice_reward(prompt: str, completion: str, reference: Any) -> float:
    return float(extract_choice(completion) == reference)


# -- code ------------------------------------------------------------------------------------------------------------
def code_example(row: dict, where: str) -> TaskExample:
    """HumanEval (a function's `prompt`, its `test` defining check(), `entry_point`) or MBPP (`text`, `test_list`);
    the reference is the test script run after the reply's code."""
    if "entry_point" in row:
        signature, entry = _text(row, "prompt", where), _text(row, "entry_point", where)
        content = f"Complete this Python function; reply with the whole function in a ```python block.\n\n{signature}"
        tests = f"{row['test']}\n\ncheck({entry})\n"
        return TaskExample([{"role": "user", "content": content}], {"setup": signature, "tests": tests}, "code")
    tests = row["test_list"]
    if not isinstance(tests, list) or not tests:
        raise DataError(f"{where}: test_list must be a non-empty list of assert lines")
    text = _text(row, "text", where) if "text" in row else _text(row, "prompt", where)
    content = f"{text}\nYour code should pass this test:\n{tests[0]}\nReply with the code in a ```python block."
    setup = str(row.get("test_setup_code") or "")
    script = "\n".join([setup, *map(str, tests)]) + "\n"
    return TaskExample([{"role": "user", "content": content}], {"setup": "", "tests": script}, "code")


# -- SFT conversations ----------------------------------------------------------------------------------------------
_ANNOTATION = re.compile(r"<<([^<>=]+)=([^<>]*)>>")


def gsm8k_reply(answer: str) -> str:
    r"""GSM8K's worked answer with each `<<expression=result>>` annotation as a calculator call and its (masked)
    result, the way nanochat trains tool use on it; the text the annotation stood before is kept.

    >>> gsm8k_reply("She pays 3*4 = <<3*4=12>>12 dollars.\n#### 12")
    'She pays 3*4 = <|tool_call_start|>3*4<|tool_call_end|><|tool_start|>12<|tool_end|>12 dollars.\n#### 12'
    """
    return _ANNOTATION.sub(
        lambda m: (
            f"{TOOL_CALL_START}{m.group(1).strip()}{TOOL_CALL_END}{TOOL_RESULT_START}{m.group(2).strip()}"
            f"{TOOL_RESULT_END}"
        ),
        answer,
    )


def task_conversation(row: dict, where: str, task_format: str = "auto") -> list[dict] | None:
    """A task-layout row as an SFT conversation (its prompt as the user turn, its reference solution as the reply),
    or None when the row has no task layout."""
    task_format = detect_format(row) if task_format == "auto" else task_format
    if task_format == "number":
        if "question" not in row or "answer" not in row:
            return None
        reply = gsm8k_reply(str(row["answer"]))
    else:
        example = READERS[task_format](row, where)
        if task_format == "choice":
            reply = f"The answer is {example.reference}."
        elif task_format == "math":
            reply = str(row["solution"]) if "solution" in row else f"\\boxed{{{example.reference}}}"
        else:
            code = row.get("canonical_solution")
            code = f"{row['prompt']}{code}" if code is not None else str(row.get("code", ""))
            reply = f"```python\n{code.rstrip()}\n```"
        return [*example.messages, {"role": "assistant", "content": reply}]
    return [{"role": "user", "content": str(row["question"])}, {"role": "assistant", "content": reply}]


def _text(row: dict, name: str, where: str) -> str:
    if name not in row:
        raise DataError(f"{where}: no {name!r} field; fields present: {sorted(row)}")
    return str(row[name])


READERS = {"math": math_example, "choice": choice_example, "code": code_example}
"""Row -> TaskExample for the formats with their own layout (number rows are read by the question/answer columns)."""

"""One row of a dataset (a JSONL object, a parquet / Arrow row) as the example a stage trains on.

Every stage reads its data through the same sources (`tierlm.data.sources`): what differs is the
kind of example a row becomes, and which columns hold it (`Fields`, from the config's `data.*_column`).

| kind | a row holds | becomes |
|---|---|---|
| text | `text` | a pretraining document |
| chat | `messages` (OpenAI `role`/`content`, or ShareGPT `from`/`value`), or `prompt` + `completion` | a conversation |
| preference | `prompt` + `chosen` + `rejected` strings, or `chosen` / `rejected` chats [1] | a `PreferencePair` |
| unpaired | `prompt` + `completion` (text or messages) + a boolean `label` (TRL's KTO form) | an `UnpairedExample` |
| task | a `question` (or `prompt` / `messages`) and an `answer` whose final number is the reference | a `TaskExample` |

[1] With or without a separate `prompt`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from tierlm.data.tokenizer import check_conversation
from tierlm.errors import DataError
from tierlm.tasks import TaskExample, extract_answer
from tierlm.tasks.formats import READERS, detect_format, task_conversation

KINDS = ("text", "chat", "preference", "unpaired", "task")


@dataclass(frozen=True)
class Fields:
    """Names of the columns to read from JSONL, parquet and HF dataset rows."""

    text: str = "text"
    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"
    chosen: str = "chosen"
    rejected: str = "rejected"
    question: str = "question"
    answer: str = "answer"
    domain: str = "domain"
    tools: str = "tools"
    answer_pattern: str | None = None
    """A regex finding the reference in the answer column (its first group, else the whole match); None:
    the number after GSM8K's '####', else the last number."""
    task_format: str = "auto"
    """How a task row is read (`tierlm.tasks.formats`): number, math, choice, code, or auto (by its columns)."""


@dataclass(frozen=True)
class PreferencePair:
    chosen: list[dict]
    rejected: list[dict]
    ref_chosen_logp: float | None = None
    ref_rejected_logp: float | None = None
    margin: float | None = None  # how much better chosen is (TRL's reward-model `margin` column)


@dataclass(frozen=True)
class UnpairedExample:
    """One reply judged on its own (KTO's data): the whole conversation, and whether its last reply is desirable."""

    conversation: list[dict]
    label: bool


class Conversation(list):
    """A conversation (a list of messages) with the `tools` (function schemas) it may call, which the
    chat template renders (see `tierlm.data.chat_templates`), and `prompt_turns`: how many of its first messages are
    a prompt given to the model, never trained on (a prompt/completion row's prompt, as TRL's completion-only loss)."""

    def __init__(self, messages: list[dict], tools: list[dict] | None = None, prompt_turns: int = 0):
        super().__init__(messages)
        self.tools, self.prompt_turns = tools, prompt_turns


def read_tools(value: Any, where: str) -> list[dict] | None:
    """A row's tools column: a list of function schemas, or that list as a JSON string (as many
    datasets store it); None when empty."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise DataError(f"{where}: the tools column is not JSON ({e})") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"{where}: tools must be a list of function schemas, got {type(value).__name__}")
    return _without_nones(value)


# -- conversations ---------------------------------------------------------------------------
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
"""ShareGPT's `from` values and the roles they become (Axolotl's and LLaMA-Factory's mapping)."""


def as_messages(value: Any, where: str) -> list[dict]:
    """A conversation in OpenAI form (`role`/`content`); ShareGPT turns (`from`/`value`) are converted, and OpenAI's
    text content parts joined and its `developer` role read as `system`, as `tierlm serve` reads a request's.

    >>> as_messages([{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], "row 0")
    [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'hello'}]
    >>> parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    >>> as_messages([{"role": "developer", "content": parts}], "row 0")
    [{'role': 'system', 'content': 'a\\nb'}]
    """
    if isinstance(value, list) and value and all(isinstance(m, dict) and "from" in m and "value" in m for m in value):
        out = []
        for i, turn in enumerate(value):
            role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
            if role is None:
                raise DataError(
                    f"{where}: ShareGPT turn {i} is from {turn['from']!r}; known speakers: {', '.join(SHAREGPT_ROLES)}"
                )
            out.append({"role": role, "content": turn["value"]})
        return out
    if isinstance(value, list):  # keep only what a chat template reads (datasets adds None for absent keys)
        return [_openai_message(_without_nones(m), i, where) if isinstance(m, dict) else m for i, m in enumerate(value)]
    return value


def _openai_message(message: dict, i: int, where: str) -> dict:
    """Text content parts joined by newlines (vLLM's and `tierlm serve`'s reading), `developer` as `system`."""
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        kinds = sorted({str(part.get("type")) for part in content} - {"text"})
        if kinds:
            raise DataError(f"{where}: message {i} has {', '.join(kinds)} content parts; tierlm trains on text parts")
        message = {**message, "content": "\n".join(str(part.get("text", "")) for part in content)}
    if message.get("role") == "developer":
        message = {**message, "role": "system"}
    return message


def _without_nones(value: Any) -> Any:
    """Arrow gives every struct all its fields, None where a row had none (a tool call's arguments too)."""
    if isinstance(value, dict):
        return {k: _without_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nones(v) for v in value]
    return value


def _checked(messages: list[dict], where: str, needs_assistant: bool = True) -> list[dict]:
    try:
        check_conversation(messages, needs_assistant)
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    return messages


def _column(row: dict, name: str, where: str, hint: str) -> Any:
    if name not in row:
        raise DataError(f"{where}: no {name!r} field; fields present: {sorted(row)} ({hint})")
    return row[name]


# -- rows ------------------------------------------------------------------------------------
def row_to_text(row: dict, fields: Fields, where: str) -> str:
    return str(_column(row, fields.text, where, "set data.text_column"))


def _messages_field(row: dict, fields: Fields) -> str | None:
    """The row's conversation column: `fields.messages`, or ShareGPT's `conversations` while the default name is
    in use (Axolotl's and LLaMA-Factory's ShareGPT layouts, and the datasets made for them, name it so)."""
    if fields.messages in row:
        return fields.messages
    return "conversations" if fields.messages == "messages" and "conversations" in row else None


def _prompt_messages(prompt: Any, where: str) -> list[dict]:
    """A prompt column's value as messages: a string is the user's turn."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else as_messages(prompt, where)


def row_to_conversation(row: dict, fields: Fields, where: str) -> list[dict]:
    """A chat row as the conversation to train on: a messages list (OpenAI's or ShareGPT's form), TRL's
    prompt/completion (strings, or conversational: the prompt's messages, then the completion's, only the
    completion trained, as TRL's completion-only loss), or a task's row (GSM8K, MATH, ...) with its solution.

    >>> row = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}
    >>> chat = row_to_conversation(row, Fields(), "row 0")
    >>> [m["content"] for m in chat], chat.prompt_turns
    (['hi', 'yo'], 1)
    """
    prompt_turns = 0
    if (column := _messages_field(row, fields)) is not None:
        messages = as_messages(row[column], where)
    elif fields.prompt in row and fields.completion in row:
        prompt = _checked(_prompt_messages(row[fields.prompt], where), where, needs_assistant=False)
        completion = row[fields.completion]
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        completion = as_messages(completion, where)
        if not (isinstance(completion, list) and completion and isinstance(completion[0], dict)):
            raise DataError(f"{where}: the completion must be a string or a list of messages, got {completion!r:.60}")
        if completion[0].get("role") != "assistant":
            raise DataError(f"{where}: the completion must open with an assistant turn, got {completion[0]!r:.60}")
        messages, prompt_turns = prompt + completion, len(prompt)
    elif (solved := task_conversation(row, where, fields.task_format)) is not None:  # GSM8K, ARC, MMLU, MATH, code
        messages = solved
    elif fields.text in row:  # TRL's SFTTrainer trains such rows as language modelling: tierlm's pretrain stage
        raise DataError(
            f"{where}: holds plain text ({fields.text!r}), not a conversation; train on text with `tierlm pretrain` "
            "(model.model_name_or_path continues from a model), or give SFT a 'messages' list or prompt/completion"
        )
    else:
        raise DataError(
            f"{where}: needs a {fields.messages!r} list or {fields.prompt!r}/{fields.completion!r} fields; "
            f"fields present: {sorted(row)} (set data.messages_column, or data.prompt_column / data.completion_column, "
            "or give rows in a task layout: GSM8K, MATH, ARC, MMLU, HumanEval, MBPP)"
        )
    tools = read_tools(row.get(fields.tools), where)
    return _checked(Conversation(messages, tools, prompt_turns) if tools or prompt_turns else messages, where)


def _reply(value: Any, prompt: list[dict] | None, where: str) -> list[dict]:
    """A chosen or rejected side as a whole conversation: a string answers the prompt; a list is the
    whole conversation when it opens with a non-assistant turn, else the reply after the prompt."""
    if isinstance(value, str):
        if prompt is None:
            raise DataError(f"{where}: chosen/rejected are strings, so the row needs a prompt column")
        return prompt + [{"role": "assistant", "content": value}]
    messages = as_messages(value, where)
    if (
        isinstance(messages, list)
        and messages
        and isinstance(messages[0], dict)
        and messages[0].get("role") != "assistant"
    ):
        return messages
    if prompt is None:
        raise DataError(f"{where}: chosen/rejected hold only the reply, so the row needs a prompt column")
    return prompt + messages


def row_to_preference(row: dict, fields: Fields, where: str) -> PreferencePair:
    """TRL's preference forms: standard (`prompt`, `chosen`, `rejected` strings), conversational with an
    implicit prompt (`chosen` / `rejected` whole conversations, e.g. trl-lib/ultrafeedback_binarized),
    or with an explicit one (`prompt` messages, `chosen` / `rejected` replies)."""
    chosen = _column(row, fields.chosen, where, "set data.chosen_column")
    rejected = _column(row, fields.rejected, where, "set data.rejected_column")
    prompt = row.get(fields.prompt)
    if prompt is not None:
        prompt = _checked(_prompt_messages(prompt, where), where, needs_assistant=False)
    sides = []
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        conversation = _checked(_reply(value, prompt, where), where)
        if conversation[-1]["role"] != "assistant":
            raise DataError(f"{where}: the {name} conversation must end with an assistant turn")
        sides.append(conversation)
    margin = row.get("margin")
    if margin is not None and not isinstance(margin, (int, float)):
        raise DataError(f"{where}: margin must be a number, got {margin!r}")
    return PreferencePair(sides[0], sides[1], row.get("ref_chosen_logp"), row.get("ref_rejected_logp"), margin)


def row_to_unpaired(row: dict, fields: Fields, where: str) -> UnpairedExample:
    """TRL's unpaired preference form: a `prompt` (string or messages), a `completion` (string, or the reply's
    messages) and a boolean `label` (True: desirable)."""
    prompt = _column(row, fields.prompt, where, "set data.prompt_column")
    completion = _column(row, fields.completion, where, "set data.completion_column")
    if "label" not in row:
        raise DataError(
            f"{where}: no 'label' field (fields present: {sorted(row)}); KTO's unpaired rows say whether each "
            "completion is desirable (true) or not (false)"
        )
    if not isinstance(row["label"], bool):
        raise DataError(f"{where}: label must be true or false, got {row['label']!r}")
    prompt = _prompt_messages(prompt, where)
    conversation = _checked(_reply(completion, _checked(prompt, where, needs_assistant=False), where), where)
    if conversation[-1]["role"] != "assistant":
        raise DataError(f"{where}: the completion must end with an assistant turn")
    return UnpairedExample(conversation, row["label"])


def row_to_task(row: dict, fields: Fields, where: str) -> TaskExample:
    """An RL prompt (the question column, else the prompt column as text or messages) and the reference
    its answer column gives through the extraction rule (`Fields.answer_pattern`); a row in the layout of
    another task format (`Fields.task_format`, detected from its columns by default: MATH, ARC / MMLU,
    HumanEval / MBPP) is read by that format (`tierlm.tasks.formats`). The domain column, where the row has one,
    names the prompt's domain (multi-teacher distillation routes by it).

    >>> row_to_task({"question": "2 + 2?", "answer": "4", "domain": "math"}, Fields(), "row 1").domain
    'math'
    """
    example = _task_example(row, fields, where)
    domain = row.get(fields.domain)
    if domain is None:
        return example
    if not isinstance(domain, (str, int)) or isinstance(domain, bool):
        raise DataError(
            f"{where}: the {fields.domain!r} field names the prompt's domain, a string; got {domain!r} "
            "(set data.domain_column to another field)"
        )
    return replace(example, domain=str(domain))


def _task_example(row: dict, fields: Fields, where: str) -> TaskExample:
    task_format = fields.task_format
    if task_format == "auto":
        task_format = detect_format(row)
        if task_format == "math" and (fields.answer_pattern is not None or fields.question in row):
            task_format = "number"  # its question column and extraction rule were named: read them
    if task_format != "number":
        return READERS[task_format](row, where)
    for name in (fields.question, fields.prompt, _messages_field(row, fields)):
        if name in row:
            messages = _prompt_messages(row[name], where)
            break
    else:
        raise DataError(
            f"{where}: no {fields.question!r} or {fields.prompt!r} field; fields present: {sorted(row)} "
            "(set data.question_column)"
        )
    messages = _checked(messages, where, needs_assistant=False)
    if messages[-1]["role"] != "user":
        raise DataError(f"{where}: the prompt must end with a user turn")
    answer = _column(row, fields.answer, where, "set data.answer_column")
    reference = extract_answer(str(answer), fields.answer_pattern)
    if reference is None:
        rule = (
            f"data.answer_pattern {fields.answer_pattern!r}"
            if fields.answer_pattern
            else "a final number (or '#### N')"
        )
        raise DataError(
            f"{where}: the answer {str(answer)[:60]!r} has no reference by the extraction rule ({rule}); "
            "fix the row or set data.answer_pattern"
        )
    return TaskExample(messages, reference)


def example_texts(example: Any) -> list[str]:
    """The texts inside an example of any kind (what a tokenizer is trained on).

    >>> example_texts(TaskExample([{"role": "user", "content": "2 + 2?"}], 4.0)), example_texts("a document")
    (['2 + 2?'], ['a document'])
    """
    if isinstance(example, str):
        return [example]
    if isinstance(example, PreferencePair):
        return [m["content"] for m in example.chosen + example.rejected[-1:]]
    if isinstance(example, UnpairedExample):
        return [m["content"] for m in example.conversation]
    if isinstance(example, TaskExample):
        return [m["content"] for m in example.messages]
    return [m["content"] for m in example]


_CONVERT = {
    "text": row_to_text,
    "chat": row_to_conversation,
    "preference": row_to_preference,
    "unpaired": row_to_unpaired,
    "task": row_to_task,
}


def convert_row(row: dict, kind: str, fields: Fields, where: str) -> Any:
    """A JSON or Arrow row as the `kind` of example (see the module docstring)."""
    assert kind in _CONVERT, f"kind must be one of {KINDS}, got {kind!r}"
    return _CONVERT[kind](row, fields, where)

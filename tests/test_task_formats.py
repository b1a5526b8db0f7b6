"""The task formats read from the layouts the Hub serves (local folders in that layout), each scored by its own
reward (math-verify for MATH, the option letter, the tests in the sandbox), and user reward functions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO
from test_hub_data import gsm8k_rows, parquet_folder
from tierlm.builders.tasks import open_tasks, user_reward
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError, DataError
from tierlm.tasks.formats import choice_example, detect_format
from tierlm.tasks.rewards import CodeReward, math_reward

ARC = {
    "id": "Mercury_1",
    "question": "Which gas do plants take in?",
    "choices": {"text": ["oxygen", "carbon dioxide", "helium", "neon"], "label": ["1", "2", "3", "4"]},
    "answerKey": "2",
}
MMLU = {"question": "2 + 2 = ?", "subject": "math", "choices": ["3", "4", "5", "6"], "answer": 1}
MATH = {"problem": "What is 1/2 + 1/4?", "solution": r"Add: $\frac{2}{4} + \frac{1}{4} = \boxed{\frac{3}{4}}$."}
HUMANEVAL = {
    "task_id": "HumanEval/0",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Sum of a and b."""\n',
    "canonical_solution": "    return a + b\n",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}
MBPP = {
    "task_id": 2,
    "text": "Write a function to square a number.",
    "code": "def square(x):\n    return x * x",
    "test_list": ["assert square(3) == 9", "assert square(-2) == 4"],
    "test_setup_code": "",
}


def _config(folder, *extra):
    return TierlmConfig.load("tiny_rl", [f"data.dataset_name={folder}", "data.val_fraction=0.25", *extra])


@pytest.mark.parametrize(
    "row, task_format, reference",
    [(ARC, "choice", "B"), (MMLU, "choice", "B"), (MATH, "math", r"\frac{3}{4}")],
    ids=["arc", "mmlu", "math"],
)
def test_each_layout_reads_from_a_hub_folder_with_its_reward(tmp_path, row, task_format, reference):
    folder = parquet_folder(tmp_path / "data", {"train": [row] * 8})
    train, val = open_tasks(_config(folder))
    example = train.example(0)
    assert detect_format(row) == task_format and example.format == task_format and example.reference == reference
    assert len(train) == 6 and len(val) == 2 and example.messages[-1]["role"] == "user"
    right = {"choice": "The answer is B.", "math": r"So it is $\boxed{0.75}$."}[task_format]
    wrong = {"choice": "I pick A", "math": r"\boxed{\frac{2}{3}}"}[task_format]
    assert train.reward(example.prompt, right, example.reference) == 1.0
    assert train.reward(example.prompt, wrong, example.reference) == 0.0


def test_math_verify_counts_equivalent_forms():
    for answer, reference in [(r"\boxed{\sqrt{8}}", r"2\sqrt{2}"), (r"\boxed{0.5}", r"\frac{1}{2}"), ("x = 3", "3")]:
        assert math_reward("", answer, reference) == 1.0, (answer, reference)
    assert math_reward("", r"\boxed{\sqrt{7}}", r"2\sqrt{2}") == 0.0


def test_gsm8k_keeps_its_number_reward_and_a_bad_layout_is_refused_with_its_row(tmp_path):
    train, _ = open_tasks(_config(parquet_folder(tmp_path / "g", {"train": gsm8k_rows(8, "t")})))
    assert train.example(1).format == "number" and train.example(1).reference == 4.0
    with pytest.raises(DataError, match="answerKey 'E' is not one of the labels"):
        choice_example({**ARC, "answerKey": "E"}, "row 3")
    with pytest.raises(DataError, match="answer must index choices"):
        open_tasks(_config(parquet_folder(tmp_path / "m", {"train": [{**MMLU, "answer": 9}] * 4})))


@pytest.mark.parametrize("row", [HUMANEVAL, MBPP], ids=["humaneval", "mbpp"])
def test_code_rows_are_scored_by_running_their_tests_in_the_sandbox(tmp_path, row):
    folder = parquet_folder(tmp_path / "code", {"train": [row] * 4})
    train, _ = open_tasks(_config(folder, "rl.sandbox_workers=2"))
    example = train.example(0)
    assert example.format == "code" and isinstance(train._reward, CodeReward)
    name = "add" if row is HUMANEVAL else "square"
    body = "return a + b" if row is HUMANEVAL else "return x * x"
    args = "a, b" if row is HUMANEVAL else "x"
    right = f"Here you go:\n```python\ndef {name}({args}):\n    {body}\n```"
    wrong = f"```python\ndef {name}({args}):\n    return 0\n```"
    items = [(example.prompt, reply, example.reference) for reply in (right, wrong, "import sys\nsys.exit(0)")]
    assert train.rewards(items) == [1.0, 0.0, 0.0]
    train._reward.sandbox.close()


def test_user_reward_functions_are_imported_checked_and_refused_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompt, completion, reference):\n    return len(completion) / 10\n"
        "def two_args(prompt, completion):\n    return 1.0\n"
        "def text(prompt, completion, reference):\n    return 'good'\n"
    )
    monkeypatch.chdir(tmp_path)
    assert user_reward("my_rewards:length")("p", "abcde", None) == 0.5
    for spec, message in [
        ("no_such_module:f", "cannot import no_such_module"),
        ("my_rewards:missing", "has no function 'missing'"),
        ("my_rewards:two_args", r"must take \(prompt, completion, reference\)"),
    ]:
        with pytest.raises(ConfigError, match=message):
            user_reward(spec)
    with pytest.raises(DataError, match="returned 'good'"):
        user_reward("my_rewards:text")("p", "c", None)


@pytest.mark.slow
def test_rl_trains_on_a_code_task_scored_in_the_sandbox(tiny_runs, tmp_path):
    """`tierlm rl` on a HumanEval-layout file: each step's completions run with the tests in the sandbox's pool (the
    tiny model writes no working code: rewards 0, the loop unharmed)."""
    from conftest import RL
    from tierlm.commands.cli import main

    data = tmp_path / "he.jsonl"
    data.write_text("".join(json.dumps({**HUMANEVAL, "task_id": f"HumanEval/{i}"}) + "\n" for i in range(6)))
    args = ["rl", "--config", "tiny_rl", f"model.model_name_or_path={tiny_runs / 'sft'}", *RL]
    args += [f"data.dataset_name={data}", "data.val_fraction=0.34", "training.logging_steps=1"]
    assert main([*map(str, args), "data.max_seq_length=256", f"infra.output_dir={tmp_path / 'code'}"]) == 0
    records = map(json.loads, (tmp_path / "code" / "metrics.jsonl").read_text().splitlines())
    train = [r for r in records if r["type"] == "train"]
    assert len(train) == 2 and all(r["reward_mean"] == 0.0 for r in train)


def test_task_layouts_read_as_sft_conversations_with_gsm8k_annotations_as_masked_tool_results(tmp_path, tiny_tokenizer):
    """SFT on a GSM8K folder trains the worked answer with each <<a*b=c>> annotation as a calculator call (trained)
    and its result (masked), as nanochat does; ARC rows train the option's letter."""
    from tierlm.builders.loaders import open_splits
    from tierlm.special_tokens import TOOL_CALL_START, TOOL_RESULT_START

    gsm8k = parquet_folder(tmp_path / "gsm8k", {"train": gsm8k_rows(8, "t")})
    config = TierlmConfig.load("tiny_sft", [f"data.dataset_name={gsm8k}", "data.val_fraction=0.25"])
    trains, _ = open_splits(config, "chat", tiny_tokenizer)
    conversation = trains[0][0].fetch([2])[0]
    assert conversation[0]["content"].startswith("t: Tom has 2 apples")
    reply = conversation[-1]["content"]
    assert f"{TOOL_CALL_START}2+4" in reply and f"{TOOL_RESULT_START}6" in reply and reply.endswith("#### 6")
    ids, mask = tiny_tokenizer.render_conversation(conversation, train_on="last_assistant")
    text = lambda keep: tiny_tokenizer.decode([t for t, m in zip(ids, mask) if m == keep])  # noqa: E731
    assert "2+4" in text(1) and TOOL_RESULT_START not in text(1) and f"{TOOL_RESULT_START}6" in text(0)
    arc = parquet_folder(tmp_path / "arc", {"train": [ARC] * 4})
    config = TierlmConfig.load("tiny_sft", [f"data.dataset_name={arc}", "data.val_fraction=0.25"])
    trains, _ = open_splits(config, "chat", tiny_tokenizer)
    conversation = trains[0][0].fetch([0])[0]
    assert "B. carbon dioxide" in conversation[0]["content"] and conversation[-1]["content"] == "The answer is B."


def test_nanochats_sft_mixture_reads_each_layout_with_its_own_split_and_config(tmp_path, tiny_tokenizer):
    """The nanochat_sft preset's mixture with each hub dataset replaced by a local folder in its layout: SmolTalk's
    messages, MMLU's `all` config and `auxiliary_train` split, GSM8K's `main` config, and synthetic spelling — each
    component read with its own split / config and weighted."""
    from omegaconf import OmegaConf

    from tierlm.builders.loaders import open_splits

    smoltalk = tmp_path / "smoltalk.jsonl"
    smoltalk.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"},
                                                         {"role": "assistant", "content": "hello"}]}) + "\n"
                                for i in range(8)))  # fmt: skip
    mmlu = parquet_folder(tmp_path / "mmlu", {"auxiliary_train": [MMLU] * 6, "test": [MMLU] * 2}, {"all": "all"})
    gsm8k = parquet_folder(
        tmp_path / "gsm8k", {"train": gsm8k_rows(6, "t"), "test": gsm8k_rows(2, "v")}, {"main": "main"}
    )
    preset = OmegaConf.to_container(OmegaConf.load(Path(REPO) / "configs" / "nanochat_sft.yaml"))
    local = [str(smoltalk), str(mmlu), str(gsm8k), "synthetic:spelling"]
    for part, name in zip(preset["data"]["mixture"], local):
        part["dataset_name"] = name
    preset["data"].update(num_synthetic_examples=10, num_synthetic_eval_examples=4, val_fraction=0.25)
    config = TierlmConfig.from_dict(preset)
    trains, vals = open_splits(config, "chat", tiny_tokenizer)
    assert [len(t) for t, _ in trains] == [6, 6, 6, 10] and [w for _, w in trains] == [1.0, 1.0, 2.0, 1.0]
    assert [len(v) for v in vals] == [2, 2, 2, 4]
    mmlu_chat, gsm8k_chat, spelling = (trains[i][0].fetch([0])[0] for i in (1, 2, 3))
    assert mmlu_chat[-1]["content"] == "The answer is B." and "#### " in gsm8k_chat[-1]["content"]
    assert "is spelled" in spelling[-1]["content"] and spelling[0]["content"].startswith(("How many", "Count", "In"))

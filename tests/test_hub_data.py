"""Datasets with named splits and configs, laid out locally as the Hub serves them (never the network):
data.split, data.eval_split, data.dataset_config (issue 17's dataset spec, first part)."""

import json

import pytest

from conftest import TINY, run_main
from tierlm.builders.loaders import open_splits
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError, DataError


def _chat(i: int, tag: str) -> dict:
    return {
        "prompt": f"{tag} {i}",
        "prompt_id": f"{tag}{i}",
        "messages": [
            {"role": "user", "content": f"{tag}: what is {i} + {i}?"},
            {"role": "assistant", "content": f"{i} + {i} = {2 * i}"},
        ],
    }


def hub_folder(root, splits: dict[str, int], configs: tuple[str, ...] = ("default",)):
    """A dataset repository as the Hub lays it out: README.md's YAML names each config's files by split."""
    import datasets

    lines = ["---", "configs:"]
    for config in configs:
        lines += [f"- config_name: {config}", "  data_files:"]
        for split, n in splits.items():
            folder = root / config / "data" if len(configs) > 1 else root / "data"
            folder.mkdir(parents=True, exist_ok=True)
            datasets.Dataset.from_list([_chat(i, f"{config}-{split}") for i in range(n)]).to_parquet(
                folder / f"{split}-00000-of-00001.parquet"
            )
            prefix = f"{config}/data" if len(configs) > 1 else "data"
            lines += [f"  - split: {split}", f"    path: {prefix}/{split}-*"]
    (root / "README.md").write_text("\n".join(lines + ["---", "", "# a local stand-in"]) + "\n")
    return root


def _config(folder, *overrides):
    return TierlmConfig.load("tiny_sft", [f"data.dataset_name={folder}", *overrides])


def test_named_train_and_eval_splits(tmp_path, tiny_tokenizer):
    """Laid out like HuggingFaceH4/ultrachat_200k: train_sft / test_sft."""
    folder = hub_folder(tmp_path / "ultrachat", {"train_sft": 40, "test_sft": 7})
    trains, (val,) = open_splits(
        _config(folder, "data.split=train_sft", "data.eval_split=test_sft"), "chat", tiny_tokenizer
    )
    assert len(trains[0][0]) == 40 and len(val) == 7  # all of train_sft trains; test_sft evaluates
    assert "test_sft" in json.dumps(val.fetch([0])) and "train_sft" in json.dumps(trains[0][0].fetch([0]))
    with pytest.raises(DataError, match="has splits train_sft, test_sft; there is no 'train'"):
        open_splits(_config(folder), "chat", tiny_tokenizer)
    with pytest.raises(DataError, match="there is no 'nope'"):
        open_splits(_config(folder, "data.split=train_sft", "data.eval_split=nope"), "chat", tiny_tokenizer)


def test_evaluation_never_silently_reads_the_training_split(tmp_path, tiny_tokenizer):
    """A dataset with a validation split evaluates on it; one without holds out a tail of train
    (before: a missing "val" split fell back to evaluating on the training rows)."""
    with_val = hub_folder(tmp_path / "a", {"train": 30, "validation": 5})
    trains, (val,) = open_splits(_config(with_val), "chat", tiny_tokenizer)
    assert len(trains[0][0]) == 30 and len(val) == 5 and "validation" in json.dumps(val.fetch([0]))
    only_train = hub_folder(tmp_path / "b", {"train": 40})
    trains, (val,) = open_splits(_config(only_train, "data.val_fraction=0.25"), "chat", tiny_tokenizer)
    assert len(trains[0][0]) == 30 and len(val) == 10
    seen = {json.dumps(x) for x in trains[0][0].fetch(range(30))}
    assert not any(json.dumps(x) in seen for x in val.fetch(range(10)))


def test_dataset_config(tmp_path, tiny_tokenizer):
    folder = hub_folder(tmp_path / "c", {"train": 12, "test": 3}, configs=("en", "de"))
    trains, (val,) = open_splits(_config(folder, "data.dataset_config=de"), "chat", tiny_tokenizer)
    assert len(trains[0][0]) == 12 and len(val) == 3 and "de-train" in json.dumps(trains[0][0].fetch([0]))
    with pytest.raises(DataError, match="config 'fr'"):
        open_splits(_config(folder, "data.dataset_config=fr"), "chat", tiny_tokenizer)


def test_eval_split_needs_named_splits(tmp_path, tiny_tokenizer):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(_chat(i, "f")) + "\n" for i in range(20)))
    with pytest.raises(ConfigError, match="no named splits"):
        open_splits(_config(path, "data.eval_split=test"), "chat", tiny_tokenizer)


def test_sft_on_an_ultrachat_like_folder(tmp_path):
    folder = hub_folder(tmp_path / "ultrachat", {"train_sft": 200, "test_sft": 20})
    result = run_main(
        "sft",
        "--config",
        "tiny_pretrain",
        *TINY,
        f"data.dataset_name={folder}",
        "data.split=train_sft",
        "data.eval_split=test_sft",
        "training.num_train_steps=4",
        "training.eval_steps=4",
        "training.warmup_steps=0",
        "training.save_steps=0",
        "data.max_seq_length=64",
        f"infra.output_dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"eval"' in line
    ]
    assert evals and evals[-1]["val_loss"] > 0


# -- one dataset spec for every stage: DPO, RL, ShareGPT, data_files ---------------------------
def parquet_folder(root, rows_by_split: dict[str, list[dict]], configs: dict[str, str] | None = None):
    """A Hub-layout folder from explicit rows: {split: rows}; with `configs` {name: prefix}, one copy per config."""
    import datasets

    lines = ["---", "configs:"]
    for config, prefix in (configs or {"default": "data"}).items():
        lines += [f"- config_name: {config}", "  data_files:"]
        for split, rows in rows_by_split.items():
            (root / prefix).mkdir(parents=True, exist_ok=True)
            datasets.Dataset.from_list(rows).to_parquet(root / prefix / f"{split}-00000-of-00001.parquet")
            lines += [f"  - split: {split}", f"    path: {prefix}/{split}-*"]
    (root / "README.md").write_text("\n".join(lines + ["---", ""]) + "\n")
    return root


def _turns(question: str, reply: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]


def ultrafeedback_rows(n: int, tag: str) -> list[dict]:
    """trl-lib/ultrafeedback_binarized's columns: chosen / rejected whole conversations (implicit prompt), scores."""
    return [
        {
            "chosen": _turns(f"{tag} {i} + {i}?", f"{2 * i}"),
            "rejected": _turns(f"{tag} {i} + {i}?", f"{2 * i + 1}"),
            "score_chosen": 8.0,
            "score_rejected": 3.0,
        }
        for i in range(n)
    ]


def gsm8k_rows(n: int, tag: str) -> list[dict]:
    """openai/gsm8k's columns: question, and an answer with worked steps ending in '#### N'."""
    return [
        {
            "question": f"{tag}: Tom has {i} apples and buys {i + 2}. How many?",
            "answer": f"{i} + {i + 2} = <<{i}+{i + 2}={2 * i + 2}>>{2 * i + 2} apples\n#### {2 * i + 2}",
        }
        for i in range(n)
    ]


def test_preference_forms_of_trl(tmp_path, tiny_tokenizer):
    """The implicit-prompt conversational form (trl-lib/ultrafeedback_binarized), the explicit-prompt one,
    and HuggingFaceH4's prompt string beside whole conversations all read as the same pair."""
    want = (_turns("q 1 + 1?", "2"), _turns("q 1 + 1?", "3"))
    forms = [
        {"chosen": want[0], "rejected": want[1]},
        {"prompt": [want[0][0]], "chosen": [want[0][1]], "rejected": [want[1][1]]},
        {"prompt": "q 1 + 1?", "chosen": want[0], "rejected": want[1]},
        {"prompt": "q 1 + 1?", "chosen": "2", "rejected": "3"},
    ]
    for i, row in enumerate(forms):
        folder = parquet_folder(tmp_path / f"f{i}", {"train": [row] * 6, "test": [row] * 2})
        trains, (val,) = open_splits(_config(folder), "preference", tiny_tokenizer)
        pair = trains[0][0][0]
        assert (pair.chosen, pair.rejected) == want and len(val) == 2, (i, pair)
    bad = parquet_folder(tmp_path / "bad", {"train": [{"chosen": "2", "rejected": "3"}] * 4})
    with pytest.raises(DataError, match="needs a prompt column"):
        open_splits(_config(bad), "preference", tiny_tokenizer)


def test_dpo_on_an_ultrafeedback_like_folder(tmp_path, tiny_runs):
    folder = parquet_folder(
        tmp_path / "ultrafeedback", {"train": ultrafeedback_rows(24, "train"), "test": ultrafeedback_rows(6, "test")}
    )
    result = run_main(
        "dpo",
        "--config",
        "configs/tiny_dpo.yaml",
        f"model.model_name_or_path={tiny_runs / 'sft'}",
        f"data.dataset_name={folder}",
        "data.max_seq_length=64",
        "training.num_train_steps=2",
        "training.eval_steps=2",
        "training.warmup_steps=0",
        "training.save_steps=0",
        "training.per_device_train_batch_size=4",
        "infra.progress_bar=false",
        "infra.device_type=cpu",
        f"infra.output_dir={tmp_path / 'dpo'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [
        json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines() if '"eval"' in line
    ]
    assert evals and {"val_loss", "reward_margin", "pref_acc"} <= set(evals[-1]), (
        evals
    )  # on the 6 pairs of the test split


def test_rl_tasks_from_a_gsm8k_like_folder_and_an_answer_pattern(tmp_path):
    folder = parquet_folder(
        tmp_path / "gsm8k",
        {"train": gsm8k_rows(20, "train"), "test": gsm8k_rows(5, "test")},
        configs={"main": "main", "socratic": "socratic"},
    )
    config = TierlmConfig.load("tiny_rl", [f"data.dataset_name={folder}", "data.dataset_config=main"])
    from tierlm.stages.rl import open_tasks

    train, val = open_tasks(config)
    assert len(train) == 20 and len(val) == 5
    example = train.example(3)
    assert example.reference == 8.0 and example.messages[0]["content"].startswith("train: Tom has 3")
    assert (
        train.reward(example.prompt, "3 + 5 = 8", example.reference) == 1.0
        and train.reward(example.prompt, "9", 8.0) == 0.0
    )
    # A MATH-like column with a custom extraction rule.
    math = parquet_folder(
        tmp_path / "math",
        {"train": [{"problem": f"{i}*2?", "solution": f"so \\boxed{{{2 * i}}} (check: {i})"} for i in range(10)]},
    )
    config = TierlmConfig.load(
        "tiny_rl",
        [
            f"data.dataset_name={math}",
            "data.question_column=problem",
            "data.answer_column=solution",
            r"data.answer_pattern=boxed\{([^}]*)\}",
            "data.val_fraction=0.2",
        ],
    )
    train, val = open_tasks(config)
    assert [train.example(i).reference for i in range(3)] == [0.0, 2.0, 4.0] and len(val) == 2
    with pytest.raises(DataError, match="no reference by the extraction rule"):
        open_tasks(
            TierlmConfig.load(
                "tiny_rl",
                [
                    f"data.dataset_name={math}",
                    "data.question_column=problem",
                    "data.answer_column=solution",
                    r"data.answer_pattern=answer=(\d+)",
                ],
            )
        )


def test_rl_on_a_gsm8k_like_folder(tmp_path, tiny_runs):
    folder = parquet_folder(
        tmp_path / "gsm8k", {"train": gsm8k_rows(20, "train"), "test": gsm8k_rows(4, "test")}, configs={"main": "main"}
    )
    result = run_main(
        "rl",
        "--config",
        "configs/tiny_rl.yaml",
        f"model.model_name_or_path={tiny_runs / 'sft'}",
        f"data.dataset_name={folder}",
        "data.dataset_config=main",
        "data.max_seq_length=64",
        "training.num_train_steps=1",
        "training.eval_steps=1",
        "training.save_steps=0",
        "rl.prompts_per_step=2",
        "rl.group_size=2",
        "rl.eval_problems=4",
        "rl.eval_k=2",
        "rl.max_new_tokens=4",
        "infra.progress_bar=false",
        "infra.device_type=cpu",
        f"infra.output_dir={tmp_path / 'rl'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [
        json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines() if '"eval"' in line
    ]
    assert evals and "pass@1" in evals[-1], evals


def test_sharegpt_conversations(tmp_path, tiny_tokenizer):
    rows = [
        {
            "id": i,
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": f"{i}+1?"},
                {"from": "gpt", "value": f"{i + 1}"},
            ],
        }
        for i in range(10)
    ]
    path = tmp_path / "sharegpt.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+1?"},
        {"role": "assistant", "content": "3"},
    ]
    trains, _ = open_splits(_config(path, "data.messages_column=conversations"), "chat", tiny_tokenizer)
    assert trains[0][0][2] == expected
    trains, _ = open_splits(_config(path), "chat", tiny_tokenizer)  # ShareGPT's column name needs no setting
    assert trains[0][0][2] == expected
    path.write_text(json.dumps({"conversations": [{"from": "wizard", "value": "x"}]}) + "\n")
    with pytest.raises(DataError, match="from 'wizard'; known speakers"):
        open_splits(_config(path, "data.messages_column=conversations"), "chat", tiny_tokenizer)


def test_conversational_prompt_completion_trains_the_completion_only(tmp_path, tiny_tokenizer):
    """TRL's conversational prompt/completion rows (as the Hub's parquet holds them): the prompt's messages, then the
    completion's; the loss on the completion only (TRL's completion-only loss: every token after the prompt rendered
    with its generation prompt), even where the prompt holds an earlier assistant turn."""
    import datasets

    rows = [
        {
            "prompt": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": f"{i}+1?"},
                {"role": "assistant", "content": f"{i + 1}"},
                {"role": "user", "content": "and +2?"},
            ],
            "completion": [{"role": "assistant", "content": f"{i + 2}"}],
        }
        for i in range(10)
    ]
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "pc.parquet")
    trains, _ = open_splits(_config(tmp_path / "pc.parquet"), "chat", tiny_tokenizer)
    chat = trains[0][0][3]
    assert [m["content"] for m in chat] == ["be brief", "3+1?", "4", "and +2?", "5"]
    ids, mask = tiny_tokenizer.render_conversation(chat, "all_assistant")
    prompt = tiny_tokenizer.hf.apply_chat_template(rows[3]["prompt"], tokenize=False, add_generation_prompt=True)
    prompt_ids = tiny_tokenizer.hf(prompt, add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids
    assert mask == [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))
    ids, mask = tiny_tokenizer.render_conversation(list(chat), "all_assistant")  # as one conversation: both answers
    assert sum(mask) > len(ids) - len(prompt_ids)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "completion": [{"role": "user", "content": "4"}]}) + "\n")
    with pytest.raises(DataError, match="completion must open with an assistant turn"):
        open_splits(_config(path), "chat", tiny_tokenizer)


def test_openai_content_parts_and_the_developer_role(tmp_path, tiny_tokenizer):
    """Messages as OpenAI's API writes them: text parts joined by newlines, `developer` read as `system` (as `tierlm
    serve` reads a request, so training and serving render the same prompt); a part that is not text is one line."""
    row = {
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "user", "content": [{"type": "text", "text": "2+1?"}, {"type": "text", "text": "digits only"}]},
            {"role": "assistant", "content": "3"},
        ]
    }
    path = tmp_path / "parts.jsonl"
    path.write_text((json.dumps(row) + "\n") * 10)
    trains, _ = open_splits(_config(path), "chat", tiny_tokenizer)
    assert trains[0][0][0] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+1?\ndigits only"},
        {"role": "assistant", "content": "3"},
    ]
    row["messages"][1]["content"].append({"type": "image_url", "image_url": {"url": "x.png"}})
    path.write_text((json.dumps(row) + "\n") * 10)
    with pytest.raises(DataError, match="message 1 has image_url content parts"):
        open_splits(_config(path), "chat", tiny_tokenizer)


def test_data_files(tmp_path, tiny_tokenizer):
    """datasets' data_files: which files of a folder make which split, or a builder name with its files."""
    folder = tmp_path / "files"
    folder.mkdir()
    for name, n in (("part-a.jsonl", 12), ("part-b.jsonl", 8), ("held.jsonl", 4)):
        (folder / name).write_text("".join(json.dumps(_chat(i, name)) + "\n" for i in range(n)))
    trains, (val,) = open_splits(
        _config(folder, "data.data_files={train: part-*.jsonl, test: held.jsonl}"), "chat", tiny_tokenizer
    )
    assert len(trains[0][0]) == 20 and len(val) == 4 and "held.jsonl" in json.dumps(val[0])
    trains, (val,) = open_splits(
        _config("json", f"data.data_files={folder / 'part-a.jsonl'}", "data.val_fraction=0.25"), "chat", tiny_tokenizer
    )
    assert len(trains[0][0]) == 9 and len(val) == 3


def test_a_name_that_is_neither_a_path_nor_a_hub_id(tiny_tokenizer):
    with pytest.raises(DataError, match="neither an existing file or folder nor a hub dataset id"):
        open_splits(_config("data/missing.jsonl"), "chat", tiny_tokenizer)

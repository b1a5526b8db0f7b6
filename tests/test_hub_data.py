"""Datasets with named splits and configs, laid out locally as the Hub serves them (never the network):
data.split, data.eval_split, data.dataset_config (issue 17's dataset spec, first part)."""

import json

import pytest

from conftest import TINY, run_cli
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError, DataError
from tierlm.recipes import open_splits


def _chat(i: int, tag: str) -> dict:
    return {"prompt": f"{tag} {i}", "prompt_id": f"{tag}{i}",
            "messages": [{"role": "user", "content": f"{tag}: what is {i} + {i}?"}, {"role": "assistant", "content": f"{i} + {i} = {2 * i}"}]}


def hub_folder(root, splits: dict[str, int], configs: tuple[str, ...] = ("default",)):
    """A dataset repository as the Hub lays it out: README.md's YAML names each config's files by split."""
    import datasets

    lines = ["---", "configs:"]
    for config in configs:
        lines += [f"- config_name: {config}", "  data_files:"]
        for split, n in splits.items():
            folder = root / config / "data" if len(configs) > 1 else root / "data"
            folder.mkdir(parents=True, exist_ok=True)
            datasets.Dataset.from_list([_chat(i, f"{config}-{split}") for i in range(n)]).to_parquet(folder / f"{split}-00000-of-00001.parquet")
            prefix = f"{config}/data" if len(configs) > 1 else "data"
            lines += [f"  - split: {split}", f"    path: {prefix}/{split}-*"]
    (root / "README.md").write_text("\n".join(lines + ["---", "", "# a local stand-in"]) + "\n")
    return root


def _config(folder, *overrides):
    return TierlmConfig.load("tiny_sft", [f"data.dataset_name={folder}", *overrides])


def test_named_train_and_eval_splits(tmp_path, tiny_tokenizer):
    """Laid out like HuggingFaceH4/ultrachat_200k: train_sft / test_sft."""
    folder = hub_folder(tmp_path / "ultrachat", {"train_sft": 40, "test_sft": 7})
    trains, (val,) = open_splits(_config(folder, "data.split=train_sft", "data.eval_split=test_sft"), "sft", tiny_tokenizer)
    assert len(trains[0][0]) == 40 and len(val) == 7  # all of train_sft trains; test_sft evaluates
    assert "test_sft" in json.dumps(val.fetch([0])) and "train_sft" in json.dumps(trains[0][0].fetch([0]))
    with pytest.raises(DataError, match="has splits train_sft, test_sft; there is no 'train'"):
        open_splits(_config(folder), "sft", tiny_tokenizer)
    with pytest.raises(DataError, match="there is no 'nope'"):
        open_splits(_config(folder, "data.split=train_sft", "data.eval_split=nope"), "sft", tiny_tokenizer)


def test_evaluation_never_silently_reads_the_training_split(tmp_path, tiny_tokenizer):
    """A dataset with a validation split evaluates on it; one without holds out a tail of train
    (before: a missing "val" split fell back to evaluating on the training rows)."""
    with_val = hub_folder(tmp_path / "a", {"train": 30, "validation": 5})
    trains, (val,) = open_splits(_config(with_val), "sft", tiny_tokenizer)
    assert len(trains[0][0]) == 30 and len(val) == 5 and "validation" in json.dumps(val.fetch([0]))
    only_train = hub_folder(tmp_path / "b", {"train": 40})
    trains, (val,) = open_splits(_config(only_train, "data.val_fraction=0.25"), "sft", tiny_tokenizer)
    assert len(trains[0][0]) == 30 and len(val) == 10
    seen = {json.dumps(x) for x in trains[0][0].fetch(range(30))}
    assert not any(json.dumps(x) in seen for x in val.fetch(range(10)))


def test_dataset_config(tmp_path, tiny_tokenizer):
    folder = hub_folder(tmp_path / "c", {"train": 12, "test": 3}, configs=("en", "de"))
    trains, (val,) = open_splits(_config(folder, "data.dataset_config=de"), "sft", tiny_tokenizer)
    assert len(trains[0][0]) == 12 and len(val) == 3 and "de-train" in json.dumps(trains[0][0].fetch([0]))
    with pytest.raises(DataError, match="config 'fr'"):
        open_splits(_config(folder, "data.dataset_config=fr"), "sft", tiny_tokenizer)


def test_eval_split_needs_named_splits(tmp_path, tiny_tokenizer):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(_chat(i, "f")) + "\n" for i in range(20)))
    with pytest.raises(ConfigError, match="no named splits"):
        open_splits(_config(path, "data.eval_split=test"), "sft", tiny_tokenizer)


def test_sft_on_an_ultrachat_like_folder(tmp_path):
    folder = hub_folder(tmp_path / "ultrachat", {"train_sft": 200, "test_sft": 20})
    result = run_cli("sft", "--config", "tiny_pretrain", *TINY, f"data.dataset_name={folder}", "data.split=train_sft",
                     "data.eval_split=test_sft", "training.num_train_steps=4", "training.eval_steps=4", "training.warmup_steps=0",
                     "training.save_steps=0", "data.max_seq_length=64", f"infra.output_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert evals and evals[-1]["val_loss"] > 0

"""training.num_train_epochs: a run as long as that many passes over its data (nanochat's SFT: one), the epoch in
every train line and the report, resumed mid-epoch exactly; refusals in one line."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import CHAT, REPO, RL, TINY, resume_from_checkpoint
from tierlm.commands.cli import main
from tierlm.config import TierlmConfig
from tierlm.data.packing import Document, PackedLoader
from tierlm.errors import ConfigError


class Rows:
    """Documents of exactly one row each (so a pass's batches are plain arithmetic)."""

    def __init__(self, n: int, row: int):
        self.n, self.row = n, row

    def __len__(self) -> int:
        return self.n

    def fetch(self, indices):
        return [Document(torch.full((self.row,), i).numpy()) for i in indices]


def test_a_pass_counts_its_whole_batches_and_leaves_the_loader_where_it_was():
    loader = PackedLoader(Rows(23, 9), batch_size=4, seq_len=8, buffer_docs=5)
    assert loader.batches_per_pass() == 23 // 4  # 5 whole batches; the 3 left over are no step
    loader.next_batch(), loader.next_batch()
    before = loader.state_dict()
    assert loader.batches_per_pass() == 5 and loader.state_dict() == before  # counted on a copy


def lines(run, kind="train"):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]


def test_pretraining_by_epochs_stops_after_the_passes_and_resumes_mid_epoch_exactly(tmp_path, reports):
    args = [
        "pretrain",
        "--config",
        "tiny_pretrain",
        *TINY,
        "training.num_train_steps=null",
        "training.num_train_epochs=2",
        "training.per_device_train_batch_size=8",
        "training.logging_steps=1",
        "training.save_steps=10",
    ]
    run = tmp_path / "run"
    assert main([*args, f"infra.output_dir={run}"]) == 0
    config = TierlmConfig.load("tiny_pretrain", [*TINY, "training.per_device_train_batch_size=8"])
    from tierlm.builders.loaders import build_loaders
    from tierlm.data import load_tokenizer
    from tierlm.stages import STAGES

    loader, _ = build_loaders(config, STAGES["pretrain"], load_tokenizer(run / "model"), 1, False)
    steps = 2 * loader.batches_per_pass()
    train = lines(run)
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert train[-1]["epoch"] == pytest.approx(2.0) and train[steps // 2 - 1]["epoch"] == pytest.approx(1.0)
    assert "| epoch | 2 |" in (run / "report.md").read_text()
    weights = (run / "model" / "model.safetensors").read_bytes()
    resume_from_checkpoint(args, run, 10, in_process=True)  # mid-epoch: the first pass has more steps than 10
    assert steps // 2 > 10 and (run / "model" / "model.safetensors").read_bytes() == weights


def test_a_step_limited_run_keeps_the_epoch_in_its_state_and_lines(tmp_path):
    """Without num_train_epochs the epoch is the loader's: documents read over the pass, past 1 on the second
    pass, in every train line, the summary and the checkpoint's trainer state (so a resume goes on counting)."""
    args = [
        "pretrain",
        "--config",
        "tiny_pretrain",
        *TINY,
        "training.per_device_train_batch_size=8",
        "training.logging_steps=1",
        "training.save_steps=10",
    ]
    config = TierlmConfig.load("tiny_pretrain", [*TINY, "training.per_device_train_batch_size=8"])
    from tierlm.builders.loaders import build_loaders
    from tierlm.data import load_tokenizer
    from tierlm.stages import STAGES

    probe = tmp_path / "probe"
    assert main([*args, f"infra.output_dir={probe}"]) == 0  # 2 steps: a tokenizer to count a pass with
    loader, _ = build_loaders(config, STAGES["pretrain"], load_tokenizer(probe / "model"), 1, False)
    steps = loader.batches_per_pass() * 3 // 2
    run = tmp_path / "run"
    assert main([*args, f"training.num_train_steps={steps}", f"infra.output_dir={run}"]) == 0
    epochs = [r["epoch"] for r in lines(run)]
    assert len(epochs) == steps and epochs == sorted(epochs) and 0 < epochs[0] < 1 < epochs[-1] < 2
    state = json.loads((run / "checkpoints" / "step_10" / "trainer_state.json").read_text())
    assert state["loop"]["epoch"] == lines(run)[9]["epoch"]
    assert json.loads((run / "model" / "training_meta.json").read_text())["epoch"] == epochs[-1]


def test_preference_pairs_by_epoch(tiny_runs, tmp_path):
    """DPO for one epoch: as many steps as whole global batches of the training pairs (the plain count)."""
    from tierlm.builders.loaders import build_pair_loaders
    from tierlm.data import load_tokenizer

    overrides = [*CHAT, f"model.model_name_or_path={tiny_runs / 'sft'}", "training.logging_steps=1"]
    overrides += ["training.num_train_steps=null", "training.num_train_epochs=1", "data.num_synthetic_examples=40"]
    run = tmp_path / "dpo"
    assert main(["dpo", "--config", "tiny_dpo", *overrides, f"infra.output_dir={run}"]) == 0
    config = TierlmConfig.load(REPO / "configs/tiny_dpo.yaml", overrides)
    pairs = len(build_pair_loaders(config, load_tokenizer(tiny_runs / "sft" / "model"), 0, 1)[0])
    assert [r["step"] for r in lines(run)] == list(range(1, pairs // 4 + 1))  # 4 pairs a step
    assert lines(run)[-1]["epoch"] == pytest.approx((pairs // 4) * 4 / pairs)


def test_sft_for_one_epoch_as_nanochat_trains_it(tiny_runs, tmp_path):
    """SFT by epochs with the nanochat_sft preset's schedule (one epoch, the LR held for the first 80%, then down to
    0): as many steps as whole batches of one pass over the conversations, the LR of each step as written out."""
    from tierlm.builders.loaders import build_loaders
    from tierlm.data import load_tokenizer
    from tierlm.stages import STAGES

    preset = TierlmConfig.load("nanochat_sft").training
    schedule = [f"training.{k}={getattr(preset, k)}" for k in ("lr_scheduler_type", "warmdown_ratio", "min_lr_ratio")]
    assert (preset.num_train_epochs, preset.num_train_steps, preset.warmdown_ratio) == (1, None, 0.2)
    overrides = [*CHAT, f"model.model_name_or_path={tiny_runs / 'sft'}", "training.logging_steps=1", *schedule]
    overrides += ["training.num_train_steps=null", "training.num_train_epochs=1", "data.num_synthetic_examples=150"]
    overrides += ["training.warmup_steps=0", "training.learning_rate=1e-3", "training.eval_steps=0"]
    run = tmp_path / "sft"
    assert main(["sft", "--config", "tiny_sft", *overrides, f"infra.output_dir={run}"]) == 0
    config = TierlmConfig.load(REPO / "configs/tiny_sft.yaml", overrides)
    loader, _ = build_loaders(config, STAGES["sft"], load_tokenizer(tiny_runs / "sft" / "model"), 1, False)
    steps = loader.batches_per_pass() // config.training.gradient_accumulation_steps
    train = lines(run)
    assert steps >= 15 and [r["step"] for r in train] == list(range(1, steps + 1))
    assert train[-1]["epoch"] == pytest.approx(
        steps * config.training.gradient_accumulation_steps / loader.batches_per_pass()
    )
    held = round(0.8 * steps)  # warmdown: the peak for 80% of the steps, then linearly towards 0 at the end
    expected = [1e-3 if i < held else 1e-3 * (steps - i) / (steps - held) for i in range(steps)]
    assert expected[-1] < 1e-3 / 2
    assert [r["lr"] for r in train] == pytest.approx(expected, rel=1e-6)


def test_rl_by_epoch_passes_over_its_prompts(tiny_runs, tmp_path):
    """RL for one epoch over 8 prompts at 2 a step: 4 steps, the last at epoch 1."""
    run = tmp_path / "rl"
    overrides = [*RL, f"model.model_name_or_path={tiny_runs / 'sft'}", "training.logging_steps=1"]
    overrides += ["training.num_train_steps=null", "training.num_train_epochs=1", "data.num_synthetic_examples=8"]
    assert main(["rl", "--config", "tiny_rl", *overrides, f"infra.output_dir={run}"]) == 0
    assert [(r["step"], r["epoch"]) for r in lines(run)] == [(1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0)]


def test_epochs_refusals(tmp_path, capsys):
    with pytest.raises(ConfigError, match="keep one"):
        TierlmConfig.load("tiny_pretrain", ["training.num_train_epochs=1", "training.target_param_data_ratio=10"])
    for overrides, message in (
        (["training.num_train_epochs=1", "training.num_train_steps=5"], "set training.num_train_steps=null"),
        (["training.num_train_epochs=0.01", "training.num_train_steps=null"], "make no whole step"),
    ):
        assert main(["pretrain", "--config", "tiny_pretrain", *TINY, *overrides, f"infra.output_dir={tmp_path}/r"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not (tmp_path / "r").exists()

"""The FSDP2 training story's config as its users write it (its own field names), `infra.num_gpus` against the
launcher, and a run continued from any checkpoint: an earlier one, or another run's."""

from __future__ import annotations

import json

import pytest

from conftest import TINY
from tierlm.commands.cli import main
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError

STORY_YAML = """\
model:
  model_name_or_path: Qwen/Qwen3-0.6B
  tokenizer_name_or_path: null
  num_sentinel_tokens: 100
  use_flash_attention: true
data:
  dataset_name: HuggingFaceFW/fineweb-edu
  dataset_config: null
  text_column: text
  streaming: true
  max_seq_length: 8192
  max_encoder_length: 4096
  max_decoder_length: 2048
  ul2_task_weights: [1, 1, 1, 1, 4]
  preprocessing_num_workers: 4
  shuffle_buffer_size: 10000
training:
  per_device_train_batch_size: 4
  per_device_eval_batch_size: 8
  gradient_accumulation_steps: 8
  learning_rate: 2.0e-4
  weight_decay: 0.01
  adam_beta1: 0.9
  adam_beta2: 0.999
  adam_epsilon: 1.0e-8
  max_grad_norm: 1.0
  num_train_steps: 100000
  warmup_steps: 1000
  lr_scheduler_type: cosine
  bf16: true
  fp16: false
  save_steps: 1000
  save_total_limit: 5
  eval_steps: 500
  eval_samples: 1000
  logging_steps: 10
  report_to: [wandb, tensorboard]
  seed: 42
infra:
  output_dir: ./output
  logging_dir: ./logs
  distributed_type: fsdp
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_activation_checkpointing: true
  fsdp_cpu_offload: false
  deepspeed_config: null
  num_gpus: 8
  wandb_project: qwen3-encoder-decoder
  wandb_entity: null
  wandb_run_name: null
"""


def test_the_story_s_training_config_loads_as_written(tmp_path):
    (tmp_path / "training_config.yaml").write_text(STORY_YAML)
    config = TierlmConfig.load(tmp_path / "training_config.yaml")
    tr, infra = config.training, config.infra
    assert (tr.eval_batches, tr.logging_dir, infra.activation_checkpointing, infra.cpu_offload) == (
        125,
        "./logs",
        True,
        False,
    )
    assert (infra.num_gpus, infra.distributed_type, tr.adam_epsilon, config.data.ul2_task_weights) == (
        8,
        "fsdp",
        1e-8,
        [1, 1, 1, 1, 4],
    )
    overridden = TierlmConfig.load(
        tmp_path / "training_config.yaml", ["training.eval_samples=16", "infra.logging_dir=x"]
    )
    assert (overridden.training.eval_batches, overridden.training.logging_dir) == (2, "x")  # an override wins
    (tmp_path / "both.yaml").write_text("training:\n  logging_dir: a\ninfra:\n  logging_dir: b\n")
    with pytest.raises(ConfigError, match="infra.logging_dir=b is tierlm's training.logging_dir, which the config"):
        TierlmConfig.load(tmp_path / "both.yaml")
    with pytest.raises(ConfigError, match="training.eval_samples must be > 0"):
        TierlmConfig.load(None, ["training.eval_samples=-3"])


def test_num_gpus_must_be_what_the_launcher_started(tmp_path, capsys):
    assert (
        main(["pretrain", "--config", "tiny_pretrain", *TINY, "infra.num_gpus=8", f"infra.output_dir={tmp_path}/r"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "infra.num_gpus=8 but 1 rank(s) were started" in err[0], err


def test_a_run_continues_from_any_checkpoint(tmp_path, capsys):
    """Run A saves at steps 3 and 6. Run B, a new directory, continues from A's step 3 and ends with A's weights bit
    for bit, its lines from step 4. A checkpoint of another shape, or no checkpoint at all, is one line."""
    args = ["pretrain", "--config", "tiny_pretrain", *TINY, "training.num_train_steps=6", "training.save_steps=3"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main([*args, "training.logging_steps=1", f"infra.output_dir={a}"]) == 0
    weights = (a / "model" / "model.safetensors").read_bytes()
    assert (
        main(
            [
                *args,
                "training.logging_steps=1",
                f"infra.output_dir={b}",
                "--resume-from",
                str(a / "checkpoints" / "step_3"),
            ]
        )
        == 0
    )
    assert (b / "model" / "model.safetensors").read_bytes() == weights
    steps = [r["step"] for r in map(json.loads, (b / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert steps == [4, 5, 6]
    capsys.readouterr()
    for chosen, message in (
        (a / "checkpoints" / "step_3", "was run with model.depth=1, this command has 2"),
        (tmp_path / "nowhere", "is not a checkpoint folder"),
    ):
        assert main([*args, "model.depth=2", f"infra.output_dir={tmp_path}/c", "--resume-from", str(chosen)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not (tmp_path / "c").exists()


def test_save_best_keeps_a_checkpoint_of_every_new_best_evaluation(tmp_path):
    """training.save_best with an evaluation every step and no save_steps: a checkpoint exactly at the steps whose
    val loss beat every earlier one (read from the run's own eval lines), plus the last; the summary names the best."""
    from tierlm.checkpoint import find_best_checkpoint, list_checkpoints

    run = tmp_path / "run"
    args = ["pretrain", "--config", "tiny_pretrain", *TINY, "training.num_train_steps=8", "training.eval_steps=1"]
    assert main([*args, "training.save_best=true", "training.learning_rate=0.05", f"infra.output_dir={run}"]) == 0
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "eval"]
    best, expected = float("inf"), set()
    for r in evals:
        if r["step"] >= 1 and r["val_loss"] < best:  # step 0's evaluation is of no checkpoint
            best, _ = r["val_loss"], expected.add(r["step"])
    saved = {int(p.name.split("_")[1]) for p in list_checkpoints(run / "checkpoints")}
    assert saved == expected | {8} and len(expected) >= 2, (saved, [(r["step"], r["val_loss"]) for r in evals])
    loss = {r["step"]: r["val_loss"] for r in evals}
    assert find_best_checkpoint(run / "checkpoints").name == f"step_{min(saved, key=loss.get)}"

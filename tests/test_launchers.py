"""`accelerate launch` as a launcher (issue 18): seed 002's FSDP2 Accelerate config runs tierlm with 2 CPU
processes, its FSDP2 / mixed-precision / checkpointing settings honoured; conflicts are one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from tierlm.config import TierlmConfig
from tierlm.config.launchers import accelerate_overrides
from tierlm.errors import ConfigError

SEED_FSDP2_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap:
    - Qwen3EncoderLayer
    - Qwen3DecoderLayer
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_activation_checkpointing: true
  fsdp_sync_module_states: true
  fsdp_use_orig_params: true
  fsdp_backward_prefetch: BACKWARD_PRE
mixed_precision: bf16
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
ENV = {
    "ACCELERATE_MIXED_PRECISION": "bf16",
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_ACTIVATION_CHECKPOINTING": "true",
}


def test_the_settings_are_taken_and_conflicts_refused():
    config = accelerate_overrides(TierlmConfig.load("ul2-tiny"), ENV)
    assert config.training.bf16 and not config.training.fp16 and config.infra.distributed_type == "fsdp"
    assert config.infra.activation_checkpointing and config.infra.fsdp_sharding_strategy == "FULL_SHARD"
    assert accelerate_overrides(TierlmConfig.load("ul2-tiny"), {}) == TierlmConfig.load(
        "ul2-tiny"
    )  # not under Accelerate
    with pytest.raises(ConfigError, match="sets training.bf16=True but the tierlm config says False"):
        accelerate_overrides(TierlmConfig.load("ul2-tiny", ["training.bf16=false"]), ENV)
    with pytest.raises(ConfigError, match="FSDP2: set fsdp_version: 2"):
        accelerate_overrides(TierlmConfig.load("ul2-tiny"), {**ENV, "FSDP_VERSION": "1"})
    with pytest.raises(ConfigError, match="NO_SHARD"):
        accelerate_overrides(TierlmConfig.load("ul2-tiny"), {**ENV, "FSDP_SHARDING_STRATEGY": "NO_SHARD"})


def test_a_conflict_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, **ENV, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierlm",
            "pretrain",
            "--config",
            "ul2-tiny",
            "training.bf16=false",
            f"infra.output_dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "make them agree" in result.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_accelerate_launch_with_the_seed_s_fsdp2_config(tmp_path):
    (tmp_path / "fsdp2.yaml").write_text(SEED_FSDP2_YAML)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(tmp_path / "fsdp2.yaml"),
            "--num_processes",
            "2",
            "-m",
            "tierlm",
            "pretrain",
            "--config",
            "ul2-tiny",
            "model.depth=1",
            "tokenizer.vocab_size=300",
            "tokenizer.num_train_docs=300",
            "training.num_train_steps=3",
            "training.warmup_steps=0",
            "training.eval_steps=3",
            "training.eval_batches=1",
            "training.save_steps=3",
            "data.max_encoder_length=64",
            "data.max_decoder_length=32",
            "training.per_device_train_batch_size=2",
            "infra.progress_bar=false",
            f"infra.output_dir={out}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("final val loss") == 1  # rank 0 reports
    meta = json.loads((out / "model" / "training_meta.json").read_text())
    assert meta["world_size"] == 2 and meta["distributed_type"] == "fsdp"
    import yaml

    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (
        saved["training"]["bf16"]
        and saved["infra"]["activation_checkpointing"]
        and saved["infra"]["fsdp_sharding_strategy"] == "FULL_SHARD"
    )
    assert (out / "checkpoints" / "step_3" / "state").is_dir()  # FSDP's sharded checkpoint

"""`accelerate launch` as a launcher: the shipped Accelerate configs (configs/accelerate_fsdp2.yaml, the FSDP2
training story's, and configs/accelerate_deepspeed.yaml, ZeRO-3 with the optimizer offloaded) run tierlm with 2 CPU
processes, their settings honoured; conflicts and what tierlm does not do are one line each."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TINY
from tierlm.config import TierlmConfig
from tierlm.config.launchers import accelerate_overrides
from tierlm.errors import ConfigError

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
def test_the_launch_script_runs_ul2_tiny_with_the_shipped_fsdp2_config(tmp_path):
    """scripts/launch_training.sh (Accelerate with configs/accelerate_fsdp2.yaml) on 2 CPU processes, the overrides
    in the FSDP2 story's own field names (infra.fsdp_activation_checkpointing, infra.num_gpus, training.eval_samples,
    infra.logging_dir)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "NUM_PROCESSES": "2"}  # the yaml's bf16 stays
    out = tmp_path / "run"
    env.update(OUTPUT_DIR=str(out), TRAIN_CONFIG="ul2-tiny", PYTHON=sys.executable)
    result = subprocess.run(
        [
            "bash",
            str(REPO / "scripts" / "launch_training.sh"),
            "model.depth=1",
            "tokenizer.vocab_size=300",
            "tokenizer.num_train_docs=300",
            "training.num_train_steps=3",
            "training.warmup_steps=0",
            "training.eval_steps=3",
            "training.eval_samples=2",
            "training.save_steps=3",
            "data.max_encoder_length=64",
            "data.max_decoder_length=32",
            "training.per_device_train_batch_size=2",
            "infra.fsdp_activation_checkpointing=true",
            "infra.num_gpus=2",
            f"infra.logging_dir={tmp_path / 'logs'}",
            "infra.progress_bar=false",
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
    assert saved["training"]["eval_batches"] == 1 and saved["training"]["logging_dir"] == str(tmp_path / "logs")
    assert (out / "checkpoints" / "step_3" / "state").is_dir()  # FSDP's sharded checkpoint


DEEPSPEED_ENV = {
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
    "ACCELERATE_GRADIENT_CLIPPING": "1.0",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
}


def test_deepspeed_settings_are_taken_and_what_tierlm_cannot_do_refused(tiny_runs, tmp_path, capsys):
    from tierlm.builders.backend import read_deepspeed_config
    from tierlm.commands.cli import main

    infra = accelerate_overrides(TierlmConfig.load("tiny_pretrain"), DEEPSPEED_ENV).infra
    assert (infra.distributed_type, infra.deepspeed_zero_stage, infra.deepspeed_offload_optimizer) == (
        "deepspeed",
        3,
        True,
    )
    assert not infra.deepspeed_offload_params
    for change, message in (
        ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "0"}, "stage 0 is plain data parallelism"),
        ({"ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme"}, "not to NVMe"),
        ({"ACCELERATE_GRADIENT_CLIPPING": "lots"}, "is not a number"),
    ):
        with pytest.raises(ConfigError, match=message):
            accelerate_overrides(TierlmConfig.load("tiny_pretrain"), {**DEEPSPEED_ENV, **change})
    for overrides, message in (
        (["infra.deepspeed_offload_optimizer=true"], "is a DeepSpeed setting"),
        (["infra.distributed_type=deepspeed", "infra.tensor_parallel_size=2"], "shards by ZeRO"),
        (
            ["infra.distributed_type=deepspeed", "infra.deepspeed_zero_stage=2", "infra.deepspeed_offload_params=true"],
            "stage=3",
        ),
        (["infra.distributed_type=deepspeed", "infra.cpu_offload=true"], "FSDP's"),
    ):
        with pytest.raises(ConfigError, match=message):
            TierlmConfig.load("tiny_pretrain", overrides)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        read_deepspeed_config(str(tmp_path / "list.json"))
    for argv, message in (
        (
            [
                "dpo",
                "--config",
                "tiny_dpo",
                f"model.model_name_or_path={tiny_runs / 'sft'}",
                "infra.distributed_type=deepspeed",
            ],
            "does not run under DeepSpeed",
        ),
        (["pretrain", "--config", "tiny_pretrain", "infra.distributed_type=deepspeed"], "runs under a launcher"),
        (["pretrain", "--config", "configs/accelerate_deepspeed.yaml"], "is Accelerate's launcher config"),
    ):
        assert main([*argv, f"infra.output_dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.serial
def test_accelerate_launch_with_the_shipped_deepspeed_config(tmp_path):
    """configs/accelerate_deepspeed.yaml on 2 CPU processes: DeepSpeed's ZeRO-3 with the optimizer offloaded takes the
    same steps as one process on the same global batch (1e-5); its checkpoint exports to the weights its final model
    folder holds; a sharded checkpoint is refused by `sample` (one line: export it first)."""
    from tierlm.commands.cli import main
    from tierlm.models import load_native_model

    tiny = [
        "--config",
        "tiny_pretrain",
        *TINY,
        "training.num_train_steps=4",
        "training.save_steps=4",
        "training.logging_steps=1",
        "infra.progress_bar=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    command += [str(REPO / "configs" / "accelerate_deepspeed.yaml"), "--num_processes", "2", "--mixed_precision", "no"]
    command += ["-m", "tierlm", "pretrain", *tiny, "training.per_device_train_batch_size=4"]
    result = subprocess.run(
        [*command, f"infra.output_dir={tmp_path / 'ds'}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        main(["pretrain", *tiny, "training.per_device_train_batch_size=8", f"infra.output_dir={tmp_path / 'one'}"]) == 0
    )

    def losses(run):
        return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    assert (
        losses(tmp_path / "ds") == pytest.approx(losses(tmp_path / "one"), abs=1e-5)
        and len(losses(tmp_path / "one")) == 4
    )
    assert json.loads((tmp_path / "ds" / "model" / "training_meta.json").read_text())["distributed_type"] == "deepspeed"
    step_4 = tmp_path / "ds" / "checkpoints" / "step_4"
    assert (step_4 / "deepspeed").is_dir()
    assert main(["export", str(step_4), str(tmp_path / "exported")]) == 0
    exported, final = (load_native_model(p).state_dict() for p in (tmp_path / "exported", tmp_path / "ds" / "model"))
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    assert main(["sample", "--checkpoint", str(step_4), "--prompt", "hi"]) == 2


def accelerate_environment(config_file, num_processes: int = 2) -> dict[str, str]:
    """The environment `accelerate launch --config_file FILE` gives each process, by Accelerate's own launcher code
    (its argument checks and its DeepSpeed / multi-GPU environment), without starting any."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(config_file), "--num_processes", str(num_processes), "x.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:  # as `launch_command` does before DeepSpeed's launcher
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config if defaults else [])
        return prepare_deepspeed_cmd_env(args)[1]
    return prepare_multi_gpu_env(args)


def test_the_training_storys_deepspeed_config_as_written(tmp_path):
    """The FSDP2 story's own DeepSpeed Accelerate config, byte for byte (tests/fixtures/story): its
    `gradient_accumulation_steps: auto` means what the tierlm config says (it was refused: "auto" is not a number),
    its ZeRO stage, optimizer offload, clipping and bf16 are taken, and a tiny run's config resolves with them."""
    env = accelerate_environment(REPO / "tests" / "fixtures" / "story" / "accelerate_deepspeed.yaml")
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "auto"  # what Accelerate exports for it
    base = TierlmConfig.load("tiny_pretrain", ["training.gradient_accumulation_steps=2"])
    config = accelerate_overrides(base, env)
    assert config.training.gradient_accumulation_steps == 2  # the tierlm config's, as "auto" asks
    assert config.infra.distributed_type == "deepspeed" and config.infra.deepspeed_zero_stage == 3
    assert config.infra.deepspeed_offload_optimizer and not config.infra.deepspeed_offload_params
    assert config.training.max_grad_norm == 1.0 and config.training.bf16


def test_wandb_project_from_the_environment_when_the_config_sets_none(tmp_path, monkeypatch):
    """`WANDB_PROJECT` (exported by scripts/launch_training.sh) names the W&B project unless infra.wandb_project
    does: the run's wandb.init gets it (W&B's own argument beats its environment, so tierlm must not pass its
    default over it)."""
    wandb = pytest.importorskip("wandb")
    from conftest import run_main

    projects = []
    real = wandb.init

    def recording(**kwargs):
        projects.append(kwargs["project"])
        return real(**kwargs)

    monkeypatch.setattr(wandb, "init", recording)
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WANDB_PROJECT", "from-the-launch-script")
    args = ["pretrain", "--config", "tiny_pretrain", *TINY, "training.report_to=[wandb]"]
    assert run_main(*args, f"infra.output_dir={tmp_path / 'a'}").returncode == 0
    assert run_main(*args, "infra.wandb_project=mine", f"infra.output_dir={tmp_path / 'b'}").returncode == 0
    assert projects == ["from-the-launch-script", "mine"]


def test_the_training_storys_fsdp_config_as_written_and_each_setting_honoured_or_refused(tmp_path):
    """The FSDP2 Accelerate config of an Accelerate-style training script, byte for byte (tests/fixtures/story):
    FSDP2, FULL_SHARD, activation checkpointing, CPU-RAM-efficient loading (from a transformers folder too:
    test_distributed) and bf16 are taken; its wrap policy, prefetch, state-dict type, original parameters and module
    sync are what tierlm does; each of those at a value tierlm does not honour is refused in one line."""
    story = (REPO / "tests" / "fixtures" / "story" / "accelerate_fsdp2.yaml").read_text()
    config = accelerate_overrides(TierlmConfig.load("tiny_pretrain"), accelerate_environment_of(story, tmp_path))
    infra = config.infra
    assert infra.distributed_type == "fsdp" and infra.fsdp_sharding_strategy == "FULL_SHARD"
    assert infra.activation_checkpointing and infra.cpu_ram_efficient_loading and not infra.cpu_offload
    assert config.training.bf16
    for line, other in [
        ("fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP", "fsdp_auto_wrap_policy: SIZE_BASED_WRAP"),
        ("fsdp_backward_prefetch: BACKWARD_PRE", "fsdp_backward_prefetch: BACKWARD_POST"),
        ("fsdp_state_dict_type: SHARDED_STATE_DICT", "fsdp_state_dict_type: FULL_STATE_DICT"),
        ("fsdp_use_orig_params: true", "fsdp_use_orig_params: false"),
    ]:
        assert line in story
        env = accelerate_environment_of(story.replace(line, other), tmp_path)
        key, value = other.split(": ")
        with pytest.raises(ConfigError, match=f"the Accelerate config's {key}: {value} is not what tierlm does"):
            accelerate_overrides(TierlmConfig.load("tiny_pretrain"), env)
    unsynced = story.replace("sync_module_states: true", "sync_module_states: false")  # (Accelerate wants it with
    unsynced = unsynced.replace("cpu_ram_efficient_loading: true", "cpu_ram_efficient_loading: false")  # this)
    config = accelerate_overrides(TierlmConfig.load("tiny_pretrain"), accelerate_environment_of(unsynced, tmp_path))
    assert config.infra.distributed_type == "fsdp" and not config.infra.cpu_ram_efficient_loading


def accelerate_environment_of(text: str, folder) -> dict[str, str]:
    path = folder / "accelerate.yaml"
    path.write_text(text)
    return accelerate_environment(path)

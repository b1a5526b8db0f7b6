"""Presets ship inside the package: listed by `tierlm config list`, used as `--config NAME`, found
by an installed wheel (not only a clone), with the corpus `gpt2-shakespeare-char` trains on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from tierlm.commands.cli import main
from tierlm.config import TierlmConfig
from tierlm.config.files import list_presets


def test_presets_are_listed_and_loaded_by_name(capsys):
    assert main(["config", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("gpt2-shakespeare-char", "tiny_pretrain", "tiny_sft", "tiny_dpo", "tiny_rl"):
        assert name in out and name in list_presets()
    config = TierlmConfig.load("gpt2-shakespeare-char", ["training.num_train_steps=700"])
    assert config.model.architecture == "gpt2" and config.training.num_train_steps == 700
    assert TierlmConfig.load("tiny_pretrain") == TierlmConfig.load(REPO / "configs" / "tiny_pretrain.yaml")


@pytest.mark.slow
def test_an_installed_wheel_finds_its_presets_and_corpus(tmp_path):
    """The wheel installed into a new virtual environment (its own site-packages; the dependencies seen
    through a .pth file, so nothing is downloaded), run from a folder with no source tree."""
    import site as site_module

    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    venv = tmp_path / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # torch, transformers, ... from this environment: directories only (their .pth files, like the
    # editable install of the source tree, are not read from a directory a .pth file adds).
    Path(purelib, "tierlm_test_deps.pth").write_text("\n".join(site_module.getsitepackages()) + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", *map(str, wheels.glob("*.whl"))],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore")
    work = tmp_path / "elsewhere"  # no configs/ folder, no source tree
    work.mkdir()
    where = subprocess.run(
        [python, "-c", "import tierlm; print(tierlm.__file__)"], cwd=work, env=env, capture_output=True, text=True
    )
    assert where.stdout.startswith(purelib), (
        f"the test must run the installed wheel, got {where.stdout} {where.stderr[-500:]}"
    )
    listed = subprocess.run(
        [python, "-m", "tierlm", "config", "list"], cwd=work, env=env, capture_output=True, text=True
    )
    assert "gpt2-shakespeare-char" in listed.stdout, listed.stderr
    run = subprocess.run(
        [
            python,
            "-m",
            "tierlm",
            "pretrain",
            "--config",
            "gpt2-shakespeare-char",
            "training.num_train_steps=20",
            "training.warmup_steps=2",
            "training.eval_steps=20",
            "training.eval_batches=2",
            "infra.progress_bar=false",
            "infra.output_dir=run",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert (work / "run" / "model" / "config.json").is_file() and "final val loss" in run.stdout


def test_every_preset_is_a_valid_config():
    for name in list_presets():
        TierlmConfig.load(name)  # raises ConfigError naming the key if a preset went stale
    baseline = TierlmConfig.load("gpt2-vanilla-baseline")
    tokens_per_step = (
        baseline.training.per_device_train_batch_size
        * baseline.training.gradient_accumulation_steps
        * baseline.data.max_seq_length
    )
    assert (baseline.model.depth, baseline.model.depth * baseline.model.aspect_ratio, tokens_per_step) == (
        12,
        768,
        16 * 4 * 1024,
    )
    # Seed 003's ablation presets: the baseline's model and budget, their variants, their optimizer.
    from tierlm.commands.ablate import parse_variant

    ra, kv = TierlmConfig.load("gpt2-ra-ablation"), TierlmConfig.load("gpt2-kv-pruning-ablation")
    assert [parse_variant(v).name for v in ra.ablation.variants] == ["V0", "V1", "V3", "V7", "V9"]
    assert (
        ra.training.optimizer == "adamw_spam" and ra.model.ra.per_head_gates and ra.training.bf16 and ra.infra.compile
    )
    assert [parse_variant(v).name for v in kv.ablation.variants] == ["V0", "V16", "V17", "V18"]
    for preset in (ra, kv):
        assert preset.training.num_train_steps == baseline.training.num_train_steps and preset.model.depth == 12


def test_the_shakespeare_preset_trains_as_a_stream(tmp_path):
    code = main(
        [
            "pretrain",
            "--config",
            "gpt2-shakespeare-char",
            "training.num_train_steps=20",
            "training.warmup_steps=2",
            "training.eval_steps=20",
            "training.eval_batches=2",
            "infra.progress_bar=false",
            f"infra.output_dir={tmp_path / 'run'}",
        ]
    )
    assert code == 0

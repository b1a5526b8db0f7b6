"""On a machine that reaches no Hub (a cluster's compute node, an air-gapped box), a Hub id that is not in the local
cache is one line and exit 2 within seconds, not a minute of retries (`tierlm.primitives.hub`): the probe finds the
Hub unreachable (here an endpoint that refuses at once, with the offline variables unset), the libraries look only in
their caches, and nothing is written. `tierlm plan` plans what it can and names what it cannot know."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

TINY = [
    "model.depth=1",
    "model.aspect_ratio=32",
    "model.head_dim=32",
    "training.num_train_steps=2",
    "training.warmup_steps=0",
]


def offline_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a machine whose Hub refuses connections: an empty cache, no offline variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    }
    env.update(
        HF_ENDPOINT="http://127.0.0.1:9",  # the discard port: nothing listens, the connection is refused at once
        HF_HOME=str(tmp_path / "hf"),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        **extra,
    )
    env.pop("HTTPS_PROXY", None), env.pop("https_proxy", None)
    return env


def tierlm(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`tierlm ARGS` on that machine. Its stderr is the check that nothing retried: huggingface_hub logs a line per
    retry ("Retrying in 1s [Retry 1/5]"), about a minute of them, and the tests ask for one line."""
    return subprocess.run(
        [sys.executable, "-m", "tierlm", *args],
        cwd=tmp_path,
        env=offline_env(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=240,
    )


CASES = {
    "a Hub model": (
        ["sft", "--config", str(REPO / "configs/tiny_sft.yaml"), "model.model_name_or_path=Qwen/Qwen3-0.6B"],
        "tokenizer 'Qwen/Qwen3-0.6B' is not in the local Hugging Face cache and the Hub (http://127.0.0.1:9) cannot "
        "be reached from here: give a local folder, or on a connected machine run `hf download Qwen/Qwen3-0.6B`",
    ),
    "a Hub dataset in a mixture": (
        ["pretrain", "--config", "tiny_pretrain", *TINY, "data.mixture=[{dataset_name: HuggingFaceFW/fineweb-edu}]"],
        "dataset 'HuggingFaceFW/fineweb-edu' is not in the local Hugging Face cache and the Hub (http://127.0.0.1:9) "
        "cannot be reached from here: give a local folder, or on a connected machine run `hf download "
        "HuggingFaceFW/fineweb-edu --repo-type dataset`",
    ),
    "a Hub tokenizer": (
        ["pretrain", "--config", "tiny_pretrain", *TINY, "model.tokenizer_name_or_path=gpt2"],
        "tokenizer 'gpt2' is not in the local Hugging Face cache",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hub_id_without_the_hub_is_one_line_and_nothing_written(case, tmp_path):
    args, expected = CASES[case]
    done = tierlm(tmp_path, *args, "infra.output_dir=run")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("tierlm: error: "), done.stderr
    assert expected in lines[0] and f"HF_HOME={tmp_path / 'hf'}" in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing written, not even the cache folder"


def test_the_offline_variables_are_named_when_the_user_set_them(tmp_path):
    done = tierlm(tmp_path, "pretrain", "--config", "tiny_pretrain", *TINY, "model.tokenizer_name_or_path=gpt2",
                  HF_HUB_OFFLINE="1")  # fmt: skip
    assert (
        done.returncode == 2
        and "HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE/HF_DATASETS_OFFLINE set this machine offline" in (done.stderr)
    ), done.stderr


def test_plan_sizes_what_it_can_and_names_the_tokenizer_it_cannot_read(tmp_path):
    """The GPT-2 baseline preset names the Hub's gpt2 tokenizer: offline, the plan is made for the config's
    vocabulary and says so."""
    done = tierlm(tmp_path, "plan", "--config", "gpt2-vanilla-baseline", "infra.device_type=cpu")
    assert done.returncode == 0, done.stderr
    assert (
        "note: the tokenizer 'gpt2' is not in the local cache and the Hub cannot be reached: the model is sized "
        in (done.stdout)
    )
    assert "parameters" in done.stdout and done.stderr == ""


def test_push_says_in_one_line_that_it_needs_the_hub(tmp_path, tiny_runs):
    done = tierlm(tmp_path, "push", str(tiny_runs / "sft"), "--repo", "me/tiny")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "tierlm: error: tierlm push needs the Hugging Face Hub and the Hub (http://127.0.0.1:9) cannot be reached "
        "from here: run it where the Hub answers"
    ], done.stderr


def test_a_harness_task_without_the_hub_is_one_line(tmp_path, tiny_runs):
    """An lm-evaluation-harness task whose dataset is on the Hub: its datasets come from the local cache only."""
    pytest.importorskip("lm_eval")
    done = tierlm(tmp_path, "eval", "--checkpoint", str(tiny_runs / "sft"), "--harness", "arc_easy")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "a task's dataset cannot be read" in lines[0], done.stderr

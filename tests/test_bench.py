"""The benchmark scripts stay runnable: the GPU scripts' CPU dry modes, the harness's table."""

import json
import subprocess
import sys

from conftest import REPO


def test_gpu_mfu_dry_run_on_cpu():
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_mfu.py"), "--dry-run"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout.splitlines()[-1])
    assert record["tokens_per_sec"] > 0 and 0 < record["mfu"] < 1 and record["loss"] > 0
    assert record["flops_per_token"] > 6 * record["params"] * 0.5  # the 6N term dominates


def test_gpu_generation_dry_run_on_cpu():
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_generation.py"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["contender"] for r in rows] == ["tierlm-native", "tierlm-hf", "transformers"]
    for r in rows:
        assert r["tokens_per_sec"] > 0 and abs(r["tokens_per_sec"] - r["steps_per_sec"] * r["batch"]) <= r["batch"]


def test_harness_table_reports_medians_and_ratios(capsys):
    sys.path.insert(0, str(REPO / "bench"))
    from harness import table

    table({"a": [{"tok": 10.0}, {"tok": 30.0}, {"tok": 20.0}], "ref": [{"tok": 10.0}]}, "tok", "ref")
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("| a | 20 | 2.00x") and lines[3].startswith("| ref | 10 | 1.00x")  # 3 significant digits

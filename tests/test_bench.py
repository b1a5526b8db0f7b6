"""The benchmark scripts stay runnable: the GPU scripts' CPU dry modes, the harness's table."""

import json
import subprocess
import sys

from conftest import REPO


def dry_run(script: str) -> list[dict]:
    """The JSON lines `bench/SCRIPT --dry-run` prints (tiny sizes on CPU), after it exits 0."""
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), "--dry-run"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_gpu_mfu_dry_run_on_cpu():
    record = dry_run("gpu_mfu.py")[-1]
    assert record["tokens_per_sec"] > 0 and 0 < record["mfu"] < 1 and record["loss"] > 0
    assert record["flops_per_token"] > 6 * record["params"] * 0.5  # the 6N term dominates


def test_inference_card_dry_run_on_cpu():
    rows = dry_run("inference_card.py")
    assert [(r["contender"], r["batch"]) for r in rows] == [
        ("tierlm", 1), ("tierlm", 3), ("tierlm-static", 1), ("tierlm-static", 3)
    ]  # fmt: skip
    for r in rows:
        assert r["step_ms"] > 0 and 0 < r["mbu"] and r["bound_steps_per_sec"] > 0
        assert abs(r["tokens_per_sec"] * r["new_tokens"] ** -1 * (r["prefill_ms"] / 1e3 + (r["new_tokens"] - 1)
                   * r["step_ms"] / 1e3) - r["batch"]) < 0.2 * r["batch"]  # fmt: skip


def test_rollout_batch_dry_run_on_cpu():
    rows = dry_run("rollout_batch.py")
    assert [r.get("contender") for r in rows[:2]] == ["together", "alone"] and rows[2]["together_speedup"] > 0
    assert all(r["seconds"] > 0 and r["tokens_per_sec"] > 0 for r in rows[:2])


def test_harness_table_reports_medians_and_ratios(capsys):
    sys.path.insert(0, str(REPO / "bench"))
    from harness import table

    table({"a": [{"tok": 10.0}, {"tok": 30.0}, {"tok": 20.0}], "ref": [{"tok": 10.0}]}, "tok", "ref")
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("| a | 20 | 2.00x") and lines[3].startswith("| ref | 10 | 1.00x")  # 3 significant digits

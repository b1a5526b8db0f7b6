"""Run reports (issue 20, part 1): every run directory gets report.md and plots/*.png (the panels its
metrics have: losses, LR, gradient norm, throughput, memory; RL reward, KL, phase times; DPO margins),
`tierlm report` rebuilds one or overlays several."""

from __future__ import annotations

import json

from tierlm.commands.cli import main
from tierlm.metrics.report import overlay_report, write_run_report


def _run(folder, stage: str, lines: list[dict]):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "run.json").write_text(json.dumps({"stage": stage, "fingerprint": {"model.depth": 2}}))
    return folder


def _pretrain_lines(scale: float = 1.0):
    lines = [{"type": "eval", "step": 0, "tokens_seen": 0, "val_loss": 5.0 * scale}]
    for step in range(1, 11):
        lines.append(
            {
                "type": "train",
                "step": step,
                "loss": 5.0 / step,
                "loss_ema": 5.2 / step,
                "lr": 1e-3,
                "grad_norm": 1.0 / step,
                "tokens_per_sec": 1000.0,
                "trained_tokens_per_sec": 900.0,
                "tokens_seen": 256 * step,
                "elapsed_s": 0.5 * step,
                "rss_mb": 500.0,
            }
        )
        if step % 5 == 0:
            lines.append({"type": "eval", "step": step, "tokens_seen": 256 * step, "val_loss": 4.0 * scale / step})
    return lines


def test_a_pretraining_report_has_its_curves_and_figures(tmp_path):
    run = _run(tmp_path / "pre", "pretrain", _pretrain_lines())
    report = write_run_report(run).read_text()
    plots = sorted(p.stem for p in (run / "plots").glob("*.png"))
    assert plots == ["grad_norm", "loss_steps", "loss_tokens", "lr", "memory", "throughput"]  # no MFU, RL or DPO panels
    assert (
        "# tierlm run: pretrain — pre" in report
        and "| val_loss | 5 | 0.4 |" in report
        and "![loss_steps](plots/loss_steps.png)" in report
    )
    assert '"model.depth": 2' in report


def test_rl_and_dpo_reports_draw_their_own_panels(tmp_path):
    rl = (
        [{"type": "eval", "step": 0, "pass@1": 0.4, "pass@k": 0.8, "k": 4}]
        + [
            {
                "type": "train",
                "step": s,
                "loss": 0.1,
                "lr": 1e-4,
                "grad_norm": 0.5,
                "reward_mean": 0.5 + s / 100,
                "kl": 0.01 * s,
                "time_generation_s": 1.0,
                "time_scoring_s": 0.1,
                "time_training_s": 0.3,
                "value_loss": 0.2 / s,
            }
            for s in range(1, 6)
        ]
        + [{"type": "eval", "step": 5, "pass@1": 0.6, "pass@k": 0.9, "k": 4}]
    )
    write_run_report(_run(tmp_path / "rl", "rl", rl))
    assert {"reward", "kl", "rl_phases", "value_loss"} <= {p.stem for p in (tmp_path / "rl" / "plots").glob("*.png")}
    dpo = [{"type": "train", "step": s, "loss": 0.69 - s / 100, "lr": 1e-4, "grad_norm": 0.5} for s in range(1, 4)] + [
        {"type": "eval", "step": 3, "val_loss": 0.6, "reward_margin": 0.2, "pref_acc": 0.7}
    ]
    write_run_report(_run(tmp_path / "dpo", "dpo", dpo))
    assert "dpo" in {p.stem for p in (tmp_path / "dpo" / "plots").glob("*.png")}


def test_several_runs_overlay_in_one_report(tmp_path):
    a, b = _run(tmp_path / "a", "pretrain", _pretrain_lines()), _run(tmp_path / "b", "pretrain", _pretrain_lines(0.5))
    report = overlay_report([a, b], tmp_path / "both").read_text()
    assert "| a | " in report and "| b | " in report and (tmp_path / "both" / "plots" / "loss_steps.png").is_file()
    assert (
        main(["report", str(a), str(b), "--out", str(tmp_path / "cli")]) == 0
        and (tmp_path / "cli" / "report.md").is_file()
    )
    assert not (a / "report.md").exists()  # overlaying writes only into --out
    assert main(["report", str(a)]) == 0 and (a / "report.md").is_file()


def test_a_run_draws_its_report_unless_told_not_to(tmp_path, monkeypatch):
    """A run directory gets report.md and plots/ as it trains, as users' runs do; with TIERLM_REPORT=off (a sweep's
    many short runs, this suite) it gets neither, and `tierlm report RUN` draws the same files afterwards."""
    from conftest import run_main

    args = ["pretrain", "--config", "configs/tiny_pretrain.yaml", "training.num_train_steps=4"]
    args += ["training.warmup_steps=0", "training.eval_steps=2", "infra.progress_bar=false"]
    for setting in ("on", "off"):
        monkeypatch.setenv("TIERLM_REPORT", setting)
        done = run_main(*args, f"infra.output_dir={tmp_path / setting}")
        assert done.returncode == 0, done.stderr[-2000:]
    on, off = tmp_path / "on", tmp_path / "off"
    drawn = sorted(p.name for p in (on / "plots").glob("*.png"))
    assert (on / "report.md").is_file() and {"loss_steps.png", "lr.png", "grad_norm.png"} <= set(drawn)
    assert not (off / "report.md").exists() and not (off / "plots").exists()
    assert run_main("report", str(off)).returncode == 0
    assert sorted(p.name for p in (off / "plots").glob("*.png")) == drawn and (off / "report.md").is_file()

"""Logging that survives a resume (issue 20): a run rolled back to a checkpoint and resumed leaves
TensorBoard, MLflow and W&B with one continuous run — each step once, the uninterrupted run's values."""

from __future__ import annotations

import json
import os

import pytest

from conftest import TINY, resume_from_checkpoint, run_main

ARGS = [
    "pretrain",
    "--config",
    "configs/tiny_pretrain.yaml",
    *[a for a in TINY if not a.startswith("infra.output_dir")],
    "training.num_train_steps=6",
    "training.save_steps=3",
    "training.logging_steps=1",
]


def _tensorboard_losses(run) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return [(e.step, round(e.value, 6)) for e in events.Scalars("train/loss")]


def _mlflow_losses(run) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the run's local file store (see MLflowSink)
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    run_id = (run / "mlflow_run_id").read_text().strip()
    return sorted((m.step, round(m.value, 6)) for m in client.get_metric_history(run_id, "train/loss"))


@pytest.mark.slow
def test_tensorboard_and_mlflow_continue_the_same_run(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    args = [*ARGS, "training.report_to=[tensorboard,mlflow]"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for out in (straight, resumed):
        result = run_main(*args, f"infra.output_dir={out}")
        assert result.returncode == 0, result.stderr[-3000:]
    run_id = (resumed / "mlflow_run_id").read_text()
    resume_from_checkpoint(args, resumed, 3)
    want = [
        (r["step"], round(r["loss"], 6))
        for r in map(json.loads, (straight / "metrics.jsonl").read_text().splitlines())
        if r["type"] == "train"
    ]
    assert [s for s, _ in want] == [1, 2, 3, 4, 5, 6]
    assert _tensorboard_losses(resumed) == _tensorboard_losses(straight) == want  # steps 4-6 purged, then logged again
    assert _mlflow_losses(resumed) == _mlflow_losses(straight) == want  # one run, each step once
    assert (resumed / "mlflow_run_id").read_text() == run_id


@pytest.mark.slow
def test_wandb_resumes_the_run_the_directory_keeps(tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        args = [*ARGS, "training.report_to=[wandb]"]
        result = run_main(*args, f"infra.output_dir={out}")
        assert result.returncode == 0, result.stderr[-3000:]
        run_id = (out / "wandb_run_id").read_text().strip()
        resume_from_checkpoint(args, out, 3)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert (out / "wandb_run_id").read_text().strip() == run_id
    offline = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(
        name.endswith(run_id) for name in offline
    )  # both parts are the one run (synced as one)


def test_tierlm_train_from_python_calls_the_callbacks(tmp_path, reports):
    """`tierlm.train(config, stage, overrides, callbacks)`: the whole stage, as the CLI runs it, with the
    loop's events handed to the caller's callbacks."""
    import tierlm

    events = []

    class Recorder:
        def on_log(self, record):
            events.append(("log", record["step"]))

        def on_eval(self, metrics):
            events.append(("eval", round(metrics["val_loss"], 3)))

        def on_save(self, path):
            events.append(("save", path.name))

    overrides = [
        *[a for a in TINY if not a.startswith("infra.output_dir")],
        "training.num_train_steps=4",
        "training.eval_steps=2",
        "training.save_steps=2",
        "training.logging_steps=2",
        f"infra.output_dir={tmp_path / 'run'}",
    ]
    summary = tierlm.train("tiny_pretrain", "pretrain", overrides, callbacks=[Recorder()])
    assert summary["step"] == 4 and (tmp_path / "run" / "report.md").is_file()
    kinds = [e[0] for e in events]
    assert kinds.count("log") == 2 and kinds.count("save") == 2 and kinds.count("eval") == 3  # evals at steps 0, 2, 4
    assert ("save", "step_4") in events


@pytest.mark.parametrize("second", ["right", "low again"])
def test_no_mfu_over_100_percent_when_the_peak_was_measured_low(tmp_path, monkeypatch, second):
    """The CPU peak measured while something else ran is low, and every step beats it: the trainer measures it again
    at the first such step; measured low again, the MFU becomes unknown (no figure, one warning) — never over 100%."""
    import json

    from conftest import TINY, run_main
    from tierlm.metrics import flops

    flops._measured_cpu_flops.cache_clear()
    real, calls = flops.measure_cpu_flops, []

    def slowed(dtype):
        calls.append(1)
        return 1e6 if len(calls) == 1 or second == "low again" else real(dtype)

    monkeypatch.setattr(flops, "measure_cpu_flops", slowed)
    out = tmp_path / "run"
    args = ["pretrain", "--config", "configs/tiny_pretrain.yaml", *TINY, "training.num_train_steps=3"]
    result = run_main(*args, "training.logging_steps=1", f"infra.output_dir={out}")
    flops._measured_cpu_flops.cache_clear()
    assert result.returncode == 0, result.stderr
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert len(calls) == 2 and len(train) == 3
    assert all(r.get("mfu", 0.0) <= 1.0 for r in train)
    if second == "right":
        assert all(0 < r["mfu"] <= 1.0 for r in train)
    else:
        assert not any("mfu" in r for r in train) and "MFU is not printed from here on" in result.stderr


def test_the_in_loop_sample_lines_are_the_models_greedy_answers(tiny_runs):
    """Each evaluation logs a `sample` line per training.sample_prompts prompt; the last ones are what transformers'
    own greedy decoding of the final model folder writes (the SFT run: the prompts as user turns)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tierlm.config import TierlmConfig
    from tierlm.data import load_tokenizer
    from tierlm.rollout.text import readable_text

    run = tiny_runs / "sft"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    config = TierlmConfig.load(run / "config.yaml")
    prompts = config.training.sample_prompts
    evals = [r["step"] for r in records if r["type"] == "eval"]
    samples = [r for r in records if r["type"] == "sample"]
    assert prompts and evals and [(s["step"], s["prompt"]) for s in samples] == [(e, p) for e in evals for p in prompts]
    tokenizer = load_tokenizer(run / "model")
    model = AutoModelForCausalLM.from_pretrained(run / "model").eval()
    for sample in samples[-len(prompts) :]:
        ids = tokenizer.render_for_completion([{"role": "user", "content": sample["prompt"]}])
        budget = config.training.sample_max_new_tokens
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=budget, do_sample=False, eos_token_id=tokenizer.stop_ids
            )
        assert sample["completion"] == readable_text(tokenizer, out[0, len(ids) :].tolist())

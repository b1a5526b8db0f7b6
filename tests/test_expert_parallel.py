"""Expert parallelism (`infra.expert_parallel_size`, `tierlm.backends.expert_parallel`) under torchrun with gloo: two
ranks sharing out the experts take the steps one process takes at the same global batch, resume bit for bit, reshard
into one process, and export the whole model (transformers' Qwen3-MoE loads it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_main, torchrun

COMMON = [
    "pretrain", "--config", "configs/tiny_pretrain.yaml", "model.moe.num_experts=4", "training.num_train_steps=8",
    "training.warmup_steps=2", "training.save_steps=4", "training.eval_steps=4", "training.logging_steps=2",
    "data.num_synthetic_examples=2000", "infra.progress_bar=false",
]  # fmt: skip
TWO_RANKS = ["training.per_device_train_batch_size=8", "infra.expert_parallel_size=2"]
ONE = ["training.per_device_train_batch_size=16"]


def _lines(run: Path) -> list[tuple[str, int, float, float | None]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [
        (r["type"], r["step"], r["loss"] if r["type"] == "train" else r["val_loss"], r.get("grad_norm"))
        for r in records
        if r["type"] in ("train", "eval")
    ]


def _back_to(run: Path, step: int) -> None:
    """The run as if it had stopped after its step-`step` checkpoint."""
    for later in (run / "checkpoints").glob("step_*"):
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    (run / "checkpoints" / "latest").write_text(f"step_{step}\n")


@pytest.mark.slow
def test_two_expert_parallel_ranks_train_resume_and_export_as_one_process(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    done = torchrun("-m", "tierlm", *COMMON, *TWO_RANKS, f"infra.output_dir={two}")
    assert done.returncode == 0, done.stderr[-3000:]
    done = run_main(*COMMON, *ONE, f"infra.output_dir={one}")
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = _lines(two), _lines(one)
    assert [x[:2] for x in a] == [x[:2] for x in b]
    for x, y in zip(a, b):  # the losses, and the gradient norm (the experts' part summed over the ranks)
        assert abs(x[2] - y[2]) < 1e-5 and (x[3] is None or abs(x[3] - y[3]) < 1e-5 * max(1.0, y[3])), (x, y)
    train = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    alone = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    assert train[-1]["param_bytes"] < 0.8 * alone[-1]["param_bytes"]  # half the experts on each rank

    # The 2-rank checkpoint read whole by one process (each rank's experts are shards of the whole): the weights the
    # one-process run saved at the same step.
    from tierlm.checkpoint import load_checkpoint
    from tierlm.models import load_native_model

    alone = load_native_model(one / "checkpoints" / "step_4" / "model")
    resharded = load_native_model(one / "checkpoints" / "step_4" / "model")
    with torch.no_grad():
        for p in resharded.parameters():
            p.zero_()
    load_checkpoint(two / "checkpoints" / "step_4", resharded, restore_rng=False)
    for (name, mine), theirs in zip(resharded.state_dict().items(), alone.state_dict().values()):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4, msg=name)

    _back_to(two, 4)
    done = torchrun("-m", "tierlm", *COMMON, *TWO_RANKS, f"infra.output_dir={two}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _lines(two) == a  # bit for bit

    from transformers import AutoModelForCausalLM

    theirs, ours = (AutoModelForCausalLM.from_pretrained(run / "model") for run in (two, one))
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, atol=1e-3, rtol=1e-3)


def test_expert_parallelism_refuses_a_model_without_experts_in_one_line(tmp_path):
    from tierlm.backends.expert_parallel import ExpertParallelTrainingBackend
    from tierlm.backends.options import BackendOptions
    from tierlm.errors import ConfigError
    from tierlm.models import GPTConfig, build_gpt

    dense = build_gpt(GPTConfig(depth=1, aspect_ratio=16, head_dim=16, vocab_size=10, max_seq_len=8))
    with pytest.raises(ConfigError, match="this model has none: set model.moe.num_experts"):
        ExpertParallelTrainingBackend(
            dense, torch.optim.SGD, None, tmp_path, "cpu", options=BackendOptions(expert_parallel_size=2)
        )

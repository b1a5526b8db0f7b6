"""Expert parallelism (`infra.expert_parallel_size`, `tierlm.backends.expert_parallel`) with gloo: ranks forked as
torchrun starts them (tests/forked.py; test_distributed checks they see what torchrun's ranks see): two ranks sharing
out the experts take the steps one process takes at the same global batch, resume bit for bit, reshard into one
process, and export the whole model (transformers' Qwen3-MoE loads it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_main
from forked import ranks

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


def _same_steps(run: Path, one: Path) -> list:
    """`run`'s losses and gradient norms (the experts' part summed over the ranks) are the one-process run's."""
    a, b = _lines(run), _lines(one)
    assert [x[:2] for x in a] == [x[:2] for x in b]
    for x, y in zip(a, b):
        assert abs(x[2] - y[2]) < 1e-5 and (x[3] is None or abs(x[3] - y[3]) < 1e-5 * max(1.0, y[3])), (x, y)
    return a


def _param_bytes(run: Path) -> float:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["type"] == "train"][-1]["param_bytes"]


def _reads_whole(run: Path, one: Path) -> None:
    """`run`'s step-4 checkpoint read whole by one process (each rank's experts, and FSDP2's dense shards, are shards
    of the whole): the weights and balancing biases the one-process run saved at the same step."""
    from tierlm.checkpoint import load_checkpoint
    from tierlm.models import load_native_model

    alone = load_native_model(one / "checkpoints" / "step_4" / "model")
    resharded = load_native_model(one / "checkpoints" / "step_4" / "model")
    with torch.no_grad():
        for p in [*resharded.parameters(), *(b for n, b in resharded.named_buffers() if n.endswith("expert_bias"))]:
            p.zero_()
    # The balancing bias moved (each rank's expert load summed over the ranks before it does) and came back whole.
    assert all(b.abs().sum() > 0 for n, b in alone.named_buffers() if n.endswith("expert_bias"))
    load_checkpoint(run / "checkpoints" / "step_4", resharded, restore_rng=False)
    for (name, mine), theirs in zip(resharded.state_dict().items(), alone.state_dict().values()):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_two_expert_parallel_ranks_train_resume_and_export_as_one_process(tmp_path):
    """Beside DDP (the default) and beside FSDP2 (infra.distributed_type=fsdp: the dense weights sharded too)."""
    two, fsdp, one = tmp_path / "two", tmp_path / "fsdp", tmp_path / "one"
    done = run_main(*COMMON, *ONE, f"infra.output_dir={one}")
    assert done.returncode == 0, done.stderr[-3000:]
    done = ranks("-m", "tierlm", *COMMON, *TWO_RANKS, f"infra.output_dir={two}")
    assert done.returncode == 0, done.stderr[-3000:]
    a = _same_steps(two, one)
    assert _param_bytes(two) < 0.8 * _param_bytes(one)  # half the experts on each rank
    _reads_whole(two, one)
    done = ranks("-m", "tierlm", *COMMON, *TWO_RANKS, "infra.distributed_type=fsdp", f"infra.output_dir={fsdp}")
    assert done.returncode == 0, done.stderr[-3000:]
    _same_steps(fsdp, one)
    # half of every weight on each rank: the experts shared out, FSDP2's shards of the rest (DDP kept the rest whole)
    assert abs(_param_bytes(fsdp) - _param_bytes(one) / 2) < 0.01 * _param_bytes(one) < _param_bytes(two)
    assert json.loads((fsdp / "model" / "training_meta.json").read_text())["distributed_type"] == "expert_parallel_fsdp"
    _reads_whole(fsdp, one)
    # Its step-4 checkpoint resumed by one process at the same global batch: weights, optimizer and schedule reshard.
    _back_to(fsdp, 4)
    done = run_main(*COMMON, *ONE, f"infra.output_dir={fsdp}")
    assert done.returncode == 0, done.stderr[-3000:]
    _same_steps(fsdp, one)

    _back_to(two, 4)
    done = ranks("-m", "tierlm", *COMMON, *TWO_RANKS, f"infra.output_dir={two}")  # resuming at two ranks
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

"""Tensor and pipeline parallelism (issue 21) with real processes: torchrun, gloo on CPU, one thread per rank.

The reference is one process on the same global batches (tests/distributed_worker.py's "single" mode):
10 AdamW steps with clipping, two micro-batches of uneven trained tokens per step, a decaying LR.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_distributed import assert_same_steps, run_worker


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    return {**run_worker("single", out / "single.json", save_at=5, checkpoint_dir=out / "ckpt"), "step_5": out / "ckpt" / "step_5"}


def test_tensor_parallel_matches_one_process_and_splits_the_blocks(single, tmp_path):
    tp = run_worker("tp", tmp_path / "tp.json", save_at=5, checkpoint_dir=tmp_path / "ckpt")
    assert_same_steps(tp["steps"], single["steps"], tol=1e-4)
    # each rank holds half of every block's projections (the embeddings, the head and the norms stay whole)
    assert tp["memory"]["param_bytes"] < 0.8 * single["memory"]["param_bytes"]
    # a TP=2 checkpoint resumes in one process as if the run never stopped
    resumed = run_worker("single", tmp_path / "resumed.json", steps="5:10", load=tmp_path / "ckpt" / "step_5",
                         checkpoint_dir=tmp_path / "ckpt_single")
    assert_same_steps(resumed["steps"], single["steps"][5:], tol=1e-4)


def test_one_process_checkpoint_resumes_tensor_parallel(single, tmp_path):
    resumed = run_worker("tp", tmp_path / "tp.json", steps="5:10", load=single["step_5"])
    assert_same_steps(resumed["steps"], single["steps"][5:], tol=1e-4)


def test_tensor_parallel_times_fsdp_on_four_ranks_matches_one_process(single, tmp_path):
    both = run_worker("tp_dp", tmp_path / "tp_dp.json", nproc=4)
    assert both["world_size"] == 4
    assert_same_steps(both["steps"], single["steps"], tol=1e-4)


@pytest.mark.parametrize("mode", ["pp", "pp_gpipe"])
def test_pipeline_stages_match_one_process(single, mode, tmp_path):
    """2 stages of one block each, 2 pipeline micro-batches per micro-batch (1F1B and GPipe)."""
    pp = run_worker(mode, tmp_path / "pp.json", save_at=5, checkpoint_dir=tmp_path / "ckpt")
    assert_same_steps(pp["steps"], single["steps"], tol=1e-4)
    if mode == "pp":  # each stage wrote its own blocks and their optimizer state: one checkpoint, resumed in one process
        resumed = run_worker("single", tmp_path / "resumed.json", steps="5:10", load=tmp_path / "ckpt" / "step_5",
                             checkpoint_dir=tmp_path / "ckpt_single")
        assert_same_steps(resumed["steps"], single["steps"][5:], tol=1e-4)
        back = run_worker("pp", tmp_path / "back.json", steps="5:10", load=single["step_5"])
        assert_same_steps(back["steps"], single["steps"][5:], tol=1e-4)


def test_cli_tensor_and_pipeline_parallel_runs_train_as_one_process_and_export(tmp_path):
    """`torchrun -m tierlm pretrain` with infra.tensor_parallel_size=2, then pipeline_parallel_size=2 (4 blocks, 2
    stages; evaluation through the stages): the losses and the exported model of one process; a tensor-parallel
    checkpoint resumed in one process."""
    import json
    import shutil

    from safetensors.torch import load_file

    from tests.conftest import run_cli, torchrun

    common = ["pretrain", "--config", "configs/tiny_pretrain.yaml", "model.depth=4", "model.aspect_ratio=16", "training.num_train_steps=6",
              "training.warmup_steps=1", "training.save_steps=3", "training.eval_steps=3", "training.logging_steps=1",
              "data.num_synthetic_examples=2000", "training.per_device_train_batch_size=4", "infra.progress_bar=false"]

    def lines(run) -> list[tuple]:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [(r["type"], r["step"], r["loss"] if r["type"] == "train" else r["val_loss"]) for r in records if r["type"] in ("train", "eval")]

    one = tmp_path / "one"
    assert (result := run_cli(*common, f"infra.output_dir={one}")).returncode == 0, result.stderr[-3000:]
    reference, final = lines(one), load_file(one / "model" / "model.safetensors")
    for name, sizes in (("tp", ["infra.tensor_parallel_size=2"]), ("pp", ["infra.pipeline_parallel_size=2", "model.tie_embeddings=false"])):
        if name == "pp":  # the reference with untied embeddings too
            assert (result := run_cli(*common, *sizes[1:], f"infra.output_dir={one}_untied")).returncode == 0, result.stderr[-3000:]
            reference, final = lines(tmp_path / "one_untied"), load_file(tmp_path / "one_untied" / "model" / "model.safetensors")
        run = tmp_path / name
        result = torchrun("-m", "tierlm", *common, *sizes, f"infra.output_dir={run}")
        assert result.returncode == 0, result.stderr[-3000:]
        got = lines(run)
        assert [r[:2] for r in got] == [r[:2] for r in reference]
        assert all(abs(a[2] - b[2]) < 1e-4 for a, b in zip(got, reference)), (name, got, reference)
        exported = load_file(run / "model" / "model.safetensors")
        assert exported.keys() == final.keys() and all(torch.allclose(exported[k], final[k], atol=1e-4) for k in final), name
    # the tensor-parallel run's step-3 checkpoint, resumed in one process, ends where the one-process run did
    run = tmp_path / "tp"
    shutil.rmtree(run / "checkpoints" / "step_6")
    (run / "checkpoints" / "latest").write_text("step_3\n")
    assert (result := run_cli(*common, f"infra.output_dir={run}")).returncode == 0, result.stderr[-3000:]
    assert all(abs(a[2] - b[2]) < 1e-4 for a, b in zip(lines(run), lines(one)))

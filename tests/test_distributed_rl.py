"""RL and DPO at two ranks (gloo on CPU, one thread per rank): the rollouts and steps one process takes, under DDP
and FSDP2 (the ranks forked as torchrun would start them, tests/forked.py); an FSDP RL job on two "nodes" (two torchrun
agents) that loses a rank and resumes by itself. Its own file so that the test
workers deal it apart from tests/test_distributed.py (they split the suite by file)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from tests.conftest import run_main
from tests.forked import ranks


def test_rl_and_dpo_at_two_ranks(tiny_runs, tmp_path, monkeypatch):
    """`tierlm rl` at two ranks under DDP and FSDP2 draws the rollouts one process draws (each prompt's sampling
    keyed by its place in the global batch, every group on one rank) and takes the same steps (per-step losses
    1e-5, with a KL reference) after dealing the rows over the ranks by their cost; the FSDP run's sampler is a
    whole copy refreshed after every update, and a rank lost mid-run on two "nodes" is restarted by torchrun and
    resumes by itself, bit-identical. `tierlm dpo` at two ranks (FSDP) matches one process on the same global
    batch. (RL on a reward for digits: with the task's own, the tiny model earns 0 everywhere and no step moves the
    weights.)"""
    from conftest import digits_reward

    sft = tiny_runs / "sft"
    reward = digits_reward(tmp_path, monkeypatch)
    tiny = [
        "data.max_seq_length=64",
        "data.num_synthetic_examples=2000",
        "data.num_synthetic_eval_examples=32",
        "training.eval_batches=1",
        "infra.device_type=cpu",
        "infra.progress_bar=false",
    ]
    rl = [
        "rl",
        "--config",
        "configs/tiny_rl.yaml",
        f"model.model_name_or_path={sft}",
        *tiny,
        "training.num_train_steps=3",
        "training.eval_steps=0",
        "training.save_steps=2",
        "training.logging_steps=1",
        "rl.algorithm=grpo",
        "rl.kl_coef=0.05",
        "rl.eval_problems=4",
        "rl.prompts_per_step=4",
        "rl.group_size=2",
        "rl.max_new_tokens=6",
        "rl.micro_batch_size=2",
        reward,
    ]
    one = tmp_path / "rl1"
    result = run_main(*rl, f"infra.output_dir={one}")
    assert result.returncode == 0, result.stderr[-3000:]
    for kind in ("ddp", "fsdp"):
        out = tmp_path / f"rl_{kind}"
        result = ranks("-m", "tierlm", *rl, f"infra.distributed_type={kind}", f"infra.output_dir={out}")
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.count("held-out pass@1") == 1
        assert json.loads((out / "model" / "training_meta.json").read_text())["distributed_type"] == kind
        records, reference = (
            [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in (out, one)
        )
        assert [(r["type"], r["step"]) for r in records] == [(r["type"], r["step"]) for r in reference]
        for a, b in zip(records, reference):
            assert a.get("completion_len") == b.get("completion_len") and a.get("reward_mean") == b.get("reward_mean")
            for key in ("loss", "kl", "grad_norm", "pass@1", "pass@k"):
                assert abs(a.get(key, 0.0) - b.get(key, 0.0)) < 1e-5, (kind, key, a, b)
            if "kl" in b:  # every rank's tokens' mean, as one process's (not rank 0's alone)
                assert a["kl"] == pytest.approx(b["kl"], rel=1e-4), (kind, a["kl"], b["kl"])
        train = [r for r in records if r["type"] == "train"]
        assert [r["weight_version"] for r in train] == [0, 1, 2]  # rollouts of step n: the weights after n updates
        # the rows dealt over the ranks by their FLOPs (rl.balance_ranks): never worse than as sampled
        assert all(1.0 <= r["rank_imbalance"] <= r["rank_imbalance_before"] for r in train), train
        assert all(r["logprob_abs_diff"] < 1e-4 for r in train)  # the FSDP sampler's copy is the policy
        assert all(r["grad_norm"] > 0 for r in train)  # the steps move the weights
    assert (out / "checkpoints" / "step_3" / "state").is_dir() and (out / "model" / "model.safetensors").is_file()

    # The FSDP job on two "nodes" (torchrun agents, --max-restarts 1): a rank SIGKILLed as it begins step 3, after
    # the step-2 checkpoint; torchrun restarts the group, which resumes by itself and ends with the uninterrupted
    # run's weights.
    from tests.test_monitor import ENV, two_nodes

    killed = tmp_path / "rl_killed"
    args = ["-m", "tierlm", *rl, "infra.distributed_type=fsdp", f"infra.output_dir={killed}"]
    path = os.pathsep.join([ENV["PYTHONPATH"], os.environ["PYTHONPATH"]])  # tierlm's tree, then the reward's module
    jobs = two_nodes(args, {**ENV, "TIERLM_FAULT_KILL": "0:3", "PYTHONPATH": path})
    outputs = [job.communicate(timeout=400) for job in jobs]
    assert all(job.returncode == 0 for job in jobs), [err[-3000:] for _, err in outputs]
    assert sum(out_.count("held-out pass@1") for out_, _ in outputs) == 1  # the restarted group finished once
    straight, resumed = (load_file(run / "model" / "model.safetensors") for run in (out, killed))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)

    # DPO at 2 ranks x 4 pairs computes what 1 process x 8 pairs does (pairs are never split across ranks).
    dpo = [
        "dpo",
        "--config",
        "configs/tiny_dpo.yaml",
        f"model.model_name_or_path={sft}",
        *tiny,
        "data.num_synthetic_examples=64",
        "data.num_synthetic_eval_examples=16",
        "training.num_train_steps=4",
        "training.eval_steps=2",
        "training.logging_steps=1",
        "training.warmup_steps=0",
        "training.per_device_eval_batch_size=4",
        "training.eval_batches=4",
    ]
    result = ranks(
        "-m", "tierlm", *dpo, "training.per_device_train_batch_size=4", f"infra.output_dir={tmp_path / 'dpo2'}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_main(*dpo, "training.per_device_train_batch_size=8", f"infra.output_dir={tmp_path / 'dpo1'}")
    assert result.returncode == 0, result.stderr[-3000:]
    two, one = (
        [
            r
            for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())
            if r["type"] in ("train", "eval")
        ]
        for run in ("dpo2", "dpo1")
    )  # FSDP writes no "sample" lines
    assert [(r["type"], r["step"]) for r in two] == [(r["type"], r["step"]) for r in one]
    for a, b in zip(two, one):
        for key in ("loss", "val_loss", "pref_acc", "reward_margin"):
            if key in a:
                assert abs(a[key] - b[key]) < 1e-4, (key, a, b)

    # TR-DPO under DDP: each rank mixes its whole copy of the policy into its reference, as one process does.
    synced = [*dpo, "training.save_steps=4", "dpo.reference_sync_steps=2", "dpo.reference_mixup_alpha=0.5"]
    out2, out1 = tmp_path / "tr2", tmp_path / "tr1"
    result = ranks("-m", "tierlm", *synced, "infra.distributed_type=ddp", "training.per_device_train_batch_size=4",
                   f"infra.output_dir={out2}")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_main(*synced, "training.per_device_train_batch_size=8", f"infra.output_dir={out1}")
    assert result.returncode == 0, result.stderr[-3000:]
    two, one = ([r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                 if r["type"] in ("train", "eval")] for run in (out2, out1))  # fmt: skip
    assert [(r["type"], r["step"]) for r in two] == [(r["type"], r["step"]) for r in one]
    for a, b in zip(two, one):
        for key in ("loss", "val_loss", "reward_margin"):
            if key in a:
                assert abs(a[key] - b[key]) < 1e-4, (key, a, b)
    refs = [load_file(run / "checkpoints" / "step_4" / "reference.safetensors") for run in (out2, out1)]
    assert refs[0].keys() == refs[1].keys() and all(torch.allclose(refs[0][k], refs[1][k], atol=1e-5) for k in refs[1])

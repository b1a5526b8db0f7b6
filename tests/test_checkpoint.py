"""Checkpoints you can trust: kill-and-resume exactness, crash-safe writes, safe loading, retention,
averaging, export, non-finite steps, failing writers and async saves."""

import json
import os
import pickle
import signal
import subprocess
import time

import pytest
import torch

from conftest import kill_at_checkpoint, run_main
from forked import start
from tierlm import checkpoint
from tierlm.backends import PyTorchTrainingBackend
from tierlm.backends.options import BackendOptions
from tierlm.errors import CheckpointError, TrainingDiverged
from tierlm.models import GPTConfig, build_gpt

TINY_RUN = [
    "model.depth=2",
    "model.aspect_ratio=32",
    "model.head_dim=32",
    "tokenizer.vocab_size=300",
    "data.num_synthetic_examples=3000",
    "data.num_synthetic_eval_examples=64",
    "data.max_seq_length=64",
    "training.per_device_train_batch_size=8",
    "training.eval_batches=1",
    "training.eval_steps=0",
    "training.logging_steps=1",
    "training.warmup_steps=2",
    "infra.progress_bar=false",
    "infra.device_type=cpu",
]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _weights(run):
    from safetensors.torch import load_file

    return load_file(run / "model" / "model.safetensors")


MUON = [
    "training.optimizer=muon",
    "training.muon_momentum_warmup_steps=40",
    "training.weight_decay=0.1",
    "training.muon_refinements=[polar_express,normuon,cautious_wd]",  # NorMuon's second moment resumes too
]
PRUNE = [
    "training.optimizer=adamw_prune",
    "training.prune_warmup=10",
    "training.prune_frequency=5",
    "training.prune_sparsity=0.5",
]


@pytest.mark.slow
# Plain AdamW's state is a subset of AdamWPrune's (AdamW with more state): it covers it. AdamWSPAM's state round trip
# is tested in process (tests/test_optimizers.py), which saves the suite a third killed run. Not `serial`: the kill
# waits for the step-20 checkpoint, whatever the machine's load, and a busier machine only leaves it more room.
@pytest.mark.parametrize("optimizer", [MUON, PRUNE], ids=["muon+adamw", "adamw_prune"])
def test_sigkill_then_resume_is_bit_identical(tmp_path, optimizer):
    """2N steps straight == N steps, SIGKILL of the real process, resume for N more (CPU, fp32); with
    Muon + AdamW, the momentum warm-up and the weight-decay schedule run across the kill too."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    args = [
        "pretrain",
        "--config",
        "configs/tiny_pretrain.yaml",
        *TINY_RUN,
        *optimizer,
        "training.num_train_steps=60",
        "training.save_steps=20",
    ]
    assert run_main(*args, f"infra.output_dir={straight}").returncode == 0

    kill_at_checkpoint(args, killed, 20)
    assert not (killed / "checkpoints" / "step_60").exists()

    result = run_main(*args, f"infra.output_dir={killed}", "--resume")
    assert result.returncode == 0, result.stderr
    losses = lambda run: [(r["step"], r["loss"]) for r in _lines(run / "metrics.jsonl") if r["type"] == "train"]  # noqa: E731
    assert losses(killed) == losses(straight) and len(losses(straight)) == 60
    a, b = _weights(straight), _weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if (
        optimizer is PRUNE
    ):  # the saved (exportable) weights are the masked ones: half the hidden matrices' entries are 0
        hidden = [v for k, v in a.items() if k.startswith("model.layers.") and v.ndim == 2]
        zeros = sum(int((v == 0).sum()) for v in hidden) / sum(v.numel() for v in hidden)
        assert abs(zeros - 0.5) < 0.01, zeros
        assert "sparsity" in [r for r in _lines(killed / "metrics.jsonl") if r["type"] == "train"][-1]
        results = json.loads((killed / "results.json").read_text())  # the pruning evaluation beside the model
        assert (
            abs(results["sparsity"] - 0.5) < 0.01 and 0.25 < results["weight_zeros"] < zeros
        )  # all matrices, embeddings too
        assert {"perplexity", "latency_ms_p50_T64", "latency_ms_p95_T64", "peak_rss_mb"} <= set(results)


WRITER = """
import sys, torch
from tierlm import checkpoint
from tierlm.models import GPTConfig, build_gpt
model = build_gpt(GPTConfig(depth=4, aspect_ratio=64, head_dim=64, vocab_size=8192, max_seq_len=64))  # ~7M params
optimizer = torch.optim.AdamW(model.parameters())
model(torch.zeros(1, 4, dtype=torch.long)).sum().backward(); optimizer.step()
step = 0
while True:
    step += 1
    with torch.no_grad():
        next(model.parameters()).fill_(step)  # each checkpoint's weights say which step wrote them
    checkpoint.save_checkpoint(sys.argv[1], step, model, optimizer, trainer_state={"step": step})
    if step == 1:
        print("ready", flush=True)
"""


@pytest.mark.slow
@pytest.mark.serial
def test_sigkill_while_writing_never_leaves_a_bad_latest(tmp_path):
    """Kill a process that saves checkpoints back to back, at random moments, many times: `latest` always loads."""
    import random

    rng, caught_mid_write = random.Random(0), 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for trial in range(8):
        root = tmp_path / f"trial{trial}"
        proc = start("-c", WRITER, root, stdout=subprocess.PIPE, env=env)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        caught_mid_write += any(p.name.startswith(".tmp_step_") for p in root.iterdir())
        latest = checkpoint.find_latest_checkpoint(root)
        assert latest is not None and checkpoint.verify_checkpoint(latest) is None
        model = build_gpt(GPTConfig(depth=4, aspect_ratio=64, head_dim=64, vocab_size=8192, max_seq_len=64))
        state = checkpoint.load_checkpoint(latest, model, torch.optim.AdamW(model.parameters()), restore_rng=False)
        assert next(model.parameters()).flatten()[0].item() == state["step"] == int(latest.name.split("_")[1])
    assert caught_mid_write >= 2, f"only {caught_mid_write} of 8 kills landed during a write; the test did not bite"


def _backend(tmp_path, **kwargs):
    model = build_gpt(GPTConfig(depth=1, aspect_ratio=32, head_dim=16, vocab_size=40, max_seq_len=16))
    return PyTorchTrainingBackend(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        None,
        tmp_path / "ckpt",
        "cpu",
        None,
        BackendOptions(**kwargs),
    )


def _batch():
    return {"input_ids": torch.randint(0, 40, (2, 8)), "labels": torch.randint(0, 40, (2, 8))}


def forge_meta(checkpoint_path):
    """What an attacker who edits a checkpoint can also do: record the new files' sizes and hashes."""
    meta = json.loads((checkpoint_path / "meta.json").read_text())
    meta.update(checkpoint.file_manifest(checkpoint_path, exclude=("meta.json",)))
    (checkpoint_path / "meta.json").write_text(json.dumps(meta))


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {Evil.marker}",))


def test_malicious_pickle_is_never_executed(tmp_path):
    backend = _backend(tmp_path)
    backend.forward_backward(_batch())
    backend.optim_step()
    path = backend.save_checkpoint(1).wait()
    Evil.marker = tmp_path / "pwned"
    (path / "train_state.pt").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="is damaged"):  # the recorded size and hash catch the change...
        backend.load_checkpoint(path).wait()
    forge_meta(path)  # ...but an attacker can rewrite meta.json too: the reader itself must refuse
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        backend.load_checkpoint(path).wait()
    assert not Evil.marker.exists()


def test_damaged_latest_falls_back_to_the_previous(tmp_path, capsys):
    from tierlm.config import TierlmConfig
    from tierlm.stages import run_stage

    overrides = [*TINY_RUN, "training.num_train_steps=10", "training.save_steps=5", f"infra.output_dir={tmp_path}"]
    config = TierlmConfig.load("configs/tiny_pretrain.yaml", overrides)
    run_stage(config, "pretrain")
    weights = tmp_path / "checkpoints" / "step_10" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated, as by a full disk or a crash
    assert "model/model.safetensors is 1000 bytes" in checkpoint.verify_checkpoint(weights.parents[1])
    summary = run_stage(TierlmConfig.load("configs/tiny_pretrain.yaml", overrides), "pretrain")
    assert summary["resumed_from"].endswith("step_5")
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tierlm: warning")]
    assert len(warnings) == 1 and "step_10" in warnings[0] and "damaged" in warnings[0]


def _fake_checkpoint(root, step, metric):
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"step": step, "metric": metric, "files": {}}))
    (root / "latest").write_text(f"step_{step}\n")


def test_retention_keeps_newest_and_best(tmp_path):
    for step, metric in zip(range(1, 7), [3.0, 1.0, 4.0, None, 5.0, 6.0]):
        _fake_checkpoint(tmp_path, step, metric)
    checkpoint.prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_2", "step_5", "step_6"]
    assert checkpoint.find_best_checkpoint(tmp_path).name == "step_2"


def test_average_equals_hand_computed_mean(tmp_path):
    from tierlm.models import load_native_model, save_model_folder

    config = GPTConfig(depth=1, aspect_ratio=32, head_dim=16, vocab_size=40, max_seq_len=16)
    models = [build_gpt(config) for _ in range(3)]
    for i, model in enumerate(models):
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(i, 1.0)
    folders = [save_model_folder(m, tmp_path / f"m{i}") for i, m in enumerate(models)]
    result = run_main("average", *folders, "--out", tmp_path / "avg")
    assert result.returncode == 0, result.stderr
    averaged = load_native_model(tmp_path / "avg")
    for name, param in averaged.named_parameters():
        expected = sum(dict(m.named_parameters())[name] for m in models) / 3
        assert torch.allclose(param, expected, atol=1e-6), name
    with pytest.raises(CheckpointError, match="at least 2"):
        checkpoint.average_checkpoints(folders[:1], tmp_path / "one")


def test_export_loads_in_transformers_with_equal_logits(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = _backend(tmp_path)
    with torch.no_grad():
        for p in backend.model.parameters():
            p.normal_(0, 0.2)
    path = backend.save_checkpoint(1, write_extra=lambda folder: tiny_tokenizer.save(folder / "model")).wait()
    result = run_main("export", path, tmp_path / "exported")
    assert result.returncode == 0, result.stderr
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert AutoTokenizer.from_pretrained(tmp_path / "exported").chat_template
    ids = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - backend.model(ids)).abs().max().item() <= 1e-4
    assert run_main("export", path, tmp_path / "exported").returncode == 2  # never overwrites


def test_nonfinite_steps_are_skipped_then_the_run_stops(tmp_path):
    from tierlm.config import TrainingConfig
    from tierlm.loops.trainer import Trainer
    from tierlm.strategies import PretrainStrategy

    class PoisonedStrategy(PretrainStrategy):
        poisoned_steps: set = {3, 5, 6, 7}
        step = 0

        def compute_loss(self, logits, batch):
            total, count = super().compute_loss(logits, batch)
            return (total * float("nan"), count) if self.step in self.poisoned_steps else (total, count)

    class Loader:
        def next_batch(self):
            return {"tokens": torch.randint(0, 40, (2, 9))}

        def state_dict(self):
            return {}

    backend = _backend(tmp_path, max_grad_norm=1.0)
    strategy = PoisonedStrategy()
    trainer = Trainer(
        backend,
        strategy,
        train_loader=Loader(),
        config=TrainingConfig(
            num_train_steps=10, save_steps=2, eval_steps=0, logging_steps=1, max_consecutive_nonfinite=3
        ),
    )
    original = trainer.step

    def step_and_count(batches):
        strategy.step = trainer.state.step + 1
        before = [p.detach().clone() for p in backend.model.parameters()]
        metrics = original(batches)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, backend.model.parameters()))
        assert unchanged == bool(metrics["skipped"]) == (strategy.step in strategy.poisoned_steps)
        return metrics

    trainer.step = step_and_count
    with pytest.raises(TrainingDiverged, match="3 consecutive steps .up to step 7.*Last good checkpoint: .*step_6"):
        trainer.train()
    assert trainer.state.skipped_steps == 4
    assert checkpoint.verify_checkpoint(tmp_path / "ckpt" / "step_6") is None


def test_failing_writer_is_a_clear_error_and_keeps_older_checkpoints(tmp_path, monkeypatch):
    import errno

    backend = _backend(tmp_path)
    first = backend.save_checkpoint(1).wait()

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.core.torch, "save", full_disk)
    with pytest.raises(
        CheckpointError, match="could not write checkpoint .*step_2: No space left on device; older checkpoints"
    ):
        backend.save_checkpoint(2).wait()
    assert checkpoint.find_latest_checkpoint(tmp_path / "ckpt") == first and checkpoint.verify_checkpoint(first) is None
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] and not any(
        p.name.startswith(".tmp") for p in (tmp_path / "ckpt").iterdir()
    )


def test_async_save_writes_the_same_files_as_sync(tmp_path):
    torch.manual_seed(3)
    sync = _backend(tmp_path / "sync")
    torch.manual_seed(3)
    background = _backend(tmp_path / "async", async_save=True)
    batch = _batch()
    for backend in (sync, background):
        backend.forward_backward(batch)
        backend.optim_step()
    torch.manual_seed(7)
    a = sync.save_checkpoint(1, {"x": 1}).wait()
    torch.manual_seed(7)
    future = background.save_checkpoint(1, {"x": 1})
    with torch.no_grad():  # training goes on at once; the checkpoint holds the state at save time
        for p in background.model.parameters():
            p.add_(1.0)
    b = future.wait()
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for name in files:
        if name.name == "meta.json":
            strip = lambda path: {k: v for k, v in json.loads(path.read_text()).items() if k != "saved_at"}  # noqa: E731
            assert strip(a / name) == strip(b / name)
        else:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_garbage_collection_is_frozen_after_the_first_step_and_given_back_after(tmp_path, monkeypatch):
    """The loop collects once after the first step and freezes what survives (no GC pass over the model's objects
    again), then collects every GC_COLLECT_STEPS steps; after the run the collector is on again and nothing stays
    frozen (a process group held by a cycle must be collectable before exit)."""
    import gc

    from tierlm.config import TrainingConfig
    from tierlm.loops import trainer as trainer_module
    from tierlm.strategies import PretrainStrategy

    class Loader:
        def next_batch(self):
            return {"tokens": torch.randint(0, 40, (2, 9))}

    calls, enabled_during = [], []
    real_collect = gc.collect
    monkeypatch.setattr(trainer_module, "GC_COLLECT_STEPS", 3)
    monkeypatch.setattr(trainer_module.gc, "collect", lambda *a: calls.append("collect") or real_collect(*a))
    trainer = trainer_module.Trainer(
        _backend(tmp_path),
        PretrainStrategy(),
        train_loader=Loader(),
        config=TrainingConfig(num_train_steps=7, save_steps=0, eval_steps=0, logging_steps=1),
        progress_bar=False,
    )
    original = trainer.after_step
    trainer.after_step = lambda metrics, log: (original(metrics, log), enabled_during.append(gc.isenabled()))[0]
    gc.unfreeze()  # what conftest's `_suite_frozen` froze: a process that froze nothing, as a user's
    frozen_before = gc.get_freeze_count()
    trainer.train()
    assert calls == ["collect"] * 3  # after step 1, then at steps 3 and 6
    assert enabled_during == [False] * 7 and gc.isenabled() and gc.get_freeze_count() == frozen_before == 0

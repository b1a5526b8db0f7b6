"""DDP and FSDP2 with real processes (gloo on CPU, one thread per rank).

References: a single process on the same global batch (the worker's "single" mode), and a run
that never stopped. The ranks are forked from a preloaded process (tests/forked.py) where what is tested is what they
compute; through torchrun where it is what torchrun does with them (a rank that raises or is killed, a signal).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.conftest import REPO, TINY, first_failure, run_main, torchrun
from tests.forked import ranks, start

WORKER = REPO / "tests" / "distributed_worker.py"


def run_worker(mode: str, out: Path, nproc: int = 2, **options) -> dict:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    if mode == "single":
        from tests.distributed_worker import main

        main([mode, str(out), *flags])
    else:
        result = ranks(WORKER, mode, out, *flags, nproc=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def assert_same_steps(a: list[dict], b: list[dict], tol: float = 1e-5) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= tol, (x, y)
        assert abs(x["grad_norm"] - y["grad_norm"]) <= tol, (x, y)
        assert x["lr"] == y["lr"]


def test_forked_processes_are_what_torchrun_and_popen_start(tmp_path):
    """tests/forked.py stands in for torchrun and for `subprocess.Popen([sys.executable, ...])` in the tests: each
    rank's environment (what tierlm reads of it), command line, working folder and exit code are the ones torchrun
    gives, a failing rank fails the job, and a single process's pipe, exit code and death by a signal are Popen's."""
    script = tmp_path / "show.py"  # each rank's line in one write() to the pipe the ranks share (print's could mix)
    script.write_text(
        "import json, os, sys\n"
        "keys = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'OMP_NUM_THREADS']\n"
        "seen = {k: os.environ.get(k) for k in keys}\n"
        "seen['present'] = [k for k in ('MASTER_ADDR', 'MASTER_PORT', 'TORCHELASTIC_RUN_ID') if k in os.environ]\n"
        "tree = os.environ['PYTHONPATH'].split(os.pathsep)[0]\n"
        "seen.update(argv=sys.argv[1:], cwd=os.getcwd(), name=__name__, tree=tree)\n"
        "os.write(1, ('SEEN ' + json.dumps(seen, sort_keys=True) + '\\n').encode())\n"
        "sys.exit(int(sys.argv[1]) if os.environ['RANK'] == '1' else 0)\n"
    )

    def seen(result) -> list[str]:
        return sorted(line for line in result.stdout.splitlines() if line.startswith("SEEN "))

    real, forked = torchrun(script, "0", "x"), ranks(script, "0", "x")
    assert real.returncode == forked.returncode == 0, (real.stderr[-2000:], forked.stderr[-2000:])
    assert len(seen(real)) == 2 and seen(forked) == seen(real)
    assert ranks(script, "3").returncode == 3  # rank 1's exit code ends the job
    one = start(script, "4", env={**os.environ, "RANK": "1", "PYTHONPATH": "tree"}, stdout=subprocess.PIPE)
    assert json.loads(one.stdout.read().removeprefix("SEEN "))["tree"] == "tree" and one.wait(60) == 4
    sleeper = start("-c", "import time; time.sleep(60)")
    sleeper.send_signal(signal.SIGKILL)
    assert sleeper.wait(30) == -signal.SIGKILL  # as subprocess.Popen's returncode says it


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    return {
        **run_worker("single", out / "single.json", save_at=5, checkpoint_dir=out / "ckpt"),
        "step_5": out / "ckpt" / "step_5",
    }


def test_ddp_matches_one_process(single, tmp_path):
    """2 ranks x 2 rows, 2 micro-batches with uneven trained tokens == 1 process x 4 rows, 10 steps (1e-5)."""
    ddp = run_worker("ddp", tmp_path / "ddp.json")
    assert_same_steps(ddp["steps"], single["steps"])
    assert single["steps"][-1]["loss"] < single["steps"][0]["loss"]  # it trained


def test_fsdp_matches_one_process_and_shards_memory(single, tmp_path):
    fsdp = run_worker("fsdp", tmp_path / "fsdp.json")
    assert_same_steps(fsdp["steps"], single["steps"])
    # Parameter and optimizer bytes per rank <= 1/N of one process's + 10%.
    for key in ("param_bytes", "optimizer_bytes"):
        assert fsdp["memory"][key] <= single["memory"][key] / 2 * 1.10, (key, fsdp["memory"], single["memory"])


@pytest.fixture(scope="module")
def single_muon(tmp_path_factory):
    out = tmp_path_factory.mktemp("single_muon")
    return run_worker("single", out / "single.json", optimizer="muon", checkpoint_dir=out / "ckpt")


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_muon_at_two_ranks_matches_one_process(single_muon, mode, tmp_path):
    """Muon (matrices, orthogonalised once each: by their owner rank, then broadcast) + AdamW (the
    rest), momentum warm-up and weight decay schedule: 2 DDP / FSDP2 ranks == 1 process, 10 steps (1e-5)."""
    two = run_worker(mode, tmp_path / f"{mode}.json", optimizer="muon")
    assert_same_steps(two["steps"], single_muon["steps"])
    assert single_muon["steps"][-1]["loss"] < single_muon["steps"][0]["loss"]


def test_a_gpt2_research_variant_at_two_ranks_matches_one_process(tmp_path):
    """GPT-2 V6 (RA gates, R-MLP with its mixer and extra gate: per-layer scalars FSDP2 shards unevenly) at 2 FSDP2
    ranks == 1 process, 10 steps (1e-5). (DDP's replicas hold whole modules: nothing variant-specific to split.)"""
    one = run_worker("single", tmp_path / "one.json", model="gpt2_v6")
    two = run_worker("fsdp", tmp_path / "fsdp.json", model="gpt2_v6")
    assert_same_steps(two["steps"], one["steps"])
    assert one["steps"][-1]["loss"] < one["steps"][0]["loss"]


def test_sharded_checkpoint_resumes_at_one_rank_as_if_never_stopped(single, tmp_path):
    """Save at 2 ranks (step 5, DCP's async save: written while steps 6..10 train) -> load in one process -> steps
    6..10 equal the run that never stopped."""
    first = run_worker("fsdp", tmp_path / "first.json", save_at=5, checkpoint_dir=tmp_path / "ckpt", async_save=1)
    assert_same_steps(first["steps"], single["steps"])
    checkpoint = tmp_path / "ckpt" / "step_5"
    assert (checkpoint / "state").is_dir() and not (checkpoint / "model" / "model.safetensors").exists()
    resumed = run_worker(
        "single", tmp_path / "resumed.json", steps="5:10", load=checkpoint, checkpoint_dir=tmp_path / "c1"
    )
    assert_same_steps(resumed["steps"], single["steps"][5:])


def test_full_checkpoint_resumes_at_two_ranks(single, tmp_path):
    """A one-process checkpoint (step 5) continued by 2 FSDP ranks (with activation checkpointing)
    equals the run that never stopped."""
    assert (single["step_5"] / "model" / "model.safetensors").is_file()
    resumed = run_worker(
        "fsdp",
        tmp_path / "resumed.json",
        steps="5:10",
        load=single["step_5"],
        checkpoint_dir=tmp_path / "c2",
        activation_checkpointing=1,
    )
    assert_same_steps(resumed["steps"], single["steps"][5:])


@pytest.mark.serial
def test_deepspeed_zero3_matches_one_process_resumes_and_exports(single, tmp_path):
    """DeepSpeed's own engine, ZeRO-3 with the optimizer state offloaded to CPU (torch's AdamW there), 2 ranks:
    the same 10 steps as one process (losses, clipped grad norms, LRs: 1e-5); its checkpoint (DeepSpeed's
    partitions, sealed) resumes at step 5 as if never stopped; `tierlm export` consolidates it into the weights
    one process had at step 5; and a pickle planted in it (manifest forged to match) is refused, never run."""
    from test_run_safety import forge_manifest, payload
    from tierlm.commands.cli import main
    from tierlm.models import load_native_model

    zero = run_worker("zero3_offload", tmp_path / "zero.json", save_at=5, checkpoint_dir=tmp_path / "ck")
    assert_same_steps(zero["steps"], single["steps"])
    for key in ("param_bytes", "optimizer_bytes"):  # each rank holds its partition
        assert zero["memory"][key] <= single["memory"][key] / 2 * 1.10, (key, zero["memory"], single["memory"])
    step_5 = tmp_path / "ck" / "step_5"
    assert (step_5 / "deepspeed").is_dir() and not (step_5 / "model" / "model.safetensors").exists()
    resumed = run_worker(
        "zero3_offload", tmp_path / "resumed.json", steps="5:10", load=step_5, checkpoint_dir=tmp_path / "c1"
    )
    assert_same_steps(resumed["steps"], single["steps"][5:])

    assert main(["export", str(step_5), str(tmp_path / "exported")]) == 0
    exported = load_native_model(tmp_path / "exported").state_dict()
    reference = load_native_model(single["step_5"] / "model").state_dict()
    assert exported.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.allclose(exported[name], value, atol=1e-5), (name, (exported[name] - value).abs().max())

    marker = tmp_path / "pwned"
    target = next((step_5 / "deepspeed" / "state").glob("*optim_states.pt"))
    target.write_bytes(payload(marker))
    forge_manifest(step_5)
    assert main(["export", str(step_5), str(tmp_path / "exported_again")]) == 2
    assert not marker.exists() and not (tmp_path / "exported_again").exists()


def test_tier2_factories_train_the_same_steps(tmp_path):
    """`create_fsdp_backend` and `create_ddp_backend` from one model folder compute the same 3 updates."""
    from tests.distributed_worker import CONFIG

    from tierlm.models import build_gpt, save_model_folder

    torch.manual_seed(0)
    folder = save_model_folder(build_gpt(CONFIG), tmp_path / "model")
    result = ranks(WORKER, "factories", tmp_path / "f.json", f"--model-folder={folder}")
    assert result.returncode == 0, result.stderr[-3000:]
    losses = json.loads((tmp_path / "f.json").read_text())
    assert len(losses["fsdp"]) == 3 and losses["fsdp"][-1] < losses["fsdp"][0]
    assert all(abs(a - b) < 1e-5 for a, b in zip(losses["fsdp"], losses["ddp"]))


def test_a_rank_that_raises_ends_the_job_naming_it(tmp_path):
    result = torchrun(WORKER, "fsdp_raise", tmp_path / "x.json", timeout=120)  # a hung job: TimeoutExpired
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stderr and "rank      : 1" in result.stderr, result.stderr[-2000:]


def _rank_pid(parent: int, rank: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in env:
            return int(entry.name)
    return None


_JOB_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _start_training_job(out: Path, *overrides: str) -> subprocess.Popen:
    """A 2-rank DDP `tierlm pretrain` under torchrun, returned once it has logged a few training steps."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "tierlm",
        "pretrain",
        "--config",
        "configs/tiny_pretrain.yaml",
        f"infra.output_dir={out}",
        "training.warmup_steps=1",
        "training.logging_steps=1",
        "training.eval_steps=0",
        "data.num_synthetic_examples=3000",
        "infra.progress_bar=false",
        "infra.distributed_type=ddp",
        *overrides,
    ]
    job = subprocess.Popen(command, cwd=REPO, env=_JOB_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").is_file() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        if job.poll() is not None or time.monotonic() > deadline:
            job.kill()
            raise AssertionError(f"the job did not start training: {job.communicate()[1][-2000:]}")
        time.sleep(0.2)
    return job


@pytest.mark.serial
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to find a rank's process")
def test_a_killed_rank_ends_the_job_within_60s(tmp_path):
    """SIGKILL rank 1 of a 2-rank DDP CLI run mid-training: torchrun stops the job, non-zero, < 60 s, naming rank 1."""
    out = tmp_path / "run"
    job = _start_training_job(out, "training.num_train_steps=100000")
    try:
        pid = _rank_pid(job.pid, 1)
        assert pid is not None, "rank 1's process not found"
        os.kill(pid, signal.SIGKILL)
        _, stderr = job.communicate(timeout=60)  # a job that goes on: TimeoutExpired
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert "rank      : 1" in stderr and "SIGKILL" in stderr, stderr[-2000:]


def test_cli_two_ranks_then_one_resumes_and_exports(tmp_path):
    """`tierlm pretrain` at 2 ranks == 1 process at the same global batch; `tierlm export` gathers its
    sharded checkpoints into full folders (the run's average of its last two is their mean), and its step-6
    checkpoint resumes in one process (same losses)."""
    from tierlm.commands.cli import main

    common = [
        "pretrain",
        "--config",
        "configs/tiny_pretrain.yaml",
        "training.num_train_steps=12",
        "training.warmup_steps=2",
        "training.save_steps=6",
        "training.eval_steps=6",
        "training.logging_steps=3",
        "training.average_last_n=2",
        "data.num_synthetic_examples=3000",
        "infra.progress_bar=false",
    ]
    two = tmp_path / "two"
    result = ranks("-m", "tierlm", *common, f"infra.output_dir={two}", "training.per_device_train_batch_size=8")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("run directory:") == 1  # rank 0 reports
    one = tmp_path / "one"
    result = run_main(*common, f"infra.output_dir={one}", "training.per_device_train_batch_size=16")
    assert result.returncode == 0, result.stderr[-3000:]

    def lines(
        run: Path,
    ) -> list[dict]:  # train and eval lines (FSDP ranks write no "sample" lines: they would generate together)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [r for r in records if r["type"] in ("train", "eval")]

    def key(r: dict) -> float:
        return r["loss"] if r["type"] == "train" else r["val_loss"]

    a, b = lines(two), lines(one)
    assert [(r["type"], r["step"]) for r in a] == [(r["type"], r["step"]) for r in b]
    assert all(abs(key(x) - key(y)) < 1e-4 for x, y in zip(a, b)), list(zip(map(key, a), map(key, b)))
    last_a, last_b = (next(r for r in reversed(rs) if r["type"] == "train") for rs in (a, b))
    assert (
        last_a["param_bytes"] < 0.55 * last_b["param_bytes"]
        and last_a["optimizer_bytes"] < 0.55 * last_b["optimizer_bytes"]
    )

    # Export a sharded checkpoint: transformers loads it, with the weights the run ended with; the run's average of
    # its last 2 (sharded) checkpoints, made by rank 0 at the end, is the mean of the two exported.
    result = run_main("export", two / "checkpoints" / "step_12", tmp_path / "exported")
    assert result.returncode == 0, result.stderr
    exported, final = (
        load_file(tmp_path / "exported" / "model.safetensors"),
        load_file(two / "model" / "model.safetensors"),
    )
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    assert main(["export", str(two / "checkpoints" / "step_6"), str(tmp_path / "exported_6")]) == 0
    earlier, averaged = (load_file(p / "model.safetensors") for p in (tmp_path / "exported_6", two / "model_averaged"))
    assert all(torch.allclose(averaged[k], (earlier[k] + exported[k]) / 2, atol=1e-7) for k in final)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "exported")

    # Resume the 2-rank run's step-6 checkpoint in one process.
    import shutil

    shutil.rmtree(two / "checkpoints" / "step_12")
    (two / "checkpoints" / "latest").write_text("step_6\n")
    result = run_main(*common, f"infra.output_dir={two}", "training.per_device_train_batch_size=16")
    assert result.returncode == 0, result.stderr[-3000:]
    c = lines(two)
    assert [(r["type"], r["step"]) for r in c] == [(r["type"], r["step"]) for r in b]
    assert all(abs(key(x) - key(y)) < 1e-4 for x, y in zip(c, b))
    # A sharded checkpoint is not a model folder: sampling from it says to export first.
    result = run_main("sample", "--checkpoint", two / "checkpoints" / "step_6", "--prompt", "1 + 1")
    assert result.returncode == 2 and "tierlm export" in result.stderr


def transformers_folder(tiny_runs, folder):
    """A transformers Qwen3 model folder (no tierlm files) with the tiny runs' tokenizer: what a Hub download holds."""
    from tierlm.data import load_tokenizer
    from tierlm.primitives.models import create_hf_model_from_config

    tokenizer = load_tokenizer(tiny_runs / "pre" / "model")
    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16)
    model = create_hf_model_from_config("qwen3", vocab_size=tokenizer.vocab_size, num_key_value_heads=1, **shape)
    model.save_pretrained(folder)
    tokenizer.save(folder)
    return folder


@pytest.mark.parametrize(
    "source,strategy", [("tierlm", "SHARD_GRAD_OP"), ("transformers", "HYBRID_SHARD")], ids=["tierlm", "transformers"]
)
def test_cpu_ram_efficient_loading_reads_on_rank_0_and_trains_as_one_process(source, strategy, tiny_runs, tmp_path):
    """Continuing a trained model under FSDP2 with infra.cpu_ram_efficient_loading (Accelerate's
    fsdp_cpu_ram_efficient_loading): rank 1 builds it on the meta device and takes its shards — and the buffers no
    state dict carries (rotary tables) — from rank 0's copy by broadcast; the steps are one process's (1e-4). From a
    tierlm model folder and from a transformers one (a Qwen3 folder as the Hub serves it). Each under another
    infra.fsdp_sharding_strategy: SHARD_GRAD_OP (blocks stay gathered until their backward; the planner counts them)
    and HYBRID_SHARD (a 2-D replicate x shard mesh; one machine here, so 1 x 2)."""
    folder = tiny_runs / "pre" / "model" if source == "tierlm" else transformers_folder(tiny_runs, tmp_path / "qwen3")
    shared = [a for a in TINY if not a.startswith("model.")]  # the folder's shape is its own
    common = ["pretrain", "--config", "configs/tiny_pretrain.yaml", *shared, f"model.model_name_or_path={folder}"]
    common += ["training.num_train_steps=4", "training.logging_steps=1", "training.eval_steps=2"]
    two = tmp_path / "two"
    result = ranks(
        "-m",
        "tierlm",
        *common,
        "training.per_device_train_batch_size=4",
        "infra.distributed_type=fsdp",
        "infra.cpu_ram_efficient_loading=true",
        f"infra.fsdp_sharding_strategy={strategy}",
        f"infra.output_dir={two}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the weights were read on rank 0 alone, for 2 ranks" in result.stdout
    assert json.loads((two / "memory_estimate.json").read_text())["parts_bytes"]["FSDP gathered blocks"] > 0
    from tierlm.commands.cli import main

    assert main([*common, "training.per_device_train_batch_size=8", f"infra.output_dir={tmp_path / 'one'}"]) == 0

    def lines(run):
        records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        return [
            (r["step"], r["loss"] if r["type"] == "train" else r["val_loss"])
            for r in records
            if r["type"] in ("train", "eval")
        ]

    got, expected = lines(two), lines(tmp_path / "one")
    assert [s for s, _ in got] == [s for s, _ in expected] and len(got) >= 6
    assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(got, expected)), (got, expected)


def test_fsdp_on_one_process_saves_its_model(tmp_path):
    """FSDP2 under a one-rank group (torchrun --nproc_per_node 1, the usual way to run it on one GPU): its weights
    are DTensor shards even there, so the final model folder is written from the gathered weights (the live
    DTensors have no storage safetensors can read); the folder loads back as the trained weights."""
    import torch.distributed as dist

    from tierlm.backends.distributed import FSDPTrainingBackend
    from tierlm.models import GPTConfig, build_gpt, load_native_model, save_model_folder
    from tierlm.primitives import create_adamw_optimizer

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = build_gpt(GPTConfig(depth=1, aspect_ratio=32, head_dim=32, vocab_size=64, max_seq_len=16))
        backend = FSDPTrainingBackend(model, lambda m: create_adamw_optimizer(m, 1e-2), None, tmp_path / "ck", "cpu")
        ids = torch.randint(0, 64, (2, 9))
        backend.forward_backward({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
        backend.optim_step().wait()
        state = backend.full_model_state()
        assert state is not None and not any(hasattr(v, "full_tensor") for v in state.values())
        save_model_folder(backend.export_model, tmp_path / "model", state_dict=state)
        trained = {k: v.full_tensor() for k, v in backend.model.state_dict().items()}
    finally:
        dist.destroy_process_group()
    loaded = load_native_model(tmp_path / "model").state_dict()
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp_bf16_on_one_gpu(tmp_path):
    result = torchrun(
        "-m",
        "tierlm",
        "pretrain",
        "--config",
        "configs/tiny_pretrain.yaml",
        "training.num_train_steps=20",
        "training.warmup_steps=2",
        "training.bf16=true",
        "infra.distributed_type=fsdp",
        "infra.device_type=cuda",
        f"infra.output_dir={tmp_path}",
        nproc=1,
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.serial
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to find a rank's process")
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Only rank 1 is signalled: the ranks agree at the next step boundary, write one complete sharded
    checkpoint together, exit 143, and the same command resumes from it to the end."""
    out = tmp_path / "run"
    job = _start_training_job(
        out,
        "training.num_train_steps=60",
        "training.save_steps=0",
        "model.depth=2",
        "model.aspect_ratio=32",
        "data.max_seq_length=64",
    )
    try:
        pid = _rank_pid(job.pid, 1)
        assert pid is not None, "rank 1's process not found"
        os.kill(pid, signal.SIGTERM)
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    stopped = re.findall(r"\] stopped by SIGTERM after step (\d+);", stderr)
    assert len(stopped) == 2 and stopped[0] == stopped[1], stderr[-3000:]  # both ranks, the same step
    from tierlm.checkpoint import find_latest_checkpoint, verify_checkpoint

    latest = find_latest_checkpoint(out / "checkpoints")
    assert latest is not None and latest.name == f"step_{stopped[0]}" and verify_checkpoint(latest) is None
    assert int(stopped[0]) < 60
    result = subprocess.run(job.args, cwd=REPO, env=_JOB_ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "model" / "training_meta.json").read_text())
    assert summary["resumed_from"].endswith(f"step_{stopped[0]}") and summary["step"] == 60


def test_an_ablation_at_two_ranks_runs_each_variant_on_every_rank(tmp_path):
    """`tierlm ablate` at two ranks (as torchrun starts them): the variants run one after another on both ranks in one
    process group (joining a new group per variant would hang); rank 0 alone writes the records."""
    tiny = [
        "model.depth=1",
        "model.aspect_ratio=32",
        "model.head_dim=32",
        "tokenizer.vocab_size=300",
        "tokenizer.num_train_docs=200",
        "data.num_synthetic_examples=200",
        "data.num_synthetic_eval_examples=16",
        "data.max_seq_length=32",
        "training.num_train_steps=4",
        "training.warmup_steps=0",
        "training.eval_steps=2",
        "training.eval_batches=1",
        "training.per_device_train_batch_size=4",
        "training.sample_prompts=[]",
        "infra.progress_bar=false",
        "infra.device_type=cpu",
    ]
    out = tmp_path / "abl"
    result = ranks(
        "-m",
        "tierlm",
        "ablate",
        "--config",
        "configs/tiny_pretrain.yaml",
        *tiny,
        "--variant",
        "a:training.learning_rate=3e-3",
        "--variant",
        "b:training.learning_rate=1e-3",
        "--out",
        out,
        timeout=240,
    )
    assert result.returncode == 0, first_failure(result.stderr)
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert all(runs[v]["0"]["finished"] and runs[v]["0"]["steps"] == 4 for v in ("a", "b"))
    assert (out / "a_seed0" / "checkpoints" / "step_4" / "state").is_dir()  # a sharded (FSDP, 2-rank) checkpoint

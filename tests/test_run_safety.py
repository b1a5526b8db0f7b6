"""Nothing run, nothing lost: planted pickles never execute, run directories cannot be mixed up,
final folders appear whole, signals save and resume exactly, exported models stop where tierlm stops."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import CHAT, REPO, TINY
from forked import start
from tierlm import checkpoint
from tierlm.commands.cli import main
from tierlm.errors import CheckpointError


class Payload:
    """A pickle that, when loaded by a plain unpickler, runs a shell command creating `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def payload(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def forge_manifest(folder: Path) -> None:
    """What an attacker editing a checkpoint or model folder can also do: record the new files'
    sizes and hashes, so only the readers themselves stand between the payload and execution."""
    if (folder / "meta.json").is_file():
        meta = json.loads((folder / "meta.json").read_text())
        meta.update(checkpoint.file_manifest(folder, exclude=("meta.json",)))
        (folder / "meta.json").write_text(json.dumps(meta))
    for model in [folder / "model", folder] if (folder / "model").is_dir() else [folder]:
        meta_file = model / "training_meta.json"
        if meta_file.is_file() and "manifest" in json.loads(meta_file.read_text()):
            meta = json.loads(meta_file.read_text())
            meta["manifest"] = checkpoint.file_manifest(model, exclude=("training_meta.json",))
            meta_file.write_text(json.dumps(meta))


def test_the_payload_is_real(tmp_path):
    pickle.loads(payload(tmp_path / "ran"))
    assert (tmp_path / "ran").exists(), "the payload must run under a plain unpickler, or the tests below prove nothing"


def latest(run: Path) -> Path:
    return checkpoint.find_latest_checkpoint(run / "checkpoints")


# -- sharded (DCP) checkpoints -----------------------------------------------------------------
@pytest.fixture
def sharded(tmp_path, tiny_runs):
    """A real sharded checkpoint (what torchrun runs write), saved by a one-rank gloo group."""
    import torch.distributed as dist

    from tierlm.config import TierlmConfig
    from tierlm.data import load_tokenizer
    from tierlm.models import load_pretrained_model
    from tierlm.primitives import create_adamw_optimizer
    from tierlm.run import extras_writer

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = load_pretrained_model(tiny_runs / "pre" / "model")
        optimizer = create_adamw_optimizer(model, 1e-3)
        model(torch.randint(0, 100, (1, 8))).sum().backward()
        optimizer.step()
        writer = extras_writer(TierlmConfig.load(None), load_tokenizer(tiny_runs / "pre" / "model"), "pretrain")
        path = checkpoint.save_sharded_checkpoint(
            tmp_path / "run" / "checkpoints", 3, model, optimizer, None, {"loop": {}}, writer
        )
    finally:
        dist.destroy_process_group()
    return path


def _resume_into_fresh_model(path: Path, tiny_runs: Path) -> None:
    from tierlm.models import load_pretrained_model
    from tierlm.primitives import create_adamw_optimizer

    model = load_pretrained_model(tiny_runs / "pre" / "model")
    checkpoint.load_checkpoint(path, model, create_adamw_optimizer(model, 1e-3))


def test_a_clean_sharded_checkpoint_loads_and_exports(sharded, tiny_runs, tmp_path):
    _resume_into_fresh_model(sharded, tiny_runs)
    assert main(["export", str(sharded), str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "model.safetensors").is_file()


@pytest.mark.parametrize("target", ["state/.metadata", "state/__0_0.distcp", "train_state.pt"])
def test_a_payload_in_a_sharded_checkpoint_never_runs(target, sharded, tiny_runs, tmp_path, capsys):
    marker = tmp_path / "pwned"
    (sharded / target).write_bytes(payload(marker))
    with pytest.raises(CheckpointError, match="damaged"):  # sizes and hashes catch it first...
        _resume_into_fresh_model(sharded, tiny_runs)
    forge_manifest(sharded)  # ...and with them forged, the readers refuse it themselves
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        _resume_into_fresh_model(sharded, tiny_runs)
    export = main(["export", str(sharded), str(tmp_path / "exported")])
    assert export == (0 if target == "train_state.pt" else 2)  # export reads weights, not the optimizer state
    assert main(["sample", "--checkpoint", str(sharded), "--prompt", "hi"]) == 2  # sharded: "export it first"
    assert main(["eval", "--checkpoint", str(sharded), "--config", str(REPO / "configs/tiny_rl.yaml")]) == 2
    assert (
        main(["average", str(sharded), str(sharded), "--out", str(tmp_path / "averaged")]) == export
    )  # gathered first
    assert not marker.exists(), f"the payload in {target} ran"


def test_dcp_metadata_cannot_point_outside_its_folder(sharded, tmp_path):
    from tierlm.checkpoint.safe_dcp import read_dcp_metadata

    metadata = read_dcp_metadata(sharded / "state")
    for info in metadata.storage_data.values():
        info.relative_path = "../../../etc/hostname"
    (sharded / "state" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(pickle.UnpicklingError, match="outside its folder"):
        read_dcp_metadata(sharded / "state")


def test_non_tensor_items_are_read_without_unpickling_code(tmp_path):
    import io
    from types import SimpleNamespace

    from tierlm.checkpoint.safe_dcp import SafeLoadPlanner

    planner = SafeLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    buffer = io.BytesIO()
    torch.save(Payload(tmp_path / "pwned"), buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(SimpleNamespace(dest_index=SimpleNamespace(fqn="x")), buffer)
    assert not (tmp_path / "pwned").exists()


# -- full checkpoints and model folders, through every command ------------------------------------
@pytest.mark.parametrize("target", ["model/model.safetensors", "train_state.pt", "model/tokenizer.json"])
def test_a_payload_in_a_run_never_runs_on_resume_export_average_sample_or_eval(
    target, tiny_runs, tmp_path, monkeypatch, capsys
):
    marker = tmp_path / "pwned"
    run = tmp_path / "pre"
    shutil.copytree(tiny_runs / "pre", run)
    for folder in (latest(run), run):  # the checkpoint, and the final model folder when the file is there
        if (folder / target).is_file():
            (folder / target).write_bytes(payload(marker))
            forge_manifest(folder)
    monkeypatch.chdir(tmp_path)
    commands = [
        [
            "pretrain",
            "--config",
            str(REPO / "configs/tiny_pretrain.yaml"),
            *TINY,
            "training.num_train_steps=4",
            f"infra.output_dir={run}",
        ],
        ["export", str(latest(run)), str(tmp_path / "exported")],
        ["average", str(latest(run)), str(tiny_runs / "pre"), "--out", str(tmp_path / "averaged")],
        ["sample", "--checkpoint", str(run), "--prompt", "hi"],
        ["sample", "--checkpoint", str(latest(run)), "--prompt", "hi"],
        [
            "eval",
            "--checkpoint",
            str(run),
            "--config",
            str(REPO / "configs/tiny_rl.yaml"),
            "rl.eval_problems=2",
            "rl.eval_k=1",
        ],
    ]
    for argv in commands:
        code = main(argv)
        if target == "train_state.pt" and argv[0] not in ("pretrain",):
            continue  # only resuming reads the optimizer state; the other commands do not open it
        assert code == 2, f"{argv[0]} accepted a checkpoint carrying a payload in {target}"
    assert not marker.exists(), f"the payload in {target} ran"


def test_a_link_inside_a_checkpoint_is_never_followed(tiny_runs, tmp_path):
    run = tmp_path / "pre"
    shutil.copytree(tiny_runs / "pre", run)
    weights = latest(run) / "model" / "model.safetensors"
    secret = tmp_path / "secret.safetensors"
    shutil.copy(weights, secret)
    weights.unlink()
    weights.symlink_to(secret)  # same bytes, so sizes and hashes still match
    assert "symbolic link" in checkpoint.verify_checkpoint(latest(run))
    assert main(["export", str(latest(run)), str(tmp_path / "out")]) == 2


# -- run directories ------------------------------------------------------------------------------
def _pretrain(run: Path, *extra: str) -> int:
    return main(
        ["pretrain", "--config", str(REPO / "configs/tiny_pretrain.yaml"), *TINY, f"infra.output_dir={run}", *extra]
    )


def test_a_run_from_before_run_json_still_refuses_another_stage(tiny_runs, tmp_path, capsys):
    run = tmp_path / "pre"
    shutil.copytree(tiny_runs / "pre", run)
    (run / "run.json").unlink()
    code = main(
        [
            "sft",
            "--config",
            str(REPO / "configs/tiny_sft.yaml"),
            *CHAT,
            f"model.model_name_or_path={tiny_runs / 'pre'}",
            f"infra.output_dir={run}",
        ]
    )
    assert code == 2
    assert "holds a pretrain run" in capsys.readouterr().err


def test_resume_takes_the_tokenizer_from_the_checkpoint(tiny_runs, tmp_path):
    from tierlm.builders.tokenizer import train_tokenizer
    from tierlm.config import TierlmConfig

    run = tmp_path / "pre"
    shutil.copytree(tiny_runs / "pre", run)
    saved = (latest(run) / "model" / "tokenizer.json").read_bytes()
    config = TierlmConfig.load(REPO / "configs/tiny_pretrain.yaml", [*TINY, "tokenizer.num_train_docs=2"])
    retrained = train_tokenizer(config, "text")
    retrained.save(tmp_path / "retrained")
    assert (tmp_path / "retrained" / "tokenizer.json").read_bytes() != saved, (
        "the test needs a retrained tokenizer to differ"
    )
    assert _pretrain(run, "training.num_train_steps=5", "tokenizer.num_train_docs=2") == 0
    assert (run / "model" / "tokenizer.json").read_bytes() == saved


def test_a_line_cut_short_is_ignored_with_one_warning_on_resume(tiny_runs, tmp_path, capsys):
    run = tmp_path / "pre"
    shutil.copytree(tiny_runs / "pre", run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"type": "train", "step": 4, "lo')  # killed mid-write
    assert _pretrain(run, "training.num_train_steps=5", "training.logging_steps=1") == 0
    said = capsys.readouterr()
    assert "ignored 1 unreadable line" in said.err
    assert f"resuming from {run / 'checkpoints' / 'step_3'} (step 3 of 5)" in said.out.splitlines()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # every line whole
    assert [r["step"] for r in records if r["type"] == "train"] == [3, 4, 5]


def test_a_fresh_start_never_appends_to_an_old_runs_metrics(tiny_runs, tmp_path, capsys):
    run = tmp_path / "pre"
    shutil.copytree(tiny_runs / "pre", run)
    shutil.rmtree(run / "checkpoints")  # killed before its first save: nothing to resume
    old = (run / "metrics.jsonl").read_text()
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / ".tmp_step_9_123_456").mkdir()  # an interrupted save's leftovers
    assert _pretrain(run, "training.num_train_steps=2") == 0
    kept = [p for p in run.glob("metrics.*.jsonl")]
    assert len(kept) == 1 and kept[0].read_text() == old
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 0 and max(steps) == 2
    assert not (run / "checkpoints" / ".tmp_step_9_123_456").exists()


def test_the_final_model_folder_is_whole_and_verified(tiny_runs):
    folder = tiny_runs / "sft" / "model"
    assert checkpoint.verified_model_folder(folder) == folder
    meta = json.loads((folder / "training_meta.json").read_text())
    assert set(meta["manifest"]["sha256"]) >= {
        "model.safetensors",
        "tokenizer.json",
        "config.json",
        "generation_config.json",
    }
    assert not any(p.name.startswith(".model") for p in (tiny_runs / "sft").iterdir())


# -- exported models stop where tierlm stops ---------------------------------------------------------
def test_transformers_generate_stops_at_the_end_of_turn(tiny_runs, tmp_path):
    """A model whose greedy continuation of `<|assistant_start|>` is two tokens then `<|assistant_end|>`:
    transformers' `generate` on the saved folder must stop there, as the engine does."""
    from transformers import AutoModelForCausalLM

    from tierlm.data import load_tokenizer
    from tierlm.models import load_pretrained_model, save_model_folder
    from tierlm.rollout.engine import Engine
    from tierlm.rollout.sampling import GREEDY
    from tierlm.run import write_model_extras

    tokenizer = load_tokenizer(tiny_runs / "sft" / "model")
    model = load_pretrained_model(tiny_runs / "sft" / "model")
    vocab = tokenizer.hf.get_vocab()
    chain = [vocab["<|assistant_start|>"], vocab["a"], vocab["b"], vocab["<|assistant_end|>"]]
    with torch.no_grad():  # every block is the identity, each token's hidden state its own embedding: a bigram table
        for block in model.blocks:
            block.attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
        g = torch.Generator().manual_seed(0)
        model.embed.weight.copy_(torch.randn(model.embed.weight.shape, generator=g))
        model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        normed = torch.nn.functional.rms_norm(model.embed.weight, (model.config.n_embd,), eps=model.config.norm_eps)
        for current, following in zip(chain, chain[1:]):
            model.lm_head.weight[following] = 20 * normed[current] / normed[current].norm()
    prompt = tokenizer.render_for_completion([{"role": "user", "content": "hi"}])
    engine_tokens = Engine(model, tokenizer.stop_ids, tokenizer).generate(prompt, 1, 12, GREEDY)[0].tokens
    assert engine_tokens == chain[1:], engine_tokens

    folder = tmp_path / "model"
    save_model_folder(model, folder)
    write_model_extras(folder, tokenizer, {"stage": "sft"})
    hf = AutoModelForCausalLM.from_pretrained(folder)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert out == chain[1:], out
    (folder / "generation_config.json").unlink()  # without it, generation runs past the end of the turn
    bare = AutoModelForCausalLM.from_pretrained(folder)
    bare.generation_config.eos_token_id = None
    assert len(bare.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0]) == len(prompt) + 12


def test_every_saved_model_folder_carries_the_generation_config(tiny_runs):
    from transformers import GenerationConfig

    from tierlm.data import load_tokenizer

    end = load_tokenizer(tiny_runs / "sft" / "model").hf.convert_tokens_to_ids("<|assistant_end|>")
    for folder in (tiny_runs / "sft" / "model", latest(tiny_runs / "sft") / "model", tiny_runs / "pre" / "model"):
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
        assert end in (eos if isinstance(eos, list) else [eos]), folder


# -- signals ----------------------------------------------------------------------------------------
SIGNAL_RUN = [
    "model.depth=2",
    "model.aspect_ratio=64",
    "model.head_dim=32",
    "tokenizer.vocab_size=300",
    "tokenizer.num_train_docs=500",
    "data.num_synthetic_examples=2000",
    "data.num_synthetic_eval_examples=32",
    "data.max_seq_length=64",
    "training.per_device_train_batch_size=8",
    "training.num_train_steps=100",
    "training.warmup_steps=2",
    "training.eval_steps=15",
    "training.eval_batches=2",
    "training.logging_steps=1",
    "training.save_steps=0",
    "infra.progress_bar=false",
    "infra.device_type=cpu",
]


def _start(run: Path):
    """`python -m tierlm pretrain ...` forked from the preloaded process (tests/forked.py), its stderr a pipe."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONWARNINGS": "ignore"}
    args = ["pretrain", "--config", "configs/tiny_pretrain.yaml", *SIGNAL_RUN, f"infra.output_dir={run}"]
    return start("-m", "tierlm", *args, env=env, stderr=subprocess.PIPE)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "model" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.serial
def test_signals_at_random_moments_save_and_resume_bit_for_bit(tmp_path):
    reference = tmp_path / "reference"
    proc = _start(reference)
    assert proc.wait(timeout=600) == 0, proc.stderr.read()
    rng = random.Random(12345)
    run, stops, finished = tmp_path / "interrupted", [], False
    kinds = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1]  # each lands by step 36 of 100
    for sig in kinds:
        proc = _start(run)
        target = min(99, (stops[-1] if stops else 0) + rng.randint(3, 12))  # a step of this segment to wait for
        for line in proc.stderr:
            if line.startswith(f"step {target}/") or line.startswith(f"step {target}:"):
                break
        time.sleep(rng.uniform(0.0, 0.05))  # then a random moment: mid-step, mid-log, mid-eval or mid-save
        proc.send_signal(sig)
        rest = proc.stderr.read()
        code = proc.wait(timeout=600)
        if code == 0:  # the signal came after the last step
            finished = True
            break
        assert code == 128 + sig, rest
        stopped = [line for line in rest.splitlines() if "stopped by" in line]
        assert stopped and stopped[-1].startswith(f"tierlm: stopped by {signal.Signals(sig).name} after step"), rest
        stops.append(int(stopped[-1].split("after step ")[1].split(";")[0]))
    print(f"interrupted after steps {stops}")
    assert len(stops) >= 3, f"only {len(stops)} interruptions landed: {stops}"
    if not finished:
        proc = _start(run)
        assert proc.wait(timeout=600) == 0, proc.stderr.read()
    mine, theirs = _weights(run), _weights(reference)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), f"{name} differs after resuming at steps {stops}"

    def train(r):
        return {
            (x["step"], x["loss"])
            for x in map(json.loads, (r / "metrics.jsonl").read_text().splitlines())
            if x["type"] == "train"
        }

    assert train(run) == train(reference)


# -- the pre-flight check ------------------------------------------------------------------------------
def test_the_preflight_only_describes_the_model(tmp_path):
    """Sizing a run builds its model on the meta device: no memory, and no draw from the RNG that
    initialises the real model (a fresh run's weights are the same with or without the check)."""
    from tierlm.config import TierlmConfig
    from tierlm.metrics.memory import rss_mb
    from tierlm.plan.memory.bounds import memory_needs

    config = TierlmConfig.load(REPO / "configs/tiny_pretrain.yaml", ["data.max_seq_length=100000000", "model.depth=8"])
    torch.manual_seed(0)
    before_rng, before_mb = torch.get_rng_state(), rss_mb()
    needs = memory_needs(config, 512, None, 1000)
    assert torch.equal(torch.get_rng_state(), before_rng)
    assert rss_mb() - before_mb < 200
    assert (
        needs["the model's buffers (rotary tables for 100,000,000 positions)"][0]
        == 2 * 4 * config.model.head_dim * 100_000_000
    )


@pytest.mark.serial
def test_a_signal_repeated_while_the_run_stops_never_cuts_the_stop_short(tmp_path):
    """torchrun's agent sends SIGTERM to the ranks still stopping once one rank has exited; Slurm and `kill`
    may repeat theirs. Signals that arrive after the stop was agreed (while saving, reporting, exiting) are the
    same stop: the run still writes its checkpoint, says where, and exits 143."""
    run = tmp_path / "run"
    proc = _start(run)
    for line in proc.stderr:
        if line.startswith("step 3/"):
            break
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.005)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, rest
    assert "tierlm: stopped by SIGTERM after step" in rest, rest
    from tierlm.checkpoint import find_latest_checkpoint, verify_checkpoint

    latest = find_latest_checkpoint(run / "checkpoints")
    assert latest is not None and verify_checkpoint(latest) is None
    assert json.loads((run / "progress.json").read_text())["status"] == "interrupted"


def test_a_stop_keeps_its_handlers_only_in_a_process_that_ends_with_the_run():
    """The CLI (`held_until_exit`) keeps the handlers of a stop under way; a library caller (a notebook) gets its
    own handlers back when the loop ends, stop or not."""
    from tierlm.loops.signals import STOP_SIGNALS, GracefulStop, held_until_exit

    mine = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for held in (False, True):
        stop = GracefulStop()
        with contextlib.ExitStack() as scope:
            if held:
                scope.enter_context(held_until_exit())
            with stop:
                os.kill(os.getpid(), signal.SIGUSR1)
                assert stop.agreed_signal() == signal.SIGUSR1
            after = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        for sig, handler in mine.items():  # this test's process goes on (a pytest worker, whose end a SIGINT may be)
            signal.signal(sig, handler)
        assert all((after[sig] == stop._handle) if held else (after[sig] is mine[sig]) for sig in STOP_SIGNALS)
    with GracefulStop():  # no signal: the caller's handlers come back, in the CLI too
        pass
    with held_until_exit(), GracefulStop():
        pass
    assert all(signal.getsignal(sig) is mine[sig] for sig in STOP_SIGNALS)

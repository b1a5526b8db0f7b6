"""RL and evaluation with vLLM sampling, for real: vLLM's CPU build in its own environment (.venv-vllm, made by
`bash scripts/setup_vllm.sh`; vLLM pins transformers < 5.20, so it cannot share .venv). Where that environment
is absent every test here skips, saying so; nothing stands in for vLLM.

- in this process: `tierlm rl` started from .venv-vllm with engine.kind=vllm;
- a server: scripts/vllm_server.sh on the SFT model, and `tierlm rl` from this Python with engine.vllm_url.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, RL, free_port
from tierlm.errors import ConfigError

VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"


def _vllm_ready() -> str | None:
    if not VLLM_PY.is_file():
        return "vLLM's environment .venv-vllm is absent (bash scripts/setup_vllm.sh makes it)"
    probe = subprocess.run([str(VLLM_PY), "-c", "import vllm, tierlm"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f".venv-vllm cannot import vllm and tierlm: {probe.stderr[-300:]}"


REASON = _vllm_ready()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
ENV = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONWARNINGS": "ignore"}
STEPS = ["training.num_train_steps=3", "training.eval_steps=3", "training.logging_steps=1", "rl.temperature=1.0"]


@pytest.fixture(scope="module")
def server(tiny_runs):
    """A vLLM server on the SFT model (its own environment, its own process group) taking LoRA adapters at run
    time, stopped at the end."""
    port = free_port()
    process = subprocess.Popen(
        ["bash", "scripts/vllm_server.sh", str(tiny_runs / "sft" / "model"), str(port), "--max-model-len", "256"]
        + ["--enable-lora", "--max-lora-rank", "8"],  # LoRA policies send their adapters alone
        cwd=REPO,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while True:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            break
        except OSError:
            assert process.poll() is None, f"the vLLM server stopped: {process.stderr.read().decode()[-2000:]}"
            assert time.time() < deadline, "the vLLM server did not answer within 240 s"
            time.sleep(1)
    yield url
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=60)


def _rl(python, tiny_runs, out: Path, *extra):
    args = ["-m", "tierlm", "rl", "--config", "configs/tiny_rl.yaml", *RL, *STEPS]
    args += [f"model.model_name_or_path={tiny_runs / 'sft'}", f"infra.output_dir={out}", "engine.kind=vllm", *extra]
    env = {**ENV, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}  # a test's own reward module, where it has one
    done = subprocess.run([str(python), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


def test_a_weight_push_changes_greedy_tokens_exactly_as_the_trainers_own(tiny_runs, server):
    """In this process and through the server: vLLM's greedy tokens equal the native engine's before and after a
    push of new weights, the push changed them, and each completion carries the pushed version."""
    for python, extra in ((VLLM_PY, []), (sys.executable, ["--url", server])):
        done = subprocess.run(
            [str(python), "scripts/vllm_weight_sync.py", str(tiny_runs / "sft"), *extra],
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=600,
        )
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert done.returncode == 0, report
        assert report["same_before"] and report["same_after"] and report["changed"], report
        assert report["versions_after"] == [1] and report["max_logprob_gap"] < 1e-3, report


def test_rl_samples_with_vllm_in_process_and_through_a_server_alike(tiny_runs, server, tmp_path):
    """The same seeds draw the same rollouts in both ways (vLLM seeds each request from the step's generator), so
    the two runs train alike; every line carries its weight version and the trainer/sampler log-prob gap."""
    local = _rl(VLLM_PY, tiny_runs, tmp_path / "local")
    remote = _rl(sys.executable, tiny_runs, tmp_path / "remote", f"engine.vllm_url={server}")
    assert [r["step"] for r in local] == [1, 2, 3]
    for a, b in zip(local, remote):
        assert a["weight_version"] == b["weight_version"] == a["step"] - 1  # on-policy: the weights before the step
        assert a["reward_mean"] == b["reward_mean"] and abs(a["loss"] - b["loss"]) < 1e-6, (a, b)
        assert a["logprob_abs_diff"] < 1e-4 and b["logprob_abs_diff"] < 1e-4
    assert (tmp_path / "remote" / "sampler" / "model.safetensors").is_file()  # the hand-off folder the server read


def test_rl_under_torchrun_samples_through_one_server_as_one_process_does(tiny_runs, server, tmp_path):
    """2 DDP ranks send their share of the prompts to one server; rank 0 alone hands the weights over and the
    other waits for the server to report them. The same rollouts as one process, so the same losses."""
    from conftest import torchrun

    one = _rl(sys.executable, tiny_runs, tmp_path / "one", f"engine.vllm_url={server}")
    out = tmp_path / "two"
    args = ["-m", "tierlm", "rl", "--config", "configs/tiny_rl.yaml", *RL, *STEPS, "engine.kind=vllm"]
    args += [f"model.model_name_or_path={tiny_runs / 'sft'}", f"infra.output_dir={out}", f"engine.vllm_url={server}"]
    done = torchrun(*args, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    two = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    for a, b in zip(one, two, strict=True):
        assert a["reward_mean"] == b["reward_mean"] and abs(a["loss"] - b["loss"]) < 1e-5, (a, b)
        assert a["weight_version"] == b["weight_version"]


def test_a_server_serving_another_model_is_refused(tiny_runs, server, tmp_path):
    from tierlm.data import load_tokenizer
    from tierlm.models import GPTConfig, build_gpt
    from tierlm.rollout.vllm import VLLMEngine

    tokenizer = load_tokenizer(tiny_runs / "sft" / "model")
    other = build_gpt(GPTConfig(depth=1, aspect_ratio=32, head_dim=16, vocab_size=tokenizer.vocab_size, max_seq_len=64))
    with pytest.raises(ConfigError, match=f"the vLLM server at {server} serves another model"):
        VLLMEngine(other, tokenizer.stop_ids, tokenizer, [], tmp_path / "sampler", 64, server)
    assert not (tmp_path / "sampler").exists()


def test_check_parity_through_the_server_and_its_refusal(tiny_runs, server, tmp_path):
    """The pre-flight reports vLLM's float32 gap (about 1e-7 here) and refuses, in one line, a tolerance below it."""
    args = ["-m", "tierlm", "rl", "--config", "configs/tiny_rl.yaml", *RL, "--check-parity", "engine.kind=vllm"]
    args += [f"model.model_name_or_path={tiny_runs / 'sft'}", f"infra.output_dir={tmp_path / 'never'}"]
    args += [f"engine.vllm_url={server}"]
    ok = subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "parity ok" in ok.stdout, ok.stderr[-2000:]
    refused = subprocess.run(
        [sys.executable, *args, "rl.parity_tolerance=1e-12"], cwd=REPO, env=ENV, capture_output=True, text=True
    )
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "more than rl.parity_tolerance 1e-12" in lines[0]
    assert not (tmp_path / "never").exists()


def test_the_chat_server_answers_with_vllm_as_with_its_own_engine(tiny_runs, server):
    """`tierlm serve --engine vllm --vllm-url URL`'s chatbot: a greedy reply through vLLM is the native engine's."""
    from tierlm.commands.chat import Chatbot
    from tierlm.commands.generation import Sampling
    from tierlm.errors import DataError

    messages = [{"role": "user", "content": "What is 23 + 45?"}]
    native = Chatbot(tiny_runs / "sft", "cpu")
    through_vllm = Chatbot(tiny_runs / "sft", "cpu", engine="vllm", vllm_url=server)
    try:
        pieces = []
        reply = through_vllm.reply(messages, temperature=0.0, max_new_tokens=24, on_text=pieces.append)
        assert reply.text == native.reply(messages, temperature=0.0, max_new_tokens=24).text
        assert "".join(pieces) == reply.text and reply.completion_tokens > 0
        with pytest.raises(DataError, match="ignore_eos is honoured by tierlm's engine: serve with --engine native"):
            through_vllm.chat_choices(messages, Sampling(8, 0.0, ignore_eos=True))  # vLLM's replies come back ended
    finally:
        through_vllm.close()
        native.close()


def test_eval_samples_with_vllm_in_process_and_through_the_server_alike(tiny_runs, server):
    """`tierlm eval` (pass@k) on the same engine interface: vLLM in its process and the server give one answer (a
    wiring check: this 2-step model scores 0; the same draws through both are tested by the RL runs above)."""
    args = ["-m", "tierlm", "eval", "--checkpoint", str(tiny_runs / "sft"), "--config", "configs/tiny_rl.yaml"]
    args += ["rl.eval_problems=8", "rl.eval_k=2", "rl.max_new_tokens=8", "engine.kind=vllm"]
    local = subprocess.run([str(VLLM_PY), *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    remote = subprocess.run(
        [sys.executable, *args, f"engine.vllm_url={server}"], cwd=REPO, env=ENV, capture_output=True, text=True
    )
    assert local.returncode == 0 and remote.returncode == 0, local.stderr[-2000:] + remote.stderr[-2000:]
    line = local.stdout.strip().splitlines()[-1]  # vLLM in the process logs to stdout too
    assert line.startswith("pass@1 ") and line == remote.stdout.strip().splitlines()[-1], (local.stdout, remote.stdout)


def test_off_policy_rl_through_the_server_resumes_bit_exact(tiny_runs, server, tmp_path, monkeypatch):
    """rl.max_off_policy_steps=1 with vLLM sampling in the background: a run rolled back to its step-2 checkpoint
    (pending rollouts in it) and resumed ends with the straight run's weights bit for bit; the resumed process
    pushes the checkpoint's weights into the server before it samples again. (A reward for digits, so that the steps
    move the weights.)"""
    import torch
    from safetensors.torch import load_file

    from conftest import digits_reward, resume_from_checkpoint

    args = ["rl", "--config", "configs/tiny_rl.yaml", *RL, "engine.kind=vllm", f"engine.vllm_url={server}"]
    args += [digits_reward(tmp_path, monkeypatch)]
    args += [f"model.model_name_or_path={tiny_runs / 'sft'}", "rl.max_off_policy_steps=1", "rl.group_size=4"]
    args += ["training.num_train_steps=5", "training.save_steps=2", "training.logging_steps=1"]
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "tierlm", *args, f"infra.output_dir={out}"],
        cwd=REPO,
        env={**ENV, "PYTHONPATH": os.environ["PYTHONPATH"]},  # the reward's module
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert [r["weight_version"] for r in train] == [0, 0, 1, 2, 3]
    assert any(r["grad_norm"] > 0 for r in train[2:])  # the steps after the checkpoint move the weights
    straight = load_file(out / "model" / "model.safetensors")
    resume_from_checkpoint(args, out, 2)
    resumed = load_file(out / "model" / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_partial_rollouts_with_vllm_in_process(tiny_runs, tmp_path):
    """vLLM continues a group's unfinished rows as requests of their prompt and tokens so far. One chunk of the
    whole budget and a window of one step is the plain vLLM run (the same rewards and losses); chunks of one token
    carry groups across steps, so rows sampled by two weight versions train, each token with its sampler's
    log-prob."""
    plain = _rl(VLLM_PY, tiny_runs, tmp_path / "plain")
    args = ["rl.partial_rollouts=true", "rl.importance=none", "rl.rollout_window=2"]
    same = _rl(VLLM_PY, tiny_runs, tmp_path / "same", *args, "rl.rollout_chunk=4")
    for a, b in zip(plain, same, strict=True):
        assert a["reward_mean"] == b["reward_mean"] and abs(a["loss"] - b["loss"]) < 1e-6, (a, b)
    chunked = _rl(VLLM_PY, tiny_runs, tmp_path / "chunked", *args[:2], "rl.rollout_chunk=1", "rl.rollout_window=4")
    assert any(r["spanning_frac"] > 0 for r in chunked) and any(r["token_age_mean"] > 0 for r in chunked)
    assert all(r["rollout_rounds"] >= 1 and r["step"] - 1 - r["weight_version"] <= 2 for r in chunked)


def test_token_in_token_out_through_the_server(tiny_runs, server, tmp_path):
    """Two-turn calculator episodes sampled through the vLLM server (prompts sent as token ids, turns returned as
    ids): every turn was sampled after exactly the ids trained before it and the trained rows are the prompt, the
    sampled turns, the tool results and the environment's ids — nothing re-encoded from text (the check of
    `tests/episode_checks.py`, as for tierlm's engine in `test_rl.py`; the tiny test model calls no tool, so the
    tool results' ids are that case's to check)."""
    from episode_checks import episodes_train_the_ids_sampled
    from tierlm.data import load_tokenizer
    from tierlm.models import load_pretrained_model
    from tierlm.rollout.tools import Calculator
    from tierlm.rollout.vllm import VLLMEngine
    from tierlm.tasks import ArithmeticChain

    tok = load_tokenizer(tiny_runs / "sft" / "model")
    model = load_pretrained_model(tiny_runs / "sft" / "model")
    engine = VLLMEngine(model, tok.stop_ids, tok, [Calculator()], tmp_path / "sampler", 256, url=server)
    try:
        two_turns, _, _ = episodes_train_the_ids_sampled(engine, tok, ArithmeticChain("val", 16, 0), 24)
    finally:
        engine.close()
    assert two_turns >= 3, two_turns


def test_lora_rl_with_vllm_in_process_samples_with_each_steps_adapters(tiny_runs, tmp_path, monkeypatch):
    """A LoRA policy sampled by vLLM in this process: vLLM holds the frozen base and takes each step's adapters
    alone as a LoRA adapter named for their weight version (checked on every answer). At a learning rate that moves
    the adapters a lot every step, the sampler's log-probs stay the trainer's (|gap| < 1e-4 at every step: a stale
    adapter would show), and the sampler's folder holds the latest adapter only."""
    from conftest import digits_reward

    reward = digits_reward(tmp_path, monkeypatch)
    args = ["-m", "tierlm", "rl", "--config", "configs/tiny_rl.yaml", *RL, *STEPS, "model.lora.r=4"]
    args += [f"model.model_name_or_path={tiny_runs / 'sft'}", f"infra.output_dir={tmp_path / 'run'}", reward]
    args += ["engine.kind=vllm", "model.lora.alpha=8", "training.learning_rate=0.05", "rl.max_new_tokens=12"]
    env = {**ENV, "PYTHONPATH": os.environ["PYTHONPATH"]}
    done = subprocess.run([str(VLLM_PY), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    train = [r for r in lines if r["type"] == "train"]
    assert len(train) == 3 and any(r["grad_norm"] > 0 for r in train[:-1]), train
    assert all(r["logprob_abs_diff"] < 1e-4 and r["weight_version"] == r["step"] - 1 for r in train), train
    assert [p.name for p in (tmp_path / "run" / "sampler" / "adapters").iterdir()] == ["v3"]  # the final evaluation's


IN_PROCESS_EPISODES = """
import json, sys
sys.path.insert(0, "tests")
from episode_checks import episodes_train_the_ids_sampled
from tierlm.data import load_tokenizer
from tierlm.models import load_pretrained_model
from tierlm.rollout.tools import Calculator
from tierlm.rollout.vllm import VLLMEngine
from tierlm.tasks import ArithmeticChain

folder = sys.argv[1]
tok = load_tokenizer(folder)
engine = VLLMEngine(load_pretrained_model(folder), tok.stop_ids, tok, [Calculator()], sys.argv[2], 256)
print(json.dumps(episodes_train_the_ids_sampled(engine, tok, ArithmeticChain("val", 16, 0), 24)))
"""


def test_token_in_token_out_with_vllm_in_process(tiny_runs, tmp_path):
    """The same token-in, token-out check with vLLM in the trainer's process (run from .venv-vllm)."""
    args = ["-c", IN_PROCESS_EPISODES, str(tiny_runs / "sft" / "model"), str(tmp_path / "sampler")]
    done = subprocess.run([str(VLLM_PY), *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    two_turns, _, _ = json.loads(done.stdout.strip().splitlines()[-1])
    assert two_turns >= 3, two_turns


def test_lora_rl_through_the_server_samples_with_each_steps_adapters(tiny_runs, server, tmp_path, monkeypatch):
    """A LoRA policy sampled through a server started with --enable-lora: the server holds the frozen base and loads
    each step's adapters alone (/v1/load_lora_adapter, named for their weight version, the previous unloaded; every
    answer checked to come from it). At a learning rate that moves the adapters a lot every step the sampler's
    log-probs stay the trainer's (|gap| < 1e-4 at every step: a stale adapter would show)."""
    from conftest import digits_reward

    reward = digits_reward(tmp_path, monkeypatch)
    extra = ["model.lora.r=4", "model.lora.alpha=8", "training.learning_rate=0.05", "rl.max_new_tokens=12", reward]
    train = _rl(sys.executable, tiny_runs, tmp_path / "run", f"engine.vllm_url={server}", *extra)
    assert len(train) == 3 and any(r["grad_norm"] > 0 for r in train[:-1]), train
    assert all(r["logprob_abs_diff"] < 1e-4 and r["weight_version"] == r["step"] - 1 for r in train), train
    assert [p.name for p in (tmp_path / "run" / "sampler" / "adapters").iterdir()] == ["v3"]  # the final evaluation's
    models = json.loads(urllib.request.urlopen(server + "/v1/models", timeout=10).read())["data"]
    assert [m["id"] for m in models if m["id"].endswith("-v3")], models  # the server holds the latest adapter only
    assert not [m["id"] for m in models if m["id"].endswith(("-v0", "-v1", "-v2"))], models


ROUTED_EXPERTS = """
import sys, torch
from tierlm.models import GPTConfig, build_gpt, save_model_folder
from tierlm.models.moe import MoEConfig
from tierlm.rollout.vllm import import_vllm
moe = MoEConfig(num_experts=4, experts_per_token=2, expert_width=24)
save_model_folder(build_gpt(GPTConfig(depth=2, aspect_ratio=32, head_dim=16, vocab_size=61, moe=moe)), sys.argv[1])
try:
    import_vllm().LLM(model=sys.argv[1], dtype="float32", max_model_len=64, enforce_eager=True,
                      skip_tokenizer_init=True, enable_return_routed_experts=True)
except Exception as e:
    print("REFUSED", str(e).splitlines()[-2 if "validation error" in str(e) else -1])
else:
    print("RETURNS ROUTES")
"""


def test_vllms_cpu_build_cannot_return_routed_experts(tmp_path):
    """Why `rl.routing_replay` with engine.kind=vllm is refused: vLLM 0.32 returns the experts a mixture-of-experts
    model routed each token to (`enable_return_routed_experts`) only from its Model Runner V2, which needs Triton with a
    CPU backend that its CPU build lacks. A tierlm MoE folder (Qwen3-MoE) asking for them is refused at start; when a
    vLLM answers with routes instead, this fails and tierlm's vLLM engine should hand them on (`Completion.routes`)."""
    args = ["-c", ROUTED_EXPERTS, str(tmp_path / "moe")]
    done = subprocess.run([str(VLLM_PY), *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED" in done.stdout and "Model Runner V2" in done.stdout, done.stdout[-2000:]

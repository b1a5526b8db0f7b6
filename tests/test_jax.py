"""The JAX backend (issue 19): the native GPT's JAX forward equals PyTorch's, the functional optimizers
equal torch.optim's and optax's step for step, the JAX backend trains as the PyTorch backend does (20
AdamW steps of pretraining, SFT and DPO within 1e-4, with parameter roles, weight decay, warmup and
clipping), checkpoints cross between the backends both ways, and the rows of a batch split over
several local devices give the one-device result."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("jax", reason="the JAX backend needs jax and optax (pip install -e .[jax])")
pytest.importorskip("optax", reason="the JAX backend needs jax and optax (pip install -e .[jax])")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from conftest import REPO  # noqa: E402
from tierlm.backends.jax_backend import JaxTrainingBackend  # noqa: E402
from tierlm.backends.options import BackendOptions  # noqa: E402
from tierlm.backends.pytorch import PyTorchTrainingBackend  # noqa: E402
from tierlm.backends.references import FrozenReference  # noqa: E402
from tierlm.models import GPTConfig, build_gpt  # noqa: E402
from tierlm.primitives.optim import RoleSettings, build_adamw  # noqa: E402
from tierlm.primitives.schedules import create_warmup_scheduler  # noqa: E402
from tierlm.strategies import PretrainStrategy, SFTStrategy  # noqa: E402
from tierlm.strategies.dpo import DPOStrategy  # noqa: E402

V = 97


def _model(tied: bool = False, **shape) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_gpt(
        GPTConfig(
            **{
                "depth": 2,
                "aspect_ratio": 32,
                "head_dim": 16,
                "n_kv_head": 2,
                "vocab_size": V,
                "max_seq_len": 64,
                "tie_embeddings": tied,
                **shape,
            }
        )
    )
    with torch.no_grad():  # the fresh model's output projections are zero: make every weight matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize(
    "shape",
    [{}, {"tie_embeddings": True}, {"window_pattern": "SL", "short_window": 5, "n_kv_head": 1}],
    ids=["untied", "tied", "windows-mqa"],
)
def test_the_jax_forward_is_the_pytorch_model(shape):
    from tierlm.models.gpt.jax import forward, params_from_torch

    model = _model(**shape).eval()
    ids = torch.randint(0, V, (2, 12))
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])  # row 0 packs two documents
    params = params_from_torch(model)
    with torch.no_grad():
        for pos in (None, positions):
            want = model(ids, position_ids=pos)
            got = forward(
                params, model.config, jnp.asarray(ids.numpy()), None if pos is None else jnp.asarray(pos.numpy())
            )
            np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-5, rtol=0)


def _gpt2(**shape) -> torch.nn.Module:
    from tierlm.models.gpt2.family import GPT2_FAMILY
    from tierlm.models.gpt2.model import GPT2Config

    torch.manual_seed(0)
    model = GPT2_FAMILY.build_from_config(
        GPT2Config(**{"n_layer": 2, "n_head": 4, "n_embd": 32, "vocab_size": V, "block_size": 64, **shape})
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("bias", [True, False])
def test_the_jax_gpt2_is_the_pytorch_gpt2(bias):
    from tierlm.models.gpt.jax import params_from_torch
    from tierlm.models.gpt2.jax import forward

    model = _gpt2(bias=bias).eval()
    ids = torch.randint(0, V, (2, 12))
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])
    with torch.no_grad():
        for pos in (None, positions):
            got = forward(
                params_from_torch(model),
                model.config,
                jnp.asarray(ids.numpy()),
                None if pos is None else jnp.asarray(pos.numpy()),
            )
            np.testing.assert_allclose(np.asarray(got), model(ids, position_ids=pos).numpy(), atol=1e-5, rtol=0)


def test_gpt2_variants_are_refused_by_the_jax_backend(tmp_path):
    from tierlm.errors import ConfigError

    model = _gpt2(ra_r=4)
    with pytest.raises(ConfigError, match="computes plain GPT-2; this model uses ra_r"):
        JaxTrainingBackend(model, torch.optim.AdamW(model.parameters()), tmp_path)


def test_functional_optimizers_equal_torch_and_optax_step_for_step():
    from tierlm.primitives.optim.functional import FunctionalMuon, PyTorchAdam, apply_updates
    from tierlm.primitives.optim.jax import JaxAdam
    from tierlm.primitives.optim.muon import Muon

    g = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in start.items()} for _ in range(20)]
    for weight_decay, reference in ((0.1, torch.optim.AdamW), (0.0, torch.optim.Adam)):
        params = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
        torch_opt = reference(params.values(), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
        functional, jax_opt = (
            PyTorchAdam(0.01, 0.9, 0.95, 1e-8, weight_decay),
            JaxAdam(0.01, 0.9, 0.95, 1e-8, weight_decay),
        )
        f_params, j_params = dict(start), {k: jnp.asarray(v.numpy()) for k, v in start.items()}
        f_state, j_state = functional.init(f_params), jax_opt.init(j_params)
        for step_grads in grads:
            for k, p in params.items():
                p.grad = step_grads[k].clone()
            torch_opt.step()
            updates, f_state = functional.update(step_grads, f_state, f_params)
            f_params = apply_updates(f_params, updates)
            j_updates, j_state = jax_opt.update(
                {k: jnp.asarray(v.numpy()) for k, v in step_grads.items()}, j_state, j_params
            )
            j_params = {k: j_params[k] + j_updates[k] for k in j_params}
        for k, p in params.items():
            torch.testing.assert_close(f_params[k], p.detach(), atol=1e-6, rtol=0)
            np.testing.assert_allclose(np.asarray(j_params[k]), p.detach().numpy(), atol=1e-6, rtol=0)
        assert JaxAdam.moments(j_state)[0] == 20
    w = torch.nn.Parameter(start["w"].clone())
    muon, functional = (
        Muon([w], lr=0.02, weight_decay=0.1, ns_dtype=torch.float32),
        FunctionalMuon(0.02, weight_decay=0.1),
    )
    f_w, state = {"w": start["w"].clone()}, functional.init({"w": start["w"]})
    for step_grads in grads[:5]:
        w.grad = step_grads["w"].clone()
        muon.step()
        updates, state = functional.update({"w": step_grads["w"]}, state, f_w)
        f_w = apply_updates(f_w, updates)
    torch.testing.assert_close(f_w["w"], w.detach(), atol=1e-5, rtol=0)


def _backends(model: torch.nn.Module, tmp_path, steps: int = 20, optimizer: str = "adamw"):
    """A PyTorch and a JAX backend over copies of `model`: AdamW with four roles' LRs, weight decay on the
    matrices, 3 warmup steps then cosine, gradients clipped at 1 (`optimizer="muon"`: Muon on the matrices, its
    momentum warmed up and its weight decay falling as nanochat's schedule moves them, AdamW on the rest)."""
    from tierlm.primitives.optim import build_muon

    matrix_lr = 2e-2 if optimizer == "muon" else 3e-3
    settings = RoleSettings(
        matrix_lr=matrix_lr, embedding_lr=2e-2, unembedding_lr=4e-3, scalar_lr=5e-3, weight_decay=0.1
    )
    out = []
    for kind in ("pytorch", "jax"):
        m = copy.deepcopy(model)
        optimizer_ = (build_muon if optimizer == "muon" else build_adamw)(m, settings)
        scheduler = create_warmup_scheduler(optimizer_, 3, steps, "cosine", 0.1)
        folder = tmp_path / kind
        out.append(
            PyTorchTrainingBackend(m, optimizer_, None, folder, "cpu", scheduler, BackendOptions(max_grad_norm=1.0))
            if kind == "pytorch"
            else JaxTrainingBackend(m, optimizer_, folder, scheduler, BackendOptions(max_grad_norm=1.0))
        )
    return out


def _batches(kind: str, n: int = 20):
    """`n` batches cycling through 4 (so there is something to learn: the loss falls)."""
    g = torch.Generator().manual_seed(1)
    if kind == "pretrain":
        return [{"tokens": torch.randint(0, V, (4, 17), generator=g)} for _ in range(4)] * (n // 4)
    if kind == "sft":
        return [
            {"tokens": torch.randint(0, V, (4, 17), generator=g), "mask": (torch.rand(4, 17, generator=g) > 0.4).long()}
            for _ in range(4)
        ] * (n // 4)
    batches = []  # DPO: 2 pairs a batch, chosen rows then rejected rows, labels only on the responses
    for _ in range(4):
        ids = torch.randint(0, V, (4, 16), generator=g)
        labels = ids.clone()
        labels[:, :6] = -100
        batches.append({"input_ids": ids, "labels": labels})
    return batches * (n // 4)


@pytest.mark.parametrize("stage", ["pretrain", "sft", "dpo", "gpt2-pretrain", "muon-pretrain"])
def test_the_jax_backend_trains_as_the_pytorch_backend(stage, tmp_path):
    """20 AdamW (or Muon + AdamW) steps from the same weights on the same batches: losses and the trained models'
    logits within 1e-4, and the evaluation metrics (the strategies' JAX twins) too; the native GPT, and GPT-2."""
    optimizer = "muon" if stage.startswith("muon") else "adamw"
    torch_backend, jax_backend = _backends(
        _gpt2() if stage.startswith("gpt2") else _model(), tmp_path, optimizer=optimizer
    )
    stage = stage.removeprefix("gpt2-").removeprefix("muon-")
    if stage == "dpo":
        strategies = (
            DPOStrategy(0.1, FrozenReference(copy.deepcopy(torch_backend.model), "cpu")),
            DPOStrategy(0.1, jax_backend.frozen_reference()),
        )
    else:
        strategies = ((PretrainStrategy if stage == "pretrain" else SFTStrategy)(torch.ones(V, dtype=torch.long)),) * 2
    batches, losses = _batches(stage), {}
    for backend, strategy in zip((torch_backend, jax_backend), strategies):
        losses[backend] = []
        for batch in batches:
            backend.forward_backward(strategy.prepare_batch(batch), strategy.compute_loss)
            losses[backend].append(backend.optim_step().wait()["loss"])
    np.testing.assert_allclose(losses[jax_backend], losses[torch_backend], atol=1e-4, rtol=0)
    assert losses[torch_backend][-1] < losses[torch_backend][0] - 0.05  # it trained
    # The trained models: their logits (not each weight: GPT-2's key bias gets an exactly-zero gradient, since
    # softmax ignores what it adds to every score, and Adam turns each backend's float noise there into
    # lr-sized steps that change nothing the model computes).
    probe = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(
            jax_backend.model.eval()(probe), torch_backend.model.eval()(probe), atol=1e-4, rtol=0
        )
    want = torch_backend.forward(strategies[0].prepare_batch(batches[0]), strategies[0].compute_metrics).wait()
    got = jax_backend.forward(strategies[1].prepare_batch(batches[0]), strategies[1].compute_metrics).wait()
    assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-3 for k in want), (got, want)


@pytest.mark.parametrize("first,optimizer", [("jax", "adamw"), ("pytorch", "adamw"), ("jax", "muon")])
def test_a_checkpoint_crosses_between_the_backends(first, optimizer, tmp_path):
    """3 steps on one backend, a checkpoint, 3 more on the other = 6 on the first (weights, Adam moments, Muon's
    momentum, step count and schedule all crossed)."""
    strategy, batches = PretrainStrategy(), _batches("pretrain", 8)[:6]

    def train(backend, part):
        out = []
        for batch in part:
            backend.forward_backward(strategy.prepare_batch(batch), strategy.compute_loss)
            out.append(backend.optim_step().wait()["loss"])
        return out

    torch_backend, jax_backend = _backends(_model(tied=True), tmp_path / "a", steps=6, optimizer=optimizer)
    one, other = (jax_backend, torch_backend) if first == "jax" else (torch_backend, jax_backend)
    losses = train(one, batches[:3])
    path = one.save_checkpoint(3).wait()
    other.checkpoint_dir = one.checkpoint_dir
    assert other.load_checkpoint(path).wait()["backend_step"] == 3
    losses += train(other, batches[3:])
    straight = train(
        _backends(_model(tied=True), tmp_path / "b", steps=6, optimizer=optimizer)[0 if first == "pytorch" else 1],
        batches,
    )
    np.testing.assert_allclose(losses, straight, atol=1e-4, rtol=0)


def _jax_pretrain_losses(folder: Path) -> list[float]:
    """Five pretraining steps of the JAX backend on the devices JAX sees here."""
    backend, strategy, losses = _backends(_model(), folder)[1], PretrainStrategy(), []
    for batch in _batches("pretrain", 5):
        backend.forward_backward(strategy.prepare_batch(batch), strategy.compute_loss)
        losses.append(backend.optim_step().wait()["loss"])
    return losses


def test_rows_split_over_two_devices_give_the_one_device_steps(tmp_path):
    """XLA's host platform as 2 CPU devices (the data-parallel path of a multi-GPU machine): the same
    losses as one device (this process's)."""
    script = """
import json, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import jax
from test_jax import _jax_pretrain_losses
print(json.dumps({"devices": len(jax.local_devices()), "losses": _jax_pretrain_losses(Path(sys.argv[2]))}))
"""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "OMP_NUM_THREADS": "1"}
    env.update(TIERLM_CACHE_DIR=str(tmp_path / "cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    result = subprocess.run(
        [sys.executable, "-c", script, str(REPO / "tests"), str(tmp_path / "2")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads(result.stdout.strip().splitlines()[-1])
    assert two["devices"] == 2 and len(jax.local_devices()) == 1
    assert any((tmp_path / "cache" / "jax-compilation").iterdir())  # the backend keeps its compiled programs
    np.testing.assert_allclose(two["losses"], _jax_pretrain_losses(tmp_path / "1"), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_tierlm_pretrain_with_the_jax_backend(tmp_path):
    from conftest import run_main

    out = tmp_path / "run"
    args = [
        "pretrain",
        "--config",
        "tiny_pretrain",
        "infra.backend=jax",
        "training.num_train_steps=8",
        "training.warmup_steps=1",
        "training.eval_steps=4",
        "training.save_steps=4",
        "training.eval_batches=2",
        "data.num_synthetic_examples=2000",
        "infra.progress_bar=false",
        f"infra.output_dir={out}",
    ]
    result = run_main(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "eval"]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    resumed = run_main(
        *args[:-1],
        "infra.backend=pytorch",
        "training.num_train_steps=10",
        "training.resume=auto",
        f"infra.output_dir={out}",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]  # the JAX run's checkpoint continues under PyTorch


def _loss_and_gradient_equal_the_twins(strategy, logits: torch.Tensor, batch: dict, tolerance: float) -> None:
    """`strategy.compute_loss` and its jax.numpy twin (`jax_twin`) give one (loss, count) and one gradient by the
    logits."""
    import jax

    from tierlm.primitives.jax_losses import jax_twin

    leaf = logits.clone().requires_grad_(True)
    total, count = strategy.compute_loss(leaf, batch)
    total.backward()
    twin, jax_batch = jax_twin(strategy.compute_loss), {k: jnp.asarray(v.numpy()) for k, v in batch.items()}
    (jax_total, jax_count), grad = jax.value_and_grad(lambda x: twin(x, jax_batch), has_aux=True)(
        jnp.asarray(logits.numpy())
    )
    assert float(jax_count) == float(count) and abs(float(jax_total) - float(total)) < tolerance, (jax_total, total)
    np.testing.assert_allclose(np.asarray(grad[0] if isinstance(grad, tuple) else grad), leaf.grad.numpy(), atol=1e-6)


@pytest.mark.parametrize("loss", ["reinforce", "grpo", "dapo", "dr_grpo", "gspo", "cispo", "ppo", "distill"])
def test_the_policy_gradient_losses_have_jax_twins(loss):
    """Each `rl.loss` in jax.numpy (the JAX backend's) equals PyTorch's, the loss and its gradient by the logits,
    with stale old log-probs, a KL reference and off-policy importance weights."""

    from tierlm.config import RLConfig
    from tierlm.primitives.jax_losses import jax_twin
    from tierlm.strategies.rl import policy_gradient_strategy
    from tierlm.strategies.rl_losses import resolve_rl

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[0, :2] = labels[2, :] = -100  # a prompt, and a row with nothing to train
    near = torch.randn(3, 5, generator=g) * 0.3 - 2.0
    batch = {
        "labels": labels,
        "advantages": torch.randn(3, generator=g) if loss != "distill" else torch.randn(3, 5, generator=g),
        "old_logprobs": near,
        "ref_logprobs": near + 0.1 * torch.randn(3, 5, generator=g),
        "importance": torch.rand(3, 5, generator=g) + 0.5,
    }
    teacher = {"teacher": "t"} if loss == "distill" else {}
    rl = resolve_rl(RLConfig(loss=loss, kl_coef=0.05, temperature=0.8, max_new_tokens=5, **teacher))
    strategy = policy_gradient_strategy(rl)
    _loss_and_gradient_equal_the_twins(strategy, logits, batch, 1e-5)
    jax_batch = {k: jnp.asarray(v.numpy()) for k, v in batch.items()}
    metrics = jax_twin(strategy.compute_metrics)(jnp.asarray(logits.numpy()), jax_batch)
    np.testing.assert_allclose(
        np.asarray(metrics["logprobs"]), strategy.compute_metrics(logits, batch)["logprobs"].numpy(), atol=1e-6
    )


def test_dft_has_a_jax_twin():
    """training.sft_loss=dft in jax.numpy equals PyTorch's, the loss and its gradient by the logits (the weight out of
    both gradients), loss_mask included."""
    from tierlm.strategies.sft import DFTStrategy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 6, generator=g)
    labels = torch.randint(0, 6, (2, 4), generator=g)
    labels[0, :2] = -100
    batch = {"labels": labels, "loss_mask": torch.tensor([[1.0, 1.0, 0.5, 1.0], [1.0, 0.0, 1.0, 2.0]])}
    _loss_and_gradient_equal_the_twins(DFTStrategy(), logits, batch, 1e-6)


@pytest.mark.slow
def test_tierlm_rl_with_the_jax_backend_takes_the_pytorch_steps(tiny_runs, tmp_path, monkeypatch):
    """`tierlm rl infra.backend=jax` (GRPO, a KL reference): the rollouts (the sampler reads JAX's weights after each
    update), rewards, losses and held-out pass@k of the PyTorch backend's run. (A reward for digits, so the tiny model's
    rollouts differ in reward: with none the advantages are 0 and AdamW turns each backend's float noise into steps.)"""
    from conftest import digits_reward, run_main

    args = [
        "rl",
        "--config",
        str(REPO / "configs/tiny_rl.yaml"),
        f"model.model_name_or_path={tiny_runs / 'sft'}",
        "data.max_seq_length=64",
        "training.num_train_steps=3",
        "training.eval_steps=3",
        "training.logging_steps=1",
        "rl.loss=grpo",
        digits_reward(tmp_path, monkeypatch),
        "rl.kl_coef=0.05",
        "rl.prompts_per_step=4",
        "rl.group_size=4",
        "rl.max_new_tokens=8",
        "rl.eval_problems=8",
        "infra.device_type=cpu",
        "infra.progress_bar=false",
    ]
    for backend in ("jax", "pytorch"):
        result = run_main(*args, f"infra.backend={backend}", f"infra.output_dir={tmp_path / backend}")
        assert result.returncode == 0, result.stderr[-3000:]
    jax_run, torch_run = (
        [r for r in map(json.loads, (tmp_path / b / "metrics.jsonl").read_text().splitlines()) if r["type"] != "sample"]
        for b in ("jax", "pytorch")
    )
    assert [(r["type"], r["step"]) for r in jax_run] == [(r["type"], r["step"]) for r in torch_run]
    assert any(r.get("reward_std", 0.0) > 0 for r in torch_run), torch_run  # advantages that are not all 0
    for a, b in zip(jax_run, torch_run):
        assert a.get("reward_mean") == b.get("reward_mean") and a.get("completion_len") == b.get("completion_len")
        for key in ("loss", "kl", "grad_norm", "pass@1", "pass@k"):
            assert abs(a.get(key, 0.0) - b.get(key, 0.0)) < 1e-4, (key, a, b)
        assert a.get("logprob_abs_diff", 0.0) < 1e-4  # the sampler holds the weights JAX trained


def test_the_fused_head_and_loss_equals_the_logits_loss(tmp_path):
    """`linear_cross_entropy` (the head inside the loss, chunks of rows that do not divide the batch, each chunk's
    gradients taken as its logits are) == the cross-entropy of the whole logits, value and gradients; the JAX
    backend's token losses train through it."""
    import jax

    from tierlm.primitives.jax_losses import cross_entropy_sum, linear_cross_entropy

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    hidden, weight = jax.random.normal(keys[0], (3, 50, 16)), jax.random.normal(keys[1], (37, 16)) * 0.3
    labels = jax.random.randint(keys[2], (3, 50), 0, 37).at[0, :5].set(-100)
    mask = (jax.random.uniform(keys[3], (3, 50)) > 0.3).astype(jnp.int32)

    def fused(h, w):
        return linear_cross_entropy(h, w, labels, mask, chunk_rows=64)[0]

    def whole(h, w):
        return cross_entropy_sum(h @ w.T, labels, mask)[0]

    assert abs(float(jax.jit(fused)(hidden, weight)) - float(whole(hidden, weight))) < 1e-3  # a sum of ~100 tokens
    for a, b in zip(jax.grad(fused, (0, 1))(hidden, weight), jax.grad(whole, (0, 1))(hidden, weight)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    _, backend = _backends(_model(), tmp_path)
    assert backend._fuses(PretrainStrategy().compute_loss) and not backend._fuses(DPOStrategy(0.1).compute_loss)

"""The tier-0 backend: accumulation normalised over the whole step, optimizer stepping, checkpoints."""

import asyncio

import pytest
import torch

from tierlm.backends import PyTorchTrainingBackend, TrainFuture, TrainingBackend, create_cross_entropy_loss
from tierlm.backends.options import BackendOptions
from tierlm.models import build_gpt
from tierlm.primitives import cross_entropy_sum


def _backend(config, tmp_path, optimizer_cls=torch.optim.SGD, **kwargs):
    torch.manual_seed(0)
    model = build_gpt(config)
    with torch.no_grad():  # move off the zero-initialised projections so every parameter has a gradient
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    optimizer = optimizer_cls(model.parameters(), lr=1.0)
    options = BackendOptions(**kwargs)
    return PyTorchTrainingBackend(
        model, optimizer, create_cross_entropy_loss(), tmp_path / "ckpt", "cpu", None, options
    )


def _micro_batches(vocab, lengths=(7, 12, 3, 9), valid=(7, 2, 3, 5), seq=12):
    """Micro-batches of one row each, with uneven numbers of trained tokens."""
    batches = []
    for length, n_valid in zip(lengths, valid):
        ids = torch.randint(0, vocab, (1, seq))
        labels = torch.randint(0, vocab, (1, seq))
        labels[:, n_valid:] = -100
        batches.append({"input_ids": ids, "labels": labels})
    return batches


@pytest.mark.parametrize("loss_style", ["mean", "sum"])
def test_accumulation_equals_one_big_batch(tiny_gpt_config, tmp_path, loss_style):
    """4 micro-batches with 7, 2, 3 and 5 trained tokens == one batch holding all 4 rows (fp32, <= 1e-6)."""
    micro = _micro_batches(tiny_gpt_config.vocab_size)
    big = {k: torch.cat([b[k] for b in micro]) for k in ("input_ids", "labels")}
    loss_fn = None if loss_style == "mean" else (lambda logits, batch: cross_entropy_sum(logits, batch["labels"]))

    accumulated = _backend(tiny_gpt_config, tmp_path / "a", max_grad_norm=0.0)
    for batch in micro:
        accumulated.forward_backward(batch, loss_fn=loss_fn)
    m_acc = accumulated.optim_step().wait()

    single = _backend(tiny_gpt_config, tmp_path / "b", max_grad_norm=0.0)
    single.forward_backward(big, loss_fn=loss_fn)
    m_one = single.optim_step().wait()

    assert m_acc["num_tokens"] == m_one["num_tokens"] == 17
    assert abs(m_acc["loss"] - m_one["loss"]) < 1e-6
    assert abs(m_acc["grad_norm"] - m_one["grad_norm"]) < 1e-6
    # SGD with lr=1: the parameter change is exactly minus the gradient.
    for (name, a), b in zip(accumulated.model.named_parameters(), single.model.parameters()):
        assert (a - b).abs().max().item() <= 1e-6, name


def test_micro_batch_means_would_differ(tiny_gpt_config, tmp_path):
    """The control: averaging per-micro-batch means is a different (wrong) update."""
    micro = _micro_batches(tiny_gpt_config.vocab_size)
    backend = _backend(tiny_gpt_config, tmp_path, max_grad_norm=0.0)
    means = [backend.forward_backward(b).wait()["loss"] for b in micro]
    step = backend.optim_step().wait()
    assert abs(sum(means) / len(means) - step["loss"]) > 1e-3


def test_optim_step_clips_steps_scheduler_and_zeros(tiny_gpt_config, tmp_path):
    backend = _backend(tiny_gpt_config, tmp_path, max_grad_norm=0.5)
    backend.scheduler = torch.optim.lr_scheduler.LambdaLR(backend.optimizer, lambda step: 1.0 / (step + 1))
    for expected_lr in (1.0, 0.5):
        backend.forward_backward(_micro_batches(tiny_gpt_config.vocab_size)[0])
        metrics = backend.optim_step().wait()
        assert metrics["lr"] == expected_lr
        assert all(p.grad is None for p in backend.model.parameters())
    assert metrics["grad_norm"] > 0.5  # reported before clipping
    with pytest.raises(AssertionError, match="without a forward_backward"):
        backend.optim_step()


def test_protocol_and_futures(tiny_gpt_config, tmp_path):
    backend = _backend(tiny_gpt_config, tmp_path)
    assert isinstance(backend, TrainingBackend)

    async def loop():
        metrics = await backend.forward_backward(_micro_batches(tiny_gpt_config.vocab_size)[0]).result()
        step = await backend.optim_step()
        return metrics, step

    metrics, step = asyncio.run(loop())
    assert set(metrics) == {"loss", "num_tokens"} and metrics["num_tokens"] == 7
    assert {"grad_norm", "lr", "loss", "num_tokens"} <= set(step)
    assert TrainFuture.ready(3).wait() == 3


def test_bf16_autocast_on_cpu(tiny_gpt_config, tmp_path):
    backend = _backend(tiny_gpt_config, tmp_path, compute_dtype=torch.bfloat16, optimizer_cls=torch.optim.AdamW)
    loss = backend.forward_backward(_micro_batches(tiny_gpt_config.vocab_size)[0]).wait()["loss"]
    assert torch.isfinite(torch.tensor(loss))
    assert next(backend.model.parameters()).dtype == torch.float32  # autocast leaves parameters alone
    backend.optim_step().wait()


def test_checkpoint_round_trip_continues_identically(tiny_gpt_config, tmp_path):
    """Save after 2 steps, load into a fresh backend, and the next 2 steps match the uninterrupted run."""
    batches = [_micro_batches(tiny_gpt_config.vocab_size)[i % 4] for i in range(4)]

    def make(path):
        b = _backend(tiny_gpt_config, path, optimizer_cls=torch.optim.AdamW)
        b.scheduler = torch.optim.lr_scheduler.LambdaLR(b.optimizer, lambda s: 0.01 / (s + 1))
        return b

    straight = make(tmp_path / "straight")
    losses = []
    for batch in batches:
        straight.forward_backward(batch)
        losses.append(straight.optim_step().wait()["loss"])

    first = make(tmp_path / "resumed")
    for batch in batches[:2]:
        first.forward_backward(batch)
        first.optim_step().wait()
    path = first.save_checkpoint(2, {"note": "x"}).wait()
    second = make(tmp_path / "resumed")
    assert second.load_checkpoint().wait()["note"] == "x"
    resumed = []
    for batch in batches[2:]:
        second.forward_backward(batch)
        resumed.append(second.optim_step().wait()["loss"])
    assert resumed == losses[2:]
    for a, b in zip(straight.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)
    assert (path / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("bf16", [False, True])
def test_fused_cross_entropy_equals_logits_then_loss(tiny_gpt_config, tmp_path, bf16):
    """The LM head fused into the loss (the default for the native GPT) == logits, then cross-entropy:
    the same loss, gradient norm, update and eval metrics (fp32 1e-6; bf16 autocast 1e-2)."""
    from tierlm.strategies import CrossEntropyStrategy

    strategy = CrossEntropyStrategy(token_bytes=torch.arange(tiny_gpt_config.vocab_size) % 3)
    batch = _micro_batches(tiny_gpt_config.vocab_size)[1]
    batch["loss_mask"] = (torch.rand(batch["labels"].shape) > 0.3).float()
    batch["position_ids"] = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    kwargs = dict(compute_dtype=torch.bfloat16 if bf16 else None)  # SGD, lr 1: the update is the gradient
    runs = {}
    for fused in (True, False):
        backend = _backend(tiny_gpt_config, tmp_path / str(fused), fused_cross_entropy=fused, **kwargs)
        seen = {}
        original = backend.model.lm_head.forward
        backend.model.lm_head.forward = lambda x: seen.setdefault("logits", True) and original(x)
        backend.forward_backward(batch, loss_fn=strategy.compute_loss)
        step = backend.optim_step().wait()
        metrics = backend.forward(batch, strategy.compute_metrics).wait()
        assert ("logits" in seen) != fused  # the fused path never ran the LM head on its own
        runs[fused] = step, metrics, [p.detach().clone() for p in backend.model.parameters()]
    tol = 1e-2 if bf16 else 1e-6
    (step_f, metrics_f, params_f), (step_p, metrics_p, params_p) = runs[True], runs[False]
    assert step_f["num_tokens"] == step_p["num_tokens"]
    assert abs(step_f["loss"] - step_p["loss"]) <= tol * max(1.0, step_p["loss"])
    assert abs(step_f["grad_norm"] - step_p["grad_norm"]) <= tol * max(1.0, step_p["grad_norm"])
    for key in metrics_p:
        assert abs(metrics_f[key] - metrics_p[key]) <= tol * max(1.0, abs(metrics_p[key])), key
    if not bf16:
        assert max((a - b).abs().max().item() for a, b in zip(params_f, params_p)) <= 1e-6


@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_fused_cross_entropy_for_transformers_models(tmp_path, architecture):
    """A transformers model of a plain-head type gets the fused head too: the same loss, gradient and
    update as its own logits; a wrapped one (DDP here) or a soft-capped head computes logits."""
    import transformers

    from tierlm.models import fuses_cross_entropy
    from tierlm.strategies import CrossEntropyStrategy

    shape = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    config_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[architecture]
    strategy = CrossEntropyStrategy()
    batch = _micro_batches(61)[1]
    batch["position_ids"] = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    runs = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = model_cls(config_cls(**shape))
        assert fuses_cross_entropy(model)
        backend = PyTorchTrainingBackend(
            model,
            torch.optim.SGD(model.parameters(), lr=1.0),
            None,
            tmp_path / str(fused),
            "cpu",
            options=BackendOptions(fused_cross_entropy=fused),
        )
        calls = []
        model.lm_head.register_forward_hook(lambda *_: calls.append(1))
        backend.forward_backward(batch, loss_fn=strategy.compute_loss)
        assert bool(calls) != fused  # fused: the head never ran on its own
        step = backend.optim_step().wait()
        runs[fused] = step, [p.detach().clone() for p in model.parameters()]
    assert abs(runs[True][0]["loss"] - runs[False][0]["loss"]) <= 1e-6
    assert abs(runs[True][0]["grad_norm"] - runs[False][0]["grad_norm"]) <= 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(runs[True][1], runs[False][1])) <= 1e-6
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**shape))  # soft-capped logits
    assert not fuses_cross_entropy(gemma)

    class Wrapped(torch.nn.Module):  # what DDP looks like from outside: the model under .module
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    assert not fuses_cross_entropy(Wrapped(model_cls(config_cls(**shape))))


def test_fused_cross_entropy_setting_reaches_the_backend(tiny_gpt_config, tmp_path):
    from tierlm.builders.backend import build_backend
    from tierlm.config import TierlmConfig

    for value in (True, False):
        config = TierlmConfig.load(None, [f"training.fused_cross_entropy={str(value).lower()}"])
        backend = build_backend(config, build_gpt(tiny_gpt_config), tmp_path / str(value), torch.device("cpu"), None)
        assert backend.fused_cross_entropy is value

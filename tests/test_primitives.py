"""Tier-1 primitives against references: torch's AdamW, transformers' own loss, torch's schedulers."""

import copy
import math

import pytest
import torch
from torch import nn

from tierlm.errors import ConfigError, DeviceError
from tierlm.primitives import (
    compute_device_map_single_gpu,
    count_loss_tokens,
    create_adamw_optimizer,
    create_cross_entropy_loss,
    create_warmup_cosine_scheduler,
    create_warmup_scheduler,
    cross_entropy_sum,
    parse_dtype,
    resolve_device,
)


def test_parse_dtype():
    assert parse_dtype("bfloat16") == torch.bfloat16
    assert parse_dtype("float32") == torch.float32
    with pytest.raises(ValueError, match="Invalid dtype"):
        parse_dtype("invalid")


def test_device_map_and_device():
    assert compute_device_map_single_gpu("cuda", 4) == {"": 4}
    assert compute_device_map_single_gpu("cpu", 0) is None
    with pytest.raises(ConfigError):
        compute_device_map_single_gpu("tpu", 0)
    assert resolve_device("cpu").type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(DeviceError, match="no CUDA GPU"):
        resolve_device("cuda")


def _model():
    return nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 20))


def _steps_side_by_side(*pairs, steps: int = 5):
    """Step every (model, optimizer) pair on the same random batches; yields the step after each."""
    for step in range(steps):
        x = torch.randint(0, 20, (4, 6))
        for model, opt in pairs:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        yield step


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("exclude", [False, True])
def test_adamw_matches_torch(exclude, fused):
    ours_model = _model()
    ref_model = copy.deepcopy(ours_model)
    ours = create_adamw_optimizer(
        ours_model,
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        exclude_norms_biases_embeddings=exclude,
        fused=fused,
    )
    if exclude:
        decay = [ref_model[1].weight, ref_model[3].weight]
        no_decay = [ref_model[0].weight, ref_model[1].bias, ref_model[2].weight, ref_model[2].bias, ref_model[3].bias]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    else:
        groups = [{"params": list(ref_model.parameters())}]
    ref = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=fused or None)
    for step in _steps_side_by_side((ours_model, ours), (ref_model, ref)):
        for a, b in zip(ours_model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b), f"step {step}: parameters diverged"


def test_adamw_is_fused_by_default_and_matches_the_loop_kernel():
    fused_model = _model()
    loop_model = copy.deepcopy(fused_model)
    fused = create_adamw_optimizer(fused_model, lr=1e-2, weight_decay=0.1)
    assert fused.defaults["fused"]
    loop = torch.optim.AdamW(loop_model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for _ in _steps_side_by_side((fused_model, fused), (loop_model, loop)):
        pass
    for a, b in zip(fused_model.parameters(), loop_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_adamw_groups_exempt_norms_biases_embeddings():
    model = _model()
    opt = create_adamw_optimizer(model, lr=1e-3, weight_decay=0.1, exclude_norms_biases_embeddings=True)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model[1].weight), id(model[3].weight)}
    with pytest.raises(ConfigError, match="lr"):
        create_adamw_optimizer(model, lr=-1)


def test_cross_entropy_equals_transformers_loss():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    model = Qwen3ForCausalLM(config).eval()
    input_ids = torch.randint(0, 50, (3, 12))
    hf_labels = input_ids.clone()
    hf_labels[0, :5] = -100  # a prompt that is not trained
    hf_labels[2, 9:] = -100  # padding
    with torch.no_grad():
        out = model(input_ids=input_ids, labels=hf_labels)
    # tierlm labels are already shifted: labels[t] is the target of position t.
    ours_labels = torch.cat([hf_labels[:, 1:], torch.full((3, 1), -100)], dim=1)
    ours = create_cross_entropy_loss()(out.logits, {"input_ids": input_ids, "labels": ours_labels})
    assert abs(ours.item() - out.loss.item()) < 1e-6


def test_cross_entropy_mask_and_targets_alias():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    mask = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 1, 1, 1]])
    loss_fn = create_cross_entropy_loss()
    reference = torch.nn.functional.cross_entropy(logits[mask.bool()], labels[mask.bool()])
    assert torch.allclose(loss_fn(logits, {"labels": labels, "loss_mask": mask}), reference, atol=1e-6)
    assert torch.allclose(loss_fn(logits, {"targets": labels, "loss_mask": mask}), reference, atol=1e-6)
    total, n = cross_entropy_sum(logits, labels, mask)
    assert n.item() == 7 and count_loss_tokens({"labels": labels, "loss_mask": mask}).item() == 7
    assert torch.allclose(total / n, reference, atol=1e-6)


def _lrs(scheduler, optimizer, steps):
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def _optimizer(lr=1.0):
    return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)


def test_warmup_cosine_matches_torch_sequential_lr():
    """The seed's reference construction: LinearLR(0.1 -> 1) then CosineAnnealingLR to 0.1x."""
    from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

    ours_opt, ref_opt = _optimizer(2.0), _optimizer(2.0)
    ours = create_warmup_cosine_scheduler(ours_opt, num_warmup_steps=10, num_training_steps=50, min_lr_ratio=0.1)
    ref = SequentialLR(
        ref_opt,
        [LinearLR(ref_opt, 0.1, 1.0, total_iters=10), CosineAnnealingLR(ref_opt, T_max=40, eta_min=0.2)],
        milestones=[10],
    )
    for a, b in zip(_lrs(ours, ours_opt, 50), _lrs(ref, ref_opt, 50)):
        assert abs(a - b) < 1e-9


@pytest.mark.parametrize(
    "style,expected",
    [
        # 10 steps, 2 warmup steps from 0.1x; decay to min_lr_ratio 0 (values at steps 0, 1, 2, 6, 9)
        ("linear", [0.1, 0.55, 1.0, 0.5, 0.125]),
        ("constant", [0.1, 0.55, 1.0, 1.0, 1.0]),
        ("cosine", [0.1, 0.55, 1.0, 0.5, 0.5 * (1 + math.cos(math.pi * 7 / 8))]),
        # warmdown_ratio 0.5: constant until step 5, then linear to 0 at step 10
        ("warmdown", [0.1, 0.55, 1.0, 0.8, 0.2]),
    ],
)
def test_scheduler_values_at_chosen_steps(style, expected):
    opt = _optimizer()
    scheduler = create_warmup_scheduler(opt, 2, 10, decay_style=style, min_lr_ratio=0.0, warmdown_ratio=0.5)
    lrs = _lrs(scheduler, opt, 10)
    assert [round(lrs[s], 6) for s in (0, 1, 2, 6, 9)] == [round(v, 6) for v in expected]


def test_scheduler_validation():
    with pytest.raises(ConfigError, match="num_training_steps"):
        create_warmup_scheduler(_optimizer(), 10, 10)
    with pytest.raises(ConfigError, match="decay_style"):
        create_warmup_scheduler(_optimizer(), 0, 10, decay_style="step")


@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_linear_cross_entropy_equals_head_then_torch_loss(chunk_rows):
    """Fused LM head + CE == `F.cross_entropy(h @ W.T)`: value, per-token losses, d/dh and d/dW; weighted rows;
    rows in chunks; and the GPU path (every row computed, the untrained ones weighted 0)."""
    from tierlm.primitives.losses import _LinearCrossEntropy, linear_cross_entropy

    torch.manual_seed(0)
    h = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(37, 16, requires_grad=True)
    labels = torch.randint(0, 37, (10,))
    labels[[1, 4, 5]] = -100
    weights = torch.rand(10)
    per_token = torch.nn.functional.cross_entropy(h @ w.T, labels, ignore_index=-100, reduction="none")
    reference = (per_token * weights).sum()
    ref_grads = torch.autograd.grad(reference, (h, w))
    total, losses = linear_cross_entropy(h, w, labels, weights, chunk_rows=chunk_rows)
    assert torch.allclose(total, reference, atol=1e-5) and torch.allclose(losses, per_token, atol=1e-5)
    for got, want in zip(torch.autograd.grad(2.0 * total, (h, w)), ref_grads):  # the upstream gradient scales
        assert torch.allclose(got, 2.0 * want, atol=1e-5)
    all_rows, _ = _LinearCrossEntropy.apply(h, w, labels, weights * (labels != -100), chunk_rows or 64, True)
    assert torch.allclose(all_rows, reference, atol=1e-5)
    for got, want in zip(torch.autograd.grad(all_rows, (h, w)), ref_grads):
        assert torch.allclose(got, want, atol=1e-5)
    with torch.no_grad():  # eval: the value alone
        assert torch.allclose(linear_cross_entropy(h, w, labels, weights)[0], reference, atol=1e-5)


def test_fp8_swaps_the_hidden_linears_and_disable_fp8_runs_them_plain():
    """On CPU torchao emulates the FP8 matmuls: the swap and the bf16 switch are checked here; the
    speed is a GPU matter (test_fp8_trains_on_a_gpu)."""
    import copy

    pytest.importorskip("torchao")
    from tierlm.models import GPTConfig, build_gpt
    from tierlm.primitives.fp8 import apply_float8_training, disable_fp8

    torch.manual_seed(0)
    model = build_gpt(GPTConfig(depth=2, aspect_ratio=32, head_dim=16, vocab_size=50, max_seq_len=32))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    plain = copy.deepcopy(model)
    assert apply_float8_training(model) == 14  # q, k, v, o, gate, up, down of 2 blocks (all multiples of 16)
    assert type(model.lm_head) is torch.nn.Linear  # the head keeps its precision
    ids = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        quantised = model(ids)
        with disable_fp8(model):
            unquantised = model(ids)
        again = model(ids)
    assert torch.equal(unquantised, plain(ids))
    assert not torch.allclose(quantised, unquantised, atol=1e-4) and torch.equal(
        again, quantised
    )  # FP8 back after the block


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="FP8 needs an H100-class GPU"
)
def test_fp8_trains_on_a_gpu(tmp_path):  # pragma: no cover - no such GPU on the CI machines
    from conftest import TINY, run_main

    result = run_main(
        "pretrain",
        "--config",
        "tiny_pretrain",
        *TINY,
        "infra.device_type=cuda",
        "training.fp8=true",
        "training.bf16=true",
        "model.aspect_ratio=64",
        "training.num_train_steps=20",
        f"infra.output_dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr


def test_warmup_from_zero_is_transformers_linear_schedule():
    """training.warmup_start_factor=0 with linear decay to 0 is transformers' get_linear_schedule_with_warmup, step
    for step."""
    from transformers import get_linear_schedule_with_warmup

    from tierlm.primitives.schedules import create_warmup_scheduler

    ours_opt, theirs_opt = (torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5) for _ in range(2))
    ours = create_warmup_scheduler(ours_opt, 3, 10, "linear", min_lr_ratio=0.0, warmup_start_factor=0.0)
    theirs = get_linear_schedule_with_warmup(theirs_opt, 3, 10)
    for _ in range(10):
        assert ours_opt.param_groups[0]["lr"] == pytest.approx(theirs_opt.param_groups[0]["lr"])
        ours_opt.step(), theirs_opt.step(), ours.step(), theirs.step()

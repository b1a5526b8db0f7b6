"""The usage snippets of seed 000, on CPU against a tiny local model.

Tier 2: one call. Tier 1: granular pieces handed to tier 0. Tier 0: a custom loss.
"""

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


@pytest.fixture(scope="module")
def local_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return str(folder)


def _batch():
    ids = torch.randint(0, 64, (2, 10))
    return {
        "input_ids": ids,
        "labels": torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1),
        "loss_mask": torch.ones(2, 10),
    }


def test_tier2_one_call(local_model, tmp_path):
    from tierlm.backends import create_pytorch_backend

    backend = create_pytorch_backend(
        model_name=local_model,
        checkpoint_dir=Path(tmp_path / "checkpoints"),
        device_type="cpu",
        gpu_rank=0,
        learning_rate=1e-4,
    )

    async def train():
        future = backend.forward_backward(_batch())
        metrics = await future.result()
        step = await backend.optim_step().result()
        return metrics, step

    metrics, step = asyncio.run(train())
    assert metrics["loss"] > 0 and step["lr"] == 1e-4
    assert backend.device.type == "cpu" and not backend.checkpoint_dir.exists()  # nothing written before the first save
    assert backend.save_checkpoint(1).wait() == backend.checkpoint_dir / "step_1"


def test_tier2_backend_with_scheduler(local_model, tmp_path):
    from tierlm.backends import create_backend_with_scheduler

    backend, scheduler = create_backend_with_scheduler(
        model_name=local_model,
        checkpoint_dir=Path(tmp_path / "ckpts"),
        num_training_steps=100,
        device_type="cpu",
        dtype="float32",
    )
    lrs = []
    for _ in range(4):
        backend.forward_backward(_batch())
        lrs.append(backend.optim_step().wait()["lr"])
    assert lrs[0] < lrs[1] < lrs[2] and scheduler.last_epoch == 4  # warmup over 3 steps, stepped by the backend


def test_the_documented_scheduler_loop_steps_the_schedule_once_per_step(local_model, tmp_path):
    """`create_backend_with_scheduler`'s own example, as written: the loop awaits forward_backward and optim_step and
    then calls scheduler.step() itself; the LR still follows the warmup-cosine schedule one step per optimizer step
    (the backend owns it; the caller's step() is a no-op), checked against the schedule's formula."""
    from tierlm.backends import create_backend_with_scheduler
    from tierlm.primitives.schedules import lr_multiplier

    backend, scheduler = create_backend_with_scheduler(
        model_name=local_model,
        checkpoint_dir=Path(tmp_path / "ckpts"),
        num_training_steps=1000,
        device_type="cpu",
        dtype="float32",
    )
    batch, lrs = _batch(), []

    async def loop():
        # Training loop
        for step in range(40):
            metrics = await backend.forward_backward(batch).result()  # noqa: F841
            lrs.append((await backend.optim_step().result())["lr"])
            scheduler.step()  # Update LR

    asyncio.run(loop())
    warmup = max(1, int(1000 * 0.03))  # the example's default warmup_ratio
    expected = [1e-4 * lr_multiplier(s, warmup, 1000, "cosine", min_lr_ratio=0.1) for s in range(40)]
    assert lrs == pytest.approx(expected) and scheduler.last_epoch == 40


def test_tier1_granular_into_tier0_with_custom_loss(local_model, tmp_path):
    from tierlm.backends import (
        PyTorchTrainingBackend,
        compute_device_map_single_gpu,
        create_adamw_optimizer,
        load_hf_model,
        parse_dtype,
    )

    dtype = parse_dtype("float32")
    device_map = compute_device_map_single_gpu("cpu", 0)
    model = load_hf_model(local_model, dtype, device_map)
    optimizer = create_adamw_optimizer(model, lr=1e-4, betas=(0.9, 0.999))

    seen = []

    def my_custom_loss(logits, batch):  # the seed signature: loss_fn(logits, batch) -> scalar
        seen.append(tuple(logits.shape))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    backend = PyTorchTrainingBackend(
        model=model,
        optimizer=optimizer,
        loss_fn=my_custom_loss,
        checkpoint_dir=Path(tmp_path / "checkpoints"),
        device=torch.device("cpu"),
    )
    before = [p.detach().clone() for p in model.parameters()]
    metrics = backend.forward_backward(_batch()).wait()
    backend.optim_step().wait()
    assert seen == [(2, 10, 64)] and metrics["num_tokens"] == 18
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))

"""Seed 001's surface (issue 19): its usage examples run as written (a tiny model config instead of the
seed's), on both backends: `Trainer(backend, strategy)`, `train_step(batch, model_state,
optimizer_state) -> TrainingResult`, `train_epoch`, the states, and `SFTStrategy(loss_fn=...)`."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from tierlm.backends import PyTorchBackend
from tierlm.loops.trainer import Trainer, TrainingResult
from tierlm.models import GPTConfig
from tierlm.strategies import PretrainStrategy, SFTStrategy
from tierlm.strategies.rl import PPOStrategy, token_logprobs

V = 61
MODEL_CONFIG = GPTConfig(depth=2, aspect_ratio=32, head_dim=16, n_kv_head=2, vocab_size=V, max_seq_len=32)


def backends():
    out = [("pytorch", lambda tmp: PyTorchBackend(MODEL_CONFIG, tmp, learning_rate=3e-3, device_type="cpu"))]
    if importlib.util.find_spec("jax") is not None:  # the JAX backend (the dev install has it)
        from tierlm.backends import JaxBackend

        out.append(("jax", lambda tmp: JaxBackend(MODEL_CONFIG, tmp, learning_rate=3e-3)))
    return out


def sft_dataloader(n: int = 24):
    """Chat-like rows: the mask trains the second half of each row (the "assistant"), 4 batches repeated."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, V, (4, 17), generator=g)
        mask = torch.zeros_like(tokens)
        mask[:, 9:] = 1
        batches.append({"tokens": tokens, "mask": mask})
    return batches * (n // 4)


@pytest.mark.parametrize("name,make", backends(), ids=[n for n, _ in backends()])
def test_seed_sft_example(name, make, tmp_path):
    backend = make(tmp_path)
    strategy = SFTStrategy(loss_fn="cross_entropy")
    trainer = Trainer(backend, strategy)
    model_state = backend.model_state()
    optimizer_state = model_state.optimizer_state

    losses = []
    for batch in sft_dataloader():
        result = trainer.train_step(batch, model_state, optimizer_state)
        model_state = result.model_state
        optimizer_state = model_state.optimizer_state
        losses.append(result.metrics["loss"])

    assert isinstance(result, TrainingResult) and model_state.step == 24
    assert losses[-1] < losses[0] - 0.5, losses  # it learns the repeated rows
    assert {"loss", "grad_norm", "lr", "num_tokens"} <= result.metrics.keys()
    assert {"step_s", "param_bytes", "optimizer_bytes", "communication_bytes"} <= result.diagnostics.keys()
    assert result.gradients.num_tokens == 4 * 8 and result.gradients.reduced  # 8 trained tokens a row


@pytest.mark.parametrize("name,make", backends(), ids=[n for n, _ in backends()])
def test_handing_back_an_older_state_steps_from_it(name, make, tmp_path):
    """The "pure" reading of train_step: the same (state, batch) gives the same result. On JAX a state is a
    value; on PyTorch it is a view of the live one, so the old one is kept with copy.deepcopy."""
    backend = make(tmp_path)
    trainer = Trainer(backend, PretrainStrategy())
    batch = {"tokens": torch.randint(0, V, (4, 17), generator=torch.Generator().manual_seed(1))}
    start = backend.model_state()
    if name == "pytorch":
        start = copy.deepcopy(start)
    first = trainer.train_step(batch, start)
    trainer.train_step(batch, first.model_state)  # moves on
    again = trainer.train_step(batch, start)  # from the start again
    assert again.metrics["loss"] == pytest.approx(first.metrics["loss"], abs=1e-6)
    assert again.model_state.step == 1


def test_seed_rl_example_ppo(tmp_path):
    """`PPOStrategy(kl_coef=0.1, clip_range=0.2)` on rollout batches (completions with advantages, the
    sampler's old log-probs and a reference's): the update raises the log-prob of the rewarded completion."""
    backend = PyTorchBackend(MODEL_CONFIG, tmp_path, learning_rate=3e-3, device_type="cpu")
    strategy = PPOStrategy(kl_coef=0.1, clip_range=0.2)
    trainer = Trainer(backend, strategy)
    model_state = backend.model_state()

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (2, 12), generator=g)
    labels = ids.clone()
    labels[:, :6] = -100  # prompt tokens are not trained
    with torch.no_grad():
        old = token_logprobs(backend.model(ids), labels)
    rollout_batch = {
        "input_ids": ids,
        "labels": labels,
        "advantages": torch.tensor([1.0, -1.0]),
        "old_logprobs": old,
        "ref_logprobs": old,
    }
    for _ in range(3):
        result = trainer.train_step(rollout_batch, model_state, model_state.optimizer_state)
        model_state = result.model_state
    with torch.no_grad():
        new = token_logprobs(backend.model(ids), labels).sum(dim=1)
    assert new[0] > old.sum(dim=1)[0] and new[1] < old.sum(dim=1)[1]


@pytest.mark.parametrize("name,make", backends(), ids=[n for n, _ in backends()])
def test_a_functional_optimizer_steps_the_loop(name, make, tmp_path):
    """`Trainer(backend, strategy, optimizer=<functional Adam>)`: `train_step` updates with it (its state in and out
    as `optimizer_state`) — the steps of a plain loop with torch.optim.Adam and the same clipping; handing back an older
    (model_state, optimizer_state) steps from it."""
    from tierlm.models import forward_logits

    backend = make(tmp_path)
    reference = copy.deepcopy(backend.model)  # the same initial weights, trained by a plain loop
    if name == "jax":
        from tierlm.primitives.optim.jax import JaxAdam

        optimizer = JaxAdam(lr=1e-2)
    else:
        from tierlm.primitives.optim.functional import PyTorchAdam

        optimizer = PyTorchAdam(lr=1e-2)
    strategy = PretrainStrategy()
    trainer = Trainer(backend, strategy, optimizer=optimizer)
    model_state, optimizer_state = backend.model_state(), None  # None: the optimizer's init
    batches = [{"tokens": t} for t in torch.randint(0, V, (2, 4, 17), generator=torch.Generator().manual_seed(3))] * 3
    losses, states = [], []
    for batch in batches:
        states.append((copy.deepcopy(model_state), copy.deepcopy(optimizer_state)))
        result = trainer.train_step(batch, model_state, optimizer_state)
        model_state, optimizer_state = result.model_state, result.model_state.optimizer_state
        losses.append(result.metrics["loss"])

    adam, expected = torch.optim.Adam(reference.parameters(), lr=1e-2), []
    for batch in batches:
        prepared = strategy.prepare_batch(batch)
        total, count = strategy.compute_loss(forward_logits(reference, prepared), prepared)
        (total / count).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        adam.step()
        adam.zero_grad()
        expected.append(float(total / count))
    assert losses == pytest.approx(expected, abs=1e-4) and losses[-1] < losses[0]
    again = trainer.train_step(batches[3], *states[3])  # from the state before step 4, moments included
    assert again.metrics["loss"] == pytest.approx(losses[3], abs=1e-6)
    assert backend.model_state().step == 4


def test_train_epoch_is_one_pass_of_a_tierlm_loader(tmp_path):
    import numpy as np

    from tierlm.data import ListExamples
    from tierlm.data.packing import Document, Documents, PackedLoader

    def as_documents(items):
        return [Document(np.asarray(x, dtype=np.int64)) for x in items]

    docs = Documents(ListExamples([[1] + [(7 * i + k) % V for k in range(20)] for i in range(12)]), as_documents)
    counted = PackedLoader(docs, batch_size=2, seq_len=16)
    counted.repeat = False
    one_pass = sum(1 for _ in counted)
    loader = PackedLoader(docs, batch_size=2, seq_len=16)
    trainer = Trainer(PyTorchBackend(MODEL_CONFIG, tmp_path, device_type="cpu"), PretrainStrategy())
    state = trainer.train_epoch(loader)
    assert state.step == one_pass > 0 and loader.repeat  # one pass; the loader is left repeating as it was


def test_train_epoch_evaluates_checkpoints_and_resumes_mid_epoch(tmp_path):
    """`train_epoch` evaluates every `eval_steps` and at the end, checkpoints every `save_steps` and at the end (the
    loader's position inside); a new trainer resumed from the mid-epoch checkpoint finishes the epoch (2 steps, not 6)
    with the uninterrupted one's weights."""
    import numpy as np

    from tierlm.config import TrainingConfig
    from tierlm.data import ListExamples
    from tierlm.data.packing import Document, Documents, PackedLoader

    def as_documents(items):
        return [Document(np.asarray(x, dtype=np.int64)) for x in items]

    docs = Documents(ListExamples([[1] + [(7 * i + k) % V for k in range(20)] for i in range(12)]), as_documents)
    eval_batches = [{"tokens": torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(9))}]

    class Records:
        def __init__(self):
            self.records = []

        def log(self, record):
            self.records.append(record)

        def close(self):
            pass

    def trainer(out):
        from tierlm.metrics.sinks import MetricsLogger

        torch.manual_seed(0)
        sink = Records()
        backend = PyTorchBackend(MODEL_CONFIG, out, learning_rate=3e-3, device_type="cpu")
        config = TrainingConfig(eval_steps=4, save_steps=4, save_total_limit=0)
        return Trainer(
            backend, PretrainStrategy(), config=config, eval_loader=eval_batches, logger=MetricsLogger([sink])
        ), sink

    straight, records = trainer(tmp_path / "a")
    straight.train_epoch(PackedLoader(docs, batch_size=2, seq_len=16))
    steps = straight.state.step
    assert steps == 6, steps  # 12 rows of 21 tokens in 2 x 16 windows
    assert [r["step"] for r in records.records if r["type"] == "eval"] == [4, 6]  # every 4 steps, and the end
    assert sorted(p.name for p in (tmp_path / "a").glob("step_*")) == ["step_4", "step_6"]

    resumed, _ = trainer(tmp_path / "a")  # the same folder: resumes from step 4, mid-epoch
    resumed.train_loader = PackedLoader(docs, batch_size=2, seq_len=16)
    resumed.resume(tmp_path / "a" / "step_4")
    assert resumed.state.step == 4
    resumed.train_epoch(resumed.train_loader)
    assert resumed.state.step == steps
    for (name, a), b in zip(straight.backend.model.named_parameters(), resumed.backend.model.parameters()):
        assert torch.equal(a, b), name


def test_an_unknown_loss_name_is_refused():
    with pytest.raises(ValueError, match="loss_fn must be one of"):
        SFTStrategy(loss_fn="hinge")

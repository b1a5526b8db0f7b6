"""Parallelism applied from outside the model: activation checkpointing keeps names and gradients."""

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tierlm.models import build_gpt, forward_logits
from tierlm.primitives.parallel import apply_activation_checkpointing, block_list


def _grads(model, batch):
    model.zero_grad()
    forward_logits(model, batch).float().logsumexp(-1).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_same_gradients_and_names(tiny_gpt_config):
    torch.manual_seed(0)
    plain = build_gpt(tiny_gpt_config)
    wrapped = build_gpt(tiny_gpt_config)
    wrapped.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(wrapped)
    assert wrapped.state_dict().keys() == plain.state_dict().keys()
    batch = {"input_ids": torch.randint(0, tiny_gpt_config.vocab_size, (2, 12))}
    a, b = _grads(plain, batch), _grads(wrapped, batch)
    assert len(a) == len(b)
    for (name, ga), gb in zip(a.items(), b.values()):
        torch.testing.assert_close(ga, gb, rtol=0, atol=1e-6, msg=name)


def test_block_list_finds_transformers_layers():
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    )
    assert block_list(model) is model.model.layers


def test_compiled_blocks_trace_once_for_every_layout_of_packed_documents():
    """Eager, packed documents on CPU are attended one by one; compiled blocks use the document mask
    instead, so new document lengths never retrace (dynamo's trace, no code generation: fast)."""
    import torch._dynamo

    from tierlm.models import GPTConfig, build_gpt
    from tierlm.primitives.parallel import apply_compile

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = build_gpt(GPTConfig(depth=2, aspect_ratio=32, head_dim=16, vocab_size=97, max_seq_len=64))
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, backend="eager")
    torch._dynamo.utils.counters.clear()
    for lengths in ([30, 34], [10, 54], [64], [5, 5, 54], [20, 44]):
        ids, positions = torch.randint(0, 97, (1, 64)), torch.cat([torch.arange(n) for n in lengths])[None]
        assert torch.allclose(compiled(ids, position_ids=positions), eager(ids, position_ids=positions), atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_whole_model_compile_trains_as_eager_and_compiles_only_the_training_forward(monkeypatch, tmp_path):
    """`infra.compile=model`: the backend's training forward, the fused head and loss with the blocks, goes through
    torch.compile (AOT autograd's forward and backward graphs here, no code generation) and trains as the eager model
    does, with the fused loss and with a loss over the logits; evaluation and the model itself stay eager."""
    import torch._dynamo

    from tierlm.backends import PyTorchTrainingBackend, pytorch
    from tierlm.backends.options import BackendOptions
    from tierlm.models import GPTConfig

    monkeypatch.setattr(pytorch, "WHOLE_COMPILE_OPTIONS", {"backend": "aot_eager"})
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = build_gpt(GPTConfig(depth=2, aspect_ratio=32, head_dim=16, vocab_size=97, max_seq_len=32))
    compiled = copy.deepcopy(eager)
    backends = [
        PyTorchTrainingBackend(m, torch.optim.AdamW(m.parameters(), lr=1e-2), None, tmp_path / name, "cpu", None, o)
        for m, name, o in ((eager, "eager", BackendOptions()), (compiled, "compiled", BackendOptions(compile="model")))
    ]
    ids = torch.randint(0, 97, (3, 2, 17))
    squared = lambda logits, batch: (logits.float() ** 2).mean()  # noqa: E731 - a loss the head cannot fuse into
    torch._dynamo.utils.counters.clear()
    for step in range(3):
        batch = {"input_ids": ids[step, :, :-1], "labels": ids[step, :, 1:]}
        losses = [b.forward_backward(batch, squared if step == 2 else None).wait()["loss"] for b in backends]
        assert losses[0] == pytest.approx(losses[1], rel=1e-5), step
        for b in backends:
            b.optim_step().wait()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 2  # the fused loss's forward and the logits' forward
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    evaluated = [b.forward({"input_ids": ids[0, :, :-1], "labels": ids[0, :, 1:]}).wait()["loss_sum"] for b in backends]
    assert evaluated[0] == pytest.approx(evaluated[1], rel=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # evaluation ran eagerly
    assert not isinstance(backends[1].model, torch._dynamo.eval_frame.OptimizedModule)


def test_whole_model_compile_is_refused_under_fsdp(tmp_path):
    """`infra.distributed_type=auto` is FSDP2 under torchrun, which the config cannot see: the backend refuses
    `compile="model"` in one line before it needs a process group."""
    from tierlm.backends import FSDPTrainingBackend
    from tierlm.backends.options import BackendOptions
    from tierlm.errors import ConfigError
    from tierlm.models import GPTConfig

    model = build_gpt(GPTConfig(depth=1, aspect_ratio=32, head_dim=16, vocab_size=97, max_seq_len=32))
    with pytest.raises(ConfigError, match="infra.compile=model compiles the whole forward .* not under FSDP2"):
        FSDPTrainingBackend(model, torch.optim.AdamW, None, tmp_path, "cpu", None, BackendOptions(compile="model"))

"""Parallelism applied from outside the model: activation checkpointing keeps names and gradients."""

import copy

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

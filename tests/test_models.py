"""The native GPT: meta-device build, one init, and export that transformers reloads with equal logits."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tierlm.models import GPT, GPTConfig, build_gpt, forward_logits, load_pretrained_model, save_model_folder


def test_width_follows_depth():
    config = GPTConfig(depth=6, aspect_ratio=64, head_dim=128)
    assert config.n_embd == 384 and config.n_head == 3
    assert GPTConfig(depth=3, aspect_ratio=30, head_dim=32).n_embd == 96  # rounded up to whole heads


def test_meta_build_then_single_init(tiny_gpt_config):
    with torch.device("meta"):
        model = GPT(tiny_gpt_config)
    assert all(p.is_meta for p in model.parameters())
    model = model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights()
    assert torch.isfinite(model(torch.randint(0, 97, (1, 5)))).all()
    torch.manual_seed(1)
    again = build_gpt(tiny_gpt_config)
    torch.manual_seed(1)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), build_gpt(tiny_gpt_config).parameters()))


@pytest.mark.parametrize("tie", [False, True])
def test_export_reloads_in_transformers_with_equal_logits(tmp_path, tie):
    config = GPTConfig(depth=2, aspect_ratio=48, head_dim=16, n_kv_head=1, vocab_size=101, max_seq_len=64, tie_embeddings=tie)
    model = build_gpt(config)
    with torch.no_grad():  # init zeroes the output projections; randomise everything so the check bites
        for p in model.parameters():
            p.normal_(0, 0.2)
    folder = save_model_folder(model, tmp_path / "export")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, 101, (2, 40))
    positions = torch.cat([torch.arange(25), torch.arange(15)]).expand(2, -1)  # two packed documents
    with torch.no_grad():
        for batch in ({"input_ids": ids}, {"input_ids": ids, "position_ids": positions}):
            delta = (forward_logits(model, batch) - forward_logits(hf, batch)).abs().max().item()
            assert delta <= 1e-4, delta
        # Packed documents are isolated: the packed row equals each document run alone.
        alone = torch.cat([forward_logits(model, {"input_ids": ids[:, :25]}), forward_logits(model, {"input_ids": ids[:, 25:]})], 1)
        packed = forward_logits(model, {"input_ids": ids, "position_ids": positions})
        assert (alone - packed).abs().max().item() <= 1e-5
        reloaded = load_pretrained_model(folder)
        assert isinstance(reloaded, GPT) and torch.equal(reloaded(ids), model(ids))


def test_documents_attended_one_by_one_equal_the_document_mask():
    """The CPU path for packed rows (causal attention per document) == one SDPA call under the
    document mask: outputs and gradients, with grouped-query heads and rows of 1 to 3 documents."""
    import torch.nn.functional as F

    from tierlm.models.gpt import attend_documents, document_causal_mask, document_lengths

    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 1, 2, 3, 4, 5]])
    q = torch.randn(3, 4, 8, 16, requires_grad=True)
    k, v = torch.randn(3, 2, 8, 16, requires_grad=True), torch.randn(3, 2, 8, 16, requires_grad=True)
    assert document_lengths(positions) == [[8], [3, 4, 1], [2, 6]]
    ours = attend_documents(q, k, v, document_lengths(positions))
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(positions), enable_gqa=True)
    assert (ours - reference).abs().max().item() <= 1e-5
    weights = torch.randn_like(reference)
    for a, b in zip(torch.autograd.grad((ours * weights).sum(), (q, k, v)), torch.autograd.grad((reference * weights).sum(), (q, k, v))):
        assert (a - b).abs().max().item() <= 1e-5
    whole = torch.arange(8).expand(3, 8)  # one document a row: the single-call path
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(whole), enable_gqa=True)
    assert (attend_documents(q, k, v, document_lengths(whole)) - reference).abs().max().item() <= 1e-5

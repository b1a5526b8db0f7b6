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
    config = GPTConfig(
        depth=2, aspect_ratio=48, head_dim=16, n_kv_head=1, vocab_size=101, max_seq_len=64, tie_embeddings=tie
    )
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
        alone = torch.cat(
            [forward_logits(model, {"input_ids": ids[:, :25]}), forward_logits(model, {"input_ids": ids[:, 25:]})], 1
        )
        packed = forward_logits(model, {"input_ids": ids, "position_ids": positions})
        assert (alone - packed).abs().max().item() <= 1e-5
        reloaded = load_pretrained_model(folder)
        assert isinstance(reloaded, GPT) and torch.equal(reloaded(ids), model(ids))


def test_documents_attended_one_by_one_equal_the_document_mask():
    """The CPU path for packed rows (causal attention per document) == one SDPA call under the
    document mask: outputs and gradients, with grouped-query heads and rows of 1 to 3 documents."""
    import torch.nn.functional as F

    from tierlm.models.gpt.documents import attend_documents, document_causal_mask, document_lengths

    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 1, 2, 3, 4, 5]])
    q = torch.randn(3, 4, 8, 16, requires_grad=True)
    k, v = torch.randn(3, 2, 8, 16, requires_grad=True), torch.randn(3, 2, 8, 16, requires_grad=True)
    assert document_lengths(positions) == [[8], [3, 4, 1], [2, 6]]
    ours = attend_documents(q, k, v, document_lengths(positions))
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(positions), enable_gqa=True)
    assert (ours - reference).abs().max().item() <= 1e-5
    weights = torch.randn_like(reference)
    for a, b in zip(
        torch.autograd.grad((ours * weights).sum(), (q, k, v)),
        torch.autograd.grad((reference * weights).sum(), (q, k, v)),
    ):
        assert (a - b).abs().max().item() <= 1e-5
    whole = torch.arange(8).expand(3, 8)  # one document a row: the single-call path
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(whole), enable_gqa=True)
    assert (attend_documents(q, k, v, document_lengths(whole)) - reference).abs().max().item() <= 1e-5


def _windowed_model(pattern="SSL", window=5):
    torch.manual_seed(0)
    config = GPTConfig(
        depth=3,
        aspect_ratio=32,
        head_dim=16,
        n_kv_head=1,
        vocab_size=50,
        max_seq_len=64,
        window_pattern=pattern,
        short_window=window,
    )
    model = build_gpt(config)
    with torch.no_grad():  # off the zero-initialised projections, so attention matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _dense_reference(model, ids):
    """The model's forward with attention written out: scores, an explicit dense mask per layer
    (causal, and at most `window` keys back, itself included), softmax, values."""
    from tierlm.models.gpt.model import apply_rotary

    c, T = model.config, ids.shape[1]
    x = model.embed(ids)
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    for block, window in zip(model.blocks, c.layer_windows()):
        a, h = block.attn, block.attn_norm(x)
        B = h.shape[0]
        q = a.q_norm(a.q_proj(h).view(B, T, a.n_head, a.head_dim)).transpose(1, 2)
        k = a.k_norm(a.k_proj(h).view(B, T, a.n_kv_head, a.head_dim)).transpose(1, 2)
        v = a.v_proj(h).view(B, T, a.n_kv_head, a.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = k.repeat_interleave(a.n_head // a.n_kv_head, 1), v.repeat_interleave(a.n_head // a.n_kv_head, 1)
        allowed = (j <= i) & ((i - j < window) if window is not None else True)
        scores = (q @ k.transpose(-1, -2) / a.head_dim**0.5).masked_fill(~allowed, float("-inf"))
        x = x + a.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))
        x = x + block.mlp(block.mlp_norm(x))
    return model.lm_head(model.norm(x))


def test_sliding_window_pattern_equals_a_dense_mask():
    model = _windowed_model()
    assert model.config.layer_windows() == [5, 5, None]
    ids = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, ref = model(ids), _dense_reference(model, ids)
        full = _windowed_model("L")(ids)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert (out - full).abs().max() > 1e-3  # the window changed something
    # Within the window nothing is cut off: the first 5 positions equal full attention.
    torch.testing.assert_close(out[:, :5], full[:, :5], atol=1e-5, rtol=0)


def test_sliding_window_decodes_with_the_cache_and_exports_to_qwen3(tmp_path):
    from tierlm.models import family_of

    model = _windowed_model()
    ids = torch.randint(0, 50, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        family = family_of(model)
        last, cache = family.prefill(model, ids[:, :6], 16)
        steps = [last] + [family.decode(model, ids[:, t], cache) for t in range(6, 15)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 5:15], atol=1e-5, rtol=0)
    folder = save_model_folder(model, tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert (
        hf.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
        and hf.config.sliding_window == 5
    )
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, full, atol=1e-5, rtol=0)


def test_sliding_window_inside_packed_documents_equals_each_document_alone():
    model = _windowed_model()
    a, b = torch.randint(0, 50, (1, 12)), torch.randint(0, 50, (1, 9))
    packed = torch.cat([a, b], 1)
    positions = torch.cat([torch.arange(12), torch.arange(9)])[None]
    with torch.no_grad():
        together = model(packed, position_ids=positions)
        torch.testing.assert_close(together[:, :12], model(a), atol=1e-5, rtol=0)
        torch.testing.assert_close(together[:, 12:], model(b), atol=1e-5, rtol=0)


def test_neftune_noise_follows_transformers_rule():
    """`add_embedding_noise` draws what transformers' own NEFTune hook draws from the same random state (the
    noise's scale alpha / sqrt(L d) written out as theirs computes it), only while training; off once removed."""
    try:
        from transformers.integrations.neftune import neftune_post_forward_hook
    except ImportError:  # transformers before 5.0 kept it here
        from transformers.trainer_utils import neftune_post_forward_hook

    from tierlm.models.neftune import add_embedding_noise

    model = build_gpt(GPTConfig(depth=1, aspect_ratio=32, head_dim=16, vocab_size=64, max_seq_len=32))
    theirs = torch.nn.Embedding(64, 32)
    theirs.load_state_dict(model.embed.state_dict())
    theirs.neftune_noise_alpha = 5.0
    theirs.register_forward_hook(neftune_post_forward_hook)
    ids = torch.randint(0, 64, (3, 20))
    handle = add_embedding_noise(model, 5.0)
    torch.manual_seed(7)
    ours_noisy = model.embed(ids)
    torch.manual_seed(7)
    theirs_noisy = theirs(ids)
    noise = ours_noisy - model.embed.weight[ids]
    assert 0 < noise.abs().max() <= 5.0 / (20 * 32) ** 0.5
    torch.testing.assert_close(ours_noisy, theirs_noisy, rtol=0, atol=1e-6)
    model.eval()
    assert torch.equal(model.embed(ids), model.embed.weight[ids])
    model.train()
    handle.remove()
    assert torch.equal(model.embed(ids), model.embed.weight[ids])

"""Model families behind one adapter: GPT-2 against transformers' own GPT-2, and a toy family that
the CLI trains, samples and saves without any other change to tierlm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import REPO, TINY
from tierlm.commands.cli import main
from tierlm.models import (
    FAMILIES,
    family_for_folder,
    family_named,
    forward_cross_entropy,
    forward_logits,
    load_pretrained_model,
    save_model_folder,
)
from tierlm.models.gpt2.family import GPT2_FAMILY
from tierlm.models.gpt2.model import GPT2Config
from tierlm.models.native import NativeFamily
from tierlm.models.registry import register_family


def _hf_gpt2(tmp_path: Path):
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        HFConfig(
            vocab_size=61,
            n_positions=32,
            n_embd=48,
            n_layer=2,
            n_head=3,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    ).eval()
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


def _greedy_by_recomputation(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, each from a full forward over everything so far (no cache): the engine's reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_gpt2_loads_transformers_weights_with_the_same_logits_and_loss(tmp_path):
    hf, folder = _hf_gpt2(tmp_path)
    ours = GPT2_FAMILY.import_transformers(folder).eval()
    ids = torch.randint(0, 61, (3, 20))
    with torch.no_grad():
        reference = hf(ids, labels=ids)
        assert torch.allclose(ours(ids), reference.logits, atol=1e-5)
        labels = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], dim=1)  # our labels are already shifted
        total, _ = forward_cross_entropy(ours, {"input_ids": ids, "labels": labels})
    assert torch.allclose(total / (labels != -100).sum(), reference.loss, atol=1e-6)


@pytest.mark.parametrize("variant", ["V1", "V2", "V3", "V6"])
def test_a_research_variant_of_a_pretrained_gpt2_starts_as_it(variant, tmp_path):
    """model.variant on a transformers GPT-2 folder: RA (V1), RA + self-restart (V2), R-MLP (V3) and R-MLP's
    mixer and extra gate (V6) add parameters that start at the identity: transformers' own logits at step 0."""
    from tierlm.config import ModelConfig

    hf, folder = _hf_gpt2(tmp_path)
    ours = GPT2_FAMILY.import_transformers(folder, model_config=ModelConfig(architecture="gpt2", variant=variant))
    ids = torch.randint(0, 61, (3, 20))
    with torch.no_grad():
        assert torch.allclose(ours.eval()(ids), hf(ids).logits, atol=1e-5)
    assert ours.config.ra_r == 4 and (ours.config.rmlp_r_ff == 64) == (variant in ("V3", "V6"))
    assert sum(p.numel() for p in ours.parameters()) > sum(p.numel() for p in hf.parameters())  # the new gates


def test_a_pretrained_gpt2_trains_as_v3_and_what_cannot_start_as_it_is_refused(tmp_path, capsys):
    """`tierlm pretrain` from a transformers GPT-2 folder as V3: it trains (the loss falls), and the run's model is
    the variant; a variant that changes what the model computes (V11's delayed activation) is one line."""
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    from tierlm.data import load_tokenizer

    pre = tmp_path / "pre"
    assert main(["pretrain", "--config", "tiny_pretrain", *TINY, f"infra.output_dir={pre}"]) == 0
    folder = tmp_path / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(HFConfig(vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=2)).save_pretrained(folder)
    load_tokenizer(pre / "model").save(folder)
    args = [
        "pretrain",
        "--config",
        "tiny_pretrain",
        *TINY[3:],
        "model.architecture=gpt2",
        f"model.model_name_or_path={folder}",
    ]
    run = tmp_path / "v3"
    steps = ["training.num_train_steps=30", "training.learning_rate=3e-3", "training.eval_steps=30"]
    assert main([*args, "model.variant=V3", *steps, f"infra.output_dir={run}"]) == 0
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert evals[-1]["val_loss"] < 0.8 * evals[0]["val_loss"]
    trained = load_pretrained_model(run / "model")
    assert (trained.config.ra_r, trained.config.rmlp_r_ff) == (4, 64)
    capsys.readouterr()
    assert main([*args, "model.variant=V11", f"infra.output_dir={tmp_path / 'v11'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot start as the pretrained GPT-2" in err[0], err


def test_gpt2_exports_to_transformers_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    model = GPT2_FAMILY.build_from_config(
        GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, block_size=24)
    ).eval()
    folder = save_model_folder(model, tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    ids = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, model(ids), atol=1e-5)
    again = load_pretrained_model(folder)  # and tierlm rebuilds its own module from the same folder
    assert type(again).__name__ == "GPT2" and torch.equal(again(ids), model(ids))


def test_gpt2_without_biases_saves_a_tierlm_folder(tmp_path):
    model = GPT2_FAMILY.build_from_config(
        GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=20, block_size=8, bias=False)
    )
    folder = save_model_folder(model, tmp_path / "m")
    assert not (folder / "config.json").exists() and family_for_folder(folder).name == "gpt2"
    assert GPT2_FAMILY.exportable(model) is not None
    ids = torch.randint(0, 20, (1, 8))
    assert torch.equal(load_pretrained_model(folder)(ids), model(ids))


def test_gpt2_packed_documents_compute_what_they_would_alone():
    model = GPT2_FAMILY.build_from_config(
        GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, block_size=16)
    ).eval()
    a, b = torch.randint(0, 50, (1, 5)), torch.randint(0, 50, (1, 7))
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        together = forward_logits(model, {"input_ids": packed, "position_ids": positions})
        assert torch.allclose(together[:, :5], model(a), atol=1e-5)
        assert torch.allclose(together[:, 5:], model(b), atol=1e-5)


def test_gpt2_cached_greedy_decoding_equals_recomputation():
    from tierlm.rollout.engine import Engine
    from tierlm.rollout.sampling import GREEDY

    model = GPT2_FAMILY.build_from_config(
        GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, block_size=32)
    ).eval()
    prompt = [3, 14, 15, 9]
    tokens = Engine(model).generate(prompt, 1, 10, GREEDY)[0].tokens
    assert tokens == _greedy_by_recomputation(model, prompt, 10)


def test_gpt2_trains_through_the_cli_and_beats_the_unigram_level(tmp_path):
    run = tmp_path / "gpt2"
    code = main(
        [
            "pretrain",
            "--config",
            str(REPO / "configs/tiny_pretrain.yaml"),
            *TINY,
            "model.architecture=gpt2",
            "model.dropout=0.1",
            "training.num_train_steps=40",
            "training.learning_rate=3e-3",
            "training.eval_steps=40",
            f"infra.output_dir={run}",
        ]
    )
    assert code == 0
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert evals[-1]["val_loss"] < 0.75 * evals[0]["val_loss"]
    assert type(load_pretrained_model(run / "model")).__name__ == "GPT2"


# -- a family added from outside: one class, one registry line --------------------------------------
class Bigram(nn.Module):
    """Each token predicts the next from a table: the smallest language model there is."""

    def __init__(self, config: "BigramConfig"):
        super().__init__()
        self.config = config
        self.table = nn.Embedding(config.vocab_size, config.vocab_size)

    def tie_weights(self) -> None:
        pass

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.table.weight, std=0.02)

    def forward(self, input_ids, position_ids=None):
        return self.table(input_ids)


from dataclasses import dataclass  # noqa: E402


@dataclass
class BigramConfig:
    vocab_size: int = 16
    max_seq_len: int = 64


class BigramFamily(NativeFamily):
    name = "toy_bigram"
    model_class = Bigram
    config_class = BigramConfig

    def config_fields(self, model_config):
        return {}

    def build(self, model_config, vocab_size, max_seq_len, device="cpu", dtype=torch.float32):
        return self.build_from_config(BigramConfig(vocab_size, max_seq_len), device, dtype)

    def logits(self, model, batch):
        return model(batch["input_ids"])

    def prefill(self, model, ids, max_len):
        return model(ids)[:, -1], None  # a bigram needs no cache: the last token is all it reads

    def decode(self, model, tokens, cache):
        return model(tokens[:, None])[:, -1]

    def repeat_cache(self, cache, n):
        pass

    def max_seq_len(self, model):
        return model.config.max_seq_len

    def attention_shape(self, model):
        return 0, 0


@pytest.fixture
def toy_family():
    register_family(BigramFamily())
    yield FAMILIES["toy_bigram"]
    del FAMILIES["toy_bigram"]


def test_a_registered_family_trains_samples_and_saves_through_the_cli(toy_family, tmp_path, capsys):
    run = tmp_path / "toy"
    code = main(
        [
            "pretrain",
            "--config",
            str(REPO / "configs/tiny_pretrain.yaml"),
            *TINY,
            "model.architecture=toy_bigram",
            "training.num_train_steps=30",
            "training.learning_rate=0.1",
            "training.eval_steps=30",
            f"infra.output_dir={run}",
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert json.loads((run / "model" / "tierlm_model.json").read_text())["family"] == "toy_bigram"
    model = load_pretrained_model(run / "model")
    assert isinstance(model, Bigram) and family_named("toy_bigram") is toy_family
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.0
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(run), "--prompt", "What is 1 + 1?", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["export", str(run), str(tmp_path / "exported")]) == 0
    assert "transformers has no class for this toy_bigram model" in capsys.readouterr().out


# -- GPT-2 research variants -------------------------------------------------------------------
def _gpt2(**variant):
    torch.manual_seed(0)
    return GPT2_FAMILY.build_from_config(
        GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, block_size=16, **variant)
    ).eval()


def test_unified_ra_scores_are_the_gated_sum_of_the_two_slices():
    """The attention output of an RA layer against the formula written plainly."""
    model = _gpt2(ra_r=4, ra_per_head=True)
    attn = model.h[0].attn
    with torch.no_grad():
        attn.ra.w_std.copy_(torch.tensor([0.7, 1.3]))
        attn.ra.w_rec.copy_(torch.tensor([2.0, 0.1]))
        x = torch.randn(1, 6, 32)
        q, k, v = (t.view(1, 6, 2, 16).transpose(1, 2) for t in attn.c_attn(x).split(32, dim=2))
        ws, wr = attn.ra.w_std[None, :, None, None], attn.ra.w_rec[None, :, None, None]
        scores = (
            ws * q[..., :12] @ k[..., :12].transpose(-1, -2) + wr * q[..., 12:] @ k[..., 12:].transpose(-1, -2)
        ) / 16**0.5
        scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
        expected = attn.c_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 6, 32))
        assert torch.allclose(attn(x, None), expected, atol=1e-6)


def test_variants_reduce_to_v0_with_their_gates_neutral():
    v0 = _gpt2()
    ids = torch.randint(0, 50, (2, 10))
    for variant in (
        {"ra_r": 4},
        {"ra_r": 8, "ra_per_head": True},
        {"ra_r": 4, "self_restart": True},
        {"rmlp_r_ff": 16, "rmlp_mixer": True, "rmlp_gate_alpha": True, "rmlp_attention_aware": True},
    ):
        model = _gpt2(**variant)
        missing, unexpected = model.load_state_dict(v0.state_dict(), strict=False)
        assert not unexpected and all(
            k.rsplit(".", 1)[1] in ("w_std", "w_rec", "alpha", "gate_alpha", "attn_alpha") or "mixer" in k
            for k in missing
        ), missing
        with torch.no_grad():
            for block in model.h:
                if block.attn.ra is not None:
                    block.attn.ra.w_std.fill_(1.0)
                    block.attn.ra.w_rec.fill_(1.0)
                if block.attn.restart is not None:
                    block.attn.restart.alpha.zero_()
                if hasattr(
                    block.mlp, "w_rec"
                ):  # R-MLP: gates 1, the options neutral (identity mixer, alpha 1, no attention input)
                    block.mlp.w_std.fill_(1.0)
                    block.mlp.w_rec.fill_(1.0)
            assert torch.allclose(model(ids), v0(ids), atol=1e-6), (
                variant
            )  # R-MLP splits the MLP's GELU and matmuls: rounding


def test_ra_off_is_v0_exactly():
    from tierlm.config import ModelConfig

    def build(**fields):
        torch.manual_seed(0)
        return GPT2_FAMILY.build(
            ModelConfig(architecture="gpt2", depth=2, aspect_ratio=16, head_dim=16, **fields), 50, 16
        ).eval()

    ids = torch.randint(0, 50, (2, 10))
    v0, off = build(variant="V0"), build(variant="V1", ra={"r": 0})
    assert v0.state_dict().keys() == off.state_dict().keys()
    assert torch.equal(v0(ids), off(ids))


def test_r_mlp_is_the_gated_split_written_plainly():
    model = _gpt2(rmlp_r_ff=16, rmlp_mixer=True, rmlp_gate_alpha=True, rmlp_attention_aware=True)
    mlp = model.h[0].mlp
    with torch.no_grad():
        mlp.w_std.fill_(0.6)
        mlp.w_rec.fill_(1.7)
        mlp.gate_alpha.fill_(0.5)
        mlp.attn_alpha.fill_(0.3)
        mlp.mixer.weight.copy_(torch.randn(16, 16))
        x, a = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
        gelu = lambda t: torch.nn.functional.gelu(t, approximate="tanh")  # noqa: E731
        w, b = mlp.c_fc.weight, mlp.c_fc.bias
        std = gelu(x @ w[:112].T + b[:112])
        rec = gelu((x + 0.3 * a) @ w[112:].T + b[112:]) @ mlp.mixer.weight.T * 0.5
        expected = mlp.c_proj(torch.cat([0.6 * std, 1.7 * rec], dim=-1))
        assert torch.allclose(mlp(x, a), expected, atol=1e-5)


def test_delayed_activation_is_applied_in_the_forward():
    from tierlm.models.gpt2.family import GPT2_FAMILY as family

    model = _gpt2(ra_r=4, rmlp_r_ff=16, delay_mode="step", delay_start_step=3)
    ids = torch.randint(0, 50, (2, 10))
    blocks = model.h

    def bump_reciprocal_gates():
        with torch.no_grad():
            for block in blocks:
                block.attn.ra.w_rec.add_(0.5)
                block.mlp.w_rec.add_(0.5)

    before = model(ids)
    bump_reciprocal_gates()
    assert torch.equal(model(ids), before), "while the scale is 0 the reciprocal gates must not matter"
    loss = model(ids).logsumexp(-1).sum()
    loss.backward()
    assert all(
        float(b.attn.ra.w_rec.grad.abs().sum()) == 0 and float(b.mlp.w_rec.grad.abs().sum()) == 0 for b in blocks
    )
    for step in (1, 2, 3):
        family.on_step(model, step, 1.0)
    assert float(model.coupling.scale) == 1.0
    assert not torch.allclose(model(ids), before), "once on, the reciprocal gates act"


def test_loss_stability_switches_on_when_the_loss_settles():
    from tierlm.models.gpt2.delay import CouplingWarmup

    warmup = CouplingWarmup("loss_stability", window=5, cv_threshold=0.01)
    warmup.init_weights()
    for step, loss in enumerate([5.0, 4.0, 3.5, 3.1, 3.0, 2.99, 3.01, 3.0, 2.98, 3.0], start=1):
        warmup.update(step, loss)
        if step < 9:
            assert float(warmup.scale) == 0.0, step  # the window still holds the fall
    assert float(warmup.scale) == 1.0 and int(warmup.switched_at) == 9


def test_a_delayed_run_resumes_exactly(tmp_path):
    common = [
        "pretrain",
        "--config",
        str(REPO / "configs/tiny_pretrain.yaml"),
        *TINY,
        "model.architecture=gpt2",
        "model.head_dim=16",
        "model.variant=V16",
        "model.delay.window=3",
        "model.delay.cv_threshold=0.5",
        "training.num_train_steps=12",
        "training.logging_steps=1",
    ]
    assert main([*common, f"infra.output_dir={tmp_path / 'straight'}"]) == 0
    assert main([*common, "training.save_steps=6", f"infra.output_dir={tmp_path / 'resumed'}"]) == 0
    import shutil

    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_12")
    shutil.rmtree(tmp_path / "resumed" / "model")
    (tmp_path / "resumed" / "checkpoints" / "latest").write_text("step_6\n")
    assert main([*common, "training.save_steps=6", f"infra.output_dir={tmp_path / 'resumed'}"]) == 0
    from safetensors.torch import load_file

    a, b = (
        load_file(tmp_path / "straight" / "model" / "model.safetensors"),
        load_file(tmp_path / "resumed" / "model" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and "transformer.coupling.switched_at" in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert int(a["transformer.coupling.switched_at"]) > 0  # it switched on during the run


@pytest.mark.parametrize("variant", [f"V{i}" for i in range(20)])
def test_each_variant_trains_20_steps(variant, tmp_path):
    run = tmp_path / variant
    wide = (
        ["model.aspect_ratio=384"] if variant in ("V13", "V15", "V18") else []
    )  # R_ff = 1,152 needs an MLP wider than 1,152 (4 x 384)
    delay = ["model.delay.start_step=15"] if variant in ("V11", "V12", "V13", "V14", "V15") else []
    recency = (
        ["model.kv_pruning.recency=8"] if variant in ("V14", "V15", "V17", "V18", "V19") else []
    )  # rows of 32: prune for real
    code = main(
        [
            "pretrain",
            "--config",
            str(REPO / "configs/tiny_pretrain.yaml"),
            *TINY,
            "model.architecture=gpt2",
            "model.head_dim=16",
            f"model.variant={variant}",
            "training.num_train_steps=20",
            "training.learning_rate=3e-3",
            "training.logging_steps=10",
            "training.eval_steps=20",
            f"infra.output_dir={run}",
            *wide,
            *delay,
            *recency,
        ]
    )
    assert code == 0
    lines = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] != "sample"]
    evals = [r for r in lines if r["type"] == "eval"]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    gated = variant in ("V1", "V2", "V3", "V4", "V5", "V6", "V7", "V8", "V9", "V10", "V12", "V16")  # RA's gates
    assert ("ra_w_rec_mean" in lines[-1]) == gated and ("ra_w_rec_mean" in evals[-1]) == gated
    if variant in ("V11", "V12", "V13", "V14", "V15"):  # off for 15 steps, then on: applied, and logged
        train = [r for r in lines if r["type"] == "train"]
        assert [r["coupling_scale_mean"] for r in train] == [0.0, 1.0]
    if variant in ("V15", "V18"):
        assert "kv_keep_ratio_mean" in lines[-1]
    if variant in ("V3", "V4", "V5", "V6", "V11", "V13", "V14", "V15", "V17", "V18"):
        assert "rmlp_w_rec_mean" in lines[-1]
    if variant in ("V2", "V8", "V10"):
        assert 0.0 <= lines[-1]["self_restart_alpha_min"] and lines[-1]["self_restart_alpha_max"] <= 0.5 + 0.1
    assert type(load_pretrained_model(run / "model")).__name__ == "GPT2"


def test_an_unknown_variant_is_one_line(capsys):
    code = main(
        [
            "pretrain",
            "--config",
            str(REPO / "configs/tiny_pretrain.yaml"),
            *TINY,
            "model.architecture=gpt2",
            "model.variant=V20",
        ]
    )
    assert code == 2 and "model.variant 'V20' is not a V-series step" in capsys.readouterr().err


def _pruned(**kv):
    return _gpt2(kv_prune=True, kv_recency=2, kv_keep_ratio=0.3, **kv)


@pytest.mark.parametrize("kv", [{}, {"kv_learned": True}, {"kv_values_only": True}])
def test_kv_pruning_is_causal(kv):
    """No future token changes an earlier position's output: change the last tokens, compare the rest."""
    model = _pruned(**kv)
    ids = torch.randint(0, 50, (2, 16))
    changed = ids.clone()
    changed[:, 10:] = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_kv_pruning_keeps_the_budget_and_prunes_for_real():
    from tierlm.models.gpt2.kv import CausalKVPruning

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    pruned = CausalKVPruning(keep_ratio=0.25, recency=2)
    pruned.init_weights()
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = pruned(q, k, v)
    assert torch.allclose(
        out[:, :, :2], dense[:, :, :2], atol=1e-6
    )  # the first queries see only recent keys: nothing pruned
    assert not torch.allclose(out[:, :, 8:], dense[:, :, 8:])  # later ones keep 3 of 9-12 keys
    full = CausalKVPruning(keep_ratio=1.0, recency=2)
    full.init_weights()
    assert torch.allclose(full(q, k, v), dense, atol=1e-6)  # keeping every key is plain causal attention


def test_the_learned_keep_ratio_gets_a_gradient():
    model = _pruned(kv_learned=True)
    model.train()
    model(torch.randint(0, 50, (2, 16))).logsumexp(-1).sum().backward()
    grads = [float(block.attn.kv.ratio_logit.grad.abs()) for block in model.h]
    assert all(g > 0 for g in grads), grads


def test_pruned_models_generate_as_they_recompute():
    from tierlm.rollout.engine import Engine
    from tierlm.rollout.sampling import GREEDY

    model = _gpt2(kv_prune=True, kv_recency=2, kv_keep_ratio=0.3)
    prompt = [3, 14, 15, 9, 2, 6]
    tokens = Engine(model).generate(prompt, 2, 8, GREEDY)[0].tokens
    assert tokens == _greedy_by_recomputation(model, prompt, 8)

"""The mixture-of-experts layer (`tierlm.models.moe`) against a per-token reference written out here and against
transformers' Qwen3-MoE block with the same weights; the balancing bias and routing replay."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tierlm.models.moe import MoE, MoEConfig, load_balancing_loss

DIM = 16


def _layer(seed: int = 0, **settings) -> MoE:
    torch.manual_seed(seed)
    config = MoEConfig(**{"num_experts": 4, "experts_per_token": 2, "expert_width": 8, **settings})
    layer = MoE(DIM, config)
    with torch.no_grad():
        layer.router.weight.normal_(std=0.5)
    return layer


def _reference(layer: MoE, x: torch.Tensor, routes: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token: the router's scores (softmax or sigmoid of W_r x), the top-k of score + bias (or the routes
    given), the picked scores renormalised, sum_e w_e SwiGLU_e(x) with SwiGLU_e(x) = D_e (silu(G_e x) * U_e x),
    plus the shared experts."""
    c, out = layer.config, []
    for n, token in enumerate(x.reshape(-1, DIM)):
        logits = layer.router.weight @ token
        scores = logits.softmax(-1) if c.score == "softmax" else logits.sigmoid()
        picked = (
            routes[n].tolist()
            if routes is not None
            else (scores + layer.expert_bias).topk(c.experts_per_token).indices.tolist()
        )
        weights = [scores[e] for e in picked]
        total = sum(weights) if c.normalize_top_k else 1.0
        y = torch.zeros(DIM)
        for e, w in zip(picked, weights):
            gate_up, down = layer.experts.gate_up_proj[e], layer.experts.down_proj[e]
            gate, up = gate_up[: c.expert_width] @ token, gate_up[c.expert_width :] @ token
            y = y + (w / total) * (down @ (F.silu(gate) * up))
        if layer.shared is not None:
            s = layer.shared
            y = y + s.down_proj.weight @ (F.silu(s.gate_proj.weight @ token) * (s.up_proj.weight @ token))
        out.append(y)
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize(
    "settings",
    [{}, {"score": "sigmoid"}, {"shared_experts": 1}, {"normalize_top_k": False}, {"expert_width": 6}],
    ids=["softmax", "sigmoid", "shared", "unnormalised", "loop-fallback"],
)
def test_the_layer_is_the_per_token_sum_of_its_picked_experts(settings, monkeypatch):
    """Output and gradients (input, router, experts) against the per-token reference; with width 6 the down
    projection's rows (6 floats) are not 16-byte aligned, so it runs the loop over experts instead of the grouped
    matmul (which every other projection runs)."""
    calls, grouped = [], F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **k: calls.append(1) or grouped(*a, **k))
    layer = _layer(**settings)
    x = torch.randn(3, 5, DIM, generator=torch.Generator().manual_seed(1))
    ours_x, ref_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = layer(ours_x)
    probe = torch.randn_like(ours)
    (ours * probe).sum().backward()
    grads = [p.grad.clone() for p in (layer.router.weight, layer.experts.gate_up_proj, layer.experts.down_proj)]
    layer.zero_grad()
    ref = _reference(layer, ref_x)
    (ref * probe).sum().backward()
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_x.grad, ref_x.grad, atol=1e-5, rtol=1e-5)
    for mine, p in zip(grads, (layer.router.weight, layer.experts.gate_up_proj, layer.experts.down_proj)):
        torch.testing.assert_close(mine, p.grad, atol=1e-5, rtol=1e-5)
    assert int(layer.stats["tokens_per_expert"].sum()) == 15 * layer.config.experts_per_token
    assert len(calls) == (2 if layer.config.expert_width % 4 == 0 else 1)  # width 6: the down projection loops


def test_a_qwen3_moe_block_copies_in_and_computes_the_same():
    """transformers' Qwen3MoeSparseMoeBlock with the same weights (its layout is ours): equal outputs."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=DIM, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
    )
    theirs = Qwen3MoeSparseMoeBlock(config).eval()
    layer = _layer()
    with torch.no_grad():
        theirs.gate.weight.copy_(layer.router.weight)
        theirs.experts.gate_up_proj.copy_(layer.experts.gate_up_proj)
        theirs.experts.down_proj.copy_(layer.experts.down_proj)
    x = torch.randn(2, 7, DIM, generator=torch.Generator().manual_seed(2))
    out = theirs(x)
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(layer(x), out, atol=1e-5, rtol=1e-5)


def test_the_load_balancing_loss_is_qwen3_moes():
    """The auxiliary loss against transformers' `load_balancing_loss_func` on the same router logits."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    layer = _layer()
    x = torch.randn(12, DIM, generator=torch.Generator().manual_seed(3))
    layer(x)
    logits = layer.router(x)
    theirs = load_balancing_loss_func((logits,), 4, 2)
    torch.testing.assert_close(layer.stats["load_balancing_loss"], theirs, atol=1e-6, rtol=1e-6)
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    torch.testing.assert_close(layer.stats["router_z_loss"], z)
    assert math.isclose(float(load_balancing_loss(torch.full((4, 4), 0.25), torch.arange(4)[:, None], 4)), 1.0)


def test_the_balancing_bias_moves_selection_but_not_weights():
    """A large bias on expert 3 puts it among every token's picks, with its weight still its own score (renormalised
    with the other pick's): the bias chooses, it never weighs."""
    layer = _layer()
    layer.expert_bias[3] = 10.0
    x = torch.randn(9, DIM, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(layer(x), _reference(layer, x), atol=1e-5, rtol=1e-5)
    assert (layer.routes == 3).any(dim=1).all()
    experts, weights, _, scores, _ = layer.route(x)
    picked = scores.gather(1, experts)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True))


def test_routing_replay_uses_the_given_experts_where_known_and_counts_agreement():
    """Given another layer's routes with one row unknown (-1), the layer counts the rows where its own top-k is the
    same set; with `replay` its output is the reference's with those experts on the known rows and its own on the
    unknown one (and differs from its own routing where the routes differ)."""
    layer, other = _layer(0), _layer(5)
    x = torch.randn(10, DIM, generator=torch.Generator().manual_seed(6))
    other(x)
    own = layer(x)
    own_routes = layer.routes
    given = other.routes.clone()
    given[3] = -1
    layer.sampler_routes = given
    measured = layer(x)
    torch.testing.assert_close(measured, own)  # measuring alone changes nothing
    same = (given.sort(-1).values == own_routes.sort(-1).values).all(-1)
    assert layer.stats["route_known"].tolist() == [i != 3 for i in range(10)]
    assert layer.stats["route_agree"].tolist() == [bool(same[i]) and i != 3 for i in range(10)]
    assert not layer.stats["route_agree"].all()
    layer.replay = True
    replayed = layer(x)
    expected = torch.where(torch.arange(10)[:, None] == 3, own_routes, other.routes)
    torch.testing.assert_close(replayed, _reference(layer, x, expected), atol=1e-5, rtol=1e-5)
    assert torch.equal(layer.routes, expected) and not torch.allclose(replayed, own)


def _moe_gpt(seed: int = 0, **moe):
    from tierlm.models import GPTConfig, build_gpt

    settings = {"num_experts": 4, "experts_per_token": 2, "expert_width": 24, **moe}
    config = GPTConfig(depth=2, aspect_ratio=32, head_dim=16, n_kv_head=2, vocab_size=61, max_seq_len=32,
                       moe=MoEConfig(**settings))  # fmt: skip
    torch.manual_seed(seed)
    gpt = build_gpt(config)
    with torch.no_grad():  # off the zero init, so every expert and the router matter
        for p in gpt.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return gpt.eval()


def test_a_gpt_with_experts_saves_as_transformers_qwen3_moe_with_the_same_logits(tmp_path):
    """The native GPT with `moe` is Qwen3-MoE: its folder loads into transformers' Qwen3MoeForCausalLM (and back
    into tierlm, the balancing bias with it) with equal logits."""
    from transformers import AutoModelForCausalLM

    from tierlm.models import load_native_model, save_model_folder

    gpt = _moe_gpt()
    save_model_folder(gpt, tmp_path / "model")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and hf.config.num_experts == 4
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, gpt(ids), atol=2e-5, rtol=1e-5)
        gpt.blocks[1].mlp.expert_bias.copy_(torch.tensor([2.0, -2.0, 0.0, 0.0]))  # selection moves
        save_model_folder(gpt, tmp_path / "biased")
        again = load_native_model(tmp_path / "biased")
        assert again.blocks[1].mlp.expert_bias.tolist() == [2.0, -2.0, 0.0, 0.0]
        torch.testing.assert_close(again(ids), gpt(ids), atol=0, rtol=0)
    assert gpt.num_params(active=True) < gpt.num_params()


def test_a_gpt_with_experts_decodes_with_its_cache_as_it_recomputes():
    from tierlm.rollout import generate
    from tierlm.rollout.engine import Engine
    from tierlm.rollout.sampling import GREEDY

    gpt = _moe_gpt(seed=2)
    prompt = [3, 14, 15, 9]
    engine = Engine(gpt)
    assert engine.decoders is None  # routing sizes the experts' batches on the host: never the fixed-shape step
    assert engine.generate(prompt, 2, 16, GREEDY)[0].tokens == generate(gpt, prompt, 16, GREEDY)


def test_gpt_experts_refuse_what_qwen3_moe_cannot_hold():
    from tierlm.models import GPTConfig

    config = GPTConfig(moe=MoEConfig(num_experts=4, experts_per_token=1, expert_width=8, score="sigmoid"))
    assert any("no transformers Qwen3-MoE twin" in p for p in config.validate())


def test_model_moe_settings_give_experts_the_dense_width_over_the_picks():
    """model.moe.num_experts > 0 makes every block a mixture; an expert's width defaults to the dense SwiGLU's over
    experts_per_token (rounded up to 32), so a token meets as many feed-forward weights as in the dense model."""
    from tierlm.config.model import ModelConfig, MoESettings
    from tierlm.models import GPTConfig
    from tierlm.models.gpt.family import GPTFamily

    shape = dict(depth=4, aspect_ratio=32, head_dim=32)
    dense = GPTConfig(**shape).intermediate_size  # 352
    made = GPTFamily().gpt_config(ModelConfig(**shape, moe=MoESettings(num_experts=8, experts_per_token=2)), 100, 64)
    assert (
        made.moe == MoEConfig(8, 2, -(-dense // 2 // 32) * 32, bias_update_rate=1e-3) and made.moe.expert_width == 192
    )
    wide = ModelConfig(
        **shape, moe=MoESettings(num_experts=8, expert_width=64, normalize_top_k=False, aux_loss_coef=0.01)
    )
    assert GPTFamily().gpt_config(wide, 100, 64).moe == MoEConfig(
        8, 2, 64, normalize_top_k=False, aux_loss_coef=0.01, bias_update_rate=1e-3
    )
    assert GPTFamily().gpt_config(ModelConfig(**shape), 100, 64).moe is None


def test_training_adds_each_layers_router_terms_per_trained_token():
    """In training the loss gains aux_loss_coef x load balancing + z_loss_coef x z-loss of every layer, per trained
    token (the loss is a token sum); evaluation leaves them out."""
    gpt = _moe_gpt(aux_loss_coef=0.01, z_loss_coef=0.001)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(3))
    labels = ids.roll(-1, 1)
    labels[:, -3:] = -100
    with torch.no_grad():
        plain, _ = gpt.eval()(ids, labels=labels)
        total, _ = gpt.train()(ids, labels=labels)
    terms = [(layer.stats["load_balancing_loss"], layer.stats["router_z_loss"]) for layer in gpt.moe_layers()]
    expected = plain + sum(0.01 * lb + 0.001 * z for lb, z in terms) * 18
    torch.testing.assert_close(total, expected)
    assert len(terms) == 2 and all(lb > 0 and z > 0 for lb, z in terms)


def test_each_optimizer_step_moves_the_balancing_bias_by_the_steps_load():
    """DeepSeek-V3's update after the optimizer step: each expert's bias moves by the rate toward balance, from the
    tokens the step's micro-batches routed to it (counted here from the routes each forward recorded)."""
    from tierlm.backends import PyTorchTrainingBackend
    from tierlm.backends.options import BackendOptions
    from tierlm.primitives import create_adamw_optimizer

    gpt = _moe_gpt(bias_update_rate=0.25).train()
    backend = PyTorchTrainingBackend(
        gpt, create_adamw_optimizer(gpt, lr=1e-3), None, "/tmp/unused", torch.device("cpu"), None, BackendOptions()
    )
    loads = [torch.zeros(4) for _ in gpt.moe_layers()]
    for seed in (4, 5):  # two micro-batches, one step
        ids = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(seed))
        backend.forward_backward({"input_ids": ids, "labels": ids.roll(-1, 1)})
        for load, layer in zip(loads, gpt.moe_layers()):
            load += torch.bincount(layer.routes.flatten(), minlength=4).float()
    metrics = backend.optim_step().wait()
    imbalance = sum(float(load.max() / load.mean()) for load in loads) / len(loads)
    assert metrics["expert_imbalance"] == pytest.approx(imbalance)
    for load, layer in zip(loads, gpt.moe_layers()):
        torch.testing.assert_close(layer.expert_bias, 0.25 * torch.sign(load.mean() - load))
        assert layer.load is None


def test_flops_per_token_count_the_experts_a_token_goes_through():
    """MFU and the scaling plan count the active parameters: 6 x (non-embedding params less the idle experts')."""
    from tierlm.metrics.flops import flops_per_token

    gpt = _moe_gpt()  # 4 experts, 2 per token
    c = gpt.config
    experts = sum(layer.experts.gate_up_proj.numel() + layer.experts.down_proj.numel() for layer in gpt.moe_layers())
    active = gpt.num_params() - gpt.embed.weight.numel() - experts // 2
    assert gpt.num_params(exclude_embedding=True, active=True) == active
    assert flops_per_token(gpt, 32) == 6 * active + 12 * c.depth * c.n_head * c.head_dim * 32


def _label_logprobs(model, batch) -> torch.Tensor:
    from tierlm.models import forward_logits

    with torch.no_grad():
        logits = forward_logits(model, batch)
    labels = batch["labels"]
    return torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (labels >= 0)


def test_the_engine_records_routes_and_replaying_them_gives_the_trainer_the_samplers_logprobs():
    """The engine records every token's experts (the prompt's, then each fed-back token's): the same the full forward
    picks, so the trainer agrees everywhere. Then the balancing bias moves (as an optimizer step moves it between
    sampling and training): the bias chooses experts but never weighs them, so the trainer's log-probs differ from
    the sampler's only by routing — they differ without replay and are the sampler's with it."""
    from tierlm.loops.policy_update import rollout_batch
    from tierlm.rollout.engine import Engine, Rollout

    gpt = _moe_gpt(3)
    prompt = [5, 9, 2, 7]
    completions = Engine(gpt).generate(prompt, 3, max_new_tokens=8, generator=torch.Generator().manual_seed(0))
    rollouts = [Rollout(prompt, c, 0.0, "") for c in completions]
    for c in completions:
        assert c.routes.shape == (len(prompt) + len(c.tokens) - 1, 2, 2) and c.routes.dtype == torch.int16
    batch = rollout_batch(rollouts, torch.zeros(3), pad_id=0)
    trained = batch["labels"] != -100
    assert set(batch) >= {"sampler_routes"} and "routes" not in batch
    torch.testing.assert_close(_label_logprobs(gpt, batch)[trained], batch["sampler_logprobs"][trained])
    agreement = gpt.routing_agreement()
    assert agreement["route_tokens_agree"] == agreement["route_tokens"] == sum(len(c.routes) for c in completions)

    with torch.no_grad():
        for layer in gpt.moe_layers():
            layer.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, -0.25]))
    moved = (_label_logprobs(gpt, batch) - batch["sampler_logprobs"])[trained].abs()
    agreement = gpt.routing_agreement()
    assert moved.max() > 1e-2 and agreement["route_decisions_agree"] < agreement["route_decisions"]
    replayed = _label_logprobs(gpt, rollout_batch(rollouts, torch.zeros(3), pad_id=0, replay=True))
    torch.testing.assert_close(replayed[trained], batch["sampler_logprobs"][trained], atol=1e-5, rtol=1e-5)


def test_routing_replay_is_refused_where_no_routes_are_recorded():
    """vLLM hands tierlm no routes (its CPU build cannot return them: tests/test_vllm.py): replay with it is refused
    in one line; tierlm's engine records them."""
    from tierlm.builders.engine import EngineSettings, check_routing_replay
    from tierlm.errors import ConfigError

    check_routing_replay(EngineSettings("native", routing_replay=True), _moe_gpt())
    with pytest.raises(ConfigError, match="engine.kind=vllm does not hand them to tierlm"):
        check_routing_replay(EngineSettings("vllm", routing_replay=True), _moe_gpt())


def test_the_backend_scores_and_trains_with_the_replayed_routes(tmp_path):
    """Through the training backend: its forward counts the agreement and, given `routes`, scores the sampler's
    log-probs; forward_backward replays them too (the gradient of the replayed forward's loss, not its own
    routing's)."""
    from tierlm.backends.pytorch import PyTorchTrainingBackend
    from tierlm.loops.policy_update import rollout_batch
    from tierlm.rollout.engine import Engine, Rollout
    from tierlm.strategies.rl import ReinforceStrategy

    gpt = _moe_gpt(4)
    prompt = [3, 1, 4, 1, 5]
    completions = Engine(gpt).generate(prompt, 2, max_new_tokens=6, generator=torch.Generator().manual_seed(1))
    rollouts = [Rollout(prompt, c, 1.0, "") for c in completions]
    with torch.no_grad():
        for layer in gpt.moe_layers():
            layer.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, -0.25]))
    backend = PyTorchTrainingBackend(gpt, torch.optim.SGD(gpt.parameters(), lr=0.0), None, tmp_path, "cpu")
    strategy = ReinforceStrategy()
    for replay in (False, True):
        batch = rollout_batch(rollouts, torch.ones(2), pad_id=0, replay=replay)
        out = backend.forward(batch, strategy.compute_metrics).wait()
        trained = batch["labels"] != -100
        gap = (out["logprobs"] - batch["sampler_logprobs"])[trained].abs().max()
        assert (gap < 1e-5) == replay, (replay, float(gap))
        assert out["route_tokens"] == sum(len(c.routes) for c in completions)
        assert (out["route_decisions_agree"] < out["route_decisions"]) and out["route_tokens_agree"] < out[
            "route_tokens"
        ]
    backend.forward_backward(batch, strategy.compute_loss)
    grads = {n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None}
    gpt.zero_grad()
    for i, layer in enumerate(gpt.moe_layers()):  # the reference: the layers told the routes by hand
        layer.sampler_routes, layer.replay = batch["routes"][:, :, i].reshape(-1, 2), True
    logits = gpt(batch["input_ids"])
    for layer in gpt.moe_layers():
        layer.sampler_routes, layer.replay = None, False
    loss, _ = strategy.compute_loss(logits, batch)
    loss.backward()
    for name, p in gpt.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5)


def test_a_transformers_qwen3_moe_imports_as_the_native_gpt_with_the_same_logits_and_exports_back(tmp_path):
    """A Qwen3-MoE folder written by transformers (its attention wider than its residual stream, as Qwen3's is)
    becomes the native GPT with experts — equal logits — and exports back to a folder transformers loads alike."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from tierlm.errors import ConfigError
    from tierlm.models import family_named, save_model_folder

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, norm_topk_prob=True,
    )  # fmt: skip
    theirs = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # off transformers' small init, so every expert and the router matter
        for p in theirs.parameters():
            p.add_(0.1 * torch.randn_like(p))
    theirs.save_pretrained(tmp_path / "hf")
    ours = family_named("gpt").import_transformers(tmp_path / "hf").eval()
    assert ours.config.n_embd == 32 and ours.config.n_head == 4 and len(ours.moe_layers()) == 2
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=2e-5, rtol=1e-5)
    save_model_folder(ours, tmp_path / "back")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, theirs(ids).logits, atol=2e-5, rtol=1e-5)
    config.mlp_only_layers = [1]
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mixed")
    with pytest.raises(ConfigError, match="dense layers among the sparse ones"):
        family_named("gpt").import_transformers(tmp_path / "mixed")


def test_the_plan_counts_the_parameters_one_token_goes_through():
    from tierlm.plan.scaling import parameter_counts

    gpt = _moe_gpt()
    counts = parameter_counts(gpt)
    idle = 2 * (4 - 2) / 4 * (4 * 2 * 24 * gpt.config.n_embd + 4 * gpt.config.n_embd * 24)  # 2 layers, 2 of 4 idle
    assert counts["total"] == gpt.num_params() and counts["active"] == gpt.num_params() - idle

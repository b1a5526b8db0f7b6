"""LoRA through PEFT (model.lora): only the adapters train, merged exports compute what the adapted
model computes, PEFT itself loads the exported adapter, resume is bit-exact, and DPO / RL compare
against the base with the adapters off instead of a second copy."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import CHAT, REPO, RL, resume_from_checkpoint, run_main
from forked import ranks
from tierlm.config import TierlmConfig
from tierlm.data import load_tokenizer
from tierlm.models import forward_logits, load_pretrained_model, save_model_folder
from tierlm.models.lora import adapters_disabled, all_linear_targets, apply_lora, has_lora
from tierlm.stages import STAGES

LORA = ["model.lora.r=4", "model.lora.alpha=8"]


def _adapted(tiny_runs, r=4):
    """The tiny pretrained model with adapters whose B is not zero (so they change the output)."""
    model = apply_lora(load_pretrained_model(tiny_runs / "pre" / "model"), r=r, alpha=2 * r)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(std=0.5)
            if "o_proj.base_layer" in name or "down_proj.base_layer" in name:
                param.normal_(std=0.05)  # the fresh model's residual projections are zero: make every adapter matter
    return model


def _ids():
    return {"input_ids": torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(0))}


def test_only_adapters_train_with_the_expected_count(tiny_runs):
    from tierlm.builders.model import build_model

    config = TierlmConfig.load(
        REPO / "configs/tiny_sft.yaml", [*CHAT, *LORA, f"model.model_name_or_path={tiny_runs / 'pre'}"]
    )
    tokenizer = load_tokenizer(tiny_runs / "pre" / "model")
    base = load_pretrained_model(tiny_runs / "pre" / "model")
    model = build_model(config, tokenizer, torch.device("cpu"), tiny_runs / "pre" / "model")
    targets = set(all_linear_targets(base))
    expected = sum(
        4 * (m.in_features + m.out_features)
        for n, m in base.named_modules()
        if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in targets
    )
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert sum(trainable.values()) == expected and all(".lora_" in n for n in trainable)
    assert targets == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }  # not lm_head, not embed
    torch.testing.assert_close(
        forward_logits(model, _ids()), forward_logits(base, _ids()), rtol=0, atol=0
    )  # B = 0: unchanged


def test_merged_and_unmerged_folders_compute_the_adapted_model(tiny_runs, tmp_path):
    model = _adapted(tiny_runs)
    want = forward_logits(model, _ids())
    assert not torch.allclose(
        want, forward_logits(load_pretrained_model(tiny_runs / "pre" / "model"), _ids()), atol=1e-3
    )
    save_model_folder(model, tmp_path / "merged", merge_lora=True)
    save_model_folder(model, tmp_path / "apart")  # as a checkpoint keeps it: the frozen base and the adapters
    for folder in ("merged", "apart"):
        loaded = load_pretrained_model(tmp_path / folder)
        assert not has_lora(loaded)
        torch.testing.assert_close(forward_logits(loaded, _ids()), want, rtol=0, atol=1e-5)
    base_weight = load_file(tmp_path / "apart" / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(base_weight, model.blocks[0].attn.q_proj.base_layer.weight, rtol=0, atol=0)


def test_peft_loads_the_exported_adapter_onto_the_exported_base(tiny_runs, tmp_path):
    """Another runtime's view: transformers loads the base tierlm exports, PEFT puts our adapter on it,
    and the logits are the adapted model's (and the merged export's)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _adapted(tiny_runs)
    want = forward_logits(model, _ids())
    save_model_folder(model, tmp_path / "run_model", merge_lora=True)
    save_model_folder(model, tmp_path / "base")  # its weights: the (perturbed) frozen base alone
    shutil.copytree(
        tmp_path / "run_model" / "adapter", tmp_path / "adapter", ignore=shutil.ignore_patterns("tierlm_adapter.json")
    )
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    torch.testing.assert_close(peft_model(**_ids()).logits, want, rtol=0, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run_model").eval()
    torch.testing.assert_close(merged(**_ids()).logits, want, rtol=0, atol=1e-5)


def test_the_reference_is_the_base_with_adapters_off(tiny_runs):
    from tierlm.backends.references import AdapterFreeReference, frozen_reference

    model = _adapted(tiny_runs).train()
    reference = frozen_reference(model, "cpu")
    assert isinstance(reference, AdapterFreeReference) and reference.model is model  # no second copy
    base = load_pretrained_model(tiny_runs / "pre" / "model")
    with torch.no_grad():
        for name, param in base.named_parameters():  # the same perturbed base weights as _adapted's
            param.copy_(
                dict(model.named_parameters())[
                    name.replace("_proj.weight", "_proj.base_layer.weight")
                    if any(f"{p}_proj.weight" in name for p in ("q", "k", "v", "o", "gate", "up", "down"))
                    else name
                ]
            )
    got = reference.forward(_ids(), lambda logits, batch: {"logits": logits}).wait()["logits"]
    torch.testing.assert_close(got, forward_logits(base, _ids()), rtol=0, atol=1e-6)
    assert model.training and not torch.allclose(
        forward_logits(model, _ids()), got, atol=1e-3
    )  # adapters back on, mode restored
    with adapters_disabled(model):
        torch.testing.assert_close(forward_logits(model.eval(), _ids()), got, rtol=0, atol=1e-6)


def _train_losses(run):
    return [
        (r["step"], r["loss"])
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if r["type"] == "train"
    ]


@pytest.mark.slow
def test_lora_sft_resumes_bit_exactly_and_exports(tiny_runs, tmp_path):
    args = [
        "sft",
        "--config",
        "configs/tiny_sft.yaml",
        *CHAT,
        *LORA,
        "model.lora.dropout=0.1",
        f"model.model_name_or_path={tiny_runs / 'pre'}",
        "training.num_train_steps=6",
        "training.save_steps=3",
        "training.logging_steps=1",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_main(*args, f"infra.output_dir={straight}").returncode == 0
    shutil.copytree(straight, resumed)  # the same run, rolled back to its step 3 and resumed in this process
    resume_from_checkpoint(args, resumed, 3, in_process=True)
    assert _train_losses(resumed)[-3:] == _train_losses(straight)[-3:] and len(_train_losses(straight)) == 6
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(straight / "model" / name), load_file(resumed / "model" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    # The frozen base did not move; the final folder holds the merged weights and the adapter apart.
    base = load_file(tiny_runs / "pre" / "model" / "model.safetensors")
    final = load_file(straight / "model" / "model.safetensors")
    assert torch.equal(base["model.embed_tokens.weight"], final["model.embed_tokens.weight"])
    assert not torch.equal(
        base["model.layers.0.self_attn.q_proj.weight"], final["model.layers.0.self_attn.q_proj.weight"]
    )
    # `tierlm export` of the step-3 checkpoint (base + adapters apart) merges; --adapter-only is PEFT's folder.
    from tierlm.commands.cli import main

    assert main(["export", str(straight / "checkpoints" / "step_3"), str(tmp_path / "merged")]) == 0
    assert main(["export", str(straight / "checkpoints" / "step_3"), str(tmp_path / "adapter"), "--adapter-only"]) == 0
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_runs / "pre" / "model"), tmp_path / "adapter"
    ).eval()
    torch.testing.assert_close(merged(**_ids()).logits, peft_model(**_ids()).logits, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_lora_dpo_and_rl_run_against_the_adapter_free_reference(tiny_runs, tmp_path):
    dpo = run_main(
        "dpo",
        "--config",
        "configs/tiny_dpo.yaml",
        *CHAT,
        *LORA,
        f"model.model_name_or_path={tiny_runs / 'sft'}",
        "training.eval_steps=2",
        f"infra.output_dir={tmp_path / 'dpo'}",
    )
    assert dpo.returncode == 0, dpo.stderr[-3000:]
    first = [
        r
        for r in map(json.loads, (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines())
        if r["type"] == "train"
    ][0]
    assert abs(first["loss"] - 0.6931) < 1e-3, first  # step 1: policy == reference (B = 0), so the DPO loss is log 2
    rl = run_main(
        "rl",
        "--config",
        "configs/tiny_rl.yaml",
        *RL,
        *LORA,
        "rl.kl_coef=0.1",
        f"model.model_name_or_path={tiny_runs / 'sft'}",
        f"infra.output_dir={tmp_path / 'rl'}",
    )
    assert rl.returncode == 0, rl.stderr[-3000:]
    assert (tmp_path / "rl" / "model" / "adapter" / "adapter_model.safetensors").is_file()


def test_the_memory_planner_traces_the_adapted_model(tiny_runs):
    """Fake trace == the real step; optimizer state is the adapters' AdamW moments only; no reference copy."""
    from tierlm.plan.memory import estimate_run_memory, trace_step

    config = TierlmConfig.load(
        REPO / "configs/tiny_sft.yaml", [*CHAT, *LORA, f"model.model_name_or_path={tiny_runs / 'pre'}"]
    )
    fake = trace_step(config, STAGES["sft"], 300, 4, 64, tiny_runs / "pre" / "model")
    real = trace_step(config, STAGES["sft"], 300, 4, 64, tiny_runs / "pre" / "model", fake=False)
    assert fake["Optstate"] == real["Optstate"] and abs(fake["Activation"] - real["Activation"]) <= 4096
    adapters = sum(p.numel() for n, p in _adapted(tiny_runs).named_parameters() if ".lora_" in n)
    assert 2 * 4 * adapters <= fake["Optstate"] <= 2 * 4 * adapters + 4 * 64  # exp_avg + exp_avg_sq (+ step counters)
    dpo = TierlmConfig.load(
        REPO / "configs/tiny_dpo.yaml", [*CHAT, *LORA, f"model.model_name_or_path={tiny_runs / 'sft'}"]
    )
    assert (
        estimate_run_memory(dpo, 1, STAGES["dpo"], vocab_size=300, pretrained=tiny_runs / "sft" / "model").parts[
            "reference model"
        ]
        == 0
    )


@pytest.mark.slow
def test_lora_under_fsdp_matches_one_process_and_exports(tiny_runs, tmp_path):
    """FSDP2 shards frozen base and trainable adapters together; 2 ranks x 4 rows train as 1 process x 8;
    the sharded checkpoint (adapters inside the shards, adapter_config.json beside) exports merged."""
    common = [
        "sft",
        "--config",
        "configs/tiny_sft.yaml",
        *CHAT,
        *LORA,
        f"model.model_name_or_path={tiny_runs / 'pre'}",
        "training.num_train_steps=4",
        "training.save_steps=4",
        "training.logging_steps=1",
    ]
    one = run_main(*common, "training.per_device_train_batch_size=8", f"infra.output_dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    two = ranks(
        "-m",
        "tierlm",
        *common,
        "training.per_device_train_batch_size=4",
        "infra.distributed_type=fsdp",
        f"infra.output_dir={tmp_path / 'two'}",
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert [loss for _, loss in _train_losses(tmp_path / "two")] == pytest.approx(
        [loss for _, loss in _train_losses(tmp_path / "one")], abs=1e-4
    )
    checkpoint = tmp_path / "two" / "checkpoints" / "step_4"
    assert (checkpoint / "state").is_dir() and (checkpoint / "model" / "adapter" / "adapter_config.json").is_file()
    result = run_main("export", checkpoint, tmp_path / "exported")
    assert result.returncode == 0, result.stderr[-2000:]
    a, b = (
        load_file(tmp_path / "exported" / "model.safetensors"),
        load_file(tmp_path / "two" / "model" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_lora_under_tensor_and_pipeline_parallel_matches_one_process_and_exports(two_block_runs, tmp_path):
    """LoRA SFT at tensor parallel 2 (each adapted layer's base and the adapter half that shares its split: B for
    q/k/v/gate/up, A for o/down), with the sequence split too (the norms stay frozen: PyTorch's SequenceParallel
    re-registers them trainable), and on 2 pipeline stages trains as one process and exports its merged model."""
    pre = two_block_runs / "pre"  # two blocks of two heads: one block per stage, one head per rank
    common = [
        "sft",
        "--config",
        "configs/tiny_sft.yaml",
        *CHAT,
        *LORA,
        f"model.model_name_or_path={pre}",
        "training.num_train_steps=4",
        "training.logging_steps=1",
        "training.learning_rate=3e-3",
    ]
    assert (one := run_main(*common, f"infra.output_dir={tmp_path / 'one'}")).returncode == 0, one.stderr[-3000:]
    reference = load_file(tmp_path / "one" / "model" / "model.safetensors")
    layouts = {
        "tp": ["infra.tensor_parallel_size=2"],
        "sp": ["infra.tensor_parallel_size=2", "infra.sequence_parallel=true"],  # B of o/down: its tokens' share
        "pp": ["infra.pipeline_parallel_size=2"],
    }
    for name, layout in layouts.items():
        run = tmp_path / name
        result = ranks("-m", "tierlm", *common, *layout, f"infra.output_dir={run}")
        assert result.returncode == 0, result.stderr[-3000:]
        got, expected = (
            [
                r[key]
                for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if r["type"] == "train"
                for key in ("loss", "grad_norm")
            ]
            for out in (run, tmp_path / "one")
        )  # the gradient norm too: AdamW's step hides a gradient off by a constant factor
        assert len(got) == 8 and got == pytest.approx(expected, abs=1e-5), layout
        exported = load_file(run / "model" / "model.safetensors")
        assert exported.keys() == reference.keys() and all(
            torch.allclose(exported[k], reference[k], atol=1e-5) for k in reference
        ), layout
        assert (run / "model" / "adapter" / "adapter_model.safetensors").is_file()
    assert not all(torch.equal(reference[k], v) for k, v in load_file(pre / "model" / "model.safetensors").items())


def test_lora_tensor_parallel_plan_splits_each_adapter_with_its_layer_and_refuses_what_it_cannot():
    from tierlm.errors import ConfigError
    from tierlm.models import build_gpt
    from tierlm.models.gpt.model import GPTConfig
    from tierlm.models.lora import tensor_parallel_plan
    from tierlm.models.registry import family_of

    def block(dropout=0.0):
        model = apply_lora(build_gpt(GPTConfig(vocab_size=64, depth=1, aspect_ratio=64, head_dim=32)), 4, 8, dropout)
        return model, next(family_of(model).blocks(model).children())

    model, first = block()
    plan = tensor_parallel_plan(first, family_of(model).tensor_parallel_plan(model, 2))
    assert plan["attn.q_proj.base_layer"] == plan["attn.q_proj.lora_B.default"] == "colwise"
    assert plan["attn.o_proj.base_layer"] == plan["attn.o_proj.lora_A.default"] == "rowwise"
    assert "attn.q_proj.lora_A.default" not in plan and "attn.o_proj.lora_B.default" not in plan  # whole on each rank
    assert plan["attn.q_norm"] == "grad_allreduce" and "attn.q_proj" not in plan
    with pytest.raises(ConfigError, match="model.lora.dropout=0"):
        tensor_parallel_plan(block(0.1)[1], family_of(model).tensor_parallel_plan(model, 2))
    split_tokens = tensor_parallel_plan(first, family_of(model).tensor_parallel_plan(model, 2), sequence_parallel=True)
    assert split_tokens["attn.o_proj.lora_B.default"] == "grad_allreduce"  # each rank holds its tokens' share
    with pytest.raises(ConfigError, match="splits as colwise_qkv"):
        tensor_parallel_plan(first, {"attn.q_proj": "colwise_qkv"})


def test_a_sampler_copy_takes_the_adapters_alone_and_refuses_a_stale_or_partial_one(tiny_runs):
    """Adapter-only sync to tierlm's engine: a copy of the LoRA policy, given only the adapters the policy trained
    (stamped with their weight version), samples with the policy's logits exactly, its base weights untouched; an
    adapter stamped for another version, or missing a tensor, is refused."""
    import copy

    from tierlm.rollout.adapters import adapter_payload
    from tierlm.rollout.engine import Engine

    policy = _adapted(tiny_runs)
    engine = Engine(copy.deepcopy(policy))
    with torch.no_grad():  # an optimizer step's worth of change, in the adapters only (the base is frozen)
        for name, param in policy.named_parameters():
            if ".lora_" in name:
                param.add_(0.1 * torch.randn_like(param))
    state = policy.state_dict()
    payload = adapter_payload(state, 1)
    assert 0 < len(payload) - 1 < len(state) and all(".lora_" in k for k in payload if k != "adapter.weight_version")
    before = {k: v.clone() for k, v in engine.model.state_dict().items() if ".lora_" not in k}
    assert not torch.allclose(forward_logits(engine.model.eval(), _ids()), forward_logits(policy.eval(), _ids()))
    engine.load_weights(payload, 1)
    assert engine.weight_version == 1
    torch.testing.assert_close(forward_logits(engine.model, _ids()), forward_logits(policy, _ids()), rtol=0, atol=0)
    assert all(torch.equal(v, engine.model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(RuntimeError, match="the adapters of weight version 1 were offered as version 2"):
        engine.load_weights(payload, 2)
    partial = dict(payload)
    partial.pop(next(k for k in partial if ".lora_B." in k))
    with pytest.raises(RuntimeError, match="the adapters offered differ from the sampler's"):
        engine.load_weights(partial, 1)
    assert engine.weight_version == 1


@pytest.mark.slow
def test_lora_rl_sampling_ahead_syncs_the_adapters_alone_with_the_whole_syncs_weights(tiny_runs, tmp_path, monkeypatch):
    """LoRA RL one step off-policy (the background sampler holds a copy of the policy): each sync hands it the
    adapters alone, and four steps end with the weights of the same run syncing every weight (the engine told it
    takes no adapters), bit for bit; a reward for digits, so the steps move the adapters."""
    from conftest import digits_reward
    from tierlm.rollout.engine import Engine

    args = ["rl", "--config", "configs/tiny_rl.yaml", *RL, *LORA, f"model.model_name_or_path={tiny_runs / 'sft'}"]
    args += [digits_reward(tmp_path, monkeypatch), "rl.max_off_policy_steps=1", "training.num_train_steps=4"]
    args += ["rl.max_new_tokens=8", "training.logging_steps=1"]
    loads = []
    original = Engine.load_weights
    monkeypatch.setattr(Engine, "load_weights", lambda self, state, v: loads.append(state) or original(self, state, v))
    assert run_main(*args, f"infra.output_dir={tmp_path / 'adapters'}").returncode == 0
    assert loads and all("adapter.weight_version" in s for s in loads if s is not None), [len(s) for s in loads]
    monkeypatch.setattr(Engine, "takes_adapters", False)
    loads.clear()
    assert run_main(*args, f"infra.output_dir={tmp_path / 'whole'}").returncode == 0
    assert loads and all(s is None or "adapter.weight_version" not in s for s in loads)
    lines = [json.loads(r) for r in (tmp_path / "adapters" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["grad_norm"] > 0 for r in lines if r["type"] == "train")
    a = load_file(tmp_path / "adapters" / "model" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "whole" / "model" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

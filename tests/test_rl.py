"""Generation engine, tools, policy-gradient losses, DPO, rewards: each against a hand-written or naive reference."""

from __future__ import annotations

import copy
import itertools
import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from episode_checks import episodes_train_the_ids_sampled
from tierlm.backends import PyTorchTrainingBackend
from tierlm.builders.tasks import open_task
from tierlm.config import RLConfig
from tierlm.errors import DataError
from tierlm.loops.evaluation import pass_at_k
from tierlm.loops.policy_update import rollout_batch
from tierlm.models import build_gpt, forward_logits
from tierlm.primitives.losses import IGNORE_INDEX
from tierlm.rollout import generate
from tierlm.rollout.engine import Engine, Rollout
from tierlm.rollout.sampling import GREEDY, SamplingParams
from tierlm.rollout.text import answer_text
from tierlm.rollout.together import like_lengths
from tierlm.rollout.tools import Calculator
from tierlm.strategies.dpo import DPOStrategy
from tierlm.strategies.preference_losses import PREFERENCE_LOSSES, PreferenceSettings
from tierlm.strategies.rl import (
    ReinforceStrategy,
    group_advantages,
    kl_penalty,
    policy_gradient_loss,
    policy_gradient_strategy,
    token_logprobs,
)
from tierlm.strategies.rl_losses import resolve_rl
from tierlm.tasks import exact_number_reward


def _models(tiny_gpt_config):
    torch.manual_seed(0)
    gpt = build_gpt(tiny_gpt_config)
    with torch.no_grad():  # off the zero init so greedy decoding is not trivially constant
        for p in gpt.parameters():
            p.add_(0.3 * torch.randn_like(p))
    hf = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=tiny_gpt_config.vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
        )
    ).eval()
    return {"native": gpt, "transformers": hf}


@pytest.mark.parametrize("kind", ["native", "transformers"])
def test_engine_greedy_equals_full_recompute(tiny_gpt_config, kind):
    model = _models(tiny_gpt_config)[kind]
    prompt = [3, 14, 15, 92, 65]
    reference = generate(model, prompt, max_new_tokens=24, params=GREEDY)  # full recompute, no cache
    with warnings.catch_warnings():  # a deprecated argument (transformers' past_key_values since 5.25) fails it
        warnings.simplefilter("error", FutureWarning)
        completions = Engine(model).generate(prompt, num_samples=3, max_new_tokens=24, params=GREEDY)
    assert all(c.tokens == reference for c in completions)
    # The sampler's log-probs are the model's, recomputed over the whole sequence.
    ids = torch.tensor([prompt + reference])
    full = torch.log_softmax(forward_logits(model, {"input_ids": ids}).float(), -1)[0, len(prompt) - 1 : -1]
    expected = full.gather(1, torch.tensor(reference)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(completions[0].logprobs), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind", ["native", "gpt2", "transformers"])
def test_a_prefill_computes_the_last_positions_logits_only(tiny_gpt_config, kind):
    """The engine's prefill (`family.prefill`) runs the LM head on each row's last position (`logits_at`, transformers'
    `logits_to_keep`), not on every position of a long prompt: (B, V) logits, those of the full forward."""
    from tierlm.models import family_of
    from tierlm.models.gpt2.model import GPT2, GPT2Config

    torch.manual_seed(0)
    models = _models(tiny_gpt_config)
    models["gpt2"] = GPT2(GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=97, block_size=32)).eval()
    model = models[kind]
    head, rows = model.get_output_embeddings() if kind == "transformers" else model.lm_head, []
    hook = head.register_forward_hook(lambda module, args, out: rows.append(args[0][..., 0].numel()))
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        logits, _ = family_of(model).prefill(model, ids, 16)
    hook.remove()
    assert rows == [2]  # one position a row went through the head
    torch.testing.assert_close(logits, forward_logits(model, {"input_ids": ids})[:, -1], atol=1e-5, rtol=1e-5)


def test_engine_sampling_is_seeded_and_stops(tiny_gpt_config):
    model = _models(tiny_gpt_config)["native"]
    engine = Engine(model, stop_ids=[7])
    a = engine.generate([1, 2, 3], 4, 20, SamplingParams(1.0, top_k=20), torch.Generator().manual_seed(5))
    b = engine.generate([1, 2, 3], 4, 20, SamplingParams(1.0, top_k=20), torch.Generator().manual_seed(5))
    assert [c.tokens for c in a] == [c.tokens for c in b]
    for c in a:
        assert c.finished == (7 in c.tokens) and (not c.finished or c.tokens[-1] == 7)


def _static_and_slicing(model, run):
    """`run(engine)` on the engine with the fixed-shape decode step and on the one slicing its cache."""
    return run(Engine(model, stop_ids=[7], static=True)), run(Engine(model, stop_ids=[7], static=False))


def _same_samples(a, b):
    """The same tokens and stops; log-probs to float32's rounding of two kernel paths (a batch of 16 masked over its
    bucket against one row sliced: on an AMD EPYC with one thread 1.1e-5 apart at a log-prob of -2.2)."""
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert [c.finished for c in a] == [c.finished for c in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("samples,temperature,top_k", [(3, 0.0, None), (5, 1.0, None), (2, 0.8, 10)])
def test_the_fixed_shape_decode_step_samples_what_the_slicing_step_samples(tiny_gpt_config, samples, temperature,
                                                                           top_k):  # fmt: skip
    """The static cache (a tensor position, attention over the whole bucket masked past it, rows padded to a bucket:
    3 and 5 rows run in buckets of 4 and 8) against today's step: the same tokens, greedy and under one seed, and
    the same log-probs; a second prompt of another length in the same bucket sees nothing of the first."""
    model = _models(tiny_gpt_config)["native"]

    def run(engine):
        return [
            engine.generate(
                prompt, samples, 30, SamplingParams(temperature, top_k), torch.Generator().manual_seed(seed)
            )
            for prompt, seed in (([3, 14, 15, 92, 65], 1), ([9, 2], 2))
        ]

    static, slicing = _static_and_slicing(model, run)
    for a, b in zip(static, slicing):
        _same_samples(a, b)
    decoders = Engine(model, static=True).decoders
    first = decoders.get(3, 35)
    assert len(first.cache.layers[0].k) == 4 and decoders.get(4, 100) is first
    model.to(torch.float64)  # the weights moved: a graph captured on the old ones would read freed memory
    assert decoders.get(4, 100) is not first and decoders.get(4, 100).cache.layers[0].k.dtype == torch.float64


def test_fixed_shape_decoding_continues_partial_rollouts_as_the_slicing_step(tiny_gpt_config):
    model = _models(tiny_gpt_config)["native"]

    def run(engine):
        rows = engine.generate([1, 2, 3], 3, 4, SamplingParams(1.0), torch.Generator().manual_seed(0))
        rows = [r for r in rows if not r.finished]
        engine.extend([1, 2, 3], rows, 12, SamplingParams(1.0), torch.Generator().manual_seed(1))
        return rows

    _same_samples(*_static_and_slicing(model, run))


def test_packed_projections_are_the_weights_themselves_through_training_and_inference_mode(tiny_gpt_config):
    """The fixed-shape step's q/k/v and gate/up packed into one matrix each: the same samples as the step reading
    the separate weights and as the slicing step; the model's weights become views of the packed matrices (no
    memory added); an optimizer step after a generation under `torch.inference_mode` trains the weights (still
    ordinary tensors) and the next generation samples what an unpacked copy of the trained model samples."""
    from tierlm.rollout.static_decode import Decoders, packed, projections

    model = _models(tiny_gpt_config)["native"]
    before = sum(p.untyped_storage().nbytes() for p in model.parameters())
    engine, apart = Engine(model, stop_ids=[7], static=True), Engine(model, stop_ids=[7], static=True)
    apart.decoders = Decoders(model, graph=False, pack=False)

    def sample(engine, seed=3):
        return engine.generate([3, 14, 15], 3, 20, SamplingParams(1.0), torch.Generator().manual_seed(seed))

    with torch.inference_mode():
        first = sample(engine)
    attn, mlp = model.blocks[1].attn, model.blocks[1].mlp
    weights = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight)
    storages = {w.untyped_storage().data_ptr() for w in weights}
    assert len(storages) == 2 and not any(w.is_inference() for w in weights)
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == len(list(model.parameters())) - 6
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == before
    assert attn.qkv_weight is None and mlp.gate_up_weight is None  # set only while a step runs
    _same_samples(first, sample(apart))
    _same_samples(first, sample(Engine(model, stop_ids=[7], static=False)))

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with packed(projections(model)):  # as while another thread's decode step runs: a training forward reads apart
        model(ids, labels=ids)[0].backward()
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in weights)
    optimizer.step()
    trained = sample(engine, seed=4)
    assert [r.tokens for r in trained] != [r.tokens for r in sample(Engine(_models(tiny_gpt_config)["native"],
                                                                                stop_ids=[7]), seed=4)]  # fmt: skip
    _same_samples(trained, sample(Engine(copy.deepcopy(model), stop_ids=[7], static=False), seed=4))


def test_lora_projections_stay_apart_in_the_packed_step(tiny_gpt_config):
    """LoRA on q and v (PEFT's layers, adapters non-zero): the step packs each layer's gate and up but leaves q/k/v
    apart, and samples what the slicing step samples."""
    from tierlm.models.lora import apply_lora
    from tierlm.rollout.static_decode import projections

    model = apply_lora(_models(tiny_gpt_config)["native"], r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    assert {name for _, name, _ in projections(model)} == {"gate_up_weight"}

    def sample(engine):
        return engine.generate([3, 14, 15], 3, 20, SamplingParams(1.0), torch.Generator().manual_seed(3))

    _same_samples(sample(Engine(model, stop_ids=[7], static=True)), sample(Engine(model, stop_ids=[7], static=False)))


@pytest.mark.parametrize("static", [False, True])
def test_sampling_ahead_of_the_host_changes_nothing(tiny_gpt_config, static):
    """Steps sampled in runs of 3 or 8 before the host reads them (as on CUDA) against one at a time: the same tokens,
    log-probs, stops and streamed tokens, partial rollouts continued the same, and the generators (given, and torch's
    own) left where the step-by-step loop leaves them, though the runs overshoot the step where every row stopped."""
    model = _models(tiny_gpt_config)["native"]
    stops = list(range(0, 97, 6))  # a stop every ~6 tokens: rows stop inside runs, and all of them before the budget

    def run(ahead):
        engine = Engine(model, stop_ids=stops, static=static)
        engine.ahead = ahead
        streamed, generator = [], torch.Generator().manual_seed(1)
        torch.manual_seed(3)
        out = [
            engine.generate(
                [3, 14, 15], 6, 40, SamplingParams(1.0), generator, on_token=lambda r, c: streamed.append(r)
            ),
            engine.generate([9, 2], 4, 30, SamplingParams(0.7, top_p=0.9)),  # torch's own generator
            engine.generate([5, 6], 2, 20, GREEDY),
        ]
        partial = engine.generate([1, 2, 3], 5, 2, SamplingParams(1.0), generator)
        rows = [r for r in partial if not r.finished]
        engine.extend([1, 2, 3], rows, 30, SamplingParams(1.0), generator)
        return out + [partial], streamed, torch.rand(4, generator=generator), torch.rand(4)

    steady = run(1)
    lengths = [max(len(c.tokens) for c in group) for group in steady[0][:2]]
    assert all(c.finished for group in steady[0][:2] for c in group) and lengths[0] < 40 and lengths[0] % 8
    for ahead in (3, 8):
        groups, streamed, given, default = run(ahead)
        for a, b in zip(groups, steady[0]):
            _same_samples(a, b)
        assert streamed == steady[1]
        assert torch.equal(given, steady[2]) and torch.equal(default, steady[3])


@pytest.mark.parametrize(
    "ahead,temperature,top_k,top_p,static",
    [(1, 1.0, None, None, None), (8, 1.0, 20, None, True), (3, 0.8, None, 0.9, None), (8, 0.0, None, None, True)],
)
def test_prompts_decoded_together_sample_what_each_samples_alone(tiny_gpt_config, ahead, temperature, top_k, top_p,
                                                                 static):  # fmt: skip
    """`generate_many` with the fixed-shape decoder: prompts of 1-12 tokens right-aligned in one batch of 14 rows
    (a bucket of 16), read every `ahead` steps, against each prompt generated alone step by step (with `static`
    None, the CPU's default, alone is the slicing step): the same tokens, stops and log-probs (to float rounding),
    each prompt's generator left where its own generation leaves it, though the groups stop at different steps."""
    model = _models(tiny_gpt_config)["native"]
    prompts = [([3, 14, 15], 3), ([9, 2, 6, 5, 3, 5, 8], 5), ([1], 2), (list(range(20, 32)), 4)]
    stops = list(range(0, 97, 9))

    def run(together):
        engine = Engine(model, stop_ids=stops, static=static)
        assert engine.decoders is not None and engine.fixed_alone == bool(static)
        engine.ahead = ahead if together else 1  # alone: the step-by-step loop
        generators = [torch.Generator().manual_seed(seed) for seed in range(len(prompts))]
        requests = [(prompt, n, g) for (prompt, n), g in zip(prompts, generators)]
        params = SamplingParams(temperature, top_k, top_p)
        if together:
            assert engine._runs([(len(p), n, 40, g) for p, n, g in requests], params) == [[0, 1, 2, 3]]
            fed = []  # tokens a row of each forward: the prompts' prefills (in two groups of like lengths), then steps
            hook = model.register_forward_pre_hook(lambda _, args: fed.append(args[0].shape[1]))
            out = engine.generate_many(requests, 40, params)
            hook.remove()
            assert sum(n > 1 for n in fed) == len(like_lengths([len(p) for p, _ in prompts])) == 2
        else:
            out = [engine.generate(p, n, 40, params, g) for p, n, g in requests]
        return out, [torch.rand(3, generator=g) for g in generators]

    (together, after), (alone, expected) = run(True), run(False)
    for a, b in zip(together, alone):
        _same_samples(a, b)
    assert all(torch.equal(x, y) for x, y in zip(after, expected))
    lengths = [max(len(c.tokens) for c in group) for group in alone]
    assert len(set(lengths)) > 1 and min(lengths) < 40  # groups stopped at different steps, some before the budget


def test_prompts_decode_together_only_where_each_would_have_its_budget_and_its_generator(tiny_gpt_config):
    model = _models(tiny_gpt_config)["native"]  # a context of 64 positions
    engine, g = Engine(model), [torch.Generator() for _ in range(4)]

    def runs(steps, generators=g, temperature=1.0, engine=engine):
        items = [(10, 30, steps[0], generators[0]), (20, 30, steps[1], generators[1]), (40, 2, steps[2], generators[2]),
                 (5, 4, steps[3], generators[3])]  # fmt: skip
        return engine._runs(items, SamplingParams(temperature))

    # 64 rows at most; the longest prefix and the steps within the context; the same steps
    assert runs([20] * 4) == [[0, 1, 2], [3]]  # 62 rows, then 66
    assert runs([30] * 4) == [[0, 1], [2], [3]]  # 40 + 30 > 64
    assert runs([20, 20, 19, 19]) == [[0, 1], [2, 3]]
    assert runs([4] * 4, [g[0]] * 4) == [[0], [1], [2], [3]]  # one generator for all: its draws would interleave
    assert runs([4] * 4, [g[0]] * 4, temperature=0.0) == [[0, 1, 2], [3]]  # greedy draws nothing
    assert runs([4] * 4, engine=Engine(model, static=False)) == [[0], [1], [2], [3]]


@pytest.mark.parametrize("ahead", [1, 8])
def test_partial_rollouts_continued_together_get_what_each_gets_alone(tiny_gpt_config, ahead):
    """`extend_many` with the fixed-shape decoder: the unfinished rows of three prompts (prefixes of different
    lengths, a budget that gives one of them fewer steps, so it goes alone) continued as one batch, against each group
    continued alone by the slicing step: the same tokens, log-probs, versions and stops, and the generators left
    where their own continuation leaves them."""
    model = _models(tiny_gpt_config)["native"]
    stops = list(range(0, 97, 24))  # rare: most rows run to the budget, some stop
    prompts = [[3, 14, 15], [9, 2, 6, 5, 3, 5, 8], [1], list(range(20, 32))]

    def run(static):
        engine = Engine(model, stop_ids=stops, static=static)
        engine.ahead = ahead if static is None else 1
        requests, generators = [], []
        for i, prompt in enumerate(prompts):  # first chunks, of different lengths: 4 tokens, the last one 6
            rows = engine.generate(prompt, 3, 6 if i == 3 else 4, SamplingParams(1.0), torch.Generator().manual_seed(i))
            generators.append(torch.Generator().manual_seed(10 + i))
            requests.append((prompt, [r for r in rows if not r.finished], generators[-1]))
        requests = [r for r in requests if r[1]]
        assert len(requests) == 4
        engine.load_weights(None, 1)
        alone, extend = [], engine.extend
        engine.extend = lambda prompt, *args: (alone.append(prompt), extend(prompt, *args))[1]
        engine.extend_many(requests, 12, SamplingParams(1.0), budget=16)  # the last group's room: 16 - 6 = 10
        assert alone == (prompts[3:] if static is None else prompts)  # the first three together
        return [rows for _, rows, _ in requests], [torch.rand(2, generator=g) for g in generators]

    (together, after), (alone, expected) = run(None), run(False)
    for a, b in zip(together, alone):
        _same_samples(a, b)
        assert [r.versions for r in a] == [r.versions for r in b] and all(1 in r.versions for r in a)
    assert all(torch.equal(x, y) for x, y in zip(after, expected))
    rows = [r for group in alone for r in group]
    assert any(len(r.tokens) == 16 for r in rows) and any(r.finished and len(r.tokens) < 16 for r in rows)


def test_the_compiled_decode_step_samples_what_the_eager_step_samples(tiny_gpt_config, monkeypatch):
    """`Engine(compile=True)`: the fixed-shape step traced whole by torch.compile (AOT autograd's functionalised graph,
    which Inductor compiles; here without Inductor's code generation, 6-40 s more on CPU: scripts/gpu_checks.sh and
    bench/inference_card.py run Inductor) samples the eager step's tokens and log-probs, every bucket sharing it
    after one recompile with dynamic shapes."""
    import torch._dynamo

    from tierlm.rollout import static_decode

    monkeypatch.setattr(static_decode, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _models(tiny_gpt_config)["native"]
    engines = compiled, eager = Engine(model, stop_ids=[7], compile=True), Engine(model, stop_ids=[7], static=True)
    assert compiled.decoders.compile and not eager.decoders.compile
    for prompt, samples in (([3, 14, 15], 3), ([9, 2], 5), ([1] * 30, 2), ([4, 5], 16)):  # row buckets 4, 8, 2, 16
        a, b = (e.generate(prompt, samples, 30, SamplingParams(1.0), torch.Generator().manual_seed(2)) for e in engines)
        _same_samples(a, b)
    assert len(compiled.decoders.decoders) == 4 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_compile_options_reach_torch_compile_and_sample_the_eager_tokens(tiny_gpt_config, monkeypatch):
    """`Engine(compile="max-autotune")` (bench/inference_card.py's `tierlm-compiled-autotune`) compiles its step with
    those Inductor options; traced here without Inductor (which reads them), it samples the eager step's tokens."""
    import torch._dynamo

    from tierlm.rollout import static_decode

    monkeypatch.setattr(static_decode, "COMPILE_BACKEND", "aot_eager")
    options, compile = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: options.append(kw.get("options")) or compile(fn, **kw))
    static_decode.compiled_decode_step.cache_clear()
    torch._dynamo.reset()
    model = _models(tiny_gpt_config)["native"]
    engines = Engine(model, compile="max-autotune"), Engine(model, static=True)
    a, b = (e.generate([3, 14, 15], 3, 12, SamplingParams(1.0), torch.Generator().manual_seed(2)) for e in engines)
    _same_samples(a, b)
    assert options == [{"max_autotune": True, "coordinate_descent_tuning": True}]
    static_decode.compiled_decode_step.cache_clear()


def test_engine_compile_refuses_a_model_without_the_fixed_shape_step(tiny_gpt_config):
    from tierlm.builders.engine import EngineSettings, build_engine
    from tierlm.errors import ConfigError

    models, tokenizer = _models(tiny_gpt_config), SimpleNamespace(stop_ids=[7])
    with pytest.raises(ConfigError, match=r"engine.compile \(--compile\) compiles the native GPT's fixed-shape decode"):
        build_engine(EngineSettings(compile=True), models["transformers"], tokenizer)
    with pytest.raises(ConfigError, match="fixed-shape decode step, which this model lacks"):
        Engine(models["transformers"], stop_ids=[7], compile=True)  # the engine itself (tierlm sample --compile)
    assert build_engine(EngineSettings(compile=True), models["native"], tokenizer).decoders.compile


def test_sample_and_chat_compile_their_decode_step_when_asked(tiny_runs, monkeypatch):
    """`tierlm sample --compile` prints what `tierlm sample` prints (sampled, seeded); `tierlm chat/serve --compile`
    build tierlm's engine with the compiled step (serve's refusal with --engine vllm: tests/test_bad_inputs.py)."""
    import torch._dynamo

    from conftest import run_main
    from tierlm.commands.chat import Chatbot
    from tierlm.commands.generation import Sampling
    from tierlm.rollout import static_decode

    monkeypatch.setattr(static_decode, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    args = ["sample", "--checkpoint", str(tiny_runs / "sft"), "--prompt", "What is 2 + 3?", "--temperature", "1"]
    args += ["--max-new-tokens", "12", "--device-type", "cpu"]
    counters = torch._dynamo.utils.counters
    counters.clear()
    plain = run_main(*args)
    assert counters["stats"]["unique_graphs"] == 0
    compiled = run_main(*args, "--compile")
    assert counters["stats"]["unique_graphs"] >= 1  # the decode step went through torch.compile
    assert plain.returncode == compiled.returncode == 0 and plain.stdout == compiled.stdout, compiled.stderr[-2000:]
    bot = Chatbot(tiny_runs / "sft", "cpu", compile=True)
    try:
        assert bot.engine.decoders.compile and bot.engine.fixed_alone
    finally:
        bot.close()
    # serve's continuous batch compiles its step too, on a CPU as on a GPU (the fixed-shape step, not the slicing
    # one), and samples what the uncompiled batch samples
    bots = (
        Chatbot(tiny_runs / "sft", "cpu", compile=True, batch_rows=4),
        Chatbot(tiny_runs / "sft", "cpu", batch_rows=4),
    )
    try:
        steps = bots[0].scheduler.decoder.steps
        assert steps is not None and steps.compile and bots[1].scheduler.decoder.steps is None
        question = [{"role": "user", "content": "What is 2 + 3?"}]
        compiled, plain = (b.chat_choices(question, Sampling(12, 0.0, n=3, ignore_eos=True))[0].tokens for b in bots)
        assert compiled == plain and len(compiled) == 12
    finally:
        for b in bots:
            b.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decoding_equals_the_eager_step(tiny_gpt_config):
    """On a GPU the engine replays the step captured in a CUDA graph: bit for bit the fixed-shape step run eagerly
    (float32 and bf16), and in float32 the slicing step's tokens (run by scripts/gpu_checks.sh)."""
    from tierlm.rollout.static_decode import Decoders

    for dtype in (torch.float32, torch.bfloat16):
        model = _models(tiny_gpt_config)["native"].to("cuda", dtype)
        graphed = Engine(model, stop_ids=[7])
        assert graphed.decoders is not None and graphed.decoders.graph
        eager = Engine(model, stop_ids=[7], static=True)
        eager.decoders = Decoders(eager.model, graph=False)
        slicing = Engine(model, stop_ids=[7], static=False)
        for samples in (1, 6):
            a, b, c = (
                e.generate([3, 14, 15], samples, 40, SamplingParams(1.0), torch.Generator("cuda").manual_seed(4))
                for e in (graphed, eager, slicing)
            )
            assert [x.tokens for x in a] == [x.tokens for x in b] and [x.logprobs for x in a] == [x.logprobs for x in b]
            if dtype == torch.float32:
                _same_samples(a, c)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_decoding_compiled_ahead_and_batched_samples_the_eager_tokens(tiny_gpt_config):
    """On a GPU, in float32: the step compiled by Inductor and captured (engine.compile) samples the tokens of the
    step launched kernel by kernel; reading the tokens every step changes nothing; prompts decoded together
    (`generate_many`) sample what each samples alone (run by scripts/gpu_checks.sh)."""
    model = _models(tiny_gpt_config)["native"].to("cuda")
    compiled, eager, every_step = Engine(model, [7], compile=True), Engine(model, [7], static=False), Engine(model, [7])
    every_step.ahead = 1
    assert compiled.ahead == 8 and compiled.decoders.graph and compiled.decoders.compile
    for samples in (1, 6):
        a, b, c, d = (
            e.generate([3, 14, 15], samples, 40, SamplingParams(1.0), torch.Generator("cuda").manual_seed(4))
            for e in (compiled, eager, every_step, Engine(model, [7]))
        )
        _same_samples(a, b)
        assert [x.tokens for x in c] == [x.tokens for x in d] and [x.logprobs for x in c] == [x.logprobs for x in d]

    def requests():
        return [(p, n, torch.Generator("cuda").manual_seed(n)) for p, n in (([3, 14, 15], 3), ([9, 2, 6, 5, 3], 5))]

    together = Engine(model, [7]).generate_many(requests(), 40, SamplingParams(1.0))
    for a, (p, n, g) in zip(together, requests()):
        _same_samples(a, every_step.generate(p, n, 40, SamplingParams(1.0), g))


class ScriptedEngine(Engine):
    """The model's choices come from a script (one entry per step, forced steps included), so the
    tool path is exercised exactly; the cache and sampling code around it is the real one."""

    def __init__(self, script: list[int], vocab_size: int, **kwargs):
        super().__init__(torch.nn.Linear(1, 1), **kwargs)
        self.script, self.vocab_size, self.calls = script, vocab_size, 0

    def _logits(self, rows: int) -> torch.Tensor:
        logits = torch.full((rows, self.vocab_size), -30.0)
        logits[:, self.script[min(self.calls, len(self.script) - 1)]] = 30.0
        self.calls += 1
        return logits

    def _prefill(self, ids, num_samples, max_len):
        return self._logits(ids.shape[0] * num_samples), None

    def _decode(self, tokens, cache):
        return self._logits(tokens.shape[0])

    def max_len(self):
        return 256


def test_calculator_result_is_spliced_in_and_masked(tiny_tokenizer):
    tok = tiny_tokenizer
    vocab = tok.hf.get_vocab()
    call = [vocab["<|tool_call_start|>"], *tok.encode("17 + 25"), vocab["<|tool_call_end|>"]]
    result = [vocab["<|tool_start|>"], *tok.encode("42"), vocab["<|tool_end|>"]]
    answer = [*tok.encode("17 + 25 = 42"), vocab["<|assistant_end|>"]]
    filler = [tok.encode("9")[0]] * len(result)  # what the model "wanted" while the engine forced the result
    engine = ScriptedEngine(
        call + filler + answer, tok.vocab_size, stop_ids=tok.stop_ids, tokenizer=tok, tools=[Calculator()]
    )
    [completion] = engine.generate([1, 2], 1, 64, GREEDY)
    assert completion.tokens == call + result + answer and completion.finished and completion.tool_calls == 1
    assert completion.mask == [1] * len(call) + [0] * len(result) + [1] * len(answer)
    assert all(lp == 0.0 for lp, m in zip(completion.logprobs, completion.mask) if not m)
    assert answer_text(tok, completion.tokens).strip() == "17 + 25 = 42"

    # In the training batch the prompt and the tool result carry no label.
    batch = rollout_batch([Rollout([1, 2], completion, 1.0, "")], torch.tensor([0.5]), tok.pad_id)
    labelled = [int(t) for t in batch["labels"][0] if t != IGNORE_INDEX]
    assert labelled == call + answer
    assert batch["labels"][0, 0] == IGNORE_INDEX  # predicting the prompt's second token: not trained


def test_group_advantages_against_hand_computation():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    adv = group_advantages(rewards, group_size=4)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, -0.75, 0.25]))
    std = group_advantages(rewards, group_size=4, normalize_std=True)
    torch.testing.assert_close(std[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(std[4:], (rewards[4:] - 0.75) / math.sqrt(0.1875), atol=1e-5, rtol=0)


def test_batch_scaled_advantages_divide_by_the_whole_steps_std_over_every_rank():
    """Lite PPO's (TRL's scale_rewards="batch"): the group's mean off, the step's population std divided out; two
    ranks, each with half the groups and `total` summing their moments, give the one-process figures."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0])
    group_mean = rewards.view(-1, 4).mean(dim=1).repeat_interleave(4)
    expected = (rewards - group_mean) / (rewards.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(group_advantages(rewards, 4, "batch"), expected)
    assert not torch.allclose(expected, group_advantages(rewards, 4, "group"))  # not the groups' stds
    halves = rewards[:8], rewards[8:]

    def total(_mine):  # what the loop's all-reduce of each rank's {n, sum, squares} returns
        return {
            "n": 12.0,
            "sum": float(rewards.double().sum()),
            "squares": float((rewards.double() ** 2).sum()),
        }

    per_rank = torch.cat([group_advantages(h, 4, "batch", total=total) for h in halves])
    torch.testing.assert_close(per_rank, expected)
    loop = policy_gradient_strategy(resolve_rl(RLConfig(loss="grpo", normalize_std="batch")))
    torch.testing.assert_close(loop.advantages(rewards, 4), expected)


@pytest.mark.parametrize(
    ("ratio", "advantage", "zero_grad"),
    [
        (1.5, 1.0, True),  # above 1 + eps with A > 0: clipped, no gradient
        (0.5, -1.0, True),  # below 1 - eps with A < 0: clipped, no gradient
        (1.1, 1.0, False),  # inside the region: the gradient of ratio * A
        (0.5, 1.0, False),  # below 1 - eps with A > 0: the unclipped term is the minimum, gradient flows
        (1.5, -1.0, False),  # above 1 + eps with A < 0: likewise
    ],
)
def test_clipping_gradient_is_zero_outside_the_clip_region(ratio, advantage, zero_grad):
    logp = torch.tensor([[-1.0]], requires_grad=True)
    old = torch.tensor([[-1.0 - math.log(ratio)]])
    loss, count, stats = policy_gradient_loss(logp, torch.tensor([advantage]), torch.ones(1, 1), old, clip_range=0.2)
    loss.backward()
    if zero_grad:
        assert logp.grad.abs().item() == 0.0 and stats["clipped_sum"] == 1
    else:
        assert logp.grad.item() == pytest.approx(-ratio * advantage, rel=1e-5)


def test_reinforce_gradient_is_nanochats_objective():
    """Without old log-probs: d loss / d logp = -A per trained token, as -(logp * A).sum()."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([0.5, -0.25])
    loss, count, _ = policy_gradient_loss(logp, adv, mask)
    loss.backward()
    reference = logp.detach().clone().requires_grad_(True)
    (-(reference * adv[:, None] * mask).sum()).backward()
    assert count == 5 and torch.equal(logp.grad, reference.grad)


def test_kl_penalty_is_the_exact_kl_in_expectation():
    """E_{x~p}[k3(x)] = KL(p || r) for categorical p and r."""
    p = torch.tensor([0.5, 0.3, 0.2])
    r = torch.tensor([0.2, 0.5, 0.3])
    expected = (p * (p / r).log()).sum()
    k3 = kl_penalty(p.log(), r.log())
    assert (k3 >= 0).all()
    torch.testing.assert_close((p * k3).sum(), expected)
    # And the loss adds kl_coef * KL per token.
    logp = p.log()[None]
    with_kl, _, stats = policy_gradient_loss(
        logp, torch.zeros(1), torch.ones(1, 3), ref_logprobs=r.log()[None], kl_coef=0.1
    )
    torch.testing.assert_close(with_kl, 0.1 * k3.sum())


def test_masked_tokens_get_no_gradient(tiny_gpt_config):
    model = _models(tiny_gpt_config)["native"]
    ids = torch.randint(0, tiny_gpt_config.vocab_size, (2, 10))
    labels = ids.roll(-1, dims=1).clone()
    labels[:, :4] = IGNORE_INDEX  # prompt
    labels[0, 6:8] = IGNORE_INDEX  # a tool result
    batch = {"input_ids": ids, "labels": labels, "advantages": torch.tensor([1.0, -0.5])}
    strategy = ReinforceStrategy()
    logits = forward_logits(model, batch).detach().requires_grad_(True)
    total, count = strategy.compute_loss(logits, batch)
    total.backward()
    assert count == (labels != IGNORE_INDEX).sum()
    assert logits.grad[labels == IGNORE_INDEX].abs().max() == 0
    assert logits.grad[labels != IGNORE_INDEX].abs().max() > 0


def test_parity_of_trainer_and_sampler_logprobs_through_the_backend(tiny_gpt_config, tmp_path):
    model = _models(tiny_gpt_config)["native"]
    backend = PyTorchTrainingBackend(model, torch.optim.SGD(model.parameters(), lr=0.0), None, tmp_path, "cpu")
    engine = Engine(model)
    prompt = [5, 6, 7]
    completions = engine.generate(prompt, 3, 12, SamplingParams(1.0), torch.Generator().manual_seed(0))
    batch = rollout_batch([Rollout(prompt, c, 0.0, "") for c in completions], torch.zeros(3), 0)
    trainer_logprobs = backend.forward(batch, ReinforceStrategy().compute_metrics).wait()["logprobs"]
    trained = batch["labels"] != IGNORE_INDEX
    assert (trainer_logprobs - batch["sampler_logprobs"]).abs()[trained].max() < 2e-5


def test_dpo_loss_against_the_formula(tiny_gpt_config):
    torch.manual_seed(1)
    logits = torch.randn(4, 5, tiny_gpt_config.vocab_size)
    labels = torch.randint(0, tiny_gpt_config.vocab_size, (4, 5))
    labels[:, :2] = IGNORE_INDEX
    ref = torch.tensor([-9.0, -11.0, -10.5, -8.0])
    beta = 0.3
    strategy = DPOStrategy(beta=beta)
    total, count = strategy.compute_loss(logits, {"labels": labels, "ref_logps": ref})
    logp = [sum(math.log(torch.softmax(logits[r, t], -1)[labels[r, t]].item()) for t in range(2, 5)) for r in range(4)]
    expected = [
        math.log(1 + math.exp(-beta * ((logp[i] - ref[i].item()) - (logp[i + 2] - ref[i + 2].item()))))
        for i in range(2)
    ]
    assert count == 2
    assert total.item() == pytest.approx(sum(expected), rel=1e-5)
    loss, chosen, rejected = PREFERENCE_LOSSES["sigmoid"].fn(
        torch.tensor([-1.0]), torch.tensor([-1.0]), torch.tensor([-1.0]), torch.tensor([-1.0]), PreferenceSettings(0.1)
    )
    assert loss.item() == pytest.approx(math.log(2))


def test_token_logprobs_match_cross_entropy():
    logits = torch.randn(2, 3, 11)
    labels = torch.tensor([[1, 2, IGNORE_INDEX], [4, IGNORE_INDEX, 6]])
    ce = torch.nn.functional.cross_entropy(
        logits.view(-1, 11), labels.view(-1), reduction="none", ignore_index=IGNORE_INDEX
    )
    torch.testing.assert_close(token_logprobs(logits, labels).view(-1), -ce)


def test_rewards_and_gsm8k_style_jsonl(tmp_path):
    assert exact_number_reward("", "so the answer is 1,234", 1234) == 1.0
    assert exact_number_reward("", "#### -7", -7) == 1.0 and exact_number_reward("", "6", 7) == 0.0
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "2 + 2?", "answer": "2 + 2 = 4\n#### 4"}) + "\n")
    task = open_task(str(path), "train", 0, 0)
    assert len(task) == 1 and task.example(0).reference == 4.0 and task.reward("", "it is 4", 4.0) == 1.0
    path.write_text(json.dumps({"question": "?", "answer": "none"}) + "\n")
    with pytest.raises(DataError, match="gsm.jsonl:1"):
        open_task(str(path), "train", 0, 0)


def test_pass_at_k_against_enumeration():
    import itertools

    n, c, k = 5, 2, 3
    draws = list(itertools.combinations([1] * c + [0] * (n - c), k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))


def test_multi_turn_episode_keeps_sampled_tokens_and_masks_the_environment(tiny_tokenizer):
    from tierlm.config import RLConfig
    from tierlm.loops.sampling import RolloutSampler
    from tierlm.tasks import ArithmeticChain

    tok = tiny_tokenizer
    peek = ArithmeticChain("val", 4, seed=0)
    messages = peek.reset(2)
    first, second = peek.expected
    end = tok.hf.get_vocab()["<|assistant_end|>"]
    reply1, reply2 = f"{messages[0]['content'][8:-1]} = {first}", f"{second}"
    turn1, turn2 = tok.encode(reply1) + [end], tok.encode(reply2) + [end]
    engine = ScriptedEngine(turn1 + turn2, tok.vocab_size, stop_ids=tok.stop_ids, tokenizer=tok)
    sampler = RolloutSampler(engine, tok, RLConfig(max_new_tokens=16))
    rollout = sampler.episode(ArithmeticChain("val", 4, seed=0), 2, 1.0, torch.Generator().manual_seed(0))
    assert rollout.reward == 1.0  # both turns right
    c = rollout.completion
    bridge = len(c.tokens) - len(turn1) - len(turn2)
    assert bridge > 0 and c.tokens[: len(turn1)] == turn1 and c.tokens[-len(turn2) :] == turn2
    assert c.mask == [1] * len(turn1) + [0] * bridge + [1] * len(turn2)
    # The episode's tokens are exactly the chat template's rendering of the whole conversation.
    conversation = [
        messages[0],
        {"role": "assistant", "content": reply1},
        {"role": "user", "content": peek.next_question},
        {"role": "assistant", "content": reply2},
    ]
    ids, _ = tok.render_conversation(conversation)
    assert rollout.prompt_ids + c.tokens == ids


class BiasedEngine(Engine):
    """tierlm's engine with a bias added to the model's logits (the cache, sampling and tool code are the real
    ones): a random model then ends its turns and opens tool calls often enough to test them."""

    def __init__(self, *args, bias: torch.Tensor, **kwargs):
        super().__init__(*args, **kwargs)
        self.bias = bias

    def _prefill(self, ids, num_samples, max_len):
        logits, cache = super()._prefill(ids, num_samples, max_len)
        return logits + self.bias, cache

    def _decode(self, tokens, cache):
        return super()._decode(tokens, cache) + self.bias


def test_token_in_token_out_multi_turn_episodes_train_exactly_the_ids_sampled(tiny_tokenizer):
    """A random model sampled by tierlm's engine through two-turn episodes with the calculator: every turn was
    sampled after exactly the ids trained before it, the trained rows are the prompt, the sampled turns, the tool
    results and the environment's ids (its chat-template bridge), and no reply was re-encoded from its text — some
    replies here are not the tokenizer's own encoding of their text, so a re-encoding would show."""
    from tierlm.models import GPTConfig
    from tierlm.special_tokens import TOOL_CALL_END, TOOL_CALL_START
    from tierlm.tasks import ArithmeticChain

    tok = tiny_tokenizer
    vocab = tok.hf.get_vocab()
    torch.manual_seed(0)
    model = build_gpt(GPTConfig(depth=2, aspect_ratio=32, head_dim=16, vocab_size=len(vocab), max_seq_len=256))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    bias = torch.zeros(len(vocab))
    bias[vocab["<|assistant_end|>"]], bias[vocab[TOOL_CALL_START]], bias[vocab[TOOL_CALL_END]] = 3.5, 4.0, 5.0
    engine = BiasedEngine(model, stop_ids=tok.stop_ids, tokenizer=tok, tools=[Calculator()], bias=bias)
    two_turns, tools, non_canonical = episodes_train_the_ids_sampled(engine, tok, ArithmeticChain("val", 16, 0))
    assert two_turns >= 3 and tools >= 1 and non_canonical >= 1, (two_turns, tools, non_canonical)


def test_length_grouped_micro_batches_train_as_rows_in_order_with_less_padding(tiny_runs, tmp_path, monkeypatch):
    """Eight rollouts a step in micro-batches of three: grouped by length and cut to their widths, or in order at the
    batch's width, the same rows train, so the losses and the weights after 4 steps agree (to float summation
    order); the grouped run computes fewer padding positions. (A reward for digits, so that the tiny model's
    rollouts differ in reward and the steps move the weights.)"""
    from safetensors.torch import load_file

    from conftest import digits_reward
    from tierlm.commands.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["rl", "--config", "tiny_rl", f"model.model_name_or_path={tiny_runs / 'sft'}", "rl.micro_batch_size=3"]
    args += [digits_reward(tmp_path, monkeypatch)]
    args += ["rl.prompts_per_step=2", "rl.group_size=4", "rl.max_new_tokens=40", "rl.eval_problems=4", "rl.eval_k=2"]
    args += ["training.num_train_steps=4", "training.eval_steps=0", "training.logging_steps=1", "rl.loss=grpo"]
    args += ["infra.device_type=cpu", "data.num_synthetic_examples=200", "data.num_synthetic_eval_examples=16"]
    runs = {}
    for grouped in (True, False):
        out = tmp_path / str(grouped)
        assert main([*args, f"rl.group_by_length={grouped}", f"infra.output_dir={out}"]) == 0
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[grouped] = ([r for r in lines if r["type"] == "train"], load_file(out / "model" / "model.safetensors"))
    (grouped, weights), (in_order, reference) = runs[True], runs[False]
    for a, b in zip(grouped, in_order):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6) and a["reward_mean"] == b["reward_mean"]
    assert any(r["grad_norm"] > 0 for r in grouped)
    assert all(torch.allclose(weights[k], reference[k], atol=1e-5) for k in reference)
    assert sum(r["padding_frac"] for r in grouped) < sum(r["padding_frac"] for r in in_order)


def test_episode_budgets_end_episodes_and_rounds_batch_episodes_of_different_lengths(tiny_tokenizer):
    """rl.max_turns ends an episode after its turns (the chain's second question never asked); several episodes
    sampled together in rounds give each the rollout it gets alone."""
    from tierlm.config import RLConfig
    from tierlm.loops.episodes import run_episodes
    from tierlm.loops.sampling import RolloutSampler
    from tierlm.tasks import ArithmeticChain

    tok = tiny_tokenizer
    chain = ArithmeticChain("val", 4, seed=0)
    peek = ArithmeticChain("val", 4, seed=0)
    messages = peek.reset(2)
    end = tok.hf.get_vocab()["<|assistant_end|>"]
    turn1 = tok.encode(f"{messages[0]['content'][8:-1]} = {peek.expected[0]}") + [end]
    engine = ScriptedEngine(turn1 * 4, tok.vocab_size, stop_ids=tok.stop_ids, tokenizer=tok)
    sampler = RolloutSampler(engine, tok, RLConfig(max_new_tokens=16, max_turns=1))
    rollout = sampler.episode(chain, 2, 1.0, torch.Generator().manual_seed(0))
    assert rollout.reward == 0.5 and rollout.completion.tokens == turn1  # one turn, right: half the episode's reward
    alone = [
        run_episodes(ScriptedEngine(turn1 * 4, tok.vocab_size, stop_ids=tok.stop_ids, tokenizer=tok), tok,
                     RLConfig(max_new_tokens=16), [(chain, i, torch.Generator().manual_seed(i))], 1.0)[0]
        for i in (2, 3)
    ]  # fmt: skip
    scripted = ScriptedEngine(turn1 * 4, tok.vocab_size, stop_ids=tok.stop_ids, tokenizer=tok)
    starts = [(chain, i, torch.Generator().manual_seed(i)) for i in (2, 3)]
    together = run_episodes(scripted, tok, RLConfig(max_new_tokens=16), starts, 1.0)
    assert [(r.prompt_ids, r.completion.tokens, r.reward) for r in together] == [
        (r.prompt_ids, r.completion.tokens, r.reward) for r in alone
    ]


@pytest.mark.slow
def test_rl_on_a_multi_turn_environment_trains_past_its_first_update(tmp_path, tiny_runs):
    """`tierlm rl` on synthetic:arithmetic_chain: every step's episodes carry the weights they were sampled with
    (the version check of every step), within rl.max_episode_tokens."""
    import json

    from conftest import RL
    from tierlm.commands.cli import main

    out = tmp_path / "chain"
    args = ["rl", "--config", "tiny_rl", f"model.model_name_or_path={tiny_runs / 'sft'}", *RL]
    args += ["data.dataset_name=synthetic:arithmetic_chain", "training.logging_steps=1", "rl.max_episode_tokens=12"]
    assert main([*args, f"infra.output_dir={out}"]) == 0
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert [r["weight_version"] for r in train] == [0, 1] and all(r["completion_len"] <= 12 + 8 for r in train)


def test_sampler_draws_from_the_softmax_with_top_k_and_top_p():
    from tierlm.rollout.sampling import sample_next_token

    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    freq = torch.bincount(sample_next_token(logits, SamplingParams(1.0), g), minlength=4).float() / 20000
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.01, rtol=0)
    top2 = torch.bincount(sample_next_token(logits, SamplingParams(1.0, top_k=2), g), minlength=4).float() / 20000
    torch.testing.assert_close(
        top2,
        torch.tensor([0.0, 1.0, 2.0, -1.0])[[1, 2]].softmax(-1).new_tensor([0, 0.2689, 0.7311, 0]),
        atol=0.01,
        rtol=0,
    )
    assert set(sample_next_token(logits, SamplingParams(1.0, top_p=0.5), g).tolist()) == {
        2
    }  # the top token alone covers 0.64


@pytest.mark.parametrize(
    "penalties",
    [
        {"presence_penalty": 0.8, "frequency_penalty": 0.6},
        {"repetition_penalty": 1.8},
        {"presence_penalty": -0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.3},
    ],
)
def test_penalised_draws_are_the_formula_over_the_tokens_so_far(tiny_gpt_config, penalties):
    """`Engine.generate` with penalties (KV cache, tokens fed back ahead of the host) draws, greedy and seeded, what a
    full-recompute loop draws with the penalties written out here as vLLM applies them: repetition on the prompt's
    and the output's tokens, then frequency and presence on the output's, before the temperature."""
    from tierlm.rollout.sampling import sample_next_token

    model, prompt = _models(tiny_gpt_config)["native"], [3, 14, 15, 92, 65, 3]
    rep = penalties.get("repetition_penalty", 1.0)
    freq, presence = penalties.get("frequency_penalty", 0.0), penalties.get("presence_penalty", 0.0)

    def reference(temperature: float, seed: int) -> list[int]:
        generator, new = torch.Generator().manual_seed(seed), []
        for _ in range(20):
            logits = forward_logits(model, {"input_ids": torch.tensor([prompt + new])})[0, -1].float()
            for token in set(prompt) | set(new):
                logits[token] = logits[token] / rep if logits[token] > 0 else logits[token] * rep
            for token in set(new):
                logits[token] -= freq * new.count(token) + presence
            new.append(int(sample_next_token(logits[None], SamplingParams(temperature), generator)))
        return new

    for (temperature, seed), ahead in itertools.product(((0.0, 0), (1.0, 5)), (1, 8)):  # 8: a GPU's runs of steps
        engine = Engine(model)
        engine.ahead = ahead
        params, generator = SamplingParams(temperature, **penalties), torch.Generator().manual_seed(seed)
        [drawn] = engine.generate(prompt, 1, 20, params, generator)
        assert drawn.tokens == reference(temperature, seed), (temperature, ahead, penalties)
    assert Engine(model).generate(prompt, 1, 20, GREEDY)[0].tokens != reference(0.0, 0)  # they change the draws


def test_sample_takes_min_p_top_k_and_a_repetition_penalty(tiny_runs):
    """`tierlm sample --min-p 1` (or `--top-k 1`) keeps the likeliest token alone: what greedy decoding prints."""
    from conftest import run_main

    args = ["sample", "--checkpoint", str(tiny_runs / "sft"), "--prompt", "What is 2 + 3?", "--max-new-tokens", "12"]
    greedy = run_main(*args, "--temperature", "0")
    assert greedy.returncode == 0 and greedy.stdout.strip(), greedy.stderr[-2000:]
    for extra in (["--min-p", "1"], ["--top-k", "1"]):
        hot = run_main(*args, "--temperature", "1.5", "--seed", "4", *extra)
        assert hot.returncode == 0 and hot.stdout == greedy.stdout, hot.stderr[-2000:]
    free = [run_main(*args, "--temperature", "1.5", "--seed", str(seed)).stdout for seed in range(4)]
    assert any(out != greedy.stdout for out in free)  # unfiltered, that temperature strays
    penalised = run_main(*args, "--temperature", "0", "--repetition-penalty", "2")
    assert penalised.returncode == 0 and penalised.stdout != greedy.stdout, penalised.stderr[-2000:]


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(1.0, None, None, 0.1), (0.7, None, 0.9, None), (1.3, 20, 0.8, 0.05), (0.5, 5, None, 0.2), (1.0, 3, 0.95, 0.5)],
)
def test_the_sampling_filters_are_transformers_own_warpers(temperature, top_k, top_p, min_p):
    """Temperature, top-k, top-p, min-p, in transformers' order (`GenerationMixin._get_logits_processor`): the same
    tokens dropped and the same logits kept."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = 3 * torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    for on, warper in ((top_k, TopKLogitsWarper), (top_p, TopPLogitsWarper), (min_p, MinPLogitsWarper)):
        expected = warper(on)(None, expected) if on is not None else expected
    got = SamplingParams(temperature, top_k, top_p, min_p).filter(logits)
    kept = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(got), kept) and 0 < int(kept.sum()) < kept.numel()
    torch.testing.assert_close(got[kept], expected[kept])


def test_min_p_reaches_the_engine_and_every_token_it_draws_passes_it(tiny_gpt_config, tiny_tokenizer):
    """`rl.min_p` as the RL sampler hands it to the engine (an evaluation's temperature in place of the step's),
    and each token the engine draws under it at least min_p times as likely as the step's likeliest token."""
    from dataclasses import replace

    from tierlm.loops.sampling import RolloutSampler

    model = _models(replace(tiny_gpt_config, vocab_size=tiny_tokenizer.vocab_size, max_seq_len=256))["native"]
    engine = Engine(model, tiny_tokenizer.stop_ids, tiny_tokenizer)
    asked = []
    generate_many = engine.generate_many
    engine.generate_many = lambda requests, budget, params: (
        asked.append(params) or generate_many(requests, budget, params)
    )
    rl = RLConfig(max_new_tokens=8, temperature=1.3, top_k=40, min_p=0.2)
    task = open_task("synthetic:arithmetic", "val", 2, seed=0)
    sampler = RolloutSampler(engine, tiny_tokenizer, rl)
    sampler.groups(task, [0, 1], [torch.Generator().manual_seed(i) for i in range(2)], 2, rl.temperature)
    sampler.groups(task, [0], [torch.Generator().manual_seed(0)], 1, 0.0)
    assert asked == [SamplingParams(1.3, 40, None, 0.2), SamplingParams(0.0, 40, None, 0.2)]

    prompt, params = [3, 14, 15], SamplingParams(1.0, min_p=0.3)
    for completion in engine.generate(prompt, 6, 20, params, torch.Generator().manual_seed(1)):
        ids = torch.tensor([prompt + completion.tokens])
        probs = forward_logits(model, {"input_ids": ids}).float().softmax(-1)[0, len(prompt) - 1 : -1]
        drawn = probs.gather(1, torch.tensor(completion.tokens)[:, None]).squeeze(1)
        assert (drawn >= 0.3 * probs.max(dim=-1).values - 1e-6).all()
    unfiltered = engine.generate(prompt, 6, 20, SamplingParams(1.0), torch.Generator().manual_seed(1))
    assert any(  # the filter bites: without it some draws fall below the bar
        float(p) < 0.3 * float(m) for c in unfiltered for p, m in zip(*_drawn_and_max(model, prompt, c.tokens))
    )


def _drawn_and_max(model, prompt, tokens):
    probs = forward_logits(model, {"input_ids": torch.tensor([prompt + tokens])}).float().softmax(-1)
    probs = probs[0, len(prompt) - 1 : -1]
    return probs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1), probs.max(dim=-1).values


def test_ppo_step_with_kl_reference_runs_its_inner_epochs(tiny_tokenizer, tmp_path):

    from tierlm.backends import FrozenReference
    from tierlm.builders.tasks import open_task
    from tierlm.config import RLConfig, TrainingConfig
    from tierlm.loops.rl import RLTrainer
    from tierlm.models import GPTConfig
    from tierlm.strategies.rl import PPOStrategy

    tok = tiny_tokenizer
    torch.manual_seed(0)
    model = build_gpt(GPTConfig(depth=1, aspect_ratio=32, head_dim=16, vocab_size=tok.vocab_size, max_seq_len=64))
    reference = FrozenReference(copy.deepcopy(model), "cpu")
    backend = PyTorchTrainingBackend(model, torch.optim.AdamW(model.parameters(), lr=1e-2), None, tmp_path, "cpu")
    rl = RLConfig(algorithm="ppo", group_size=2, prompts_per_step=2, max_new_tokens=4, ppo_epochs=3, kl_coef=0.1)
    trainer = RLTrainer(
        backend,
        PPOStrategy(kl_coef=0.1, clip_range=0.2),
        Engine(model, tok.stop_ids, tok),
        tok,
        open_task("synthetic:arithmetic", "train", 50, 0),
        open_task("synthetic:arithmetic", "val", 10, 0),
        rl,
        TrainingConfig(),
        reference=reference,
    )
    first = trainer.train_step()
    assert backend.step == 3  # one optimizer step per inner epoch
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # before any update the policy is the reference
    trainer.state.step += 1
    second = trainer.train_step()
    assert backend.step == 6 and second["kl"] > 0 and math.isfinite(second["loss"])
    assert second["logprob_abs_diff"] < 1e-4


def test_gae_against_the_textbook_recursion():
    """GAE over each row's trained tokens equals the plain recursion on those tokens alone (untrained
    positions in between are skipped), for gamma < 1 and lambda < 1; returns are advantages + values."""
    from tierlm.strategies.rl import generalized_advantages

    g = torch.Generator().manual_seed(0)
    values = torch.randn(3, 9, generator=g)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0, 0, 0, 1]])
    rewards = torch.tensor([1.0, 0.0, -0.5])
    gamma, lam = 0.9, 0.8
    adv, ret = generalized_advantages(rewards, values, mask, gamma, lam)
    for row in range(3):
        idx = mask[row].nonzero().squeeze(1)
        v = values[row, idx].tolist()
        n = len(v)
        r = [0.0] * (n - 1) + [float(rewards[row])]
        deltas = [r[t] + gamma * (v[t + 1] if t + 1 < n else 0.0) - v[t] for t in range(n)]
        want = [sum((gamma * lam) ** k * deltas[t + k] for k in range(n - t)) for t in range(n)]
        torch.testing.assert_close(adv[row, idx], torch.tensor(want), atol=1e-6, rtol=0)
        torch.testing.assert_close(ret[row, idx], torch.tensor(want) + values[row, idx], atol=1e-6, rtol=0)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_clipped_value_loss_takes_the_worse_of_clipped_and_unclipped():
    from tierlm.strategies.rl import clipped_value_loss

    old, ret, mask = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, -1.0]]), torch.tensor([[1, 1]])
    values = torch.tensor([[0.5, 0.5]])  # moved 0.5 from old; clip 0.2 keeps 0.2
    total, count = clipped_value_loss(values, old, ret, mask, 0.2)
    # token 0: unclipped (0.5-1)^2 = 0.25, clipped (0.2-1)^2 = 0.64 -> 0.64; token 1: (1.5)^2 = 2.25 vs (1.2)^2 = 1.44
    # -> 2.25
    assert total.item() == pytest.approx(0.5 * (0.64 + 2.25)) and count.item() == 2
    assert clipped_value_loss(values, old, ret, mask, None)[0].item() == pytest.approx(0.5 * (0.25 + 2.25))


def test_the_value_model_is_the_policy_with_a_zero_value_head(tiny_gpt_config):
    from tierlm.loops.critic import value_model
    from tierlm.models import GPTConfig

    for tied in (False, True):
        policy = build_gpt(GPTConfig(**{**tiny_gpt_config.to_dict(), "tie_embeddings": tied}))
        critic = value_model(policy)
        ids = torch.randint(0, 97, (2, 5))
        assert critic(ids).shape == (2, 5, 1) and (critic(ids) == 0).all()
        assert policy(ids).shape == (2, 5, 97) and policy.lm_head.weight.shape == (
            97,
            policy.config.n_embd,
        )  # the policy untouched


def _tiny_rl(tiny_runs) -> list[str]:
    """`tierlm rl` from the shared tiny SFT run: 2 prompts a step, checkpoints every 2 steps, a small pass@k."""
    return [
        "rl",
        "--config",
        "tiny_rl",
        f"model.model_name_or_path={tiny_runs / 'sft'}",
        "rl.prompts_per_step=2",
        "rl.eval_problems=4",
        "rl.eval_k=2",
        "training.save_steps=2",
        "training.eval_steps=0",
        "training.logging_steps=1",
        "infra.device_type=cpu",
        "data.num_synthetic_examples=200",
        "data.num_synthetic_eval_examples=16",
    ]


@pytest.mark.slow
def test_ppo_with_a_critic_trains_saves_and_resumes_exactly(tiny_runs, tmp_path):
    """`tierlm rl` with rl.algorithm=ppo rl.critic=true: the value loss is logged, the critic's checkpoints
    sit beside the policy's, and a run resumed from step 2 ends where the straight run does (policy
    losses and value losses)."""
    import json

    from conftest import resume_from_checkpoint, run_main

    args = [
        *_tiny_rl(tiny_runs),
        "rl.algorithm=ppo",
        "rl.critic=true",
        "rl.ppo_epochs=2",
        "rl.group_size=2",
        "rl.max_new_tokens=6",
        "training.num_train_steps=4",
        "rl.log_rollouts=2",
        "training.logging_steps=1",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for out in (straight, resumed):
        result = run_main(*args, f"infra.output_dir={out}")
        assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (straight / "critic_checkpoints").glob("step_*")) == ["step_2", "step_4"]
    resume_from_checkpoint(args, resumed, 2)

    def lines(run):
        return [
            (r["step"], r["loss"], r["value_loss"])
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["type"] == "train"
        ]

    assert all(math.isfinite(v) for _, _, v in lines(straight))
    assert lines(resumed)[-2:] == lines(straight)[-2:]
    rollouts = [[r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "rollout"]
                for run in (straight, resumed)]  # fmt: skip
    assert [(r["step"], r["index"]) for r in rollouts[1]] == [(s, i) for s in (1, 2, 3, 4) for i in (0, 1)]
    assert rollouts[1] == rollouts[0] and all(math.isfinite(r["advantage"]) for r in rollouts[0])  # the critic's


def test_importance_weights_scale_each_tokens_policy_gradient_term():
    """policy_gradient_loss with `importance`: each token's clipped surrogate times its weight (the KL term not),
    against the formula written out here."""
    torch.manual_seed(0)
    logprobs, old = torch.randn(2, 5, requires_grad=True), torch.randn(2, 5)
    ref, weights = torch.randn(2, 5), torch.rand(2, 5) * 2
    mask, adv = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]]), torch.tensor([0.5, -1.0])
    total, count, _ = policy_gradient_loss(logprobs, adv, mask, old, 0.2, ref, 0.1, weights)
    ratio = (logprobs - old).exp()
    a = adv[:, None]
    surrogate = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
    expected = ((surrogate * weights + 0.1 * kl_penalty(logprobs, ref)) * mask).sum()
    assert count == mask.sum() and torch.allclose(total, expected, atol=1e-6)


@pytest.mark.slow
def test_off_policy_rl_resumes_after_a_kill_with_the_straight_runs_weights(tiny_runs, tmp_path, monkeypatch):
    """rl.max_off_policy_steps=1: step n trains on rollouts sampled in the background with the weights of step
    n - 1 (staleness and importance weights logged). Killed at its step-2 checkpoint with the next batch in
    flight and resumed, the run ends with the uninterrupted run's weights bit for bit (the pending rollouts are
    in the checkpoint); and an asynchronous run is deterministic whatever the threads' timing. (A reward for
    digits, so that the steps move the weights.)"""
    from safetensors.torch import load_file

    from conftest import digits_reward, kill_at_checkpoint, run_main

    args = [
        *_tiny_rl(tiny_runs),
        digits_reward(tmp_path, monkeypatch),
        "rl.algorithm=grpo",
        "rl.max_off_policy_steps=1",
        "rl.group_size=4",
        "rl.max_new_tokens=8",
        "training.num_train_steps=5",
    ]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    result = run_main(*args, f"infra.output_dir={straight}")
    assert result.returncode == 0, result.stderr[-3000:]
    train = [r for r in map(json.loads, (straight / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert [r["weight_version"] for r in train] == [0, 0, 1, 2, 3] and [r["staleness"] for r in train] == [
        0,
        1,
        1,
        1,
        1,
    ]
    assert all(0 < r["importance_mean"] <= 2.0 for r in train) and train[0]["logprob_abs_diff"] < 1e-4
    assert any(r["grad_norm"] > 0 for r in train[2:])  # the steps after the checkpoint move the weights
    state = json.loads((straight / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert list(state["pending_rollouts"][0]) == ["2"]  # step 2's batch, sampled with the weights of step 1

    kill_at_checkpoint(args, killed, 2)
    result = run_main(*args, f"infra.output_dir={killed}", "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = (load_file(run / "model" / "model.safetensors") for run in (straight, killed))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_vllm_refuses_a_model_without_a_transformers_twin(tmp_path, tiny_tokenizer):
    """The GPT-2 research variants (here RA) have no transformers class, so vLLM cannot load them: one clear
    refusal before vLLM is even imported, nothing written."""
    from tierlm.builders.engine import EngineSettings, build_engine
    from tierlm.config import EngineConfig
    from tierlm.errors import ConfigError
    from tierlm.models.gpt2 import GPT2Config
    from tierlm.models.registry import family_named

    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=32, ra_r=4)
    model = family_named("gpt2").build_from_config(config)
    with pytest.raises(ConfigError, match="engine.kind=vllm loads the policy as a transformers model, but .*native"):
        build_engine(
            EngineSettings.from_section(EngineConfig(kind="vllm")), model, tiny_tokenizer, tmp_path / "sampler"
        )
    assert not (tmp_path / "sampler").exists()


def test_check_parity_reports_the_gap_and_writes_nothing(tiny_runs, tmp_path):
    """`tierlm rl --check-parity`: step 0's rollouts through the sampler and the trainer; the native engine's
    float32 log-probs match the trainer's to rounding, and no run directory is made."""
    from conftest import RL, run_main

    out = tmp_path / "never"
    done = run_main(
        "rl", "--config", "configs/tiny_rl.yaml", *RL, f"model.model_name_or_path={tiny_runs / 'sft'}",
        f"infra.output_dir={out}", "--check-parity",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("parity ok: the sampler's log-probs are "), line
    gap = float(line.split("are ")[1].split(" per token")[0])
    assert gap < 1e-5, line
    assert not out.exists()


@pytest.mark.parametrize("loss", ["dapo", "grpo"])
def test_mask_truncated_trains_the_finished_completions_alone(tiny_gpt_config, loss):
    """rl.mask_truncated (DAPO's overlong filtering): a completion cut before its end carries no loss and counts in
    no normaliser, so the step's loss is that of the finished completions alone, with the advantages their group
    gave them (the cut one's reward still in its baseline)."""
    from tierlm.config import RLConfig
    from tierlm.rollout.engine import Completion
    from tierlm.strategies.rl import policy_gradient_strategy
    from tierlm.strategies.rl_losses import resolve_rl

    model = _models(tiny_gpt_config)["native"]
    completions = [
        Completion(tokens=[9, 10, 3], logprobs=[-1.0] * 3, mask=[1, 1, 1], finished=True),
        Completion(tokens=[11, 12, 13, 14], logprobs=[-1.0] * 4, mask=[1, 1, 1, 1], finished=False),
        Completion(tokens=[15, 3], logprobs=[-1.0] * 2, mask=[1, 1], finished=True),
    ]
    rollouts = [Rollout([5, 6, 7], c, 0.0, "") for c in completions]
    advantages = torch.tensor([1.0, -0.5, -0.5])
    strategy = policy_gradient_strategy(resolve_rl(RLConfig(loss=loss, max_new_tokens=4)))

    def loss_of(batch):
        with torch.no_grad():
            total, count = strategy.compute_loss(forward_logits(model, batch), batch)
        return float(total / count)

    masked = rollout_batch(rollouts, advantages, 0, mask_truncated=True)
    assert (masked["labels"][1] == IGNORE_INDEX).all() and (masked["labels"][0] != IGNORE_INDEX).sum() == 3
    kept = [0, 2]
    alone = rollout_batch([rollouts[i] for i in kept], advantages[kept], 0)
    assert loss_of(masked) == pytest.approx(loss_of(alone), rel=1e-6)
    assert loss_of(rollout_batch(rollouts, advantages, 0)) != pytest.approx(loss_of(alone), rel=1e-3)


def test_the_rl_loop_masks_truncated_completions_when_asked(tiny_runs, tmp_path, monkeypatch):
    """Completions cut at rl.max_new_tokens=2, rewarded by their text's length (so that a group's advantages
    differ): with rl.mask_truncated a step whose completions were all cut trains nothing (gradient 0), without it
    the same step (the same seeded rollouts) trains them."""
    (tmp_path / "by_length.py").write_text("def reward(prompt, completion, reference):\n    return len(completion)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from conftest import REPO, RL
    from tierlm.config import TierlmConfig
    from tierlm.stages import run_stage

    def steps(name, *extra):
        overrides = [*RL, f"model.model_name_or_path={tiny_runs / 'sft'}", "rl.max_new_tokens=2"]
        overrides += ["rl.reward=by_length:reward", "training.logging_steps=1", f"infra.output_dir={tmp_path / name}"]
        run_stage(TierlmConfig.load(REPO / "configs/tiny_rl.yaml", [*overrides, *extra]), "rl")
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [(r["finished_frac"], r["grad_norm"]) for r in records if r["type"] == "train"]

    masked, trained = steps("masked", "rl.mask_truncated=true"), steps("trained")
    all_cut = [i for i, (finished, _) in enumerate(masked) if finished == 0]
    assert all_cut and all(masked[i][1] == 0 and trained[i][1] > 0 for i in all_cut)


@pytest.mark.slow
def test_a_kl_reference_that_follows_the_policy_is_trls_mix_and_resumes_exactly(tiny_runs, tmp_path, monkeypatch):
    """rl.reference_sync_steps=1 with alpha 0.5 under a KL penalty: each step's checkpoint carries TRL's own mix
    (`SyncRefModelCallback._sync_target_model`) of that step's policy into the reference before it; rolled back to
    step 2 (two mixes in) and resumed, the run ends with the straight run's weights, KL and reference. (A reward for
    digits: with the task's own the tiny model earns 0, no step moves the weights, and no mix moves the reference.)"""
    import json

    from safetensors.torch import load_file
    from trl.trainer.callbacks import SyncRefModelCallback

    from conftest import digits_reward, resume_from_checkpoint, run_main
    from tierlm.models import load_pretrained_model

    out, reward = tmp_path / "synced", digits_reward(tmp_path, monkeypatch)
    args = [*_tiny_rl(tiny_runs), reward, "rl.kl_coef=0.5", "rl.reference_sync_steps=1", "rl.reference_mixup_alpha=0.5"]
    args += ["rl.group_size=2", "rl.max_new_tokens=6", "training.num_train_steps=3", "training.save_steps=1"]
    result = run_main(*args, f"infra.output_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    reference = load_pretrained_model(tiny_runs / "sft" / "model")
    for step in (1, 2, 3):
        folder = out / "checkpoints" / f"step_{step}"
        SyncRefModelCallback._sync_target_model(load_pretrained_model(folder / "model"), reference, 0.5)
        saved = load_file(folder / "reference.safetensors")
        for name, p in reference.named_parameters():
            torch.testing.assert_close(saved[name], p.detach(), rtol=0, atol=1e-7)
    moved = load_file(out / "checkpoints" / "step_3" / "reference.safetensors")
    start = dict(load_pretrained_model(tiny_runs / "sft" / "model").named_parameters())
    assert any(not torch.equal(moved[k], start[k]) for k in moved)  # it followed the policy

    def lines(run):
        records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        return [(r["step"], r["loss"], r["kl"]) for r in records if r["type"] == "train"]

    straight, weights = lines(out), load_file(out / "model" / "model.safetensors")
    assert any(kl != 0 for *_, kl in straight[1:])  # the penalty is in play
    resume_from_checkpoint(args, out, 2, in_process=True)
    assert lines(out)[-1] == straight[-1]
    resumed = load_file(out / "model" / "model.safetensors")
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)
    again = load_file(out / "checkpoints" / "step_3" / "reference.safetensors")
    assert all(torch.equal(moved[k], again[k]) for k in moved)


def test_reward_terms_are_added_to_the_task_reward_and_logged_apart(tiny_runs, tmp_path, monkeypatch):
    """rl.reward_terms (TRL's reward_funcs with reward_weights): a built-in reward and the user's function, each
    called with (prompt, answer, reference) and weighed, added to the task's (weighed by rl.task_reward_weight, 0
    here); each term's mean is logged apart and the step's reward is their weighted sum, while pass@k still counts
    the task's own answers."""
    (tmp_path / "shaping.py").write_text(
        "SEEN = []\n\ndef bonus(prompt, completion, reference):\n    SEEN.append((prompt, completion, reference))\n"
        "    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from conftest import REPO, RL
    from tierlm.config import TierlmConfig
    from tierlm.stages import run_stage

    overrides = [*RL, f"model.model_name_or_path={tiny_runs / 'sft'}", "training.logging_steps=1",
                 "rl.task_reward_weight=0", "rl.reward_terms={number: 1.0, 'shaping:bonus': 0.5}",
                 f"infra.output_dir={tmp_path / 'run'}"]  # fmt: skip
    config = TierlmConfig.load(REPO / "configs/tiny_rl.yaml", overrides)
    assert config.rl.reward_terms == {"number": 1.0, "shaping:bonus": 0.5}
    run_stage(config, "rl")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    assert train and all(r["reward_shaping.bonus"] == 1.0 for r in train)
    for r in train:
        assert r["reward_mean"] == pytest.approx(r["reward_number"] + 0.5, abs=1e-9)
    import shaping

    prompts = {prompt for prompt, _, _ in shaping.SEEN}
    assert len(shaping.SEEN) >= 2 * 2 * len(train) and all(isinstance(p, str) and p for p in prompts)
    assert any(r.get("pass@1") is not None for r in records)
    import importlib
    import sys

    from conftest import run_main

    (tmp_path / "shaping.py").unlink()  # `tierlm eval` of the run counts the task's answers: the terms need not import
    monkeypatch.delitem(sys.modules, "shaping")
    importlib.invalidate_caches()
    result = run_main("eval", "--checkpoint", tmp_path / "run")
    assert result.returncode == 0 and "pass@1" in result.stdout, result.stderr


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rl.reward_terms={formats: 1.0}"], "rl.reward_terms names 'formats'"),
        (["rl.reward_terms={'no_such_module:f': 1.0}"], "rl.reward_terms no_such_module:f: cannot import"),
        (["rl.task_reward_weight=0.5"], "rl.task_reward_weight weighs the task's reward"),
        (["data.dataset_name=synthetic:arithmetic_chain", "rl.reward_terms={number: 1.0}"], "is an environment"),
    ],
)
def test_reward_terms_refused_in_one_line(tiny_runs, overrides, message):
    from conftest import REPO, RL, run_main

    args = ["rl", "--config", REPO / "configs/tiny_rl.yaml", *RL, f"model.model_name_or_path={tiny_runs / 'sft'}"]
    result = run_main(*args, *overrides)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_gdpo_takes_the_same_rollouts_to_other_advantages(tiny_runs, tmp_path, monkeypatch):
    """rl.reward_aggregation=normalize_then_sum with a task reward and a bonus of small spread: step 1's rollouts and
    rewards are the plain sum's (with the step's std as GDPO's), its update is not (GDPO gives the bonus its own
    group scale)."""
    (tmp_path / "spread.py").write_text("def short(prompt, completion, reference):\n    return -len(completion) / 99\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from conftest import REPO, RL
    from tierlm.config import TierlmConfig
    from tierlm.stages import run_stage

    def first_step(name, *extra):
        overrides = [*RL, f"model.model_name_or_path={tiny_runs / 'sft'}", "training.num_train_steps=1",
                     "rl.reward_terms={'spread:short': 0.5}", f"infra.output_dir={tmp_path / name}"]  # fmt: skip
        overrides += extra
        run_stage(TierlmConfig.load(REPO / "configs/tiny_rl.yaml", overrides), "rl")
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return next(r for r in records if r["type"] == "train")

    plain = first_step("sum", "rl.normalize_std=batch")  # GDPO's sum is divided by the step's std too
    gdpo = first_step("gdpo", "rl.reward_aggregation=normalize_then_sum")
    assert plain["reward_mean"] == gdpo["reward_mean"] and plain["reward_spread.short"] == gdpo["reward_spread.short"]
    assert plain["grad_norm"] != pytest.approx(gdpo["grad_norm"], rel=1e-3)


def test_adaptive_entropy_control_follows_skywork_or1s_rule_and_resumes_exactly(tiny_runs, tmp_path, monkeypatch):
    """rl.entropy_target (TRL's use_adaptive_entropy): no bonus in the first step; after each step the coefficient
    moves by rl.entropy_coef_delta, up while the step's entropy (entropy_mean, every rank's trained tokens) is at or
    below the target, down above it, within min..max; the next step applies it only after a step at or below the
    target. Rolled back to step 2 and resumed, the run ends with the straight run's coefficient and weights."""
    from conftest import digits_reward, resume_from_checkpoint, run_main
    from tierlm.models import load_pretrained_model

    reward = digits_reward(tmp_path, monkeypatch)
    args = [*_tiny_rl(tiny_runs), reward, "rl.group_size=2", "rl.max_new_tokens=6", "training.num_train_steps=4",
            "rl.entropy_coef=0.01", "rl.entropy_coef_delta=0.02", "rl.entropy_coef_max=0.04"]  # fmt: skip

    def train_lines(out):
        return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]

    for target in (100.0, 1e-3):  # every step at or below the target, then every step above it
        out = tmp_path / f"target_{target}"
        result = run_main(*args, f"rl.entropy_target={target}", f"infra.output_dir={out}")
        assert result.returncode == 0, result.stderr[-3000:]
        lines = train_lines(out)
        coef, last = 0.01, math.inf
        for line in lines:
            assert line["entropy_coef"] == pytest.approx(coef if last <= target else 0.0)
            last = line["entropy_mean"]
            coef = min(coef + 0.02, 0.04) if last <= target else max(coef - 0.02, 0.0)
            assert line["entropy_coef_next"] == pytest.approx(coef)
        assert [line["entropy_coef"] for line in lines] == (
            pytest.approx([0.0, 0.03, 0.04, 0.04]) if target > 1 else [0.0] * 4
        )
    straight = tmp_path / "target_100.0"
    resumed = tmp_path / "resumed"
    result = run_main(*args, "rl.entropy_target=100", f"infra.output_dir={resumed}")
    assert result.returncode == 0, result.stderr[-3000:]
    resume_from_checkpoint(args + ["rl.entropy_target=100"], resumed, 2, in_process=True)
    assert train_lines(resumed)[-1]["entropy_coef"] == train_lines(straight)[-1]["entropy_coef"]
    a, b = (load_pretrained_model(folder / "model").state_dict() for folder in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    never = load_pretrained_model(tmp_path / "target_0.001" / "model").state_dict()  # no bonus in any step
    assert not all(torch.equal(a[k], never[k]) for k in a)  # the applied bonus trained


def test_mini_batches_deal_each_pass_into_optimizer_steps():
    """rl.mini_batches (TRL's steps_per_generation): each pass over the step's rows (rl.ppo_epochs of them) is that
    many optimizer steps, share k holding rows i with i mod rl.mini_batches = k in micro-batches of
    rl.micro_batch_size rows; every row trains once a pass, and the scoring's merged values land at their rows."""
    from tierlm.loops.policy_update import PolicyUpdate, merged

    class Recorder:  # the backend's protocol, recording which rows each forward-backward and step saw
        def __init__(self):
            self.calls = []

        def forward_backward(self, batch, fn):
            self.calls.append(sorted(int(a) for a in batch["advantages"]))

        def optim_step(self):
            self.calls.append("step")
            return type("Done", (), {"wait": lambda self: {"loss": 0.0, "lr": 0.0, "grad_norm": 0.0, "skipped": 0}})()

    rl = resolve_rl(RLConfig(loss="grpo", mini_batches=2, ppo_epochs=2, micro_batch_size=2))
    labels = torch.full((8, 6), IGNORE_INDEX)
    for row, width in enumerate([6, 2, 5, 3, 6, 4, 2, 5]):
        labels[row, width - 1] = 1
    batch = {"input_ids": torch.zeros(8, 6, dtype=torch.long), "labels": labels, "advantages": torch.arange(8.0)}
    backend = Recorder()
    update = PolicyUpdate(backend, policy_gradient_strategy(rl), rl, sum_over_ranks=lambda sums: sums)
    micro = update.micro_batches(batch)
    assert [mb.share for mb in micro] == [0, 0, 1, 1]
    for mb in micro:
        mb["old_logprobs"] = mb["advantages"][:, None].expand(-1, mb["labels"].shape[1])
    torch.testing.assert_close(merged(micro, "old_logprobs", labels.shape)[:, 0], torch.arange(8.0))
    update.apply(micro)
    steps, rows = [], []
    for call in backend.calls:  # the rows between one optimizer step and the next
        if call == "step":
            steps.append(sorted(rows))
            rows = []
        else:
            rows += call
    assert steps == [[0, 2, 4, 6], [1, 3, 5, 7]] * 2 and not rows  # 2 passes x 2 shares, each row once a pass


def test_dropout_is_off_in_the_stages_that_score_the_model_they_train(tiny_tokenizer):
    """training.disable_dropout resolves to TRL's defaults (on for dpo, rm and rl, off for pretrain and sft; a value
    given is kept) and the built model then trains with the function that scores it: the GPT-2 family's dropout
    (embeddings, the attention kernel's, residual branches) gives the same logits in training and evaluation mode."""
    from tierlm.builders.model import build_model
    from tierlm.builders.stage import resolve_config
    from tierlm.config import TierlmConfig
    from tierlm.stages import STAGES

    model = {"architecture": "gpt2", "depth": 1, "aspect_ratio": 32, "head_dim": 16, "dropout": 0.2}
    config = TierlmConfig.from_dict({"model": model, "rl": {"max_new_tokens": 8}})
    resolved = {name: resolve_config(config, STAGES[name], launched=False) for name in STAGES}
    assert {name: c.training.disable_dropout for name, c in resolved.items()} == {
        "pretrain": False, "sft": False, "dpo": True, "rm": True, "rl": True,
    }  # fmt: skip
    kept = config.model_copy(update={"training": config.training.model_copy(update={"disable_dropout": False})})
    assert resolve_config(kept, STAGES["rl"], launched=False).training.disable_dropout is False
    ids = torch.randint(0, tiny_tokenizer.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    for name, same in (("rl", True), ("dpo", True), ("sft", False)):
        torch.manual_seed(0)
        built = build_model(resolved[name], tiny_tokenizer, torch.device("cpu"), None)
        with torch.no_grad():
            trained, scored = built.train()(ids), built.eval()(ids)
        assert torch.equal(trained, scored) is same, name
    from transformers import GPT2Config, GPT2LMHeadModel

    from tierlm.models.dropout import disable_dropout

    hub_like = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=300, attn_implementation="sdpa"))
    assert disable_dropout(hub_like) == 4  # GPT-2's configs keep 0.1: embeddings, attention, residual, MLP
    with torch.no_grad():
        assert torch.equal(hub_like.train()(ids).logits, hub_like.eval()(ids).logits)


def test_kl_in_reward_makes_the_advantages_as_trls_rloo_does(tiny_gpt_config):
    """rl.kl_in_reward with rl.loss=rloo and rl.kl_estimator=k1 (TRL's RLOOTrainer): after scoring, each row's
    advantage is its reward less beta x its summed log-ratio to the reference, against the leave-one-out mean of
    its group's others, TRL's formula written out on the policy's and reference's own log-probs; the loss itself
    then carries no KL term. Without rl.kl_in_reward scoring leaves the advantages as they were."""
    from tierlm.loops.policy_update import PolicyUpdate
    from tierlm.strategies.rl_losses import loss_settings

    class Scorer:  # the backend protocol's forward, on a model of its own
        def __init__(self, seed):
            torch.manual_seed(seed)
            self.model = build_gpt(tiny_gpt_config).eval()

        def forward(self, batch, fn):
            with torch.no_grad():
                out = fn(forward_logits(self.model, batch), batch)
            return SimpleNamespace(wait=lambda: out)

    g, beta = torch.Generator().manual_seed(0), 0.3
    labels = torch.randint(0, 97, (6, 7), generator=g)
    labels[:, :3] = IGNORE_INDEX  # the prompts
    labels[1, 5:] = labels[4, 4:] = IGNORE_INDEX  # shorter completions
    batch = {"input_ids": torch.randint(0, 97, (6, 7), generator=g), "labels": labels, "advantages": torch.zeros(6)}
    batch["sampler_logprobs"] = torch.zeros(6, 7)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    policy, reference = Scorer(1), Scorer(2)

    def advantages(**settings):
        rl = resolve_rl(RLConfig(loss="rloo", group_size=3, kl_coef=beta, micro_batch_size=4, **settings))
        update = PolicyUpdate(policy, policy_gradient_strategy(rl), rl, lambda sums: sums, reference=reference)
        micro = update.micro_batches({k: v.clone() for k, v in batch.items()})
        _, figures = update.score(micro, batch, rewards, staleness=0)
        rows = torch.zeros(6)
        for mb in micro:
            rows[mb.rows] = mb["advantages"]
        return rows, figures, loss_settings(rl).kl_coef

    ours, figures, loss_kl = advantages(kl_in_reward=True, kl_estimator="k1")
    mask = labels != IGNORE_INDEX
    with torch.no_grad():
        old = torch.log_softmax(forward_logits(policy.model, batch).float(), -1)
        ref = torch.log_softmax(forward_logits(reference.model, batch).float(), -1)
    picked = lambda logp: logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]  # noqa: E731
    kl = ((picked(old) - picked(ref)) * mask).sum(-1)  # TRL's RLOO: k1 summed over the completion
    grouped = (rewards - beta * kl).view(-1, 3)
    baselines = (grouped.sum(1, keepdim=True) - grouped) / 2
    torch.testing.assert_close(ours, (grouped - baselines).view(-1), rtol=1e-5, atol=1e-6)
    assert figures["kl_reward"] == pytest.approx(float(-beta * kl.mean()), rel=1e-5) and loss_kl == 0.0
    plain, figures, loss_kl = advantages()
    assert torch.equal(plain, torch.zeros(6)) and "kl_reward" not in figures and loss_kl == beta


def test_kl_in_reward_trains_and_is_refused_where_rows_leave_their_rank(tiny_runs, tmp_path, monkeypatch):
    """`tierlm rl` with TRL's RLOO settings (rl.kl_in_reward, k1) trains, its train lines carrying the KL reward
    beside the KL, and two DDP ranks (rl.balance_ranks=false) take its steps; with rl.balance_ranks, which would deal
    a group's rows to other ranks before its advantages are made again, it is refused in one line."""
    from conftest import digits_reward, run_main
    from forked import ranks
    from tierlm.builders.tasks import check_rl_sharing
    from tierlm.errors import ConfigError

    args = [*_tiny_rl(tiny_runs), digits_reward(tmp_path, monkeypatch), "rl.group_size=2", "rl.max_new_tokens=4"]
    args += ["rl.loss=rloo", "rl.kl_coef=0.1", "rl.kl_in_reward=true", "rl.kl_estimator=k1"]
    result = run_main(*args, "training.num_train_steps=2", f"infra.output_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["type"] == "train"]
    assert len(train) == 2 and all("kl_reward" in r and "kl" in r for r in train)
    two = ranks("-m", "tierlm", *args, "training.num_train_steps=2", "rl.balance_ranks=false",
                f"infra.output_dir={tmp_path / 'two'}")  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    for ours, one in zip([r for r in lines if r["type"] == "train"], train, strict=True):
        for key in ("loss", "kl", "kl_reward", "reward_mean"):
            assert ours[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), (key, ours[key], one[key])
    rl = RLConfig(loss="rloo", kl_coef=0.1, kl_in_reward=True, prompts_per_step=4)
    with pytest.raises(ConfigError, match="set rl.balance_ranks=false"):
        check_rl_sharing(rl, None, world=2)
    check_rl_sharing(rl.model_copy(update={"balance_ranks": False}), None, world=2)
    check_rl_sharing(rl, None, world=1)


def test_log_rollouts_writes_the_first_rollouts_of_each_logged_step(tiny_runs, tmp_path, monkeypatch):
    """rl.log_rollouts=3 (2 prompts x 2 samples a step): each logged step's first three rollouts as "rollout" lines of
    metrics.jsonl after its train line, the prompt and completion decoded, the reward the reward function gives the
    answer it read, and the advantage each trained on; with all four logged, those are GRPO's advantages of the
    logged rewards."""
    from conftest import digits_reward, run_main

    args = [*_tiny_rl(tiny_runs), digits_reward(tmp_path, monkeypatch), "rl.group_size=2", "rl.max_new_tokens=6"]
    args += ["rl.loss=grpo", "rl.log_rollouts=3", "training.logging_steps=1", "training.num_train_steps=2"]
    result = run_main(*args, f"infra.output_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kinds = [(r["type"], r["step"]) for r in lines if r["type"] in ("train", "rollout")]
    assert kinds == [("train", 1), *[("rollout", 1)] * 3, ("train", 2), *[("rollout", 2)] * 3]
    strategy = policy_gradient_strategy(resolve_rl(RLConfig(loss="grpo", group_size=2)))
    for step in (1, 2):
        rows = [r for r in lines if r["type"] == "rollout" and r["step"] == step]
        assert [r["index"] for r in rows] == [0, 1, 2] and all(r["prompt"].count("What is") == 1 for r in rows)
        assert all(r["reward"] == pytest.approx(0.25 * sum(c.isdigit() for c in r["answer"])) for r in rows)
        assert all(0 < r["completion_tokens"] <= 6 and r["weight_version"] == step - 1 for r in rows)
    result = run_main(*args, "rl.log_rollouts=4", f"infra.output_dir={tmp_path / 'all'}")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "all" / "metrics.jsonl").read_text().splitlines()]
    logged = [[r for r in lines if r["type"] == "rollout" and r["step"] == step] for step in (1, 2)]
    for rows in logged:
        expected = strategy.advantages(torch.tensor([r["reward"] for r in rows]), 2)
        assert [r["advantage"] for r in rows] == pytest.approx(expected.tolist(), abs=1e-6)
    assert any(r["advantage"] != 0 for rows in logged for r in rows)


def test_mini_batches_train_in_one_process_and_under_ddp(tiny_runs, tmp_path, monkeypatch):
    """`tierlm rl rl.mini_batches=2`: one process and two DDP ranks (each rank's share of the rows dealt in two, DDP
    synchronising on each optimizer step's last micro-batch) train; a share that does not divide the rows is one
    line, exit 2."""
    from conftest import digits_reward, run_main
    from forked import ranks

    args = [*_tiny_rl(tiny_runs), digits_reward(tmp_path, monkeypatch), "rl.prompts_per_step=4", "rl.group_size=2",
            "rl.max_new_tokens=4", "rl.micro_batch_size=2"]  # fmt: skip
    args += ["rl.mini_batches=2", "training.num_train_steps=2"]
    result = run_main(*args, f"infra.output_dir={tmp_path / 'one'}")
    assert result.returncode == 0, result.stderr[-3000:]
    two = ranks("-m", "tierlm", *args, f"infra.output_dir={tmp_path / 'two'}")
    assert two.returncode == 0, two.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["type"] == "train"] == [1, 2]
    refused = run_main(*args[:-2], "rl.mini_batches=3", f"infra.output_dir={tmp_path / 'three'}")
    assert refused.returncode == 2 and "make it a divisor of them" in refused.stderr, refused.stderr
    from conftest import REPO
    from tierlm.config import TierlmConfig
    from tierlm.plan.scaling import optimizer_schedule

    config = TierlmConfig.load(REPO / "configs/tiny_rl.yaml", [*args[4:], "rl.ppo_epochs=3"])
    schedule = optimizer_schedule(config, world_size=2)  # the LR schedule counts every optimizer step
    assert (schedule.num_train_steps, schedule.gradient_accumulation_steps) == (2 * 3 * 2, 1)  # 2 of 4 rows a share

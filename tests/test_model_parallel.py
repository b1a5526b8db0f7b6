"""Tensor and pipeline parallelism (issue 21) with real processes: ranks as torchrun starts them (forked from a
preloaded process, tests/forked.py), gloo on CPU, one thread per rank.

The reference is one process on the same global batches (tests/distributed_worker.py's "single" mode):
10 AdamW steps with clipping, two micro-batches of uneven trained tokens per step, a decaying LR.
"""

from __future__ import annotations

import json

import pytest
import torch
from tests.test_distributed import assert_same_steps, run_worker


def predicted_weight_bytes(world_size: int = 2, **sizes) -> float:
    """The fp32 weights `tierlm.plan.memory.layouts` expects one rank to hold, for the worker's model."""
    from tests.distributed_worker import CONFIG

    from tierlm.models import build_gpt
    from tierlm.plan.memory.layouts import ModelShape, layout_memory
    from tierlm.primitives.model_parallel import ParallelDims

    dims = ParallelDims.from_sizes(world_size, **sizes)
    return layout_memory(ModelShape.of(build_gpt(CONFIG)), dims, 2, 16).parts["weights, gradients, AdamW (fp32)"] / 4


def test_plan_prints_the_layouts_and_megatron_backend_needs_torchrun(capsys):
    from tierlm.backends import MegatronBackend
    from tierlm.commands.cli import main
    from tierlm.errors import ConfigError

    assert (
        main(
            [
                "plan",
                "--world-size",
                "4",
                "--layouts",
                "--vocab-size",
                "512",
                "model.depth=4",
                "model.aspect_ratio=32",
                "model.head_dim=32",
                "model.n_kv_head=2",
                "infra.device_type=cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "per-rank memory of 4 ranks" in out and "TP 2 x PP 2 x DP 1" in out and "TP 1 x PP 1 x DP 4" in out
    assert "TP 4 x" not in out  # 2 key/value heads do not split over 4 ranks
    with pytest.raises(ConfigError, match="torchrun"):
        MegatronBackend(tensor_parallel_size=2)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    return {
        **run_worker("single", out / "single.json", save_at=5, checkpoint_dir=out / "ckpt"),
        "step_5": out / "ckpt" / "step_5",
    }


def test_muon_under_pipeline_parallel_matches_one_process(tmp_path):
    """Muon (the hidden matrices) + AdamW (the rest) on 2 pipeline stages: each stage's matrices orthogonalised by
    the ranks of that stage (before, ranks of different stages exchanged different matrices) == 1 process, 10 steps.
    (Tensor 2 x pipeline 2 on 4 ranks and tensor 2 alone were run too: docs and the issue's note.)"""
    one = run_worker("single", tmp_path / "one.json", optimizer="muon", checkpoint_dir=tmp_path / "c1")
    both = run_worker("pp", tmp_path / "pp.json", optimizer="muon", checkpoint_dir=tmp_path / "c2")
    assert_same_steps(both["steps"], one["steps"], tol=1e-5)
    assert one["steps"][-1]["loss"] < one["steps"][0]["loss"]


def test_tensor_parallel_matches_one_process_and_splits_the_blocks(single, tmp_path):
    tp = run_worker("tp", tmp_path / "tp.json", save_at=5, checkpoint_dir=tmp_path / "ckpt")
    assert_same_steps(tp["steps"], single["steps"], tol=1e-4)
    # each rank holds half of every block's projections (the embeddings, the head and the norms stay whole):
    # what `tierlm plan --layouts` predicts for this layout (1%)
    assert tp["memory"]["param_bytes"] < 0.8 * single["memory"]["param_bytes"]
    assert tp["memory"]["param_bytes"] == pytest.approx(predicted_weight_bytes(tensor=2), rel=0.01)
    # a TP=2 checkpoint resumes in one process as if the run never stopped
    resumed = run_worker(
        "single",
        tmp_path / "resumed.json",
        steps="5:10",
        load=tmp_path / "ckpt" / "step_5",
        checkpoint_dir=tmp_path / "ckpt_single",
    )
    assert_same_steps(resumed["steps"], single["steps"][5:], tol=1e-4)


def trains_as_one_and_reshards(mode: str, single: dict, tmp_path, **options) -> dict:
    """`mode` matches one process over 10 steps; its step-5 checkpoint resumes in one process, and one process's
    step-5 checkpoint resumes in `mode`, both as if the run never stopped."""
    run = run_worker(mode, tmp_path / f"{mode}.json", save_at=5, checkpoint_dir=tmp_path / "ckpt", **options)
    assert_same_steps(run["steps"], single["steps"], tol=1e-4)
    resumed = run_worker(
        "single",
        tmp_path / "resumed.json",
        steps="5:10",
        load=tmp_path / "ckpt" / "step_5",
        checkpoint_dir=tmp_path / "ckpt_single",
        **options,
    )
    assert_same_steps(resumed["steps"], single["steps"][5:], tol=1e-4)
    back = run_worker(mode, tmp_path / "back.json", steps="5:10", load=single["step_5"], **options)
    assert_same_steps(back["steps"], single["steps"][5:], tol=1e-4)
    return run


def test_sequence_parallel_matches_one_process_and_checkpoints_reshard(single, tmp_path):
    """Tensor parallel 2 with the embedding and head split by vocabulary (97 rows: uneven), the cross-entropy on the
    split logits, and the norms and residual stream split by sequence: one process's steps; checkpoints both ways."""
    trains_as_one_and_reshards("tp_sp", single, tmp_path)


def test_one_process_checkpoint_resumes_tensor_parallel(single, tmp_path):
    resumed = run_worker("tp", tmp_path / "tp.json", steps="5:10", load=single["step_5"])
    assert_same_steps(resumed["steps"], single["steps"][5:], tol=1e-4)


def test_tensor_parallel_times_fsdp_on_four_ranks_matches_one_process(single, tmp_path):
    both = run_worker("tp_dp", tmp_path / "tp_dp.json", nproc=4)
    assert both["world_size"] == 4
    assert_same_steps(both["steps"], single["steps"], tol=1e-4)


@pytest.mark.parametrize("mode", ["pp", "pp_gpipe"])
def test_pipeline_stages_match_one_process(single, mode, tmp_path):
    """2 stages of one block each, 2 pipeline micro-batches per micro-batch (1F1B and GPipe)."""
    pp = run_worker(mode, tmp_path / "pp.json", save_at=5, checkpoint_dir=tmp_path / "ckpt")
    assert_same_steps(pp["steps"], single["steps"], tol=1e-4)
    # rank 0 (the first stage: one block and the embedding), as the layout planner predicts for the busier stage
    assert pp["memory"]["param_bytes"] <= predicted_weight_bytes(pipeline=2) * 1.01
    if (
        mode == "pp"
    ):  # each stage wrote its own blocks and their optimizer state: one checkpoint, resumed in one process
        resumed = run_worker(
            "single",
            tmp_path / "resumed.json",
            steps="5:10",
            load=tmp_path / "ckpt" / "step_5",
            checkpoint_dir=tmp_path / "ckpt_single",
        )
        assert_same_steps(resumed["steps"], single["steps"][5:], tol=1e-4)
        back = run_worker("pp", tmp_path / "back.json", steps="5:10", load=single["step_5"])
        assert_same_steps(back["steps"], single["steps"][5:], tol=1e-4)


QWEN3 = [
    "model.architecture=qwen3",
    "model.hf_config={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4,"
    " num_key_value_heads: 2, head_dim: 16, max_position_embeddings: 256}",
]
LAYOUTS = {  # name: (the layout, what the one-process reference shares with it)
    "tp": (
        ["infra.tensor_parallel_size=2", "infra.sequence_parallel=true"],
        [],
    ),  # vocabulary split, loss parallel, sequence parallel
    "pp_interleaved": (
        ["infra.pipeline_parallel_size=2", "infra.pipeline_schedule=interleaved_1F1B", "infra.stages_per_rank=2"],
        ["model.tie_embeddings=true"],
    ),  # 4 stages of one block, 2 per rank; the head tied to the embedding
    "tp_qwen3": (["infra.tensor_parallel_size=2"], QWEN3),  # a transformers model, split by its family's plan
}  # transformers Qwen3 as pipeline stages: test_transformers_stages_chain_to_the_models_own_logits


def test_cli_tensor_and_pipeline_parallel_runs_train_as_one_process_and_export(tmp_path):
    """`tierlm pretrain` at two ranks with tensor parallel 2 (native GPT: vocabulary and sequence split too;
    transformers Qwen3: vocabulary split) and interleaved pipeline stages (evaluation through the stages): the losses
    and the exported model of one process; a tensor-parallel checkpoint resumed in one process."""
    import json
    import shutil

    from safetensors.torch import load_file
    from tests.conftest import run_main
    from tests.forked import ranks

    shape = ["model.depth=4", "model.aspect_ratio=16"]  # the native GPT's (Qwen3's shape is its model.hf_config)
    common = [
        "pretrain",
        "--config",
        "configs/tiny_pretrain.yaml",
        "training.num_train_steps=6",
        "training.warmup_steps=1",
        "training.save_steps=3",
        "training.eval_steps=3",
        "training.logging_steps=1",
        "data.num_synthetic_examples=2000",
        "training.per_device_train_batch_size=4",
        "infra.progress_bar=false",
    ]

    def lines(run) -> list[tuple]:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [
            (r["type"], r["step"], r["loss"] if r["type"] == "train" else r["val_loss"])
            for r in records
            if r["type"] in ("train", "eval")
        ]

    references: dict[tuple, object] = {}  # one one-process run per shared config
    for name, (layout, shared) in LAYOUTS.items():
        one, run = references.setdefault(tuple(shared), tmp_path / f"{name}_one"), tmp_path / name
        shared = shared if shared == QWEN3 else [*shape, *shared]
        if not one.exists():
            assert (result := run_main(*common, *shared, f"infra.output_dir={one}")).returncode == 0, result.stderr[
                -3000:
            ]
        result = ranks("-m", "tierlm", *common, *shared, *layout, f"infra.output_dir={run}")
        assert result.returncode == 0, result.stderr[-3000:]
        got, reference = lines(run), lines(one)
        assert [r[:2] for r in got] == [r[:2] for r in reference]
        assert all(abs(a[2] - b[2]) < 1e-4 for a, b in zip(got, reference)), (name, got, reference)
        exported, final = load_file(run / "model" / "model.safetensors"), load_file(one / "model" / "model.safetensors")
        assert exported.keys() == final.keys() and all(
            torch.allclose(exported[k], final[k], atol=1e-4) for k in final
        ), name
    # the tensor-parallel run's step-3 checkpoint, resumed in one process, ends where the one-process run did
    run = tmp_path / "tp"
    shutil.rmtree(run / "checkpoints" / "step_6")
    (run / "checkpoints" / "latest").write_text("step_3\n")
    assert (result := run_main(*common, *shape, f"infra.output_dir={run}")).returncode == 0, result.stderr[-3000:]
    assert all(abs(a[2] - b[2]) < 1e-4 for a, b in zip(lines(run), lines(tmp_path / "tp_one")))


@pytest.mark.parametrize("sizes", ["2x1", "1x2"])
def test_seed_megatron_backend_example_trains_as_one_process(sizes, tmp_path):
    """The trainer document's `Trainer(backend=MegatronBackend(tensor_parallel_size=.., pipeline_parallel_size=..),
    strategy=PretrainStrategy())` at tensor 2 and at pipeline 2, and its RL example (`PPOStrategy(kl_coef=0.1,
    clip_range=0.2)` on rollout batches) and DPO on preference pairs at the same sizes, the vocabulary split at tensor
    2 (the three in turn in one two-rank job): the losses of one process."""
    from tests.distributed_worker import megatron

    got = run_worker("megatron", tmp_path / "m.json", sizes=sizes)
    megatron(tmp_path / "one.json", "1x1")  # MegatronBackend in this one process
    expected = json.loads((tmp_path / "one.json").read_text())
    assert list(got) == ["pretrain", "ppo", "dpo"]
    for strategy, losses in expected.items():
        assert got[strategy] == pytest.approx(losses, abs=1e-4) and losses[-1] != losses[0], strategy
    assert expected["pretrain"][-1] < expected["pretrain"][0]


def test_tensor_times_pipeline_on_four_ranks_matches_one_process_and_its_checkpoint_resumes_in_one(single, tmp_path):
    both = run_worker("tp_pp", tmp_path / "tp_pp.json", nproc=4, save_at=5, checkpoint_dir=tmp_path / "ckpt")
    assert_same_steps(both["steps"], single["steps"], tol=1e-4)
    # the first stage's embedding split by vocabulary too: within what the planner gives the busier stage
    assert both["memory"]["param_bytes"] <= predicted_weight_bytes(4, tensor=2, pipeline=2) * 1.01
    resumed = run_worker(
        "single",
        tmp_path / "resumed.json",
        steps="5:10",
        load=tmp_path / "ckpt" / "step_5",
        checkpoint_dir=tmp_path / "ckpt_single",
    )
    assert_same_steps(resumed["steps"], single["steps"][5:], tol=1e-4)


@pytest.fixture(scope="module")
def single_gpt2(tmp_path_factory):
    out = tmp_path_factory.mktemp("single_gpt2")
    return {
        **run_worker("single", out / "single.json", save_at=5, checkpoint_dir=out / "ckpt", model="gpt2"),
        "step_5": out / "ckpt" / "step_5",
    }


def test_gpt2_tensor_parallel_splits_its_fused_qkv_and_checkpoints_reshard(single_gpt2, tmp_path):
    """GPT-2's c_attn holds q, k and v in one matrix: each rank takes its heads' rows of each (a strided shard);
    the checkpoint (stored as plain shards) resumes in one process, and one process's at TP 2."""
    trains_as_one_and_reshards("tp", single_gpt2, tmp_path, model="gpt2")


def test_gpt2_pipeline_stages_share_the_tied_embedding(single_gpt2, tmp_path):
    """The first stage's embedding and the last stage's head are one tied matrix: its two copies' gradients are
    summed (and counted once in the norm), so both take the one-process update; checkpoints reshard both ways;
    tensor x pipeline parallel on 4 ranks matches too."""
    trains_as_one_and_reshards("pp", single_gpt2, tmp_path, model="gpt2")
    both = run_worker("tp_pp", tmp_path / "tp_pp.json", nproc=4, model="gpt2")
    assert_same_steps(both["steps"], single_gpt2["steps"], tol=1e-4)


def test_gpt2_refusals_name_the_layout_that_works():
    from tierlm.backends.model_parallel import ModelParallelTrainingBackend
    from tierlm.backends.options import BackendOptions
    from tierlm.errors import ConfigError
    from tierlm.models.gpt2.family import GPT2_FAMILY
    from tierlm.models.gpt2.model import GPT2Config
    from tierlm.primitives.model_parallel import ParallelDims

    model = GPT2_FAMILY.build_from_config(GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=50, block_size=16))
    options = BackendOptions(dims=ParallelDims.from_sizes(4, tensor=2))
    with pytest.raises(ConfigError, match="pipeline stages"):  # before any process group is needed
        ModelParallelTrainingBackend(model, None, None, "unused", "cpu", options=options)
    with pytest.raises(ConfigError, match="3 attention heads do not split over 2"):
        GPT2_FAMILY.tensor_parallel_plan(
            GPT2_FAMILY.build_from_config(GPT2Config(n_layer=1, n_head=3, n_embd=48, vocab_size=50, block_size=16)), 2
        )
    variant = GPT2_FAMILY.build_from_config(
        GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=50, block_size=16, ra_r=4, delay_mode="step")
    )
    with pytest.raises(ConfigError, match="ra_r, delay_mode"):
        GPT2_FAMILY.tensor_parallel_plan(variant, 2)
    with pytest.raises(ConfigError, match="sets delay_mode"):
        GPT2_FAMILY.pipeline_stage(variant, [0], True, False)
    with pytest.raises(ConfigError, match="no sequence-parallel plan"):  # tied: the embedding and head stay whole
        GPT2_FAMILY.tensor_parallel_model_plan(model, sequence_parallel=True)
    assert GPT2_FAMILY.tensor_parallel_model_plan(model, sequence_parallel=False) == {}


def test_sequence_parallel_refusals_say_why():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tierlm.errors import ConfigError
    from tierlm.models import GPTConfig, build_gpt, family_of

    tied = build_gpt(
        GPTConfig(depth=1, aspect_ratio=32, head_dim=16, vocab_size=50, max_seq_len=16, tie_embeddings=True)
    )
    with pytest.raises(ConfigError, match="tie_embeddings=false"):
        family_of(tied).tensor_parallel_model_plan(tied, sequence_parallel=True)
    qwen3 = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            tie_word_embeddings=False,
        )
    )
    with pytest.raises(ConfigError, match="attention masks"):
        family_of(qwen3).tensor_parallel_model_plan(qwen3, sequence_parallel=True)
    assert family_of(qwen3).tensor_parallel_model_plan(qwen3, sequence_parallel=False) == {
        "model.embed_tokens": "vocab_embedding",
        "lm_head": "vocab_head",
    }


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_transformers_stages_chain_to_the_models_own_logits(model_type):
    """Each Llama-style family's stages, run one after another on packed rows, give the model's own logits
    (its masks, sliding windows included, and its rotary embedding); a stage's names are the model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tierlm.models import family_of

    config = AutoConfig.for_model(
        model_type,
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **({"sliding_window": 3} if model_type == "mistral" else {}),
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    family = family_of(model)
    ids, positions = torch.randint(0, 50, (2, 10)), torch.cat([torch.arange(6), torch.arange(4)]).expand(2, 10)
    stages = [family.pipeline_stage(model, ids_, i == 0, i == 2) for i, ids_ in enumerate([[0], [1], [2]])]
    x, sent = ids, positions
    with torch.no_grad():
        for stage in stages[:-1]:
            x, sent = stage(x, sent)  # what one stage sends the next: the residual stream, the positions as floats
        got, expected = stages[-1](x, sent), model(ids, position_ids=positions, use_cache=False).logits
    assert torch.allclose(got, expected, atol=1e-5)
    whole = model.state_dict()
    assert all(torch.equal(v, whole[k]) for stage in stages for k, v in stage.state_dict().items())
    assert [len(family.blocks(stage)) for stage in stages] == [1, 1, 1]


def test_dpo_under_pipeline_stages_matches_one_process(two_block_runs, tmp_path):
    """`tierlm dpo` on 2 pipeline stages (each micro-batch of 8 pairs cut into 2 pieces of whole pairs, the
    loss run on the last stage one piece at a time, a frozen reference on every rank) takes one process's steps:
    losses, gradient norms and evaluations."""
    from tests.conftest import run_main
    from tests.forked import ranks

    sft = two_block_runs / "sft"  # two blocks, one per stage
    dpo = [
        "dpo",
        "--config",
        "configs/tiny_dpo.yaml",
        f"model.model_name_or_path={sft}",
        "data.max_seq_length=64",
        "data.num_synthetic_examples=64",
        "data.num_synthetic_eval_examples=16",
        "infra.device_type=cpu",
        "infra.progress_bar=false",
        "training.num_train_steps=4",
        "training.eval_steps=2",
        "training.eval_batches=4",
        "training.logging_steps=1",
        "training.warmup_steps=0",
        "training.per_device_eval_batch_size=4",
        "training.per_device_train_batch_size=8",
    ]
    result = ranks("-m", "tierlm", *dpo, "infra.pipeline_parallel_size=2", f"infra.output_dir={tmp_path / 'pp'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (result := run_main(*dpo, f"infra.output_dir={tmp_path / 'one'}")).returncode == 0, result.stderr[-3000:]
    pp, one = (
        [
            r
            for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())
            if r["type"] != "sample"
        ]
        for run in ("pp", "one")
    )
    assert [(r["type"], r["step"]) for r in pp] == [(r["type"], r["step"]) for r in one]
    for a, b in zip(pp, one):
        for key in ("loss", "grad_norm", "val_loss", "reward_margin", "pref_acc"):
            if key in b:
                assert a[key] == pytest.approx(b[key], abs=1e-5), (key, a, b)
    assert one[-1]["val_loss"] < one[0]["val_loss"]

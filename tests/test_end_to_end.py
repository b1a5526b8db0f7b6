"""The whole path on CPU: pretrain -> SFT -> sample through the CLI, and exact resume of a run."""

import json

import pytest
import torch

from conftest import run_cli, run_main
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError
from tierlm.stages import run_stage

TINY = [
    "model.depth=2",
    "model.aspect_ratio=32",
    "model.head_dim=32",
    "tokenizer.vocab_size=300",
    "data.num_synthetic_examples=3000",
    "data.num_synthetic_eval_examples=64",
    "data.max_seq_length=64",
    "training.per_device_train_batch_size=8",
    "training.per_device_eval_batch_size=16",
    "training.eval_batches=2",
    "training.learning_rate=3e-3",
    "training.logging_steps=5",
    "infra.progress_bar=false",
    "infra.device_type=cpu",
]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_cli_pretrain_sft_sample(tmp_path):
    pre, sft = tmp_path / "pre", tmp_path / "sft"
    result = run_cli(
        "pretrain",
        "--config",
        "configs/tiny_pretrain.yaml",
        *TINY,
        "training.num_train_steps=40",
        "training.eval_steps=20",
        "training.warmup_steps=2",
        f"infra.output_dir={pre}",
    )
    assert result.returncode == 0, result.stderr
    assert f"run directory: {pre}" in result.stdout and "final val loss:" in result.stdout

    records = _lines(pre / "metrics.jsonl")
    train = [r for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval"]
    assert all({"step", "loss", "lr", "tokens_per_sec", "mfu"} <= set(r) for r in train)
    assert [r["step"] for r in evals] == [0, 20, 40] and all("val_bpb" in r for r in evals)
    assert evals[-1]["val_loss"] < 0.7 * evals[0]["val_loss"]
    # Each eval line says when it came in the loop and what it cost, so a time to a loss can leave evaluations out.
    assert evals[0]["elapsed_s"] == 0 and all(r["eval_s"] > 0 for r in evals)
    assert evals[1]["elapsed_s"] < evals[2]["elapsed_s"] and evals[2]["elapsed_s"] > evals[1]["eval_s"]
    assert (pre / "config.yaml").is_file() and (pre / "model" / "tokenizer.json").is_file()

    result = run_main(
        "sft",
        "--config",
        "configs/tiny_sft.yaml",
        *TINY,
        f"model.model_name_or_path={pre}",
        "training.num_train_steps=20",
        "training.eval_steps=10",
        "training.warmup_steps=0",
        f"infra.output_dir={sft}",
    )
    assert result.returncode == 0, result.stderr
    sft_evals = [r for r in _lines(sft / "metrics.jsonl") if r["type"] == "eval"]
    assert sft_evals[-1]["val_loss"] < sft_evals[0]["val_loss"]

    result = run_main("sample", "--checkpoint", sft, "--prompt", "What is 12 + 7?", "--max-new-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "the model answered nothing"

    # RL and DPO start from the SFT run: eval lines before the first update and at the end.
    rl = tmp_path / "rl"
    rl_args = [
        "rl",
        "--config",
        "configs/tiny_rl.yaml",
        f"model.model_name_or_path={sft}",
        "data.max_seq_length=64",
        "training.num_train_steps=4",
        "training.eval_steps=2",
        "training.save_steps=2",
        "training.logging_steps=1",
        "rl.eval_problems=3",
        "rl.prompts_per_step=2",
        "rl.group_size=2",
        "rl.max_new_tokens=8",
        f"infra.output_dir={rl}",
        "infra.device_type=cpu",
    ]
    result = run_main(*rl_args)
    assert result.returncode == 0, result.stderr
    assert "held-out pass@1" in result.stdout
    records = _lines(rl / "metrics.jsonl")
    evals = [r for r in records if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4] and all(
        {"pass@1", "pass@k", "k"} <= set(r) and r["k"] == 4 for r in evals
    )
    train = [r for r in records if r["type"] == "train"]
    assert all(
        {"logprob_abs_diff", "time_generation_s", "time_scoring_s", "time_training_s", "rollout_tokens_per_sec"}
        <= set(r)
        for r in train
    )
    assert all(r["logprob_abs_diff"] < 1e-4 for r in train)  # sampler and trainer agree on the sampled tokens
    assert (rl / "model" / "model.safetensors").is_file()
    # `tierlm eval` reproduces the run's last pass@k eval (the same seeded samples) without training.
    result = run_main(
        "eval",
        "--checkpoint",
        rl,
        "--config",
        "configs/tiny_rl.yaml",
        "data.max_seq_length=64",
        "rl.eval_problems=3",
        "rl.max_new_tokens=8",
        "infra.device_type=cpu",
    )
    assert result.returncode == 0, result.stderr
    last = f"pass@1 {evals[-1]['pass@1']:.3f}, pass@4 {evals[-1]['pass@k']:.3f} over 3 held-out problems"
    assert last in result.stdout
    # Without --config it reads the run's own config.yaml (problems, tools, sampling): the same line, saying so.
    result = run_main("eval", "--checkpoint", rl / "model")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(last) and f"{rl / 'config.yaml'}, the RL run's own settings" in result.stdout
    # Rewound to step 2 and resumed, RL repeats steps 3 and 4 exactly (rollouts are seeded by step).
    import shutil

    shutil.rmtree(rl / "checkpoints" / "step_4")
    (rl / "checkpoints" / "latest").write_text("step_2\n")
    result = run_main(*rl_args)
    assert result.returncode == 0, result.stderr
    again = [r for r in _lines(rl / "metrics.jsonl") if r["type"] == "train"]
    keys = ("step", "loss", "reward_mean", "grad_norm", "completion_len")
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in train]

    dpo = tmp_path / "dpo"
    result = run_main(
        "dpo",
        "--config",
        "configs/tiny_dpo.yaml",
        f"model.model_name_or_path={sft}",
        "data.max_seq_length=64",
        "data.num_synthetic_examples=64",
        "data.num_synthetic_eval_examples=16",
        "training.num_train_steps=3",
        "training.eval_steps=3",
        "training.warmup_steps=0",
        f"infra.output_dir={dpo}",
        "infra.device_type=cpu",
    )
    assert result.returncode == 0, result.stderr
    evals = [r for r in _lines(dpo / "metrics.jsonl") if r["type"] == "eval"]
    assert evals[0]["pref_acc"] == 0.5 and evals[0]["reward_margin"] == 0.0  # policy == reference at step 0
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]


def _config(tmp_path, steps, **extra):
    overrides = TINY + [
        f"training.num_train_steps={steps}",
        "training.eval_steps=0",
        "training.save_steps=5",
        "training.warmup_steps=2",
        "training.lr_scheduler_type=linear",
        f"infra.output_dir={tmp_path}",
    ]
    return TierlmConfig.load("configs/tiny_pretrain.yaml", overrides + [f"{k}={v}" for k, v in extra.items()])


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    """A run rewound to its step-5 checkpoint and resumed (with a prefetching loader) ends exactly as
    the uninterrupted run (CPU fp32)."""
    import shutil

    from safetensors.torch import load_file

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_stage(_config(straight, 10), "pretrain")
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_10")
    shutil.rmtree(resumed / "model")
    (resumed / "checkpoints" / "latest").write_text("step_5\n")

    summary = run_stage(_config(resumed, 10, **{"data.prefetch_batches": 2}), "pretrain")  # the background loader too
    assert summary["resumed_from"].endswith("step_5") and summary["step"] == 10

    def losses(run):
        return [(r["step"], r["loss"]) for r in _lines(run / "metrics.jsonl") if r["type"] == "train"]

    assert losses(resumed) == losses(straight) and len(losses(straight)) == 2  # steps 5 and 10, no duplicates
    a, b = load_file(straight / "model" / "model.safetensors"), load_file(resumed / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_never_refuses_to_reuse_a_run(tmp_path):
    (tmp_path / "checkpoints" / "step_1").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_1" / "meta.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        run_stage(_config(tmp_path, 10, **{"training.resume": "never"}), "pretrain")


def test_transformers_architecture_from_scratch_with_tensorboard(tmp_path):
    """model.architecture=llama trains from a config; the folder reloads in transformers; TensorBoard gets events."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = [
        "model.architecture=llama",
        "model.hf_config={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,"
        " num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 128}",
        "training.report_to=[tensorboard]",
    ]
    config = TierlmConfig.load(
        "configs/tiny_pretrain.yaml",
        [
            *TINY,
            *hf,
            "training.num_train_steps=4",
            "training.eval_steps=2",
            "training.warmup_steps=0",
            f"infra.output_dir={tmp_path}",
        ],
    )
    summary = run_stage(config, "pretrain")
    assert summary["step"] == 4 and "val_loss" in summary
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert AutoTokenizer.from_pretrained(tmp_path / "model").chat_template
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_cli_tokenizer_train(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"line {i} of some text, with words and numbers {i * 7}" for i in range(200)))
    result = run_main("tokenizer", "train", "--data", corpus, "--out", tmp_path / "tok", "--vocab-size", "300")
    assert result.returncode == 0, result.stderr
    from tierlm.data import load_tokenizer

    tok = load_tokenizer(tmp_path / "tok")
    assert tok.vocab_size == 300 and tok.decode(tok.encode("line 12 of")) == "line 12 of"


def _conversation_file(path, count=48):
    from tierlm.data import ArithmeticTask

    rows = [{"messages": p.conversation} for p in ArithmeticTask().problems("train", count, seed=9)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_on_a_jsonl_file_and_a_mixture(tmp_path):
    """data.dataset_name=my.jsonl just works; so does a weighted mixture; packed SFT logs its row fill."""
    data = _conversation_file(tmp_path / "my.jsonl")
    base = [*TINY, "training.num_train_steps=3", "training.eval_steps=0", "training.warmup_steps=0"]
    config = TierlmConfig.load(
        "configs/tiny_sft.yaml",
        [*base, "model.model_name_or_path=null", f"data.dataset_name={data}", f"infra.output_dir={tmp_path / 'a'}"],
    )
    summary = run_stage(config, "sft")
    assert summary["step"] == 3 and summary["val_loss"] > 0
    train = [r for r in _lines(tmp_path / "a" / "metrics.jsonl") if r["type"] == "train"]
    assert 0 < train[-1]["data_fill"] <= 1 and train[-1]["rss_mb"] > 0

    mixture = (
        f"data.mixture=[{{dataset_name: '{data}', weight: 2}}, {{dataset_name: 'synthetic:arithmetic', weight: 0.5}}]"
    )
    config = TierlmConfig.load(
        "configs/tiny_sft.yaml", [*base, "model.model_name_or_path=null", mixture, f"infra.output_dir={tmp_path / 'b'}"]
    )
    assert run_stage(config, "sft")["step"] == 3


def test_mixture_with_an_eval_dataset_trains_on_every_component(tmp_path):
    from tierlm.builders.loaders import open_splits

    data = _conversation_file(tmp_path / "my.jsonl", count=48)
    held_out = _conversation_file(tmp_path / "val.jsonl", count=10)
    mixture = (
        f"data.mixture=[{{dataset_name: '{data}', weight: 1}}, {{dataset_name: 'synthetic:arithmetic', weight: 1}}]"
    )
    config = TierlmConfig.load("configs/tiny_sft.yaml", [*TINY, mixture, f"data.eval_dataset_name={held_out}"])
    trains, vals = open_splits(config, "chat", None)
    assert [len(t) for t, _ in trains] == [48, 3000] and [len(v) for v in vals] == [10]


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"messages": []}\n', "bad.jsonl:1: a conversation must be a non-empty list"),
        (
            '{"text": "not a chat"}\n',
            "bad.jsonl:1: holds plain text ('text'), not a conversation; train on text with `tierlm pretrain`",
        ),
        ('{"question": "q"}\n', "bad.jsonl:1: needs a 'messages' list or 'prompt'/'completion' fields"),
        (
            '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n{oops\n',
            "bad.jsonl:2: malformed JSON",
        ),
    ],
)
def test_cli_bad_data_is_one_line_exit_2(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    result = run_main(
        "sft",
        "--config",
        "configs/tiny_sft.yaml",
        "model.model_name_or_path=null",
        f"data.dataset_name={tmp_path / 'bad.jsonl'}",
        f"infra.output_dir={tmp_path / 'run'}",
        timeout=120,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_token_file_beyond_vocab_is_one_line_exit_2(tmp_path, tiny_tokenizer):
    import numpy as np

    tiny_tokenizer.save(tmp_path / "tok")
    np.array([0, 5, 6, tiny_tokenizer.vocab_size + 3], dtype=np.uint16).tofile(tmp_path / "t.bin")
    result = run_main(
        "pretrain",
        f"data.dataset_name={tmp_path / 't.bin'}",
        f"model.tokenizer_name_or_path={tmp_path / 'tok'}",
        f"infra.output_dir={tmp_path / 'run'}",
        timeout=120,
    )
    assert result.returncode == 2 and f">= vocab size {tiny_tokenizer.vocab_size}" in result.stderr, result.stderr


@pytest.mark.slow
def test_speedrun_writes_a_report_card_and_resumes(tmp_path):
    """`tierlm speedrun`: tokenizer -> pretrain (sized from the depth) -> SFT -> RL -> report.md with
    PNG curves; a second invocation finds every stage finished and rebuilds the card."""
    out = tmp_path / "sr"
    small = [
        "model.aspect_ratio=32",
        "model.head_dim=32",
        "tokenizer.vocab_size=300",
        "tokenizer.num_train_docs=500",
        "data.num_synthetic_examples=500",
        "data.num_synthetic_eval_examples=16",
        "data.max_seq_length=64",
        "training.per_device_train_batch_size=4",
        "training.eval_batches=1",
        "training.num_train_steps=4",
        "training.eval_steps=2",
        "rl.eval_problems=2",
        "rl.eval_k=2",
        "rl.prompts_per_step=2",
        "rl.group_size=2",
        "rl.max_new_tokens=8",
        "infra.progress_bar=false",
        "infra.device_type=cpu",
    ]
    from test_core_eval import write_bundle

    core = ["--core", write_bundle(tmp_path / "bundle"), "training.core_steps=2"]  # CORE during pretraining
    result = run_main("speedrun", "--depth", "1", "--out", out, *small, *core)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"report card: {out / 'report.md'}" in result.stdout
    cores = [r for r in map(json.loads, (out / "pretrain" / "metrics.jsonl").read_text().splitlines())
             if r["type"] == "core"]  # fmt: skip
    assert [r["step"] for r in cores] == [2, 4] and set(cores[-1]["tasks"]) == {"sums", "which_op", "complete"}
    report = (out / "report.md").read_text()
    for section in (
        "# tierlm speedrun: depth 1",
        "## Pretraining plan",
        "## Time per stage",
        "## Results",
        "pass@1",
        "## Sample conversations",
        "![pretrain_loss](plots/pretrain_loss.png)",
        "![sft_loss](plots/sft_loss.png)",
        "![rl_reward](plots/rl_reward.png)",
        "![pretrain_core](plots/pretrain_core.png)",
        f"| pretrain CORE (the end of pretraining) | {cores[-1]['core']:.4f} |",
    ):
        assert section in report, section
    for png in ("pretrain_loss", "sft_loss", "rl_reward", "pretrain_core"):
        assert (out / "plots" / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((out / "speedrun.json").read_text())
    assert list(record["stages"]) == ["tokenizer", "pretrain", "sft", "rl"] and all(
        s["done"] for s in record["stages"].values()
    )

    again = run_main("speedrun", "--depth", "1", "--out", out, *small)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        json.loads((out / "speedrun.json").read_text())["stages"]["pretrain"]["seconds"]
        == record["stages"]["pretrain"]["seconds"]
    )
    wrong = run_main("speedrun", "--depth", "2", "--out", out, *small)
    assert wrong.returncode == 2 and "depth-1 speedrun" in wrong.stderr


def test_sft_with_neftune_or_dft_trains_on_noisy_embeddings_and_evaluates_without(tiny_runs, tmp_path):
    """training.neftune_noise_alpha changes what a training step sees (its first loss), not what evaluation sees (the
    evaluation before the first step); without it two runs are equal, so the difference is the noise's.
    training.sft_loss=dft trains Dynamic Fine-Tuning's loss (each token's cross-entropy times its probability, below
    the plain loss) and evaluates the plain cross-entropy."""
    from conftest import CHAT

    def sft(name: str, *extra: str) -> list[dict]:
        out = tmp_path / name
        overrides = [*CHAT, f"model.model_name_or_path={tiny_runs / 'pre'}", "training.num_train_steps=1"]
        overrides += ["training.eval_steps=1", "training.logging_steps=1", f"infra.output_dir={out}", *extra]
        run_stage(TierlmConfig.load("configs/tiny_sft.yaml", overrides), "sft")
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    plain, again, noisy = sft("plain"), sft("again"), sft("noisy", "training.neftune_noise_alpha=15")

    def first(records, kind, key):
        return next(r[key] for r in records if r["type"] == kind)

    assert first(plain, "train", "loss") == first(again, "train", "loss")
    assert first(noisy, "train", "loss") != first(plain, "train", "loss")
    assert first(noisy, "eval", "val_loss") == first(plain, "eval", "val_loss")
    assert first(plain, "eval", "step") == 0
    dft = sft("dft", "training.sft_loss=dft")
    assert 0 < first(dft, "train", "loss") < 0.9 * first(plain, "train", "loss")
    assert first(dft, "eval", "val_loss") == first(plain, "eval", "val_loss")


def test_profile_steps_trace_the_named_steps(tiny_runs, tmp_path, capsys):
    """training.profile_steps=[2,3] writes the rank's timeline (steps 2 and 3 as ranges, the warm-up step 1 not in it,
    the matmuls inside them) and its operator table, and says where they are; resumed inside the range, a run traces
    from where it resumed."""
    import gzip

    from conftest import TINY as SHARED_TINY

    def pretrain(out, *extra):
        overrides = [*SHARED_TINY, "training.num_train_steps=3", f"infra.output_dir={out}", *extra]
        run_stage(TierlmConfig.load("configs/tiny_pretrain.yaml", overrides), "pretrain")

    out = tmp_path / "run"
    pretrain(out, "training.profile_steps=[2,3]")
    events = json.loads(gzip.open(out / "profile" / "trace_rank0.json.gz").read())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"step 2", "step 3", "aten::mm"} <= names and "step 1" not in names
    assert (out / "profile" / "summary_rank0.txt").read_text().startswith("steps 2-3 (torch.profiler")
    assert f"profile: steps 2-3 traced to {out / 'profile' / 'trace_rank0.json.gz'}" in capsys.readouterr().out

    first = tmp_path / "first"
    pretrain(first, "training.num_train_steps=2", "training.save_steps=1")
    resumed = tmp_path / "resumed"
    pretrain(resumed, "training.profile_steps=[1,3]", f"training.resume_from_checkpoint={first}/checkpoints/step_1")
    assert (resumed / "profile" / "summary_rank0.txt").read_text().startswith("steps 2-3 (torch.profiler")

    import os
    import signal

    import tierlm
    from tierlm.loops.signals import RunInterrupted

    class StopAtStep3:  # SIGTERM, as a scheduler's pre-emption, inside the traced range
        def on_log(self, record):
            if record["step"] == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    stopped = tmp_path / "stopped"
    overrides = [*SHARED_TINY, "training.num_train_steps=6", "training.logging_steps=1", "training.profile_steps=[2,5]"]
    overrides.append(f"infra.output_dir={stopped}")
    with pytest.raises(RunInterrupted):
        tierlm.train("tiny_pretrain", "pretrain", overrides, callbacks=[StopAtStep3()])
    assert (stopped / "profile" / "summary_rank0.txt").read_text().startswith("steps 2-3 (torch.profiler")

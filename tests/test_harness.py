"""`tierlm eval --harness` (issue 20): a tierlm model as lm-evaluation-harness's language model, checked
against references — the log-likelihoods against transformers' own model of the exported folder, the
rolling (perplexity) scores against the harness's own HFLM on that folder — and the command end to end on
three small local tasks (multiple choice, perplexity, generation), its results in the run's metrics and report."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm_eval is not installed (pip install 'tierlm[eval]')")

import torch  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from tierlm.commands.cli import main  # noqa: E402

CONTEXTS = [
    ("What is 2 + 3?", " 5"),
    ("What is 12 + 7? The answer", " is 19"),
    ("", "7 + 8 = 15"),
    ("Add 4 and 4: ", "8"),
]
TEXT = "What is 23 + 45? 23 + 45 = 68. What is 7 + 9? 7 + 9 = 16. " * 4


def write_tasks(folder: Path) -> Path:
    """Three harness tasks over local JSON lines (offline): multiple choice, perplexity, generation."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "question": f"What is {a} + {b}?",
            "choices": [str(a + b), str(a + b + 1), str(a * b + 2)],
            "answer": 0,
            "text": f"{a} + {b} = {a + b}",
        }
        for a, b in [(2, 3), (12, 7), (4, 4), (9, 1), (6, 5), (3, 8)]
    ]
    (folder / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'sums.jsonl'}\ntest_split: test\n"
    )
    (folder / "mc.yaml").write_text(
        f"task: tierlm_sums_mc\n{common}output_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "ppl.yaml").write_text(
        f"task: tierlm_sums_ppl\n{common}output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    (folder / "gen.yaml").write_text(
        f"task: tierlm_sums_gen\n{common}output_type: generate_until\ndoc_to_text: '{{{{question}}}} '\n"
        "doc_to_target: '{{choices[0]}}'\ngeneration_kwargs:\n  until: ['?']\n  max_gen_toks: 6\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


def instances(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def lm(tiny_runs):
    from tierlm.commands.harness import TierlmLM
    from tierlm.data import load_tokenizer
    from tierlm.models import load_pretrained_model

    folder = tiny_runs / "pre" / "model"
    return TierlmLM(load_pretrained_model(folder), load_tokenizer(folder), batch_size=3)


def test_loglikelihoods_match_transformers_own_model_of_the_folder(lm, tiny_runs):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_runs / "pre" / "model").eval()
    got = lm.loglikelihood(instances("loglikelihood", CONTEXTS), disable_tqdm=True)
    bos = lm.tokenizer.document_separator_id
    for (context, continuation), (score, greedy) in zip(CONTEXTS, got):
        context_ids = [
            bos,
            *lm.tokenizer.encode(context.rstrip()),
        ]  # the harness moves a context's trailing space into the continuation
        whole = [bos, *lm.tokenizer.encode(context.rstrip() + context[len(context.rstrip()) :] + continuation)]
        n = len(whole) - len(context_ids)
        with torch.no_grad():
            logprobs = reference(torch.tensor([whole[:-1]])).logits[0].log_softmax(-1)[-n:]
        targets = torch.tensor(whole[-n:])
        assert score == pytest.approx(float(logprobs.gather(-1, targets[:, None]).sum()), abs=1e-4)
        assert greedy == bool((logprobs.argmax(-1) == targets).all())


def test_rolling_scores_match_the_harness_own_hf_model(lm, tiny_runs):
    from lm_eval.models.huggingface import HFLM

    from tierlm.commands.harness import TierlmLM

    requests = instances("loglikelihood_rolling", [(TEXT,), (TEXT[:30],)])
    short = TierlmLM(lm.model, lm.tokenizer, batch_size=3, max_length=24)
    assert len(lm.tokenizer.encode(TEXT)) > 4 * short.max_length  # several windows
    # the folder's tokenizer adds <|bos|> itself (as Llama's adds <s>); the rolling windows begin at the prefix token
    folder = str(tiny_runs / "pre" / "model")
    hf = HFLM(pretrained=folder, batch_size=2, device="cpu", max_length=short.max_length, add_bos_token=False)
    expected = hf.loglikelihood_rolling(requests, disable_tqdm=True)
    assert short.loglikelihood_rolling(requests, disable_tqdm=True) == pytest.approx(expected, abs=1e-3)
    assert lm.loglikelihood_rolling(requests, disable_tqdm=True) != pytest.approx(
        expected, abs=1e-1
    )  # one window sees more


def test_generation_is_the_engines_greedy_text_cut_at_the_stop_string(lm):
    from tierlm.rollout.engine import Engine
    from tierlm.rollout.sampling import GREEDY

    (text,) = lm.generate_until(instances("generate_until", [("What is 2 + 3?", {"until": ["="], "max_gen_toks": 8})]))
    tokens = (
        Engine(lm.model, sorted({*lm.tokenizer.stop_ids, lm.eot_token_id}))
        .generate(lm.tok_encode("What is 2 + 3?"), 1, 8, GREEDY)[0]
        .tokens
    )
    full = lm.tokenizer.decode([t for t in tokens if t not in lm.tokenizer.stop_ids], skip_special_tokens=True)
    assert text == full.split("=")[0] and "=" not in text


def test_an_encoder_decoder_scores_the_continuation_with_its_decoder_given_the_context(tmp_path):
    from tierlm.commands.harness import TierlmLM
    from tierlm.data import train_bpe_tokenizer
    from tierlm.data.seq2seq_tokenizer import Qwen3EncoderDecoderTokenizer
    from tierlm.models.qwen3_encdec.model import Qwen3EncDecConfig, build_qwen3_encdec

    tokenizer = Qwen3EncoderDecoderTokenizer(train_bpe_tokenizer([TEXT] * 20, 300), num_sentinel_tokens=2)
    model = build_qwen3_encdec(
        Qwen3EncDecConfig(
            vocab_size=len(tokenizer.hf),
            hidden_size=32,
            num_encoder_layers=1,
            num_decoder_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=64,
            max_position_embeddings=64,
            decoder_start_token_id=tokenizer.pad_id,
        )
    ).eval()
    lm = TierlmLM(model, tokenizer, batch_size=2)
    got = lm.loglikelihood(instances("loglikelihood", CONTEXTS[:2]), disable_tqdm=True)
    for (context, continuation), (score, _) in zip(CONTEXTS, got):
        encoder = [tokenizer.mode_ids["S"], *tokenizer.encode(context)]
        target = tokenizer.encode(continuation)
        with torch.no_grad():  # one example alone, unpadded
            logits = model(torch.tensor([encoder]), torch.tensor([[model.config.decoder_start_token_id, *target[:-1]]]))
        expected = logits[0].log_softmax(-1).gather(-1, torch.tensor(target)[:, None]).sum()
        assert score == pytest.approx(float(expected), abs=1e-4)


class LocalTasks(TaskManager):
    """The harness's TaskManager over the include path alone (the 14,659 task files it ships take 10-37 s to index),
    counting its builds; at the module's top, where pickle finds it."""

    built = 0

    def __init__(self, include_path=None):
        LocalTasks.built += 1
        super().__init__(include_path=include_path, include_defaults=False)


def test_the_task_index_is_kept_and_built_afresh_when_a_task_file_changes(tmp_path, monkeypatch):
    import lm_eval.tasks

    from tierlm.commands.harness import task_manager

    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasks)
    monkeypatch.setattr(LocalTasks, "built", 0)
    tasks = write_tasks(tmp_path / "tasks")
    names = ["tierlm_sums_gen", "tierlm_sums_mc", "tierlm_sums_ppl"]
    assert task_manager(str(tasks)).all_tasks == names and LocalTasks.built == 1
    assert task_manager(str(tasks)).all_tasks == names and LocalTasks.built == 1  # read back
    (tasks / "mc.yaml").write_text((tasks / "mc.yaml").read_text().replace("sums_mc", "sums_choice"))
    assert "tierlm_sums_choice" in task_manager(str(tasks)).all_tasks and LocalTasks.built == 2
    (kept,) = (tmp_path / "cache" / "harness-tasks").iterdir()
    kept.write_bytes(kept.read_bytes()[:100])  # cut short: built again
    assert task_manager(str(tasks)).load(["tierlm_sums_gen"])["tasks"] and LocalTasks.built == 3
    monkeypatch.setenv("TIERLM_CACHE_DIR", "off")
    assert task_manager(str(tasks)).all_tasks and LocalTasks.built == 4


def test_the_command_writes_the_results_into_the_run(tiny_runs, tmp_path, capsys, reports):
    run = tmp_path / "pre"
    shutil.copytree(tiny_runs / "pre", run)
    tasks = write_tasks(tmp_path / "tasks")
    assert (
        main(
            [
                "eval",
                "--checkpoint",
                str(run),
                "--harness",
                "tierlm_sums_mc,tierlm_sums_ppl,tierlm_sums_gen",
                "--include-path",
                str(tasks),
                "--limit",
                "4",
                "--device-type",
                "cpu",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    for name in ("tierlm_sums_mc", "tierlm_sums_ppl", "tierlm_sums_gen", "acc", "word_perplexity", "exact_match"):
        assert name in table, name
    record = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["type"] == "harness" and record["limit"] == 4 and record["step"] == 3
    assert (
        0 <= record["tasks"]["tierlm_sums_mc"]["acc"] <= 1 and record["tasks"]["tierlm_sums_ppl"]["word_perplexity"] > 1
    )
    assert json.loads((run / "harness.json").read_text())["n-samples"]["tierlm_sums_mc"]["effective"] == 4
    report = (run / "report.md").read_text()
    assert "## Evaluation harness" in report and "| tierlm_sums_ppl | bits_per_byte |" in report

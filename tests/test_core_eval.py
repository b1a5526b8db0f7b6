"""CORE on a small eval bundle in nanochat's layout: each task type against a plain per-prompt reference written
here (each prompt run alone, unpadded), the centring, the command and its refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from tierlm.errors import ConfigError
from tierlm.loops.evaluation import evaluate_core, prompts_of, read_bundle

MC = [{"query": f"What is {a} + {b}?", "choices": [f" {a + b}", f" {a + b + 3}", f" {a * b}"], "gold": 0}
      for a, b in [(2, 3), (10, 4), (7, 7), (1, 8), (6, 2)]]  # fmt: skip
SCHEMA = [{"context_options": [f"{a} + {b} =", f"{a} - {b} ="], "continuation": f"{a + b}", "gold": 0}
          for a, b in [(4, 1), (9, 3), (5, 5)]]  # fmt: skip
LM = [{"context": f"What is {a} + {b}? {a} + {b} =", "continuation": f" {a + b}"} for a, b in [(3, 4), (8, 1), (2, 2)]]


def write_bundle(root):
    (root / "eval_data").mkdir(parents=True)
    for name, items in (("mc.jsonl", MC), ("schema.jsonl", SCHEMA), ("lm.jsonl", LM)):
        (root / "eval_data" / name).write_text("".join(json.dumps(i) + "\n" for i in items))
    (root / "core.yaml").write_text(
        "icl_tasks:\n"
        "- {label: sums, dataset_uri: mc.jsonl, num_fewshot: [2], icl_task_type: multiple_choice}\n"
        "- {label: which_op, dataset_uri: schema.jsonl, num_fewshot: [0], icl_task_type: schema}\n"
        "- {label: complete, dataset_uri: lm.jsonl, num_fewshot: [1], icl_task_type: language_modeling}\n"
    )
    (root / "eval_meta_data.csv").write_text(
        "Eval Task,Task Category,Random baseline\nsums,math,33.3\nwhich_op,math,50\ncomplete,math,0\n"
    )
    return root


def _reference_right(model, tokenizer, task, index) -> bool:
    """Each prompt alone: its tokens' losses by hand, the span after the shared prefix (or before the shared
    suffix), the lowest mean loss; language modelling: greedy reproduces the continuation."""
    prompts = prompts_of(task, index)
    seqs = [[tokenizer.bos_id, *tokenizer.encode(p)] for p in prompts]
    per_token = []
    for seq in seqs:
        logits = model(torch.tensor([seq]))[0]
        per_token.append((F.cross_entropy(logits[:-1], torch.tensor(seq[1:]), reduction="none"), logits.argmax(-1)))
    if task.kind == "language_modeling":
        start, seq = len(seqs[0]), seqs[1]
        return per_token[1][1][start - 1 : len(seq) - 1].tolist() == seq[start:]
    if task.kind == "multiple_choice":
        shared = next(i for i in range(min(map(len, seqs))) if len({s[i] for s in seqs}) > 1)
        spans = [(shared, len(s)) for s in seqs]
    else:
        shared = next(i for i in range(1, min(map(len, seqs)) + 1) if len({s[-i] for s in seqs}) > 1) - 1
        spans = [(len(s) - shared, len(s)) for s in seqs]
    means = [float(losses[s - 1 : e - 1].mean()) for (losses, _), (s, e) in zip(per_token, spans)]
    return means.index(min(means)) == task.items[index]["gold"]


def test_core_equals_a_per_prompt_reference_and_centres_on_the_baseline(tiny_runs, tmp_path):
    from tierlm.data import load_tokenizer
    from tierlm.models import load_pretrained_model

    bundle = write_bundle(tmp_path / "bundle")
    model = load_pretrained_model(tiny_runs / "pre" / "model").eval()
    tokenizer = load_tokenizer(tiny_runs / "pre" / "model")
    result = evaluate_core(model, tokenizer, bundle)
    with torch.no_grad():
        for task in read_bundle(bundle):
            right = [_reference_right(model, tokenizer, task, i) for i in range(len(task.items))]
            accuracy = sum(right) / len(right)
            got = result["tasks"][task.label]
            assert got["accuracy"] == pytest.approx(accuracy), task.label
            assert got["centered"] == pytest.approx((accuracy - task.baseline) / (1 - task.baseline))
    assert result["core"] == pytest.approx(sum(r["centered"] for r in result["tasks"].values()) / 3)


def test_tierlm_eval_core_writes_the_run_result_and_refuses_a_folder_without_a_bundle(
    tiny_runs, tmp_path, capsys, reports
):
    from conftest import run_main
    from tierlm.commands.cli import main

    run = shutil.copytree(tiny_runs / "pre", tmp_path / "run")
    assert (
        main(["eval", "--checkpoint", str(run), "--core", str(write_bundle(tmp_path / "bundle")), "--limit", "2"]) == 0
    )
    assert "CORE" in capsys.readouterr().out
    assert json.loads((run / "core.json").read_text())["tasks"]["sums"]["items"] == 2
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["type"] == "core" and "## CORE" in (run / "report.md").read_text()
    bad = run_main("eval", "--checkpoint", run, "--core", tmp_path)
    assert bad.returncode == 2 and "is not a CORE eval bundle: no core.yaml" in bad.stderr.strip().splitlines()[-1]
    with pytest.raises(ConfigError, match="no core.yaml"):
        read_bundle(tmp_path)


def test_chat_core_centres_each_tasks_greedy_accuracy_on_its_chance_level(tiny_runs, tmp_path):
    """`tierlm eval --chat-core`: greedy pass@1 per named task source, centred on chance (1/4 for four options, 0 for
    an open answer), ChatCORE their mean, recorded in the run."""
    from tierlm.commands.cli import main

    arc = tmp_path / "arc.jsonl"
    arc.write_text("".join(json.dumps({"question": f"{a} + 1?", "answerKey": "A", "choices": {
        "text": [str(a + 1), str(a), "7", "9"], "label": list("ABCD")}}) + "\n" for a in range(6)))  # fmt: skip
    run = shutil.copytree(tiny_runs / "sft", tmp_path / "run")
    sources = f"arith=synthetic:arithmetic,arc={arc}"
    assert main(["eval", "--checkpoint", str(run), "--chat-core", sources, "--limit", "3"]) == 0
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    tasks = record["tasks"]
    assert record["type"] == "chat_core" and tasks["arc"]["items"] == 3 and tasks["arith"]["items"] == 3
    assert tasks["arc"]["centered"] == pytest.approx((tasks["arc"]["accuracy"] - 0.25) / 0.75)
    assert tasks["arith"]["centered"] == pytest.approx(tasks["arith"]["accuracy"])
    assert record["core"] == pytest.approx((tasks["arc"]["centered"] + tasks["arith"]["centered"]) / 2)
    with pytest.raises(SystemExit) as bad:  # argparse's refusal: exit 2
        main(["eval", "--checkpoint", str(run), "--chat-core", "arith"])
    assert bad.value.code == 2


def test_ranks_sharing_the_items_add_up_to_the_single_process_core(tiny_runs, tmp_path):
    """Each rank scores every world-th item, as many forwards on each (FSDP's collectives), and the summed counts give
    the single-process figures: here two ranks in one process, their sums added by hand."""
    from tierlm.data import load_tokenizer
    from tierlm.models import load_pretrained_model

    tasks = read_bundle(write_bundle(tmp_path / "bundle"))
    model = load_pretrained_model(tiny_runs / "pre" / "model").train()
    tokenizer = load_tokenizer(tiny_runs / "pre" / "model")
    alone = evaluate_core(model, tokenizer, tasks, max_per_task=4)
    assert model.training  # left as it was
    shares, forwards = [], []
    for rank in (0, 1):
        seen = []
        handle = model.register_forward_hook(lambda *a: seen.append(1))
        evaluate_core(
            model, tokenizer, tasks, 4, "cpu", rank, 2, sum_over_ranks=lambda counts: shares.append(counts) or counts
        )
        handle.remove()
        forwards.append(len(seen))
    total = {label: shares[0][label] + shares[1][label] for label in shares[0]}
    assert forwards[0] == forwards[1]  # 3 tasks of 4, 3, 3 items: 2 forwards each on both ranks
    for task in tasks:
        assert total[task.label] / alone["tasks"][task.label]["items"] == alone["tasks"][task.label]["accuracy"]


def test_core_during_training_is_refused_in_one_line_where_it_cannot_run(tiny_runs, tmp_path, capsys):
    from conftest import RL, TINY
    from tierlm.commands.cli import main

    bundle = write_bundle(tmp_path / "bundle")
    cases = [
        (["rl", "--config", "tiny_rl", *RL, f"model.model_name_or_path={tiny_runs / 'sft'}"], "rl does not"),
        (["pretrain", "--config", "ul2-tiny", "model.depth=1"], "decoder-only"),
        (["pretrain", "--config", "tiny_pretrain", *TINY], "not a CORE eval bundle"),
    ]
    for i, (args, says) in enumerate(cases):
        out = tmp_path / f"run{i}"
        where = tmp_path if "not a CORE" in says else bundle
        assert main([*args, f"training.core_bundle={where}", f"infra.output_dir={out}"]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert says in line and line.startswith("tierlm: error: training.core_bundle") or "not a CORE" in line, line
        assert not out.exists()

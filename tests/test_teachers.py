"""Multi-teacher on-policy distillation (rl.teachers, `tierlm.loops.teachers`): each row scored by its domain's
teacher exactly as that teacher alone scores it, and a run routing two domains to two teachers."""

from __future__ import annotations

import json

import pytest
import torch

from tierlm.backends.references import FrozenReference
from tierlm.loops.teachers import Teachers
from tierlm.models import build_gpt, forward_logits
from tierlm.primitives.losses import token_logprobs


def _gpt(config, seed: int):
    torch.manual_seed(seed)
    gpt = build_gpt(config)
    with torch.no_grad():  # off the zero init, so the two teachers disagree
        for p in gpt.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return gpt


def test_each_row_is_scored_by_its_domains_teacher_as_that_teacher_alone_scores_it(tiny_gpt_config):
    """Two teachers, five rows routed 0, 1, 1, 0, 1: every row's sampled-token log-probs and top-3 (log-probs and ids)
    are those of its own teacher's forward over the whole batch at temperature 0.7, written out with the model's
    logits (and differ from the other teacher's)."""
    models = [_gpt(tiny_gpt_config, seed) for seed in (1, 2)]
    teachers = Teachers([FrozenReference(m, "cpu") for m in models], {"add": 1}, 0, ["rest", "add"], 3, 0.7)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 97, (5, 9), generator=g)
    labels = torch.where(torch.arange(9) >= 4, torch.randint(0, 97, (5, 9), generator=g), -100)
    which = torch.tensor([teachers.route(d) for d in ["sub", "add", "add", None, "add"]])
    assert which.tolist() == [0, 1, 1, 0, 1]
    scores = teachers.score({"input_ids": input_ids, "labels": labels, "teacher": which})
    for index, model in enumerate(models):
        with torch.no_grad():
            logits = forward_logits(model.eval(), {"input_ids": input_ids})
        logprobs = token_logprobs(logits, labels, 0.7)
        values, ids = torch.log_softmax(logits / 0.7, dim=-1).topk(3, dim=-1)
        mine, theirs = which == index, which != index
        torch.testing.assert_close(scores["logprobs"][mine], logprobs[mine], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(scores["topk_logprobs"][mine], values[mine], atol=1e-5, rtol=1e-5)
        assert torch.equal(scores["topk_ids"][mine], ids[mine])
        assert not torch.allclose(scores["logprobs"][theirs], logprobs[theirs], atol=1e-3)


@pytest.mark.slow
def test_two_domains_distilled_from_two_teachers_with_their_kls_in_the_train_lines(tiny_runs, tmp_path):
    """`tierlm rl rl.loss=distill_topk rl.teachers={add: PRE, sub: SFT}` on prompts of two domains: it trains (the
    top-k KL moves the weights) and every train line carries each teacher's KL(student || teacher): the student
    starts as the SFT model, so its KL to that teacher is 0 at step 0 and its KL to the other is not."""
    from conftest import run_main, two_domain_task
    from test_rl import _tiny_rl

    out = tmp_path / "run"
    args = [*_tiny_rl(tiny_runs), *two_domain_task(tmp_path), "rl.loss=distill_topk", "rl.distill_top_k=5"]
    args += [f"rl.teachers={{add: {tiny_runs / 'pre'}, sub: {tiny_runs / 'sft'}}}", "rl.prompts_per_step=4"]
    args += ["rl.group_size=2", "rl.max_new_tokens=8", "training.num_train_steps=3", f"infra.output_dir={out}"]
    result = run_main(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert len(train) == 3 and all(r["grad_norm"] > 0 and r["loss"] > 0 for r in train), train
    steps_with_both = [r for r in train if "teacher_kl_add" in r and "teacher_kl_sub" in r]
    assert steps_with_both, train
    first = train[0]
    assert first.get("teacher_kl_sub", 0.0) < 1e-6 and first.get("teacher_kl_add", 1.0) > 1e-3, first

"""Partial rollouts (rl.partial_rollouts, `tierlm.loops.partial`): the engine's continuation against a full
recompute, the scheduler against a schedule worked out by hand, the plain run as the special case, and the exact
resume of a run killed with groups in flight."""

from __future__ import annotations

import json

import pytest
import torch

from tierlm.config import RLConfig
from tierlm.loops.partial import PartialRollouts
from tierlm.models import build_gpt, forward_logits
from tierlm.rollout.engine import Completion, Engine, Rollout
from tierlm.rollout.sampling import GREEDY, SamplingParams
from tierlm.rollout.tools import Calculator


def _random_gpt(tiny_gpt_config):
    torch.manual_seed(0)
    gpt = build_gpt(tiny_gpt_config)
    with torch.no_grad():  # off the zero init, so the samples and log-probs are not uniform
        for p in gpt.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return gpt


def test_extend_goes_on_under_new_weights_with_their_logprobs_and_versions(tiny_gpt_config):
    """Three rows sampled 4 tokens under version 0, then the weights change and `extend` adds 5 tokens each: the
    new tokens' log-probs are the new model's over the whole sequence recomputed from scratch, the old ones keep
    theirs, and each token records the version that sampled it."""
    model = _random_gpt(tiny_gpt_config)
    engine, prompt = Engine(model), [1, 2, 3]
    generator = torch.Generator().manual_seed(3)
    rows = engine.generate(prompt, 3, 4, SamplingParams(1.0), generator=generator)
    before = [list(r.logprobs) for r in rows]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    engine.load_weights(None, 1)
    engine.extend(prompt, rows, 5, SamplingParams(1.0), generator=generator)
    for r, old in zip(rows, before):
        assert len(r.tokens) == 9 and r.versions == [0] * 4 + [1] * 5 and r.weight_version == 0
        assert r.logprobs[:4] == old
        with torch.no_grad():
            logits = forward_logits(model, {"input_ids": torch.tensor([prompt + r.tokens])})[0].float()
        positions = range(len(prompt) + 3, len(prompt) + 8)  # the logits that predict tokens 4..8
        expected = [torch.log_softmax(logits[p], -1)[r.tokens[p - len(prompt) + 1]] for p in positions]
        torch.testing.assert_close(torch.tensor(r.logprobs[4:]), torch.stack(expected), atol=2e-5, rtol=0)


def test_a_tool_result_cut_by_a_chunk_is_forced_first_in_the_next(tiny_tokenizer):
    """A chunk ends two tokens into the calculator's result: the rest is kept with the row and forced (masked, log-prob
    0) at the start of the next chunk, so the row reads exactly as one uncut generation."""
    tok = tiny_tokenizer
    vocab = tok.hf.get_vocab()
    call = [vocab["<|tool_call_start|>"], *tok.encode("17 + 25"), vocab["<|tool_call_end|>"]]
    result = [vocab["<|tool_start|>"], *tok.encode("42"), vocab["<|tool_end|>"]]
    answer = [*tok.encode("17 + 25 = 42"), vocab["<|assistant_end|>"]]
    filler = [tok.encode("9")[0]] * len(result)
    from test_rl import ScriptedEngine

    script = call + filler + answer
    engine = ScriptedEngine(script, tok.vocab_size, stop_ids=tok.stop_ids, tokenizer=tok, tools=[Calculator()])
    [row] = engine.generate([1, 2], 1, len(call) + 2, GREEDY)
    assert row.tokens == call + result[:2] and row.forced == result[2:] and not row.finished
    engine.load_weights(None, 1)
    engine.extend([1, 2], [row], 64, GREEDY)
    assert row.tokens == call + result + answer and row.finished and row.tool_calls == 1 and not row.forced
    assert row.mask == [1] * len(call) + [0] * len(result) + [1] * len(answer)
    assert row.versions == [0] * (len(call) + 2) + [1] * (len(result) - 2 + len(answer))


STOP = 99


class LengthEngine:
    """Rows that stop after as many tokens as their prompt's first id says: a schedule worked out by hand."""

    device = torch.device("cpu")
    needs_state = False

    def __init__(self):
        self.weight_version = 0

    def max_len(self) -> int:
        return 1000

    def generate_many(self, requests, max_new_tokens, params):
        out = []
        for prompt, n, _ in requests:
            rows = [Completion(weight_version=self.weight_version) for _ in range(n)]
            self._grow(prompt[0], rows, max_new_tokens)
            out.append(rows)
        return out

    def extend_many(self, requests, max_new_tokens, params, budget=None):
        for prompt, rows, _ in requests:
            self._grow(prompt[0], rows, min(max_new_tokens, budget - len(rows[0].tokens)))

    def _grow(self, length: int, rows: list[Completion], n: int) -> None:
        for r in rows:
            for _ in range(n):
                if r.finished:
                    break
                r.tokens.append(STOP if len(r.tokens) + 1 == length else 5)
                r.logprobs.append(-1.0)
                r.mask.append(1)
                r.versions.append(self.weight_version)
                r.finished = r.tokens[-1] == STOP


LENGTHS = [2, 8, 2, 4, 6, 2, 8, 2, 2, 2, 2, 2, 2, 2, 2, 2]  # of the prompts, in the order they start


def _schedule(mode: str):
    """Four steps of two groups, a window of four, chunks of 2 tokens, max_staleness 1: per step, the groups trained
    (each group: (its start, its first row)) and the step's figures."""
    engine = LengthEngine()
    rl = RLConfig(
        partial_rollouts=True, prompts_per_step=2, group_size=2, rollout_window=4, rollout_chunk=2, max_new_tokens=8,
        max_staleness=1, stale_rollouts=mode,
    )  # fmt: skip
    score = lambda groups: [[Rollout(g.prompt_ids, r, 0.0, "") for r in g.rows] for g in groups]  # noqa: E731
    partial = PartialRollouts(engine, rl, 0, 1, lambda s: (s, [LENGTHS[s], s], torch.Generator()), score)
    steps = []
    for step in range(4):
        engine.weight_version = step  # on-policy: step n samples with the weights after n updates
        groups = partial.sample(step)
        steps.append(([(g[0].prompt_ids[1], g[0].completion) for g in groups], partial.step_figures(step)))
    return steps


def test_the_scheduler_runs_the_schedule_worked_out_by_hand():
    """Prompt k's rows stop after LENGTHS[k] tokens (8: the budget); a round starts prompts while fewer than four
    groups are in flight or queued.

    drop: step 0 starts 0-3; one round finishes 0 and 2 (trained). Step 1 (weights v1) starts 4, 5; 1 and 3 go on
    under v1; 3 (tokens v0 v0 v1 v1) and 5 finish. Step 2: 1 began under v0, 2 behind: dropped; starts 6-8; 7 and 8
    finish. Step 3: 4 (v1) dropped; starts 9-11: 9 and 10 trained, 11 queued, 6 in flight.
    finish: at the end of step 1, group 1 (v0: step 1 is the last that may train it) is ended at 4 tokens and taken
    first, with 3; 5 waits, so step 2 starts only 6 and 7; 4 is ended the same way and taken with 5. Step 3 starts
    8 and 9; 6 (tokens v2 v2 v3 v3) is ended and taken with 7."""
    dropped = _schedule("drop")
    assert [[start for start, _ in groups] for groups, _ in dropped] == [[0, 2], [3, 5], [7, 8], [9, 10]]
    three = dropped[1][0][0][1]
    assert three.tokens == [5, 5, 5, STOP] and three.versions == [0, 0, 1, 1] and three.weight_version == 0
    figures = [f for _, f in dropped]
    assert [f["stale_dropped"] for f in figures] == [0, 0, 1, 1]
    assert [f["rollout_rounds"] for f in figures] == [1, 1, 1, 1]
    assert [f["groups_in_flight"] for f in figures] == [2, 2, 2, 2]

    finished = _schedule("finish")
    assert [[start for start, _ in groups] for groups, _ in finished] == [[0, 2], [1, 3], [4, 5], [6, 7]]
    one, four, six = finished[1][0][0][1], finished[2][0][0][1], finished[3][0][0][1]
    assert len(one.tokens) == 4 and not one.finished and one.versions == [0, 0, 1, 1]
    assert len(four.tokens) == 4 and not four.finished and four.versions == [1, 1, 2, 2]
    assert len(six.tokens) == 4 and six.versions == [2, 2, 3, 3]
    assert [f["stale_finished"] for _, f in finished] == [0, 1, 1, 1]
    assert [f["rollout_rounds"] for _, f in finished] == [1, 1, 1, 1]
    for step, (groups, _) in enumerate(finished):
        assert all(step - min(c.versions) <= 1 for _, c in groups)


def _load(run):
    from safetensors.torch import load_file

    return load_file(run / "model" / "model.safetensors")


def _train_lines(run) -> list[dict]:
    lines = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r for r in lines if r["type"] == "train"]


def test_one_chunk_of_the_whole_budget_and_a_window_of_one_step_is_the_plain_run(tiny_runs, tmp_path):
    """With rl.rollout_chunk = rl.max_new_tokens and rl.rollout_window = rl.prompts_per_step every group finishes in
    its first round and the step's groups are the plain run's prompts with the plain run's randomness: three steps
    end with the plain run's weights bit for bit."""
    from conftest import run_main
    from test_rl import _tiny_rl

    args = [*_tiny_rl(tiny_runs), "rl.algorithm=grpo", "rl.group_size=4", "rl.max_new_tokens=8"]
    args += ["training.num_train_steps=3", "rl.importance=token_truncate"]  # the partial run's default, in both
    plain, partial = tmp_path / "plain", tmp_path / "partial"
    assert run_main(*args, f"infra.output_dir={plain}").returncode == 0
    chunked = ["rl.partial_rollouts=true", "rl.rollout_chunk=8", "rl.rollout_window=2"]
    result = run_main(*args, *chunked, f"infra.output_dir={partial}")
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = _load(plain), _load(partial)
    assert all(torch.equal(a[k], b[k]) for k in a)
    lines = _train_lines(partial)
    assert [r["reward_mean"] for r in lines] == [r["reward_mean"] for r in _train_lines(plain)]
    assert all(r["rollout_rounds"] == 1 and r["token_age_mean"] == 0 and r["stale_dropped"] == 0 for r in lines)


@pytest.mark.slow
def test_partial_rollouts_with_teachers_resume_after_a_kill_with_the_straight_runs_weights(
    tiny_runs, tmp_path, monkeypatch
):
    """All of asynchronous RL at once: partial rollouts sampled one step ahead in the background
    (rl.max_off_policy_steps=1), chunks of 3 tokens, a window of two steps, distilled from two teachers routed by the
    prompts' domains (rl.teachers). Rows end at the tiny model's context (32 tokens) after prompts of different
    lengths, so groups finish in different rounds, some go on under newer weights (several versions in one row and
    one batch) and some are in flight at every checkpoint. Killed at its step-2 checkpoint and resumed, the run ends
    with the uninterrupted run's weights bit for bit."""
    from conftest import kill_at_checkpoint, run_main, two_domain_task
    from test_rl import _tiny_rl

    args = [*_tiny_rl(tiny_runs), *two_domain_task(tmp_path), "rl.group_size=4", "rl.max_new_tokens=24"]
    args += ["rl.loss=distill", f"rl.teachers={{add: {tiny_runs / 'pre'}, sub: {tiny_runs / 'sft'}}}"]
    args += ["rl.partial_rollouts=true", "rl.rollout_chunk=3", "rl.rollout_window=4", "rl.max_off_policy_steps=1"]
    args += ["training.num_train_steps=8"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    result = run_main(*args, f"infra.output_dir={straight}")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = _train_lines(straight)
    assert all(r["grad_norm"] > 0 for r in lines[2:])  # the steps after the checkpoint move the weights
    assert any("teacher_kl_add" in r and "teacher_kl_sub" in r for r in lines[2:])  # both teachers score them
    assert any(r["spanning_frac"] > 0 for r in lines) and max(r["token_age_mean"] for r in lines) > 1
    assert all(r["staleness"] <= 2 for r in lines) and max(r["staleness"] for r in lines) == 2  # rl.max_staleness
    state = json.loads((straight / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    [mine] = state["partial_rollouts"]
    assert mine["in_flight"] and any(g["rows"] and g["rollouts"] is None for g in mine["in_flight"])
    [pending] = state["pending_rollouts"]  # the step sampled ahead, each rollout with its domain
    domains = {r["domain"] for groups in pending.values() for group in groups for r in group}
    assert domains and domains <= {"add", "sub"}, domains

    kill_at_checkpoint(args, killed, 2)
    result = run_main(*args, f"infra.output_dir={killed}", "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = _load(straight), _load(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_partial_rollouts_at_two_ranks_resume_every_ranks_groups(tiny_runs, tmp_path, monkeypatch):
    """2 DDP ranks, each scheduling its share of the window in chunks of 3 tokens: the checkpoint holds both ranks'
    groups in flight, and the run rolled back to its step-2 checkpoint and resumed at two ranks ends with the
    uninterrupted run's weights bit for bit."""
    import shutil

    from conftest import digits_reward
    from forked import ranks
    from test_rl import _tiny_rl

    args = ["-m", "tierlm", *_tiny_rl(tiny_runs), "rl.algorithm=grpo", "rl.group_size=4", "rl.max_new_tokens=24"]
    args += [digits_reward(tmp_path, monkeypatch), "rl.partial_rollouts=true", "rl.rollout_chunk=3"]
    args += ["rl.rollout_window=4", "training.num_train_steps=5", "infra.distributed_type=ddp"]
    out = tmp_path / "run"
    result = ranks(*args, f"infra.output_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    straight = _load(out)
    state = json.loads((out / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert len(state["partial_rollouts"]) == 2 and all(rank["in_flight"] for rank in state["partial_rollouts"])
    assert any(r["spanning_frac"] > 0 for r in _train_lines(out))
    for checkpoint in (out / "checkpoints").glob("step_*"):
        if int(checkpoint.name.split("_")[1]) > 2:
            shutil.rmtree(checkpoint)
    shutil.rmtree(out / "model")
    (out / "checkpoints" / "latest").write_text("step_2\n")
    result = ranks(*args, f"infra.output_dir={out}", "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = _load(out)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)

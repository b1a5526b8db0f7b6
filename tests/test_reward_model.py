"""Reward models: the Bradley–Terry loss against its formula written out here on scores read by hand at each
sequence's last token; the saved folder is transformers' own sequence classifier, scoring what tierlm scores; the
`tierlm rm` stage resumes bit-exactly and its model rewards an RL run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tierlm.config import RLConfig
from tierlm.errors import ConfigError, DataError
from tierlm.models import GPTConfig, build_gpt, save_model_folder
from tierlm.models.reward import RewardScorer, add_score_head, check_reward_model_folder
from tierlm.primitives.losses import IGNORE_INDEX
from tierlm.strategies.reward import RewardStrategy
from tierlm.strategies.rl_losses import resolve_rl

PAD = 0
# Three pairs of whole sequences (chosen, rejected) of different lengths; the reply is the last 2-3 tokens.
PAIRS = [([5, 6, 7, 8, 9], [5, 6, 7, 3]), ([4, 4, 2, 9, 9, 9], [4, 4, 2, 1]), ([3, 2, 1], [3, 2, 6, 6, 6, 6, 7])]


def _reward_model(seed: int = 0):
    torch.manual_seed(seed)
    config = GPTConfig(depth=2, aspect_ratio=16, head_dim=16, vocab_size=12, max_seq_len=16, tie_embeddings=True)
    gpt = build_gpt(config)
    return add_score_head(gpt, PAD)


def _pair_batch():
    """As `PairLoader` makes it: N chosen rows then N rejected, shifted (input = ids[:-1], labels on the reply)."""
    rows = [c for c, _ in PAIRS] + [r for _, r in PAIRS]
    width = max(map(len, rows)) - 1
    ids = torch.full((len(rows), width), PAD)
    labels = torch.full((len(rows), width), IGNORE_INDEX)
    for i, row in enumerate(rows):
        ids[i, : len(row) - 1] = torch.tensor(row[:-1])
        labels[i, len(row) - 3 : len(row) - 1] = torch.tensor(row[-2:])  # the last two tokens are the reply
    return {"input_ids": ids, "labels": labels, "margin": torch.tensor([0.5, 0.0, 1.5])}


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


@pytest.mark.parametrize("center", [0.0, 0.01])
def test_bradley_terry_loss_on_last_token_scores_equals_the_formula(center):
    """-log sigmoid(r_c - r_r - margin) + c (r_c + r_r)^2 per pair, each r the model's output at the last token of
    the whole sequence, run alone (no padding)."""
    model = _reward_model()
    strategy = RewardStrategy(PAD, center)
    batch = strategy.prepare_batch(_pair_batch())
    total, count = strategy.compute_loss(model(batch["input_ids"]), batch)
    expected = 0.0
    for (chosen, rejected), margin in zip(PAIRS, [0.5, 0.0, 1.5]):
        rc, rr = (model(torch.tensor([seq]))[0, -1, 0].item() for seq in (chosen, rejected))
        expected += -_logsig(rc - rr - margin) + center * (rc + rr) ** 2
    assert count.item() == 3
    assert total.item() == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_a_saved_reward_model_is_transformers_sequence_classifier_scoring_as_tierlm_does(tmp_path):
    """`save_model_folder` writes Qwen3ForSequenceClassification (one label, the pad id): transformers' own model
    loads it and scores a right-padded batch as the training strategy does, and `RewardScorer` reads it back."""
    from transformers import AutoModelForSequenceClassification

    model = _reward_model()
    save_model_folder(model, tmp_path / "rm")
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForSequenceClassification"] and config["pad_token_id"] == PAD
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert hf.config.num_labels == 1
    strategy = RewardStrategy(PAD)
    batch = strategy.prepare_batch(_pair_batch())
    with torch.no_grad():
        ours = strategy.scores(model(batch["input_ids"]), batch)
        theirs = hf(input_ids=batch["input_ids"], attention_mask=(batch["input_ids"] != PAD).long()).logits[:, 0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    sequences = [c for c, _ in PAIRS] + [r for _, r in PAIRS]
    scored = torch.tensor(RewardScorer(tmp_path / "rm", batch_size=4).score(sequences))
    torch.testing.assert_close(scored, ours, atol=1e-5, rtol=1e-5)


def test_a_transformers_causal_lm_becomes_its_own_sequence_classifier(tmp_path):
    """The same head swap on a transformers model (a tied GPT-2): saved as GPT2ForSequenceClassification, loaded
    back by transformers with the same scores."""
    from transformers import AutoModelForSequenceClassification, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=12, n_positions=16, n_embd=32, n_layer=1, n_head=2)).eval()
    model = add_score_head(gpt2, PAD)
    save_model_folder(model, tmp_path / "rm")
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert type(hf).__name__ == "GPT2ForSequenceClassification"
    ids = torch.tensor([[5, 6, 7, 8], [3, 2, PAD, PAD]])
    with torch.no_grad():
        ours = model(input_ids=ids).logits[..., 0].gather(1, torch.tensor([[3], [1]]))[:, 0]
        theirs = hf(input_ids=ids, attention_mask=(ids != PAD).long()).logits[:, 0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_reward_settings_and_folders_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="give rl.reward_model=FOLDER"):
        RLConfig(reward_model_weight=2.0)
    with pytest.raises(ConfigError, match="rl.reward_model"):  # the distill row fixes it (resolved with the run)
        resolve_rl(RLConfig(loss="distill", teacher="t", reward_model="r"))
    causal_lm = build_gpt(GPTConfig(depth=1, aspect_ratio=16, head_dim=16, vocab_size=12, max_seq_len=8))
    save_model_folder(causal_lm, tmp_path)
    with pytest.raises(ConfigError, match=r"is not a reward model \(architectures \['Qwen3ForCausalLM'\]"):
        check_reward_model_folder(tmp_path, "rl.reward_model")


def test_pairs_carry_their_margin_and_refuse_a_bad_one(tiny_tokenizer):
    from tierlm.data.preferences import PairLoader
    from tierlm.data.rows import Fields, row_to_preference

    fields = Fields()
    rows = [{"prompt": "1 + 2", "chosen": "3", "rejected": "4", "margin": m} for m in (1.0, 2)]
    loader = PairLoader([row_to_preference(r, fields, "row") for r in rows], tiny_tokenizer, 2, 64, shuffle=False)
    assert loader.next_batch()["margin"].tolist() == [1.0, 2.0]
    with pytest.raises(DataError, match="margin must be a number"):
        row_to_preference({**rows[0], "margin": "big"}, fields, "row 3")


@pytest.mark.slow
def test_rm_run_resumes_bit_exact_and_its_model_rewards_rl(tiny_runs, tmp_path):
    """`tierlm rm` rolled back to its step-2 checkpoint and resumed ends with the straight run's weights, logs
    held-out pair accuracy, and writes a classifier that `tierlm rl rl.reward_model=...` trains on alone (the train
    lines carry its agreement with the task's verifier)."""
    from safetensors.torch import load_file

    from conftest import CHAT, RL, resume_from_checkpoint
    from tierlm.commands.cli import main

    rm = tmp_path / "rm"
    args = ["rm", "--config", "tiny_rm", f"model.model_name_or_path={tiny_runs / 'sft'}", *CHAT]
    args += ["training.num_train_steps=4", "training.save_steps=2", "training.eval_steps=2"]
    assert main([*args, f"infra.output_dir={rm}"]) == 0
    records = [json.loads(line) for line in (rm / "metrics.jsonl").read_text().splitlines()]
    assert any(r["type"] == "eval" and 0 <= r["rm_acc"] <= 1 for r in records)
    straight = load_file(rm / "model" / "model.safetensors")
    assert "score.weight" in straight and "lm_head.weight" not in straight
    resume_from_checkpoint(args, rm, 2, in_process=True)
    resumed = load_file(rm / "model" / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)

    out = tmp_path / "rl"
    args = ["rl", "--config", "tiny_rl", f"model.model_name_or_path={tiny_runs / 'sft'}", *RL]
    args += [f"rl.reward_model={rm}", "rl.task_reward_weight=0", "rl.loss=grpo", "training.logging_steps=1"]
    assert main([*args, f"infra.output_dir={out}"]) == 0
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert len(train) == 2 and all("rm_score_mean" in r for r in train)
    from tierlm.builders.model import load_reward_model

    with pytest.raises(ConfigError, match="is not a reward model"):  # the policy's own folder: a causal LM
        load_reward_model(RLConfig(reward_model=str(tiny_runs / "sft")), None, torch.device("cpu"))

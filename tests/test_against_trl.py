"""tierlm's preference and reward-model losses against TRL's own trainers on the same batch: TRL tokenizes,
collates and scores a batch with its `DPOTrainer` / `KTOTrainer` / `RewardTrainer`; the same token ids, laid out
as tierlm's loaders lay them out, go through tierlm's strategies on the same weights."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForSequenceClassification, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from tierlm.config import DPOConfig  # noqa: E402
from tierlm.models import forward_logits, save_model_folder  # noqa: E402
from tierlm.models.reward import add_score_head  # noqa: E402
from tierlm.primitives.losses import IGNORE_INDEX  # noqa: E402
from tierlm.stages.dpo import preference_strategy  # noqa: E402
from tierlm.strategies.reward import RewardStrategy  # noqa: E402

PAIRS = [
    {"prompt": "What is 2 + 3?", "chosen": " 5", "rejected": " 6 or so"},
    {"prompt": "What is 10 - 4?", "chosen": " 6, since 10 - 4 = 6", "rejected": " 7"},
    {"prompt": "What is 1 + 1?", "chosen": " 2", "rejected": " 3"},
]


def _model(hf_tokenizer, seed: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=len(hf_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        pad_token_id=hf_tokenizer.pad_token_id,
        eos_token_id=hf_tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


def _args(config_class, tmp_path, **kwargs):
    return config_class(
        output_dir=str(tmp_path / "trl"), report_to=[], per_device_train_batch_size=3, use_cpu=True, **kwargs
    )


def _shifted(input_ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's rows (`mask` 1 on the tokens scored) as tierlm's loaders make them: shifted input_ids and labels."""
    return {"input_ids": input_ids[:, :-1], "labels": input_ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)}


@pytest.mark.parametrize(
    "loss_type, extra", [("sigmoid", {}), ("hinge", {}), ("ipo", {}), ("robust", {"label_smoothing": 0.2})]
)
def test_preference_losses_equal_trls_dpo_trainer(tiny_tokenizer, tmp_path, loss_type, extra):
    from trl import DPOConfig as TRLDPOConfig
    from trl import DPOTrainer

    hf = tiny_tokenizer.hf
    policy, reference = _model(hf, 0), _model(hf, 1)
    args = _args(TRLDPOConfig, tmp_path, beta=0.3, loss_type=[loss_type], max_length=None, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(policy, reference, args=args, train_dataset=Dataset.from_list(PAIRS), processing_class=hf)
    batch = next(iter(trainer.get_train_dataloader()))  # [chosen rows, rejected rows], right-padded
    with torch.no_grad():
        theirs = trainer._compute_loss(trainer.model, dict(batch), return_outputs=False)
        strategy = preference_strategy(DPOConfig(loss_type=loss_type, beta=0.3, **extra))
        ours_batch = _shifted(batch["input_ids"], batch["completion_mask"])
        ours_batch["ref_logps"] = strategy._logps(forward_logits(reference, ours_batch), ours_batch)["logps"]
        total, count = strategy.compute_loss(forward_logits(policy, ours_batch), strategy.prepare_batch(ours_batch))
    assert float(total / count) == pytest.approx(float(theirs), rel=1e-5, abs=1e-6)


def test_kto_equals_trls_kto_trainer(tiny_tokenizer, tmp_path):
    """The KL rows TRL collates (each prompt with another example's reply) and its labels, through tierlm's
    KTO: TRL's mean loss over the batch, with the same desirable / undesirable weights."""
    from trl import KTOConfig, KTOTrainer

    hf = tiny_tokenizer.hf
    policy, reference = _model(hf, 0), _model(hf, 1)
    rows = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"} for p in PAIRS
            for side in ("chosen", "rejected")]  # fmt: skip
    args = _args(KTOConfig, tmp_path, beta=0.3, desirable_weight=1.3, undesirable_weight=0.8, max_length=None)
    args.per_device_train_batch_size = 6
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = KTOTrainer(policy, reference, args=args, train_dataset=Dataset.from_list(rows), processing_class=hf)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        theirs = trainer._compute_loss(trainer.model, dict(batch), return_outputs=False)
        width = max(batch["input_ids"].shape[1], batch["KL_input_ids"].shape[1])
        pad = lambda t, value: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)  # noqa: E731
        ids = torch.cat([pad(batch["input_ids"], hf.pad_token_id), pad(batch["KL_input_ids"], hf.pad_token_id)])
        mask = torch.cat([pad(batch["completion_mask"], 0), pad(batch["KL_completion_mask"], 0)])
        ours_batch = _shifted(ids, mask)
        ours_batch["kto_label"] = torch.as_tensor(batch["label"], dtype=torch.float)
        strategy = preference_strategy(
            DPOConfig(loss_type="kto", beta=0.3, desirable_weight=1.3, undesirable_weight=0.8)
        )
        ours_batch["ref_logps"] = strategy._logps(forward_logits(reference, ours_batch), ours_batch)["logps"]
        total, count = strategy.compute_loss(forward_logits(policy, ours_batch), strategy.prepare_batch(ours_batch))
    assert float(total / count) == pytest.approx(float(theirs), rel=1e-5, abs=1e-6)


def test_reward_model_loss_equals_trls_reward_trainer(tiny_tokenizer, tmp_path):
    """tierlm's reward model (a causal LM with a scalar head) saved as Qwen3ForSequenceClassification: TRL's
    RewardTrainer on that folder and tierlm's Bradley–Terry strategy on the tierlm model give one loss (margins and
    centring included)."""
    from trl import RewardConfig, RewardTrainer

    hf = tiny_tokenizer.hf
    ours_model = add_score_head(_model(hf, 0), hf.pad_token_id)
    save_model_folder(ours_model, tmp_path / "rm")
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    rows = [{**p, "margin": m} for p, m in zip(PAIRS, (0.5, 0.0, 2.0))]
    args = _args(RewardConfig, tmp_path, center_rewards_coefficient=0.05, max_length=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = RewardTrainer(classifier, args=args, train_dataset=Dataset.from_list(rows), processing_class=hf)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        theirs = trainer.compute_loss(trainer.model, dict(batch))
        strategy = RewardStrategy(hf.pad_token_id, center_rewards_coefficient=0.05)
        ours_batch = _shifted(batch["input_ids"], batch["attention_mask"])  # every real token labelled: its last scores
        ours_batch["margin"] = batch["margin"]
        prepared = strategy.prepare_batch(ours_batch)
        total, count = strategy.compute_loss(forward_logits(ours_model, prepared), prepared)
    assert float(total / count) == pytest.approx(float(theirs), rel=1e-5, abs=1e-6)

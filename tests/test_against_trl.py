"""tierlm's preference and reward-model losses against TRL's own trainers on the same batch: TRL tokenizes,
collates and scores a batch with its `DPOTrainer` / `KTOTrainer` / `RewardTrainer`; the same token ids, laid out
as tierlm's loaders lay them out, go through tierlm's strategies on the same weights."""

from __future__ import annotations

import math
import warnings
from typing import Callable

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForSequenceClassification, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from conftest import PREFERENCE_CASES  # noqa: E402
from tierlm.config import DPOConfig  # noqa: E402
from tierlm.models import forward_logits, save_model_folder  # noqa: E402
from tierlm.models.reward import add_score_head  # noqa: E402
from tierlm.primitives.losses import IGNORE_INDEX  # noqa: E402
from tierlm.strategies.dpo import preference_strategy  # noqa: E402
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
    kwargs.setdefault("per_device_train_batch_size", 3)
    return config_class(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, **kwargs)


def _shifted(input_ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's rows (`mask` 1 on the tokens scored) as tierlm's loaders make them: shifted input_ids and labels."""
    return {"input_ids": input_ids[:, :-1], "labels": input_ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)}


def _dpo_against_trl(tiny_tokenizer, tmp_path, trl_kwargs: dict, ours: dict) -> tuple[float, Callable, float]:
    """TRL's `DPOTrainer._compute_loss` on the batch it collates from PAIRS (beta 0.3, `trl_kwargs`), and tierlm's
    strategy of `DPOConfig(beta=0.3, **ours, **changes)` on the same rows: (the first with `ours`, a function of
    `changes` giving the others, TRL's)."""
    from trl import DPOConfig as TRLDPOConfig
    from trl import DPOTrainer

    hf = tiny_tokenizer.hf
    policy, reference = _model(hf, 0), _model(hf, 1)
    args = _args(TRLDPOConfig, tmp_path, beta=0.3, max_length=None, **trl_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(policy, reference, args=args, train_dataset=Dataset.from_list(PAIRS), processing_class=hf)
    batch = next(iter(trainer.get_train_dataloader()))  # [chosen rows, rejected rows], right-padded
    rows = _shifted(batch["input_ids"], batch["completion_mask"])

    @torch.no_grad()
    def tierlm_loss(**changes) -> float:
        strategy = preference_strategy(DPOConfig(beta=0.3, **{**ours, **changes}))
        ours_batch = {**rows, "ref_logps": strategy.reference_logps(forward_logits(reference, rows), rows)["logps"]}
        total, count = strategy.compute_loss(forward_logits(policy, ours_batch), strategy.prepare_batch(ours_batch))
        return float(total / count)

    with torch.no_grad():
        theirs = float(trainer._compute_loss(trainer.model, dict(batch), return_outputs=False))
    return tierlm_loss(), tierlm_loss, theirs


@pytest.mark.parametrize("loss_type, extra", [case for case in PREFERENCE_CASES if case[0] not in ("simpo", "orpo")])
def test_preference_losses_equal_trls_dpo_trainer(tiny_tokenizer, tmp_path, loss_type, extra):
    ours, _, theirs = _dpo_against_trl(tiny_tokenizer, tmp_path, {"loss_type": [loss_type], **extra},
                                       {"loss_type": loss_type, **extra})  # fmt: skip
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_equals_trls_kto_trainer(tiny_tokenizer, tmp_path, loss_type):
    """The KL rows TRL collates (each prompt with another example's reply; none for apo_zero_unpaired) and its
    labels, through tierlm's KTO strategy: TRL's mean loss over the batch, with the same desirable / undesirable
    weights."""
    from trl import KTOConfig, KTOTrainer

    hf = tiny_tokenizer.hf
    policy, reference = _model(hf, 0), _model(hf, 1)
    rows = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"} for p in PAIRS
            for side in ("chosen", "rejected")]  # fmt: skip
    args = _args(KTOConfig, tmp_path, per_device_train_batch_size=6, beta=0.3, desirable_weight=1.3,
                 undesirable_weight=0.8, max_length=None, loss_type=loss_type)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = KTOTrainer(policy, reference, args=args, train_dataset=Dataset.from_list(rows), processing_class=hf)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        theirs = trainer._compute_loss(trainer.model, dict(batch), return_outputs=False)
        if loss_type == "kto":  # its KL rows after the replies
            width = max(batch["input_ids"].shape[1], batch["KL_input_ids"].shape[1])
            pad = lambda t, value: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)  # noqa: E731
            ids = torch.cat([pad(batch["input_ids"], hf.pad_token_id), pad(batch["KL_input_ids"], hf.pad_token_id)])
            mask = torch.cat([pad(batch["completion_mask"], 0), pad(batch["KL_completion_mask"], 0)])
        else:
            assert "KL_input_ids" not in batch
            ids, mask = batch["input_ids"], batch["completion_mask"]
        ours_batch = _shifted(ids, mask)
        ours_batch["kto_label"] = torch.as_tensor(batch["label"], dtype=torch.float)
        strategy = preference_strategy(
            DPOConfig(loss_type=loss_type, beta=0.3, desirable_weight=1.3, undesirable_weight=0.8)
        )
        ours_batch["ref_logps"] = strategy.reference_logps(forward_logits(reference, ours_batch), ours_batch)["logps"]
        total, count = strategy.compute_loss(forward_logits(policy, ours_batch), strategy.prepare_batch(ours_batch))
    assert float(total / count) == pytest.approx(float(theirs), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_sft_losses_equal_trls_sft_trainer(tiny_tokenizer, tmp_path, loss_type):
    """training.sft_loss's rows against TRL's `SFTTrainer.compute_loss` with its `loss_type` on the batch it collates
    (prompt-completion rows: the completions are trained), the loss and its gradients; DFT differs from the plain
    loss."""
    from trl import SFTConfig, SFTTrainer

    from tierlm.strategies.sft import SFT_LOSSES

    hf = tiny_tokenizer.hf
    model = _model(hf, 0)
    rows = [{"prompt": p["prompt"], "completion": p["chosen"]} for p in PAIRS]
    args = _args(SFTConfig, tmp_path, loss_type=loss_type, max_length=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(model, args=args, train_dataset=Dataset.from_list(rows), processing_class=hf)
    batch = next(iter(trainer.get_train_dataloader()))
    ours = {"input_ids": batch["input_ids"][:, :-1], "labels": batch["labels"][:, 1:]}
    theirs = trainer.compute_loss(trainer.model, dict(batch))
    their_grads = torch.autograd.grad(theirs, list(model.parameters()))
    logits = forward_logits(model, ours)
    mean = {name: torch.div(*row().compute_loss(logits, ours)) for name, row in SFT_LOSSES.items()}
    assert (ours["labels"] != IGNORE_INDEX).sum() > 6
    assert float(mean[loss_type]) == pytest.approx(float(theirs), rel=1e-5, abs=1e-7)
    for mine, their in zip(torch.autograd.grad(mean[loss_type], list(model.parameters())), their_grads, strict=True):
        torch.testing.assert_close(mine, their, rtol=1e-4, atol=1e-7)
    assert float(mean["dft"]) < 0.5 * float(mean["nll"])  # each token weighed by its probability, here well below 1/2


LONG_PAIRS = [  # (prompt, chosen, rejected): at 24 inputs (25 tokens) the first two are cut, the third's prompt fills
    ("What is 2 + 3?", "5", "6 or so, since 2 + 3 is about 6"),  # 14 and 41 tokens
    ("What is 10 - 4?", "6, since 10 - 4 = 6 and 6 + 4 = 10", "7"),  # 44 and 15
    ("What is " + " + ".join(["1"] * 12) + "?", "12", "13"),  # a prompt of 42 tokens
    ("What is 1 + 1?", "2", "3"),  # 14 and 14
]


def _long_pairs(tiny_tokenizer):
    """LONG_PAIRS as tierlm's pairs, and as the token ids TRL's collators take (prompt, chosen and rejected apart)."""
    from tierlm.data.preferences import PreferencePair

    def conversation(prompt, reply):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]

    pairs = [PreferencePair(conversation(p, c), conversation(p, r)) for p, c, r in LONG_PAIRS]
    examples = []
    for pair in pairs:
        (chosen, chosen_mask), (rejected, rejected_mask) = [
            tiny_tokenizer.render_conversation(side, train_on="last_assistant") for side in (pair.chosen, pair.rejected)
        ]
        start = chosen_mask.index(1)  # the reply and its end of turn, to the row's end
        assert chosen_mask[start:] == [1] * (len(chosen) - start) and chosen[:start] == rejected[:start]
        examples.append({"prompt_ids": chosen[:start], "chosen_ids": chosen[start:], "rejected_ids": rejected[start:]})
    return pairs, examples


def test_long_pairs_are_cut_and_dropped_as_trls_collators_do(tiny_tokenizer):
    """data.long_conversations=truncate lays out over-long pairs as TRL's DataCollatorForPreference does with
    truncation_mode=keep_start and max_length the row's tokens, after its DPOTrainer's filter (a prompt that fills
    max_length is dropped); the unpaired replies as its DataCollatorForUnpairedPreference with KTOTrainer's filter;
    drop (what tierlm rm uses) keeps the pairs TRL's RewardTrainer keeps (both sides within max_length)."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    from tierlm.data.preferences import PairLoader, UnpairedExample, UnpairedLoader

    pairs, examples = _long_pairs(tiny_tokenizer)
    max_len, pad = 24, tiny_tokenizer.pad_id

    def same(ours, theirs):  # the same labels, and the same inputs before each row's last scored token
        expected = _shifted(theirs["input_ids"], theirs["completion_mask"])
        assert torch.equal(ours["labels"], expected["labels"])
        read = (expected["labels"] != IGNORE_INDEX).flip(1).cummax(1).values.flip(1)
        assert torch.equal(ours["input_ids"][read], expected["input_ids"][read])

    kept = [e for e in examples if len(e["prompt_ids"]) < max_len + 1]  # DPOTrainer's filter under keep_start
    loader = PairLoader(pairs, tiny_tokenizer, len(kept), max_len, shuffle=False)
    same(loader.next_batch(), DataCollatorForPreference(pad_token_id=pad, max_length=max_len + 1)(kept))
    assert loader.stats()["pairs_dropped"] == 1 and loader.stats()["pairs_truncated"] == 2

    fits = [
        e
        for e in examples
        if max(len(e["prompt_ids"]) + len(e[s]) for s in ("chosen_ids", "rejected_ids")) <= max_len + 1
    ]
    loader = PairLoader(pairs, tiny_tokenizer, len(fits), max_len, shuffle=False, long_conversations="drop")
    same(loader.next_batch(), DataCollatorForPreference(pad_token_id=pad)(fits))
    assert loader.stats()["pairs_dropped"] == 3 and loader.stats()["pairs_truncated"] == 0

    replies = [UnpairedExample(pair.chosen, True) for pair in pairs] + [
        UnpairedExample(p.rejected, False) for p in pairs
    ]
    unpaired = [{"prompt_ids": e["prompt_ids"], "completion_ids": e[side], "label": side == "chosen_ids"}
                for side in ("chosen_ids", "rejected_ids") for e in kept]  # fmt: skip
    loader = UnpairedLoader(replies, tiny_tokenizer, len(unpaired), max_len, kl_rows=False, shuffle=False)
    theirs = DataCollatorForUnpairedPreference(pad_token_id=pad, max_length=max_len + 1)(unpaired)
    ours = loader.next_batch()
    same(ours, theirs)
    assert ours["kto_label"].tolist() == [float(e["label"]) for e in unpaired]
    assert loader.stats()["examples_dropped"] == 2 and loader.stats()["examples_truncated"] == 2


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


GRPO_CASES = [
    ("grpo", {"loss_type": "grpo", "epsilon": 0.2}, {}),
    ("dapo", {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28}, {}),
    ("dr_grpo", {"loss_type": "dr_grpo", "epsilon": 0.2}, {}),
    ("cispo", {"loss_type": "cispo", "epsilon_high": 5.0}, {}),
    ("gspo", {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.01, "epsilon_high": 0.02},
     {"clip_low": 0.01, "clip_high": 0.02}),
    ("bnpo", {"loss_type": "bnpo", "epsilon": 0.2}, {}),
    ("sapo", {"loss_type": "sapo", "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}, {}),
    ("luspo", {"loss_type": "luspo", "importance_sampling_level": "sequence", "epsilon": 0.01, "epsilon_high": 0.02},
     {"clip_low": 0.01, "clip_high": 0.02}),
    ("vespo", {"loss_type": "vespo"}, {}),
    ("sapo", {"loss_type": "sapo", "sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0},
     {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0}),
    ("vespo", {"loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_neg": 1.0},
     {"vespo_k_pos": 1.5, "vespo_lambda_neg": 1.0}),
]  # fmt: skip
CORRECTIONS = [  # (rl.importance, floor, cap, rl.off_policy_mask): TRL's vLLM importance modes and its sequence mask
    ("token_truncate", None, 1.2, None),
    ("token_mask", 0.8, 1.25, None),  # IcePop's band, narrowed so that it masks here
    ("sequence_truncate", 0.5, 3.0, None),
    ("sequence_mask", None, 2.0, None),
    (None, None, None, 0.05),  # DeepSeek-V3.2's off-policy sequence mask
]


def trl_importance(old, sampler, mask, mode, floor, cap):
    """TRL's vLLM importance-sampling ratio (GRPOTrainer._generate_and_score_completions), written out."""
    diff = torch.nan_to_num((old - sampler) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=floor, max=cap)
    low, high = floor if floor is not None else -math.inf, cap if cap is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def _grpo_against_trl(tiny_tokenizer, tmp_path, loss, theirs_kwargs, ours_kwargs, correction=None):
    """tierlm's loss and TRL's `GRPOTrainer._compute_loss` on one batch of completions of different lengths, with
    stored old log-probs far enough from the policy's that the clips bite (and a sampler's further off, for the
    corrections): (ours, theirs)."""
    from trl import GRPOConfig, GRPOTrainer

    from tierlm.config import RLConfig
    from tierlm.strategies.off_policy import importance_weights
    from tierlm.strategies.rl import policy_gradient_strategy
    from tierlm.strategies.rl_losses import resolve_rl

    hf = tiny_tokenizer.hf
    policy = _model(hf, 0)
    B, P, C = 4, 5, 8  # completions, prompt tokens, completion tokens
    args = _args(
        GRPOConfig,
        tmp_path,
        per_device_train_batch_size=B,
        num_generations=4,
        max_completion_length=C,
        bf16=False,
        **{**theirs_kwargs, "beta": 0.0},
    )  # fmt: skip  (TRL's GRPO defaults to bf16 autocast; its beta is set below, where it loads no reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            policy,
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_list([{"prompt": "What is 2 + 3?"}] * B),
            processing_class=hf,
        )
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, len(hf), (B, P), generator=g)
    completion_ids = torch.randint(3, len(hf), (B, C), generator=g)
    completion_mask = (torch.arange(C)[None] < torch.tensor([8, 5, 3, 6])[:, None]).long()
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.1])
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    labels = torch.full((B, P + C - 1), IGNORE_INDEX)
    labels[:, P - 1 :] = completion_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)
    batch = {"input_ids": ids[:, :-1], "labels": labels, "advantages": advantages}

    def full(completion_values):  # (B, C) completion values at their places in the (B, P + C - 1) rows
        values = torch.zeros(B, P + C - 1)
        values[:, P - 1 :] = completion_values * completion_mask
        return values

    with torch.no_grad():
        current = torch.log_softmax(forward_logits(policy, batch).float(), -1)
        current = current.gather(-1, ids[:, 1:, None]).squeeze(-1)[:, P - 1 :]
        old = current + 0.3 * torch.randn(B, C, generator=g)  # ratios of about e^(+-0.3): some clipped
        sampler = old + 0.2 * torch.randn(B, C, generator=g)  # the sampler's own arithmetic, further off
        sampler[3] += 0.1  # the last (negative) row: its mean KL(sampler || policy) past rl.off_policy_mask's 0.05
        inputs = {
            "prompt_ids": prompt_ids,
            "prompt_mask": torch.ones_like(prompt_ids),
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": advantages,
            "old_per_token_logps": old,
            "num_items_in_batch": completion_mask.sum(),
        }
        batch["old_logprobs"], batch["sampler_logprobs"] = full(old), full(sampler)
        if theirs_kwargs.get("beta"):  # a KL penalty: the reference's log-probs, given to both
            trainer.beta = theirs_kwargs["beta"]
            reference = current + 0.2 * torch.randn(B, C, generator=g)
            inputs["ref_per_token_logps"], batch["ref_logprobs"] = reference, full(reference)
        mode, floor, cap, mask_kl = correction or (None, None, None, None)
        if mode is not None:  # TRL's vLLM correction: its ratio written out, ours made as the RL loop makes it
            trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
            inputs["importance_sampling_ratio"] = trl_importance(old, sampler, completion_mask, mode, floor, cap)
            batch["importance"] = importance_weights(
                batch["old_logprobs"], batch["sampler_logprobs"], labels != IGNORE_INDEX, mode, floor, cap
            )
            picked = batch["importance"].expand(B, P + C - 1)[:, P - 1 :]
            theirs_ratio = inputs["importance_sampling_ratio"].expand(B, C)
            assert torch.allclose(picked * completion_mask, theirs_ratio * completion_mask)
        if mask_kl is not None:
            trainer.off_policy_mask_threshold = mask_kl
            inputs["sampling_per_token_logps"] = sampler
            kept = GRPOTrainer.get_off_policy_mask(advantages[:, None], current, sampler, completion_mask, mask_kl)
            assert kept.flatten().tolist().count(0.0) == 1  # one negative sequence dropped, one kept
            ours_kwargs = {**ours_kwargs, "off_policy_mask": mask_kl}
        trainer.model.eval()  # no gradient-accumulation scaling
        theirs = trainer._compute_loss(trainer.model, inputs)
        strategy = policy_gradient_strategy(resolve_rl(RLConfig(loss=loss, max_new_tokens=C, **ours_kwargs)))
        total, count = strategy.compute_loss(forward_logits(policy, batch), batch)
    return float(total / count), float(theirs)


KL_CASES = [  # the KL penalty (beta), plain and weighted by the importance ratio (DeepSeek-V3.2's unbiased estimate)
    (loss, {**theirs, "beta": 0.1, "use_bias_correction_kl": unbiased},
     {**ours, "kl_coef": 0.1, "unbiased_kl": unbiased})
    for loss, theirs, ours in GRPO_CASES[:5] + GRPO_CASES[6:7] + GRPO_CASES[8:9]  # grpo, dapo, dr_grpo, cispo,
    for unbiased in (False, True)  # gspo, sapo, vespo
]  # fmt: skip


@pytest.mark.parametrize(
    "loss, theirs_kwargs, ours_kwargs", KL_CASES, ids=[f"{c[0]}-{c[2]['unbiased_kl']}" for c in KL_CASES]
)
def test_kl_penalty_and_its_unbiased_estimate_equal_trls(tiny_tokenizer, tmp_path, loss, theirs_kwargs, ours_kwargs):
    """rl.kl_coef's k3 penalty as TRL adds it (beta), and rl.unbiased_kl's, weighted by the loss's importance ratio
    (TRL's use_bias_correction_kl; the sequence's ratio for GSPO), off-policy where the two differ."""
    ours, theirs = _grpo_against_trl(tiny_tokenizer, tmp_path, loss, theirs_kwargs, ours_kwargs)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)
    plain, _ = _grpo_against_trl(tiny_tokenizer, tmp_path, loss, theirs_kwargs, {**ours_kwargs, "kl_coef": 0.0,
                                                                                 "unbiased_kl": False})  # fmt: skip
    assert ours != pytest.approx(plain, rel=1e-4)  # the penalty is there
    if ours_kwargs["unbiased_kl"]:  # and weighted
        biased, _ = _grpo_against_trl(
            tiny_tokenizer, tmp_path, loss, theirs_kwargs, {**ours_kwargs, "unbiased_kl": False}
        )
        assert ours != pytest.approx(biased, rel=1e-4)


@pytest.mark.parametrize("loss, theirs_kwargs, ours_kwargs", GRPO_CASES, ids=[c[0] for c in GRPO_CASES])
def test_rl_losses_equal_trls_grpo_trainer(tiny_tokenizer, tmp_path, loss, theirs_kwargs, ours_kwargs):
    """GRPO, DAPO, Dr. GRPO, CISPO, GSPO (TRL's GRPO loss at the sequence level), BNPO, SAPO, LUSPO and VESPO (with
    their own shape settings too): tierlm's loss is TRL's `GRPOTrainer._compute_loss`."""
    ours, theirs = _grpo_against_trl(tiny_tokenizer, tmp_path, loss, theirs_kwargs, ours_kwargs)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("correction", CORRECTIONS, ids=[c[0] or "off_policy_mask" for c in CORRECTIONS])
@pytest.mark.parametrize("loss", ["dapo", "gspo", "vespo"])
def test_off_policy_corrections_equal_trls(tiny_tokenizer, tmp_path, loss, correction):
    """rl.importance's four modes (token / sequence, truncated / masked: TIS, IcePop, MIS) and rl.off_policy_mask
    under a token-level, a sequence-level and VESPO's loss (which folds the ratio into its weight): TRL's loss with its
    vLLM importance-sampling correction and its off-policy sequence mask."""
    theirs_kwargs, ours_kwargs = next((t, o) for name, t, o in GRPO_CASES if name == loss)
    ours, theirs = _grpo_against_trl(tiny_tokenizer, tmp_path, loss, theirs_kwargs, ours_kwargs, correction)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("loss", ["grpo", "dapo", "gspo", "sapo", "vespo"])
def test_top_entropy_quantile_equals_trls(tiny_tokenizer, tmp_path, loss):
    """rl.top_entropy_quantile=0.25 (Wang et al., 2025): the loss of the highest-entropy quarter of the completion
    tokens, normalised as before, as TRL's `top_entropy_quantile` computes it, under a token-level, a sequence-level
    and VESPO's loss."""
    theirs_kwargs, ours_kwargs = next((t, o) for name, t, o in GRPO_CASES if name == loss)
    trl_top = {**theirs_kwargs, "top_entropy_quantile": 0.25}
    ours, theirs = _grpo_against_trl(
        tiny_tokenizer, tmp_path, loss, trl_top, {**ours_kwargs, "top_entropy_quantile": 0.25}
    )
    everything, _ = _grpo_against_trl(tiny_tokenizer, tmp_path, loss, trl_top, ours_kwargs)  # every token trained
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6) and ours != pytest.approx(everything, rel=1e-3)


@pytest.mark.parametrize("loss, delta", [("grpo", 1.2), ("dapo", 1.2), ("bnpo", 1.2), ("gspo", 1.01), ("luspo", 1.01)])
def test_two_sided_clip_equals_trls_delta(tiny_tokenizer, tmp_path, loss, delta):
    """rl.two_sided_clip (INTELLECT-2): the ratio capped before PPO's surrogate, as TRL's `delta` caps it, under
    token-level and sequence-level ratios; the cap bites here (the loss differs from the uncapped one)."""
    theirs_kwargs, ours_kwargs = next((t, o) for name, t, o in GRPO_CASES if name == loss)
    capped = {**theirs_kwargs, "delta": delta}
    ours, theirs = _grpo_against_trl(tiny_tokenizer, tmp_path, loss, capped, {**ours_kwargs, "two_sided_clip": delta})
    uncapped, _ = _grpo_against_trl(tiny_tokenizer, tmp_path, loss, capped, ours_kwargs)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6) and ours != pytest.approx(uncapped, rel=1e-4)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "apo_zero"])
def test_ld_alpha_equals_trls(tiny_tokenizer, tmp_path, loss_type):
    """dpo.ld_alpha (LD-DPO): the tails past a pair's shorter response weighted by alpha in the policy's and the
    reference's log-probs, as TRL's `ld_alpha` weights them (the pairs' responses differ in length here)."""
    trl = {"loss_type": [loss_type], "ld_alpha": 0.4}
    ours, other, theirs = _dpo_against_trl(tiny_tokenizer, tmp_path, trl, {"loss_type": loss_type, "ld_alpha": 0.4})
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)
    assert ours != pytest.approx(other(ld_alpha=None), rel=1e-4)  # the tails are there, and weighed


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_rpo_alpha_equals_trls_added_sft_loss(tiny_tokenizer, tmp_path, loss_type):
    """dpo.rpo_alpha (RPO): the chosen responses' token-mean NLL added to the pairwise loss, as TRL adds its "sft"
    loss type with loss_weights [1, alpha]."""
    trl = {"loss_type": [loss_type, "sft"], "loss_weights": [1.0, 0.7]}
    ours, _, theirs = _dpo_against_trl(tiny_tokenizer, tmp_path, trl, {"loss_type": loss_type, "rpo_alpha": 0.7})
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("loss, quantile", [("grpo", 1.0), ("dapo", 1.0), ("gspo", 1.0), ("dapo", 0.25)])
def test_entropy_bonus_equals_trls(tiny_tokenizer, tmp_path, loss, quantile):
    """rl.entropy_coef: the loss less coef x the mean entropy over the trained tokens (the high-entropy ones with
    rl.top_entropy_quantile), as TRL's fixed entropy_coef computes it."""
    theirs_kwargs, ours_kwargs = next((t, o) for name, t, o in GRPO_CASES if name == loss)
    bonus = {"entropy_coef": 0.05, "top_entropy_quantile": quantile}
    ours, theirs = _grpo_against_trl(
        tiny_tokenizer, tmp_path, loss, {**theirs_kwargs, **bonus}, {**ours_kwargs, **bonus}
    )
    plain, _ = _grpo_against_trl(
        tiny_tokenizer, tmp_path, loss, theirs_kwargs, {**ours_kwargs, "top_entropy_quantile": quantile}
    )
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6) and ours < plain


@pytest.mark.parametrize(
    "trl, ours",
    [
        # MPO (Wang et al., 2024): TRL's documented mix, DPO's preference, BCO's quality and the SFT generation terms
        ({"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]}, {}),
        ({"loss_type": ["ipo", "sigmoid"], "loss_weights": [0.5, 1.5]}, {}),  # averaged beside summed log-probs
        ({"loss_type": ["sft"]}, {}),
        ({"loss_type": ["aot"], "label_smoothing": 0.1}, {}),
        ({"loss_type": ["aot_unpaired"]}, {}),
        ({"loss_type": ["sigmoid", "aot"]}, {}),
        ({"loss_type": ["sigmoid"], "use_weighting": True}, {}),  # WPO
        # (TRL's WPO fails on its sft term, which it weighs in place on an expanded tensor; tierlm weighs it too)
        ({"loss_type": ["ipo", "bco_pair"], "loss_weights": [1.0, 0.5], "use_weighting": True}, {}),
    ],
)
def test_combined_losses_aot_and_wpo_equal_trls(tiny_tokenizer, tmp_path, trl, ours):
    """dpo.loss_type lists with dpo.loss_weights, AOT's sorted batches and WPO's weights (dpo.use_weighting) as
    TRL's DPOTrainer computes them; each differs from the loss without what it adds."""
    ours = {**trl, **ours}
    if len(ours["loss_type"]) == 1:
        ours["loss_type"] = ours["loss_type"][0]
    mine, other, theirs = _dpo_against_trl(tiny_tokenizer, tmp_path, trl, ours)
    assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-6)
    first = trl["loss_type"][0]
    if len(trl["loss_type"]) > 1:
        assert mine != pytest.approx(other(loss_type=first, loss_weights=None, use_weighting=False), rel=1e-4)
    if trl.get("use_weighting"):
        assert mine != pytest.approx(other(use_weighting=False), rel=1e-4)

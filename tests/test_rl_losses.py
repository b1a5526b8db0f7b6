"""Each `rl.loss` against a plain reference written here from its paper's formula (loops over sequences and tokens,
no shared code with `tierlm.strategies.rl_losses`): the loss value and its gradient to 1e-6; and the normalisation
split over micro-batches equals the whole batch (the backend sums losses and normalisers over the step)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tierlm.config import RLConfig
from tierlm.errors import ConfigError
from tierlm.strategies.rl import batch_advantages, group_advantages, leave_one_out_advantages, policy_gradient_strategy
from tierlm.strategies.rl_losses import RL_LOSSES, resolve_rl

G, B, T, L = 4, 8, 6, 6  # group size, rows (2 groups), positions, max_new_tokens


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 3, 5, 1, 4, 6, 2, 5]
    mask = torch.zeros(B, T)
    for row, n in enumerate(lengths):
        mask[row, T - n :] = 1  # completions end the rows, as after a prompt
    logprobs = -torch.rand(B, T, generator=g) * 2 - 0.05
    old = logprobs + 0.3 * torch.randn(B, T, generator=g)  # ratios well outside 0.8 .. 1.28: clips are active
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    return logprobs, old, mask, rewards


def _seq_list(mask):
    return [[t for t in range(T) if mask[i, t]] for i in range(B)]


def _clip(x, low, high):
    return min(max(x, 1 - low), 1 + high)


# -- the references, from the papers' formulas ----------------------------------------------------------------
def ref_grpo(lp, old, mask, adv, eps_low, eps_high):
    """GRPO: -(1/G) sum_i (1/|o_i|) sum_t min(r A, clip(r) A)."""
    total = 0.0
    for i, ts in enumerate(_seq_list(mask)):
        seq = 0.0
        for t in ts:
            r = torch.exp(lp[i, t] - old[i, t])
            seq = seq + torch.minimum(r * adv[i], torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv[i])
        total = total + seq / len(ts)
    return -total / B


def ref_token_mean(lp, old, mask, adv, eps_low, eps_high, denominator=None):
    """DAPO (and PPO / RLOO / REINFORCE++): -(1 / sum_i |o_i|) sum_i sum_t min(r A, clip(r) A); Dr. GRPO divides by
    a constant instead."""
    total, tokens = 0.0, 0
    for i, ts in enumerate(_seq_list(mask)):
        for t in ts:
            r = torch.exp(lp[i, t] - old[i, t])
            total = total + torch.minimum(r * adv[i], torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv[i])
            tokens += 1
    return -total / (denominator or tokens)


def ref_gspo(lp, old, mask, adv, eps_low, eps_high):
    """GSPO: s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|); -(1/G) sum_i min(s_i A_i, clip(s_i) A_i)."""
    total = 0.0
    for i, ts in enumerate(_seq_list(mask)):
        log_ratio = sum(lp[i, t] - old[i, t] for t in ts)
        s = torch.exp(log_ratio / len(ts))
        total = total + torch.minimum(s * adv[i], torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv[i])
    return -total / B


def ref_cispo(lp, old, mask, adv, eps_high):
    """CISPO: -(1 / sum_i |o_i|) sum_i sum_t sg(min(r, 1 + eps_high)) A log pi."""
    total, tokens = 0.0, 0
    for i, ts in enumerate(_seq_list(mask)):
        for t in ts:
            r = float(torch.exp(lp[i, t] - old[i, t]))
            total = total + min(r, 1 + eps_high) * adv[i] * lp[i, t]
            tokens += 1
    return -total / tokens


def ref_reinforce(lp, mask, adv):
    """REINFORCE: -(1 / sum_i |o_i|) sum_i sum_t A log pi."""
    ts = _seq_list(mask)
    return -sum(adv[i] * lp[i, t] for i in range(B) for t in ts[i]) / sum(len(x) for x in ts)


def ref_sapo(lp, old, mask, adv, tau_pos, tau_neg):
    """SAPO: -(1/G) sum_i (1/|o_i|) sum_t f(r) A with the soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau, tau by A's
    sign (tau_pos for A > 0)."""
    total = 0.0
    for i, ts in enumerate(_seq_list(mask)):
        tau = tau_pos if adv[i] > 0 else tau_neg
        seq = sum(torch.sigmoid(tau * (torch.exp(lp[i, t] - old[i, t]) - 1)) * 4 / tau * adv[i] for t in ts)
        total = total + seq / len(ts)
    return -total / B


def ref_luspo(lp, old, mask, adv, eps_low, eps_high):
    """LUSPO: GSPO's per-sequence term times |o_i|: -(1/G) sum_i |o_i| min(s_i A_i, clip(s_i) A_i)."""
    total = 0.0
    for i, ts in enumerate(_seq_list(mask)):
        s = torch.exp(sum(lp[i, t] - old[i, t] for t in ts) / len(ts))
        total = total + len(ts) * torch.minimum(s * adv[i], torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv[i])
    return -total / B


def ref_vespo(lp, old, mask, adv, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0):
    """VESPO: w_i = prod_t pi / pi_old over the sequence, phi(w) = e^lam w^k e^(-lam w) (no gradient), k and lam by
    A's sign; -(1 / sum_i |o_i|) sum_i sum_t phi(w_i) A_i log pi."""
    total, tokens = 0.0, 0
    for i, ts in enumerate(_seq_list(mask)):
        w = math.exp(sum(float(lp[i, t] - old[i, t]) for t in ts))
        k, lam = (k_pos, lam_pos) if adv[i] >= 0 else (k_neg, lam_neg)
        phi = math.exp(lam) * w**k * math.exp(-lam * w)
        total = total + sum(phi * adv[i] * lp[i, t] for t in ts)
        tokens += len(ts)
    return -total / tokens


CASES = {  # rl.loss -> (its config, the reference given (lp, old, mask, advantages))
    "grpo": ({}, lambda lp, old, m, a: ref_grpo(lp, old, m, a, 0.2, 0.2)),
    "dapo": ({}, lambda lp, old, m, a: ref_token_mean(lp, old, m, a, 0.2, 0.28)),
    "dr_grpo": ({}, lambda lp, old, m, a: ref_token_mean(lp, old, m, a, 0.2, 0.2, denominator=B * L)),
    "gspo": ({"clip_low": 0.02, "clip_high": 0.03}, lambda lp, old, m, a: ref_gspo(lp, old, m, a, 0.02, 0.03)),
    "cispo": ({"clip_high": 0.5}, lambda lp, old, m, a: ref_cispo(lp, old, m, a, 0.5)),
    "rloo": ({}, lambda lp, old, m, a: ref_token_mean(lp, old, m, a, 0.2, 0.2)),
    "reinforce_pp": ({}, lambda lp, old, m, a: ref_token_mean(lp, old, m, a, 0.2, 0.2)),
    "ppo": ({"clip_range": 0.1}, lambda lp, old, m, a: ref_token_mean(lp, old, m, a, 0.1, 0.1)),
    "bnpo": ({}, lambda lp, old, m, a: ref_token_mean(lp, old, m, a, 0.2, 0.2)),
    "sapo": ({}, lambda lp, old, m, a: ref_sapo(lp, old, m, a, 1.0, 1.05)),
    "luspo": ({"clip_low": 0.02, "clip_high": 0.03}, lambda lp, old, m, a: ref_luspo(lp, old, m, a, 0.02, 0.03)),
    "vespo": ({}, ref_vespo),
    "vespo_shaped": (
        {"loss": "vespo", "vespo_k_pos": 1.0, "vespo_lambda_pos": 1.5, "vespo_k_neg": 0.5, "vespo_lambda_neg": 4.0},
        lambda lp, old, m, a: ref_vespo(lp, old, m, a, 1.0, 1.5, 0.5, 4.0),
    ),
}


def ref_advantages(loss: str, rewards: torch.Tensor) -> list[float]:
    """Group-normalised (GRPO, DAPO, GSPO, CISPO), group mean (Dr. GRPO, PPO), leave-one-out (RLOO), whole batch
    (REINFORCE++), written out."""
    r = rewards.tolist()
    out = []
    for i, x in enumerate(r):
        group = r[i // G * G : i // G * G + G]
        mean = sum(group) / G
        std = math.sqrt(sum((y - mean) ** 2 for y in group) / G)
        if loss in ("grpo", "dapo", "gspo", "cispo", "bnpo", "sapo", "luspo", "vespo", "vespo_shaped"):
            out.append((x - mean) / (std + 1e-6))
        elif loss == "rloo":
            out.append(x - (sum(group) - x) / (G - 1))
        elif loss == "reinforce_pp":
            m = sum(r) / len(r)
            out.append((x - m) / (math.sqrt(sum((y - m) ** 2 for y in r) / len(r)) + 1e-6))
        else:
            out.append(x - mean)
    return out


@pytest.mark.parametrize("loss", list(CASES))
def test_each_loss_equals_its_papers_formula(loss):
    overrides, reference = CASES[loss]
    rl = RLConfig(**{"loss": loss, "group_size": G, "max_new_tokens": L, **overrides})
    strategy = policy_gradient_strategy(resolve_rl(rl))
    lp0, old, mask, rewards = _batch()
    advantages = strategy.advantages(rewards, G)
    torch.testing.assert_close(advantages, torch.tensor(ref_advantages(loss, rewards)), atol=1e-6, rtol=1e-6)

    ours_lp = lp0.clone().requires_grad_(True)
    batch = {"advantages": advantages, "old_logprobs": old}
    total, count, _ = RL_LOSSES[rl.loss].fn(ours_lp, batch, mask, strategy.settings)
    (total / count).backward()
    ref_lp = lp0.clone().requires_grad_(True)
    expected = reference(ref_lp, old, mask, advantages.tolist())
    expected.backward()
    ours, theirs = float((total / count).detach()), float(expected.detach())
    assert abs(ours - theirs) < 1e-6, (ours, theirs)
    torch.testing.assert_close(ours_lp.grad, ref_lp.grad, atol=1e-6, rtol=1e-5)
    assert ours_lp.grad.abs().sum() > 0


def test_reinforce_is_the_token_mean_of_advantage_times_log_prob():
    lp0, _, mask, rewards = _batch()
    strategy = policy_gradient_strategy(resolve_rl(RLConfig(loss="reinforce", group_size=G)))
    adv = strategy.advantages(rewards, G)
    lp = lp0.clone().requires_grad_(True)
    total, count, _ = RL_LOSSES["reinforce"].fn(lp, {"advantages": adv}, mask, strategy.settings)
    (total / count).backward()
    ref = lp0.clone().requires_grad_(True)
    ref_reinforce(ref, mask, adv.tolist()).backward()
    torch.testing.assert_close(lp.grad, ref.grad, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("loss", list(CASES))
def test_micro_batches_normalise_as_the_whole_batch(loss):
    """Summed losses over summed normalisers of two micro-batches = the whole batch's loss: sequence means,
    token means and Dr. GRPO's constant all survive gradient accumulation (and ranks) unchanged."""
    overrides, _ = CASES[loss]
    rl = RLConfig(**{"loss": loss, "group_size": G, "max_new_tokens": L, **overrides})
    strategy = policy_gradient_strategy(resolve_rl(rl))
    lp, old, mask, rewards = _batch(1)
    adv = strategy.advantages(rewards, G)
    whole, whole_n, _ = RL_LOSSES[rl.loss].fn(lp, {"advantages": adv, "old_logprobs": old}, mask, strategy.settings)
    parts = [
        RL_LOSSES[rl.loss].fn(lp[s], {"advantages": adv[s], "old_logprobs": old[s]}, mask[s], strategy.settings)
        for s in (slice(0, 3), slice(3, B))
    ]
    split = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    assert abs(float(split.detach()) - float((whole / whole_n).detach())) < 1e-6


def test_clip_statistics_count_the_tokens_the_clip_silences():
    """DAPO's decoupled clip: a token above 1 + clip_high with A > 0 (and below 1 - clip_low with A < 0) has no
    gradient and is counted on its side."""
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.25]])).requires_grad_(True)  # ratios against old = 0
    batch = {"advantages": torch.tensor([[1.0, -1.0, 1.0, 1.0]]), "old_logprobs": torch.zeros(1, 4)}
    strategy = policy_gradient_strategy(resolve_rl(RLConfig(loss="dapo")))
    total, count, stats = RL_LOSSES["dapo"].fn(lp, batch, torch.ones(1, 4), strategy.settings)
    total.backward()
    assert lp.grad[0, :2].abs().sum() == 0 and (lp.grad[0, 2:] != 0).all()  # 1.25 < 1.28: not clipped
    assert (stats["clip_high_sum"], stats["clip_low_sum"], stats["clip_n_sum"]) == (1, 1, 4)


def test_advantage_helpers_and_the_whole_batch_over_ranks():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert leave_one_out_advantages(rewards, 4).tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert group_advantages(rewards, 4).tolist() == [0.75, -0.25, -0.25, -0.25]

    def two_ranks(sums):  # a second rank holding rewards [1, 1]: its sums added, as all_reduce would
        other = {"n": 2.0, "sum": 2.0, "squares": 2.0}
        return {k: v + other[k] for k, v in sums.items()}

    pooled = batch_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]))[:4]
    torch.testing.assert_close(batch_advantages(rewards, two_ranks), pooled)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"loss": "dapo", "clip_low": 0.3, "clip_high": 0.2}, r"rl.clip_low \(0.3\) > rl.clip_high \(0.2\)"),
        ({"loss": "cispo", "clip_low": 0.1}, "caps its importance weights from above only"),
        ({"loss": "reinforce", "clip_high": 0.2}, "clips nothing"),
        ({"loss": "dr_grpo", "normalize_std": True}, "without the std division"),
        ({"loss": "rloo", "normalize_std": True}, "has its own baseline"),
        ({"loss": "grpo", "critic": True}, "rl.critic trains PPO's value model"),
        ({"loss": "distill", "teacher": "t", "reward_model": "rm"}, "not rewards"),
        ({"loss": "no_such_loss"}, "rl.loss=no_such_loss is not one of reinforce, grpo"),
        ({"loss": "grpo", "algorithm": "ppo"}, "disagree"),
        ({"overlong_buffer": 32, "max_new_tokens": 32}, "must be below rl.max_new_tokens"),
        ({"loss": "distill"}, "rl.loss=distill learns from rl.teacher"),
        ({"teacher": "runs/tiny_rl"}, "rl.loss=distill learns from rl.teacher"),
        ({"loss": "sapo", "clip_high": 0.3}, "rl.loss=sapo gates the ratio softly"),
        ({"loss": "grpo", "sapo_temperature_neg": 2.0}, "SAPO's gate temperatures: set rl.loss=sapo"),
        ({"loss": "vespo", "clip_low": 0.1}, "rl.loss=vespo weights sequences smoothly"),
        ({"loss": "dapo", "vespo_k_pos": 1.0}, "shape VESPO's sequence weights: set rl.loss=vespo"),
        ({"importance": "token_iceberg"}, "importance"),
        ({"importance_floor": 0}, "importance_floor"),
        ({"off_policy_mask": -0.5}, "off_policy_mask"),
        ({"top_entropy_quantile": 0}, "top_entropy_quantile"),
        ({"two_sided_clip": 0.9}, "two_sided_clip"),
        ({"loss": "distill_topk", "teacher": "t", "entropy_coef": 0.01}, "rl.loss=distill_topk takes none"),
        ({"loss": "cispo", "two_sided_clip": 4.0}, "rl.loss=cispo has none"),
        ({"loss": "reinforce", "two_sided_clip": 4.0}, "rl.loss=reinforce has none"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile"),
        ({"loss": "distill_topk", "teacher": "t", "top_entropy_quantile": 0.2}, "rl.loss=distill_topk has none"),
        ({"reference_sync_steps": 4}, "with rl.kl_coef=0 there is none: set rl.kl_coef > 0, or drop it"),
        ({"kl_coef": 0.1, "reference_mixup_alpha": 0.5}, "set rl.reference_sync_steps, or drop it"),
    ],
)
def test_loss_settings_that_contradict_are_refused(overrides, message):
    """Field by field in the section (ValueError), against the loss's row when the run is resolved (ConfigError)."""
    with pytest.raises((ValueError, ConfigError), match=message):
        resolve_rl(RLConfig(**overrides))


def test_the_importance_correction_resolves_from_the_run_and_jax_refuses_the_sequence_mask():
    assert resolve_rl(RLConfig()).importance == "none"  # on-policy: no correction unless asked
    assert resolve_rl(RLConfig(max_off_policy_steps=2)).importance == "token_truncate"  # what it always was
    assert resolve_rl(RLConfig(max_off_policy_steps=2, importance="sequence_mask")).importance == "sequence_mask"
    with pytest.raises(ConfigError, match="rl.off_policy_mask is applied by the PyTorch losses"):
        resolve_rl(RLConfig(loss="grpo", off_policy_mask=0.5), jax=True)
    with pytest.raises(ConfigError, match="rl.loss=sapo has no JAX twin"):
        resolve_rl(RLConfig(loss="sapo"), jax=True)
    with pytest.raises(ConfigError, match="rl.entropy_coef is applied by the PyTorch losses"):
        resolve_rl(RLConfig(loss="grpo", entropy_coef=0.01), jax=True)
    with pytest.raises(ConfigError, match="rl.two_sided_clip is applied by the PyTorch losses"):
        resolve_rl(RLConfig(loss="grpo", two_sided_clip=4.0), jax=True)
    with pytest.raises(ConfigError, match="rl.top_entropy_quantile is applied by the PyTorch losses"):
        resolve_rl(RLConfig(loss="grpo", top_entropy_quantile=0.2), jax=True)


@pytest.mark.parametrize(
    "extra, shown",
    [
        (["rl.loss=vespo", "rl.max_off_policy_steps=1", "rl.importance=sequence_mask", "rl.off_policy_mask=0.5"],
         ["vespo_weight_mean", "importance_masked", "importance_mean", "staleness"]),
        (["rl.loss=sapo", "rl.importance=token_truncate", "rl.importance_floor=0.5"],
         ["importance_capped", "importance_mean"]),
        (["rl.loss=luspo", "rl.importance=token_mask", "rl.importance_floor=0.5", "rl.importance_cap=5"],
         ["seq_ratio_mean", "importance_masked"]),
    ],
    ids=["vespo-async-sequence_mask-opsm", "sapo-on_policy-tis", "luspo-icepop"],
)  # fmt: skip
def test_new_losses_and_corrections_train_and_show_their_figures(extra, shown, tiny_runs, tmp_path, reports):
    """A few RL steps of each new loss under an importance correction (on-policy too: a sampler's arithmetic may
    differ from the trainer's) and DeepSeek-V3.2's sequence mask: the run ends, its lines carry the figures, and the
    report plots them."""
    import json

    from tierlm.commands.cli import main

    args = ["rl", "--config", "tiny_rl", f"model.model_name_or_path={tiny_runs / 'sft'}", *extra]
    args += ["rl.prompts_per_step=2", "rl.group_size=4", "rl.max_new_tokens=8", "rl.eval_problems=4", "rl.eval_k=2"]
    args += ["training.num_train_steps=3", "training.eval_steps=0", "training.logging_steps=1"]
    args += ["infra.device_type=cpu", "data.num_synthetic_examples=200", "data.num_synthetic_eval_examples=16"]
    out = tmp_path / "run"
    assert main([*args, f"infra.output_dir={out}"]) == 0
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert len(train) == 3 and all(key in r for r in train for key in shown), train[-1]
    assert all(math.isfinite(r["loss"]) for r in train)
    assert (out / "plots" / "importance.png").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss, extra, shown",
    [
        ("dapo", ["rl.overlong_buffer=4"], ["dropped_groups", "extra_draws", "clip_low_frac", "overlong_frac"]),
        ("gspo", ["rl.ppo_epochs=2", "rl.clip_low=0.002", "rl.clip_high=0.003"], ["seq_ratio_mean", "clip_high_frac"]),
    ],
)
def test_dapo_and_gspo_runs_resume_bit_exact_and_show_their_figures(loss, extra, shown, tiny_runs, tmp_path):
    """A run rolled back to its step-2 checkpoint and resumed ends with the straight run's weights (dynamic
    sampling's extra prompts are a pure function of seed, step and rank); the train lines carry the loss's
    figures."""
    import json

    from safetensors.torch import load_file

    from conftest import resume_from_checkpoint
    from tierlm.commands.cli import main

    args = ["rl", "--config", "tiny_rl", f"model.model_name_or_path={tiny_runs / 'sft'}", f"rl.loss={loss}", *extra]
    args += ["rl.prompts_per_step=2", "rl.group_size=4", "rl.max_new_tokens=8", "rl.eval_problems=4", "rl.eval_k=2"]
    args += ["training.num_train_steps=4", "training.save_steps=2", "training.eval_steps=0", "training.logging_steps=1"]
    args += ["infra.device_type=cpu", "data.num_synthetic_examples=200", "data.num_synthetic_eval_examples=16"]
    out = tmp_path / "run"
    assert main([*args, f"infra.output_dir={out}"]) == 0
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert all(key in r for r in train for key in shown), train[0]
    straight = load_file(out / "model" / "model.safetensors")
    resume_from_checkpoint(args, out, 2, in_process=True)
    resumed = load_file(out / "model" / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_distill_is_reinforce_on_the_teachers_per_token_log_ratio():
    """On-policy distillation's loss with per-token advantages A_t = log p_teacher - log p_student (what the loop
    sets): -(1 / sum_i |o_i|) sum_i sum_t A_t log p_t, written out."""
    lp0, _, mask, _ = _batch(2)
    teacher = lp0 + 0.5 * torch.randn(B, T, generator=torch.Generator().manual_seed(3))
    adv = (teacher - lp0) * mask
    strategy = policy_gradient_strategy(resolve_rl(RLConfig(loss="distill", teacher="t")))
    lp = lp0.clone().requires_grad_(True)
    total, count, _ = RL_LOSSES["distill"].fn(lp, {"advantages": adv}, mask, strategy.settings)
    (total / count).backward()
    ref = lp0.clone().requires_grad_(True)
    ts = _seq_list(mask)
    (-sum(adv[i, t] * ref[i, t] for i in range(B) for t in ts[i]) / sum(len(x) for x in ts)).backward()
    torch.testing.assert_close(lp.grad, ref.grad, atol=1e-7, rtol=1e-6)


def _topk_batch(k: int, temperature: float):
    """Student and teacher logits over a vocabulary of 11, the teacher's top-k at `temperature` (as the loop scores
    them: `tierlm.loops.teachers.Teachers`), and the trained-token labels of `_batch`."""
    g = torch.Generator().manual_seed(5)
    student, teacher = torch.randn(B, T, 11, generator=g) * 2, torch.randn(B, T, 11, generator=g) * 2
    _, _, mask, _ = _batch(0)
    labels = torch.where(mask.bool(), torch.randint(0, 11, (B, T), generator=g), -100)
    values, ids = torch.log_softmax(teacher / temperature, dim=-1).topk(k, dim=-1)
    batch = {"labels": labels, "advantages": torch.zeros(B), "teacher_topk_ids": ids, "teacher_topk_logprobs": values}
    return student, teacher, mask, batch


def test_distill_topk_is_the_reverse_kl_over_the_teachers_top_k_written_out():
    """distill_topk's loss: at each trained position S = the teacher's 4 likeliest tokens, q = the student's softmax
    (logits / T) renormalised over S, p = the teacher's, and KL(q || p) = sum_{v in S} q_v (log q_v - log p_v); the
    mean over trained tokens — written out token by token, value and gradient."""
    import math

    temperature = 0.8
    student, teacher, mask, batch = _topk_batch(4, temperature)
    strategy = policy_gradient_strategy(resolve_rl(RLConfig(loss="distill_topk", teacher="t", temperature=0.8)))
    ours = student.clone().requires_grad_(True)
    total, count = strategy.compute_loss(ours, batch)
    (total / count).backward()
    ref = student.clone().requires_grad_(True)
    terms = []
    for i, ts in enumerate(_seq_list(mask)):
        for t in ts:
            top = sorted(range(11), key=lambda v: -float(teacher[i, t, v]))[:4]
            zs = sum(torch.exp(ref[i, t, v] / temperature) for v in top)
            zt = sum(math.exp(float(teacher[i, t, v]) / temperature) for v in top)
            q = [torch.exp(ref[i, t, v] / temperature) / zs for v in top]
            p = [math.exp(float(teacher[i, t, v]) / temperature) / zt for v in top]
            terms.append(sum(qv * (torch.log(qv) - math.log(pv)) for qv, pv in zip(q, p)))
    expected = sum(terms) / len(terms)
    expected.backward()
    torch.testing.assert_close(total / count, expected.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours.grad, ref.grad, atol=1e-7, rtol=1e-5)


def test_distill_topk_over_the_whole_vocabulary_is_trls_reverse_kl():
    """With k = the vocabulary, distill_topk is the full reverse KL: TRL's GKD loss at beta = 1
    (`GKDTrainer.generalized_jsd_loss`, TRL 1.16), value and gradient."""
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    student, teacher, mask, batch = _topk_batch(11, 0.7)
    strategy = policy_gradient_strategy(resolve_rl(RLConfig(loss="distill_topk", teacher="t", temperature=0.7)))
    ours = student.clone().requires_grad_(True)
    total, count = strategy.compute_loss(ours, batch)
    (total / count).backward()
    theirs = student.clone().requires_grad_(True)
    trl_loss = GKDTrainer.generalized_jsd_loss(theirs, teacher, batch["labels"], beta=1, temperature=0.7)
    trl_loss.backward()
    torch.testing.assert_close(total / count, trl_loss.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-7, rtol=1e-5)


@pytest.mark.slow
def test_distillation_runs_and_logs_the_students_kl_to_its_teacher(tiny_runs, tmp_path):
    """`tierlm rl rl.loss=distill rl.teacher=PRETRAINED` from the SFT model (the two share a tokenizer): it trains
    without a verifier, and every train line carries KL(student || teacher) on the sampled tokens."""
    import json

    from tierlm.commands.cli import main

    out = tmp_path / "run"
    args = ["rl", "--config", "tiny_rl", f"model.model_name_or_path={tiny_runs / 'sft'}", "rl.loss=distill"]
    args += [f"rl.teacher={tiny_runs / 'pre'}", "rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=8"]
    args += ["training.num_train_steps=3", "training.eval_steps=0", "training.logging_steps=1", "rl.eval_problems=4"]
    args += ["infra.device_type=cpu", "data.num_synthetic_examples=200", "data.num_synthetic_eval_examples=16"]
    assert main([*args, f"infra.output_dir={out}"]) == 0
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert len(train) == 3 and all(r["teacher_kl"] > 0 for r in train), train


@pytest.mark.slow
def test_a_new_loss_is_one_function_and_one_row(tiny_runs, tmp_path, monkeypatch, capsys):
    """The README's promise, kept: a loss nobody wrote before (the token-level REINFORCE surrogate squared, a toy)
    added as one function and one row of `RL_LOSSES` trains a step of `tierlm rl`, its setting refused by the same
    row's rules (a clip on a loss that fixes none), and the JAX backend refuses it (no twin) in one line."""
    import json

    from tierlm.commands.cli import main
    from tierlm.strategies.rl_losses import RLLoss
    from tierlm.strategies.rl_terms import normalise

    calls = []

    def toy(logprobs, batch, mask, s):
        calls.append(logprobs.shape)
        per_tok = -((batch["advantages"].float()[:, None] * logprobs) ** 2)
        return (*normalise(per_tok, mask, s.normalise), {})

    row = RLLoss("a toy", fn=toy, jax=None, clip=(None, None), fixed={"clip_low": None}, why="toy clips nothing")
    monkeypatch.setitem(RL_LOSSES, "toy", row)
    args = ["rl", "--config", "tiny_rl", f"model.model_name_or_path={tiny_runs / 'sft'}", "rl.loss=toy"]
    args += ["rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=4", "rl.eval_problems=2", "rl.eval_k=1"]
    args += ["training.num_train_steps=1", "training.eval_steps=0", "training.logging_steps=1"]
    args += ["infra.device_type=cpu", "data.num_synthetic_examples=40", "data.num_synthetic_eval_examples=4"]
    assert main([*args, f"infra.output_dir={tmp_path / 'run'}"]) == 0
    train = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())]
    assert [r["step"] for r in train if r["type"] == "train"] == [1] and calls
    capsys.readouterr()
    assert main([*args, "rl.clip_low=0.1", f"infra.output_dir={tmp_path / 'refused'}"]) == 2
    assert capsys.readouterr().err.strip().endswith("toy clips nothing")
    assert main([*args, "infra.backend=jax", f"infra.output_dir={tmp_path / 'jax'}"]) == 2
    assert "rl.loss=toy has no JAX twin" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists() and not (tmp_path / "jax").exists()


def test_the_entropy_bonus_has_the_gradient_of_the_mean_entropy():
    """rl.entropy_coef subtracts coef x the trained tokens' mean entropy, gradient included: the gradient of the loss
    with the bonus, less the one without, is -coef x the gradient of the entropy written out here."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    labels[0, :2] = -100
    batch = {"labels": labels, "advantages": torch.tensor([0.5, -1.0])}

    def gradient(coef):
        strategy = policy_gradient_strategy(resolve_rl(RLConfig(loss="dapo", entropy_coef=coef)))
        x = logits.clone().requires_grad_(True)
        total, count = strategy.compute_loss(x, batch)
        (total / count).backward()
        return x.grad

    x = logits.clone().requires_grad_(True)
    p = torch.softmax(x, dim=-1)
    trained = (labels != -100).float()
    mean_entropy = (-(p * p.log()).sum(dim=-1) * trained).sum() / trained.sum()
    mean_entropy.backward()
    torch.testing.assert_close(gradient(0.1) - gradient(0.0), -0.1 * x.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_as_losses_have_the_gradients_they_are_said_to(estimator):
    """Each rl.kl_estimator as a loss term on on-policy samples, its expectation over the policy taken exactly (the
    sum over the vocabulary weighted by the detached probabilities, what sampling averages to): its value is
    KL(policy || reference) but for k2 (a second-order approximation), and its gradient is 0 (k1), the reverse KL's
    (k2) or KL(reference || policy)'s (k3), each by autograd of the divergence written out here."""
    from tierlm.strategies.rl_terms import KL_ESTIMATORS

    theta = torch.randn(7, generator=torch.Generator().manual_seed(0), dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(7, generator=torch.Generator().manual_seed(1), dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    expected = (logp.exp().detach() * KL_ESTIMATORS[estimator](logp, ref)).sum()
    (grad,) = torch.autograd.grad(expected, theta)
    logp = torch.log_softmax(theta, 0)  # afresh: the graph above is spent
    p, q = logp.exp(), ref.exp()
    reverse, forward = (p * (logp - ref)).sum(), (q * (ref - logp)).sum()
    if estimator != "k2":
        torch.testing.assert_close(expected, reverse)  # k1 and k3 are unbiased
    if estimator == "k1":
        torch.testing.assert_close(grad, torch.zeros_like(grad))
    else:
        (want,) = torch.autograd.grad(reverse if estimator == "k2" else forward, theta)
        torch.testing.assert_close(grad, want)
        assert grad.abs().max() > 1e-3


def test_the_kl_estimator_reaches_the_loss_and_the_reported_kl_stays_k3s():
    """rl.kl_estimator swaps the penalty's per-token term in every loss (here grpo's) and nothing else; the `kl_sum`
    statistic is k3's either way."""
    from tierlm.strategies.rl_terms import KL_ESTIMATORS

    g = torch.Generator().manual_seed(0)
    logprobs, ref = -torch.rand(3, 5, generator=g) * 3, -torch.rand(3, 5, generator=g) * 3
    batch = {"advantages": torch.tensor([1.0, -0.5, 0.2]), "ref_logprobs": ref}
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    results = {}
    for estimator in ("k1", "k2", "k3"):
        strategy = policy_gradient_strategy(resolve_rl(RLConfig(loss="grpo", kl_coef=0.3, kl_estimator=estimator)))
        results[estimator] = strategy.spec.fn(logprobs, batch, mask, strategy.settings)
    for estimator in ("k1", "k2"):
        (total, count, stats), (base, base_count, base_stats) = results[estimator], results["k3"]
        per_row = ((KL_ESTIMATORS[estimator](logprobs, ref) - KL_ESTIMATORS["k3"](logprobs, ref)) * mask).sum(1)
        shift = 0.3 * (per_row / mask.sum(1)).sum()  # grpo: each sequence's token mean, summed over rows
        torch.testing.assert_close(total - base, shift)
        assert count == base_count and torch.equal(stats["kl_sum"], base_stats["kl_sum"])


def test_the_unbiased_kl_estimate_has_the_reverse_kls_gradient_on_policy():
    """rl.unbiased_kl (DeepSeek-V3.2): k3 times the on-policy importance ratio (1, with its gradient), in expectation
    over the policy taken exactly as in the test above: the value is still KL(policy || reference), the gradient
    becomes the reverse KL's (k3 alone has KL(reference || policy)'s)."""
    from tierlm.strategies.rl_terms import LossSettings, kl_term, ratio_to_old

    theta = torch.randn(7, generator=torch.Generator().manual_seed(0), dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(7, generator=torch.Generator().manual_seed(1), dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)[None]
    settings = LossSettings(kl_coef=1.0, unbiased_kl=True)
    penalty, _ = kl_term(logp, {"ref_logprobs": ref[None]}, torch.ones(1, 7), settings, ratio_to_old(logp, {}))
    expected = (logp.exp().detach() * penalty).sum()
    (grad,) = torch.autograd.grad(expected, theta)
    logp = torch.log_softmax(theta, 0)
    reverse = (logp.exp() * (logp - ref)).sum()
    torch.testing.assert_close(expected, reverse)
    (want,) = torch.autograd.grad(reverse, theta)
    torch.testing.assert_close(grad, want)
    logp = torch.log_softmax(theta, 0)
    penalty, _ = kl_term(logp[None], {"ref_logprobs": ref[None]}, torch.ones(1, 7), LossSettings(kl_coef=1.0))
    (biased,) = torch.autograd.grad((logp.exp().detach() * penalty).sum(), theta)
    assert (biased - want).abs().max() > 1e-3  # without the ratio, another gradient


def test_unbiased_kl_needs_a_kl_penalty_and_the_pytorch_losses():
    with pytest.raises(ConfigError, match="rl.unbiased_kl weights the KL penalty"):
        resolve_rl(RLConfig(unbiased_kl=True))
    with pytest.raises(ConfigError, match="rl.unbiased_kl is applied by the PyTorch losses"):
        resolve_rl(RLConfig(loss="grpo", kl_coef=0.1, unbiased_kl=True), jax=True)


def test_gdpo_normalises_each_reward_in_its_group_then_the_sum_over_the_step():
    """rl.reward_aggregation=normalize_then_sum, GDPO as TRL's multi_objective_aggregation computes it, written out
    here (with tierlm's population stds): each reward's z-score in its group, weighted and summed, then the sum less
    the step's mean over the step's std. A reward of small spread moves the advantages as much as a large one, which
    the plain weighted sum does not."""
    from tierlm.strategies.rl import decoupled_rewards

    G, eps = 4, 1e-6
    task = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    bonus = [0.02, 0.01, 0.03, 0.0, 0.0, 0.01, 0.02, 0.02]  # a format bonus of small spread
    length = [-0.5, 0.0, -1.0, 0.0, 0.0, 0.0, -0.25, 0.0]
    weights = [1.0, 0.5, 1.0]
    summed = []
    for row in range(8):
        start = row // G * G
        total = 0.0
        for column, weight in zip((task, bonus, length), weights):
            group = column[start : start + G]
            mean = sum(group) / G
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / G)
            total += weight * (column[row] - mean) / (std + eps)
        summed.append(total)
    mean = sum(summed) / 8
    std = math.sqrt(sum((s - mean) ** 2 for s in summed) / 8)
    expected = torch.tensor([(s - mean) / (std + eps) for s in summed])
    components = torch.tensor([task, bonus, length]).T
    got = group_advantages(decoupled_rewards(components, torch.tensor(weights), G), G, normalize_std="batch")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    plain = group_advantages((components * torch.tensor(weights)).sum(-1), G, normalize_std="batch")
    assert (got - plain).abs().max() > 0.1


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"loss": "rloo"}, "rl.loss=rloo has its own baseline (leave-one-out)"),
        ({"loss": "ppo", "critic": True}, "rl.loss=ppo has a critic"),
        ({"reward_terms": {}}, "the task's is the only one"),
        ({"normalize_std": "group"}, "drop rl.normalize_std=group, or set it to batch"),
    ],
)
def test_gdpo_is_refused_where_it_has_nothing_to_normalise(overrides, message):
    rl = {"loss": "grpo", "reward_aggregation": "normalize_then_sum", "reward_terms": {"number": 1.0}, **overrides}
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_rl(RLConfig(**rl))
    if "normalize_std" in overrides:  # unset, it is the step's
        assert resolve_rl(RLConfig(**{**rl, "normalize_std": None})).normalize_std == "batch"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"entropy_coef_delta": 0.01}, "set rl.entropy_target, or drop them"),
        ({"entropy_target": 0.5, "entropy_coef": 0.5, "entropy_coef_max": 0.1}, "keep it within rl.entropy_coef_min"),
        ({"entropy_target": 0.5, "loss": "distill_topk", "teacher": "t"}, "takes none: drop it"),
    ],
)
def test_adaptive_entropy_settings_that_contradict_are_refused(overrides, message):
    with pytest.raises((ValueError, ConfigError), match=re.escape(message)):
        resolve_rl(RLConfig(**overrides))


def test_adaptive_entropy_is_the_pytorch_losses():
    with pytest.raises(ConfigError, match="rl.entropy_target is applied by the PyTorch losses"):
        resolve_rl(RLConfig(loss="grpo", entropy_target=0.5), jax=True)

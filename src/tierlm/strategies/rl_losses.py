"""The policy-gradient losses `rl.loss` names, each one small function over the same inputs, with its reference.

Every loss takes the trainer's log-probs of the sampled tokens `logprobs` (B, T), the rollout batch (its
`advantages`, one per row; `old_logprobs`, the log-probs before this update, absent on-policy; `ref_logprobs` for
a KL penalty; `importance`, off-policy weights) and the trained-token `mask`, and returns (summed loss, normaliser,
statistics). The backend divides the step's summed loss by its summed normaliser over every micro-batch and rank,
so the normaliser decides what the loss averages over:

- `tokens`: every trained token of the step alike (DAPO's token-level loss);
- `sequences`: each row's mean over its tokens, then the mean over rows (GRPO as published);
- `rows`: each row's sum over its tokens, then the mean over rows (LUSPO: a sequence weighs as its length);
- `constant`: the sum over tokens / (rows x rl.max_new_tokens), no length normalisation (Dr. GRPO).

The shared parts are in `tierlm.strategies.rl_terms` once (the ratio, the clipped surrogate, the KL term, the
normalisation, the clip statistics), with the off-policy corrections every loss applies alike
(`tierlm.strategies.off_policy`).
The advantages (group baselines, leave-one-out, the whole batch's) are in `tierlm.strategies.rl`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from tierlm.errors import ConfigError
from tierlm.strategies.base import Variant, check_variant, refuse_on_jax
from tierlm.strategies.off_policy import importance_mode, off_policy_weight
from tierlm.strategies.rl_terms import (
    LossSettings,
    clip_statistics,
    clipped_surrogate,
    kl_term,
    normalise,
    per_token,
    ratio_to_old,
)

Result = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


# -- the losses ---------------------------------------------------------------------------------
def token_loss(logprobs, batch, mask, s: LossSettings) -> Result:
    """The clipped token-level surrogate (+ KL), weighted by off-policy importance, normalised as `s.normalise` says:
    REINFORCE, GRPO, DAPO, Dr. GRPO, RLOO, REINFORCE++, PPO and on-policy distillation differ only in their rows
    (clip bounds, normaliser, baseline)."""
    ratio = ratio_to_old(logprobs, batch)
    adv = per_token(batch["advantages"], logprobs)
    loss = clipped_surrogate(ratio, adv, s.clip_low, s.clip_high, s.ratio_cap)
    if (weight := off_policy_weight(logprobs, batch, mask, s.off_policy_mask)) is not None:
        loss = loss * weight
    kl, stats = kl_term(logprobs, batch, mask, s, ratio)
    total, count = normalise(loss + kl, mask, s.normalise, s.max_new_tokens)
    return total, count, {**stats, **clip_statistics(ratio.detach(), adv, mask, s.clip_low, s.clip_high)}


def cispo(logprobs, batch, mask, s: LossSettings) -> Result:
    """CISPO (MiniMax-M1, 2025): every token keeps its gradient; the importance ratio is clipped from above at
    1 + rl.clip_high and detached, weighting -A log p; the token-level mean."""
    ratio = ratio_to_old(logprobs, batch)  # its gradient reaches the KL penalty alone (rl.unbiased_kl)
    weight = ratio.detach().clamp(max=1.0 + s.clip_high) if s.clip_high is not None else ratio.detach()
    adv = per_token(batch["advantages"], logprobs)
    loss = -weight * adv * logprobs
    if (correction := off_policy_weight(logprobs, batch, mask, s.off_policy_mask)) is not None:
        loss = loss * correction
    kl, stats = kl_term(logprobs, batch, mask, s, ratio)
    total, count = normalise(loss + kl, mask, s.normalise, s.max_new_tokens)
    return total, count, {**stats, **clip_statistics(ratio.detach(), adv, mask, None, s.clip_high)}


def sequence_surrogate(logprobs, batch, mask, s: LossSettings):
    """GSPO's per-row loss: one importance ratio per sequence, the geometric mean of its tokens' ratios
    s = exp(mean_t(log p - log p_old)), in PPO's clipped surrogate -min(s A, clip(s) A), corrected (the mean of the
    row's `off_policy_weight`) and with the row's mean KL term. Returns (per-row loss, token counts, statistics)."""
    maskf = mask.float()
    lengths = maskf.sum(dim=1).clamp(min=1)
    old = batch.get("old_logprobs")
    delta = (logprobs - (logprobs.detach() if old is None else old)) * maskf
    seq_ratio = torch.exp(delta.sum(dim=1) / lengths)
    adv = batch["advantages"].float()
    assert adv.dim() == 1, "a sequence-level loss takes one advantage per sequence"
    loss = clipped_surrogate(seq_ratio, adv, s.clip_low, s.clip_high, s.ratio_cap)
    if (weight := off_policy_weight(logprobs, batch, mask, s.off_policy_mask)) is not None:
        loss = loss * (weight * maskf).sum(dim=1) / lengths
    kl, stats = kl_term(logprobs, batch, maskf, s, seq_ratio)
    if torch.is_tensor(kl):
        loss = loss + (kl * maskf).sum(dim=1) / lengths
    rows = (maskf.sum(dim=1) > 0).float()
    clip = clip_statistics(seq_ratio.detach(), adv, rows, s.clip_low, s.clip_high)
    stats = {**stats, **clip, "seq_ratio_sum": (seq_ratio.detach() * rows).sum(), "rows_sum": rows.sum()}
    return loss * rows, maskf.sum(dim=1), stats


def gspo(logprobs, batch, mask, s: LossSettings) -> Result:
    """GSPO (Zheng et al., 2025): `sequence_surrogate` with its ratio clipped to 1 - rl.clip_low .. 1 + rl.clip_high
    (3e-4 / 4e-4), averaged over the sequences."""
    loss, _, stats = sequence_surrogate(logprobs, batch, mask, s)
    return loss.sum(), stats["rows_sum"], stats


def luspo(logprobs, batch, mask, s: LossSettings) -> Result:
    """LUSPO (2026): GSPO's sequence loss times the sequence's length (its tokens' sum instead of their mean, so a
    long reply is not down-weighted), averaged over the sequences."""
    loss, lengths, stats = sequence_surrogate(logprobs, batch, mask, s)
    return (loss * lengths).sum(), stats["rows_sum"], stats


def sapo(logprobs, batch, mask, s: LossSettings) -> Result:
    """SAPO (Gao et al., 2025): a soft gate in place of the hard clip, -A x sigmoid(tau (r - 1)) x 4 / tau per token
    (the gradient of r at r = 1 is A, and fades smoothly as r leaves 1), tau = rl.sapo_temperature_pos for A > 0 and
    rl.sapo_temperature_neg otherwise (1.0 / 1.05); each sequence's token mean."""
    ratio = ratio_to_old(logprobs, batch)
    adv = per_token(batch["advantages"], logprobs)
    positive, negative = s.sapo_temperatures
    tau = torch.where(adv > 0, positive, negative)
    loss = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv
    if (weight := off_policy_weight(logprobs, batch, mask, s.off_policy_mask)) is not None:
        loss = loss * weight
    kl, stats = kl_term(logprobs, batch, mask, s, ratio)
    total, count = normalise(loss + kl, mask, s.normalise, s.max_new_tokens)
    return total, count, stats


def vespo(logprobs, batch, mask, s: LossSettings) -> Result:
    """VESPO (2026): no clip; each token's -phi(w) A log p with w the sequence's importance ratio, the product of its
    tokens' ratios to the old policy (and the sampler corrections of `batch["importance"]`, in log space), and
    phi(w) = e^lambda w^k e^(-lambda w) (detached; phi(1) = 1), k, lambda = rl.vespo_k_pos, rl.vespo_lambda_pos for
    A >= 0, else rl.vespo_k_neg, rl.vespo_lambda_neg (2, 3, 3, 2); the token-level mean."""
    maskf = mask.float()
    old = batch.get("old_logprobs")
    floor = math.log(1e-8)
    with torch.no_grad():
        log_ratio = (logprobs - (logprobs if old is None else old)).clamp(-20.0, 20.0)
        log_w = (log_ratio * maskf).sum(dim=1, keepdim=True)
        if batch.get("importance") is not None:  # the sampler corrections in log space: each token's, or the row's
            log_is = batch["importance"].log().clamp(floor, 20.0)
            log_w = log_w + (log_is if log_is.shape[1] == 1 else log_is * maskf).sum(dim=1, keepdim=True)
        log_w = log_w.clamp(floor, 20.0)
        assert batch["advantages"].dim() == 1, "VESPO takes one advantage per sequence"
        adv = batch["advantages"].float()[:, None]
        k_pos, lam_pos, k_neg, lam_neg = s.vespo_shape
        k = torch.where(adv >= 0, k_pos, k_neg)
        lam = torch.where(adv >= 0, lam_pos, lam_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    loss = -phi * per_token(batch["advantages"], logprobs) * logprobs
    if s.off_policy_mask is not None or batch.get("token_keep") is not None:  # importance is in phi already
        loss = loss * off_policy_weight(logprobs, {**batch, "importance": None}, mask, s.off_policy_mask)
    kl, stats = kl_term(logprobs, batch, mask, s, ratio_to_old(logprobs, batch))
    total, count = normalise(loss + kl, mask, s.normalise, s.max_new_tokens)
    rows = (maskf.sum(dim=1) > 0).float()
    return total, count, {**stats, "vespo_phi_sum": (phi[:, 0] * rows).sum(), "rows_sum": rows.sum()}


# -- the table ----------------------------------------------------------------------------------
UNSET = object()
"""RLLoss.clip: the loss reads rl.clip_range both ways (its clip bounds are not its own)."""


def topk_reverse_kl(vocab_logprobs, batch, mask, s: LossSettings) -> Result:
    """On-policy distillation over the teacher's top-k (NeMo-RL's top-k reverse KL): at each sampled position the
    student's and the teacher's log-probs of the teacher's k likeliest tokens (`teacher_topk_ids`,
    `teacher_topk_logprobs`), each renormalised over those k, and KL(student || teacher) = sum_k q (log q - log p)
    exactly, differentiated through all k (no sampled estimate); weighted by rl.importance's weights; the
    token-level mean. Takes the log-probs of the whole vocabulary (B, T, V)."""
    student = vocab_logprobs.gather(-1, batch["teacher_topk_ids"])
    student = student - torch.logsumexp(student, dim=-1, keepdim=True)
    teacher = batch["teacher_topk_logprobs"].float()
    teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
    kl = (student.exp() * (student - teacher)).sum(dim=-1)
    weight = batch.get("importance")
    loss = kl * weight if weight is not None else kl
    total, count = normalise(loss, mask, s.normalise, s.max_new_tokens)
    return total, count, {"topk_kl_sum": (kl.detach() * mask.float()).sum()}


@dataclass(frozen=True)
class RLLoss(Variant):
    """One `rl.loss`: its function and everything that makes it itself, read by the settings' resolution
    (`resolve_rl`), the strategy factory (`tierlm.strategies.rl.policy_gradient_strategy`) and the JAX backend.
    Adding a loss is one function (or none: `token_loss` with other settings) and one row of `RL_LOSSES`; which
    other rl.* settings it fixes, needs or reads are the row's `Variant` fields."""

    about: str
    """One line: the paper and what it changes."""
    fn: Callable[..., Result] = token_loss
    """(trainer log-probs (B, T), rollout batch, trained-token mask, LossSettings) -> (sum, normaliser, stats)."""
    vocab: bool = False
    """Its fn takes the log-probs of the whole vocabulary (B, T, V) instead of the sampled tokens' (B, T)."""
    jax: str | None = "token_loss"
    """Its twin's name in `tierlm.strategies.rl_losses_jax` (a name, so JAX is imported only by the JAX backend;
    None: the JAX backend refuses the loss)."""
    normalise: str = "tokens"
    """What the loss averages over: tokens, sequences or constant (see the module's docstring)."""
    clip: tuple[float | None, float | None] | object = UNSET
    """(clip_low, clip_high) when rl.clip_low / rl.clip_high are not given (UNSET: rl.clip_range both ways;
    (None, None): nothing clipped)."""
    divides_by_std: bool = False
    """rl.normalize_std's default: the group-mean advantages divided by the group's std."""
    baseline: str = "group"
    """What a reward is compared with: "group" (its prompt's samples' mean), "leave_one_out" (the others' mean),
    "batch" (the whole step's rewards, normalised)."""
    dynamic_sampling: bool = False
    """rl.dynamic_sampling's default: drop signal-free groups and draw more prompts."""

    @property
    def clips_ratio(self) -> bool:
        """It takes PPO's clipped surrogate of the importance ratio (what rl.two_sided_clip caps)."""
        return self.fn in (token_loss, gspo, luspo) and self.clip != NO_CLIP


NO_CLIP = (None, None)
NO_STD = {"normalize_std": False}

RL_LOSSES: dict[str, RLLoss] = {
    "reinforce": RLLoss(
        "nanochat's on-policy REINFORCE with a group-mean baseline: -A log p, the step's token mean",
        clip=NO_CLIP,
        fixed={"clip_low": None, "clip_high": None},
        why="rl.loss=reinforce clips nothing: drop rl.clip_low / rl.clip_high, or pick a clipped loss",
    ),
    "grpo": RLLoss(
        "GRPO (Shao et al., 2024): group-normalised advantages, clipped ratio, each sequence's token mean",
        normalise="sequences",
        divides_by_std=True,
    ),
    "dapo": RLLoss(
        "DAPO (Yu et al., 2025): decoupled clip 0.2 / 0.28, token-level mean, dynamic sampling",
        clip=(0.2, 0.28),
        divides_by_std=True,
        dynamic_sampling=True,
    ),
    "dr_grpo": RLLoss(
        "Dr. GRPO (Liu et al., 2025): no std division, no length normalisation (sum / rows x rl.max_new_tokens)",
        normalise="constant",
        fixed=NO_STD,
        why="rl.loss=dr_grpo is GRPO without the std division: drop rl.normalize_std",
    ),
    "gspo": RLLoss(
        "GSPO (Zheng et al., 2025): one clipped ratio per sequence (3e-4 / 4e-4), the sequences' mean",
        fn=gspo,
        jax="gspo",
        normalise="sequences",
        clip=(3e-4, 4e-4),
        divides_by_std=True,
    ),
    "cispo": RLLoss(
        "CISPO (MiniMax-M1, 2025): clipped, detached importance weights on every token's -A log p",
        fn=cispo,
        jax="cispo",
        clip=(None, 4.0),
        divides_by_std=True,
        fixed={"clip_low": None},
        why="rl.loss=cispo caps its importance weights from above only: drop rl.clip_low",
    ),
    "rloo": RLLoss(
        "RLOO (Ahmadian et al., 2024): leave-one-out baselines, PPO's clip, token-level mean",
        baseline="leave_one_out",
        fixed=NO_STD,
        why="rl.loss=rloo has its own baseline (leave-one-out): drop rl.normalize_std",
    ),
    "reinforce_pp": RLLoss(
        "REINFORCE++ (Hu, 2025): rewards normalised over the whole batch, PPO's clip, token-level mean",
        baseline="batch",
        fixed=NO_STD,
        why="rl.loss=reinforce_pp has its own baseline (the whole batch's): drop rl.normalize_std",
    ),
    "bnpo": RLLoss(
        "BNPO (TRL's batch-normalised GRPO): GRPO's advantages and symmetric clip, the token-level mean of the step",
        divides_by_std=True,
    ),
    "sapo": RLLoss(
        "SAPO (Gao et al., 2025): a soft sigmoid gate on the ratio instead of the clip, each sequence's token mean",
        fn=sapo,
        jax=None,
        normalise="sequences",
        clip=NO_CLIP,
        divides_by_std=True,
        fixed={"clip_low": None, "clip_high": None},
        reads=("sapo_temperature_pos", "sapo_temperature_neg"),
        why={
            **dict.fromkeys(
                ("clip_low", "clip_high"),
                "rl.loss=sapo gates the ratio softly instead of clipping it: drop rl.clip_low / rl.clip_high",
            ),
            **dict.fromkeys(
                ("sapo_temperature_pos", "sapo_temperature_neg"),
                "rl.sapo_temperature_pos / _neg are SAPO's gate temperatures: set rl.loss=sapo",
            ),
        },
    ),
    "luspo": RLLoss(
        "LUSPO (2026): GSPO's clipped sequence ratio (3e-4 / 4e-4), each sequence's loss times its length",
        fn=luspo,
        jax=None,
        normalise="rows",
        clip=(3e-4, 4e-4),
        divides_by_std=True,
    ),
    "vespo": RLLoss(
        "VESPO (2026): no clip; a gamma-shaped weight of the sequence's importance ratio on -A log p, token mean",
        fn=vespo,
        jax=None,
        clip=NO_CLIP,
        divides_by_std=True,
        fixed={"clip_low": None, "clip_high": None},
        reads=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
        why={
            **dict.fromkeys(
                ("clip_low", "clip_high"),
                "rl.loss=vespo weights sequences smoothly instead of clipping: drop rl.clip_low / rl.clip_high",
            ),
            **dict.fromkeys(
                ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
                "rl.vespo_k_* / rl.vespo_lambda_* shape VESPO's sequence weights: set rl.loss=vespo",
            ),
        },
    ),
    "ppo": RLLoss(
        "PPO (Schulman et al., 2017): clipped ratio over stored old log-probs for rl.ppo_epochs, a critic optional",
        reads=("critic",),
        why="rl.critic trains PPO's value model: set rl.loss=ppo (or drop rl.critic; other losses use baselines)",
    ),
    "distill": RLLoss(
        "on-policy distillation (Agarwal et al., 2024): each token's advantage is log p_teacher - log p_student",
        clip=NO_CLIP,
        fixed={"clip_low": None, "clip_high": None, "reward_model": None},
        needs=("teacher|teachers",),
        reads=("teacher", "teachers"),
        why="rl.loss=distill learns from rl.teacher's log-probs, not rewards, and clips nothing: give "
        "rl.loss=distill rl.teacher=FOLDER (or rl.teachers), without rl.clip_low / rl.clip_high / rl.reward_model",
    ),
    "distill_topk": RLLoss(
        "on-policy distillation over the teacher's top-k tokens (NeMo-RL): the exact reverse KL, renormalised",
        fn=topk_reverse_kl,
        vocab=True,
        jax=None,
        clip=NO_CLIP,
        fixed={"clip_low": None, "clip_high": None, "reward_model": None, "off_policy_mask": None},
        needs=("teacher|teachers",),
        reads=("teacher", "teachers", "distill_top_k"),
        why={
            **dict.fromkeys(
                ("clip_low", "clip_high", "reward_model", "off_policy_mask", "teacher"),
                "rl.loss=distill_topk learns from the teacher's top-k log-probs, not rewards, and clips nothing: "
                "give rl.loss=distill_topk rl.teacher=FOLDER (or rl.teachers), without rl.clip_low / "
                "rl.clip_high / rl.reward_model / rl.off_policy_mask",
            ),
            "distill_top_k": "rl.distill_top_k is the top-k of on-policy distillation's exact KL: set "
            "rl.loss=distill_topk",
        },
    ),
}
"""rl.loss -> what it is: the one place a policy-gradient loss is named."""


PYTORCH_ONLY: dict[str, Callable] = {
    "off_policy_mask": lambda rl: rl.off_policy_mask is not None,
    "two_sided_clip": lambda rl: rl.two_sided_clip is not None,
    "entropy_coef": lambda rl: bool(rl.entropy_coef),
    "top_entropy_quantile": lambda rl: rl.top_entropy_quantile < 1,
    "kl_estimator": lambda rl: rl.kl_estimator != "k3",
    "unbiased_kl": lambda rl: rl.unbiased_kl,
    "entropy_target": lambda rl: rl.entropy_target is not None,
    "reference_sync_steps": lambda rl: rl.reference_sync_steps is not None,
}
"""rl.<setting> -> whether a run turns it on: what the PyTorch losses apply and the JAX twins do not."""


def resolve_rl(rl, jax: bool = False):
    """The `rl` section with its loss's defaults filled in (clip bounds, std division, dynamic sampling) and the
    reference's mixup alpha, refusing in one line (a ConfigError) what the loss fixes, needs or does not read (and,
    for the JAX backend, a loss without a JAX twin). Done once, when a run's config is resolved; the strategy
    factory and the RL loop read the filled fields.

    >>> from tierlm.config import RLConfig
    >>> rl = resolve_rl(RLConfig(loss="dapo"))
    >>> rl.clip_low, rl.clip_high, rl.normalize_std, rl.dynamic_sampling
    (0.2, 0.28, True, True)
    >>> resolve_rl(RLConfig(loss="cispo", clip_low=0.1))
    Traceback (most recent call last):
    tierlm.errors.ConfigError: rl.loss=cispo caps its importance weights from above only: drop rl.clip_low
    """
    spec = check_variant(rl, "loss", RL_LOSSES, "rl")
    if jax and spec.jax is None:
        raise ConfigError(f"rl.loss={rl.loss} has no JAX twin: train it with infra.backend=pytorch")
    if rl.reference_mixup_alpha is not None and rl.reference_sync_steps is None:
        raise ConfigError("rl.reference_mixup_alpha is how far each rl.reference_sync_steps sync moves the reference: "
                          "set rl.reference_sync_steps, or drop it")  # fmt: skip
    if rl.unbiased_kl and not rl.kl_coef:
        raise ConfigError(
            "rl.unbiased_kl weights the KL penalty by the importance ratio; with rl.kl_coef=0 there is none: set "
            "rl.kl_coef > 0, or drop it"
        )
    if rl.kl_in_reward:
        check_kl_in_reward(rl, spec)
    if rl.reference_sync_steps is not None and not rl.kl_coef:
        raise ConfigError(
            "rl.reference_sync_steps moves the KL penalty's reference toward the policy; with rl.kl_coef=0 there is "
            "none: set rl.kl_coef > 0, or drop it"
        )
    if jax:
        refuse_on_jax(rl, "rl", PYTORCH_ONLY, "the PyTorch losses")
    if rl.two_sided_clip is not None and not spec.clips_ratio:
        raise ConfigError(
            f"rl.two_sided_clip caps the ratio in PPO's clipped surrogate; rl.loss={rl.loss} has none: drop it"
        )
    if (rl.entropy_coef or rl.entropy_target is not None) and spec.vocab:
        raise ConfigError(
            f"rl.entropy_coef adds the policy's entropy to a policy-gradient loss; rl.loss={rl.loss} takes none: "
            "drop it"
        )
    if rl.top_entropy_quantile < 1 and spec.vocab:
        raise ConfigError(
            f"rl.top_entropy_quantile picks the sampled tokens a policy-gradient loss trains; rl.loss={rl.loss} has "
            "none to pick: drop it"
        )
    std = rl.normalize_std if rl.normalize_std is not None else spec.divides_by_std
    if rl.reward_aggregation == "normalize_then_sum":
        std = gdpo_std(rl, spec)
    alpha = 0.6 if rl.reference_sync_steps and rl.reference_mixup_alpha is None else rl.reference_mixup_alpha  # TRL's
    low, high = (rl.clip_range, rl.clip_range) if spec.clip is UNSET else spec.clip
    dynamic = rl.dynamic_sampling if rl.dynamic_sampling is not None else spec.dynamic_sampling
    if dynamic and rl.partial_rollouts:
        raise ConfigError(
            f"rl.partial_rollouts trains the groups that finish first; dynamic sampling (rl.loss={rl.loss}'s "
            "default or rl.dynamic_sampling) redraws a step's prompts: set rl.dynamic_sampling=false or drop "
            "rl.partial_rollouts"
        )
    return rl.model_copy(
        update={
            "clip_low": rl.clip_low if rl.clip_low is not None else low,
            "clip_high": rl.clip_high if rl.clip_high is not None else high,
            "normalize_std": std,
            "dynamic_sampling": dynamic,
            "importance": importance_mode(rl),
            "reference_mixup_alpha": alpha,
        }
    )


def check_kl_in_reward(rl, spec: RLLoss) -> None:
    """rl.kl_in_reward where a reward can carry the KL: a reference (rl.kl_coef > 0), advantages from rewards."""
    clash = [
        (not rl.kl_coef, "with rl.kl_coef=0 there is none: set rl.kl_coef > 0"),
        (rl.critic or spec.vocab or "teacher" in spec.reads, f"rl.loss={rl.loss}'s advantages are not the rewards'"),
        (rl.unbiased_kl, "rl.unbiased_kl weighs a KL term of the loss, which it removes"),
        (rl.reward_aggregation == "normalize_then_sum", "GDPO normalises the rewards apart, the KL not among them"),
    ]
    for refused, why in clash:
        if refused:
            raise ConfigError(f"rl.kl_in_reward moves the KL penalty into each completion's reward; {why}: drop it")


def gdpo_std(rl, spec: RLLoss) -> str:
    """rl.reward_aggregation=normalize_then_sum (GDPO) checked: a group-baseline loss without a critic, more than the
    task's reward to normalise; its sum's advantages divide by the step's std ("batch")."""
    if spec.baseline != "group" or rl.critic:
        has = "a critic" if rl.critic else f"its own baseline ({spec.baseline.replace('_', '-')})"
        raise ConfigError(
            f"rl.reward_aggregation=normalize_then_sum normalises each reward in its group; rl.loss={rl.loss} has "
            f"{has}: drop rl.reward_aggregation"
        )
    if not (rl.reward_terms or rl.reward_model or rl.overlong_buffer):
        raise ConfigError(
            "rl.reward_aggregation=normalize_then_sum normalises each of several rewards, and the task's is the only "
            "one: add rl.reward_terms (or rl.reward_model), or drop rl.reward_aggregation"
        )
    if rl.normalize_std not in (None, "batch"):
        raise ConfigError(
            "rl.reward_aggregation=normalize_then_sum divides the summed rewards' advantages by the step's std: drop "
            f"rl.normalize_std={rl.normalize_std}, or set it to batch"
        )
    return "batch"


def loss_settings(rl) -> LossSettings:
    """What the loss of a resolved `rl` section reads from it (its normaliser is its row's: the strategy sets it)."""
    return LossSettings(
        rl.clip_low,
        rl.clip_high,
        0.0 if rl.kl_in_reward else rl.kl_coef,  # rl.kl_in_reward: the loop puts it in the rewards instead
        rl.kl_estimator,
        rl.unbiased_kl,
        rl.max_new_tokens,
        off_policy_mask=rl.off_policy_mask,
        top_entropy_quantile=rl.top_entropy_quantile,
        ratio_cap=rl.two_sided_clip,
        entropy_coef=rl.entropy_coef,
        measure_entropy=rl.entropy_target is not None,
        sapo_temperatures=(rl.sapo_temperature_pos, rl.sapo_temperature_neg),
        vespo_shape=(rl.vespo_k_pos, rl.vespo_lambda_pos, rl.vespo_k_neg, rl.vespo_lambda_neg),
    )

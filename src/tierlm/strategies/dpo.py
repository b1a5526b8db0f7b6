"""Direct Preference Optimization (Rafailov et al., 2023) and the preference losses beside it (`dpo.loss_type`).

A batch holds N chosen rows then N rejected rows (`input_ids`, `labels` with -100 off the
response). With policy and reference sequence log-probs (summed over response tokens) and
h = (pi_c - ref_c) - (pi_r - ref_r):

    sigmoid (DPO):   -log sigmoid(beta h)
    robust:          (-(1 - e) log sigmoid(beta h) + e log sigmoid(-beta h)) / (1 - 2e), e = dpo.label_smoothing
    hinge (SLiC):    max(0, 1 - beta h)
    ipo:             (h - 1 / (2 beta))^2, on log-probs averaged over each response's tokens

and, as TRL's DPOTrainer computes them, with the log-ratios l_c = pi_c - ref_c, l_r = pi_r - ref_r (h = l_c - l_r):

    sigmoid_norm:    sigmoid on log-probs averaged over each response's tokens
    exo_pair (EXO):  q log(q / (1 - e)) + (1 - q) log((1 - q) / e), q = sigmoid(beta h), e = dpo.label_smoothing
    nca_pair (NCA):  -log sigmoid(beta l_c) - 1/2 log sigmoid(-beta l_c) - 1/2 log sigmoid(-beta l_r)
    bco_pair (BCO):  -log sigmoid(beta l_c) - log sigmoid(-beta l_r)
    sppo_hard:       (l_c - 1 / (2 beta))^2 + (l_r + 1 / (2 beta))^2
    apo_zero (APO):  1 - sigmoid(beta l_c) + sigmoid(beta l_r)
    apo_down (APO):  sigmoid(beta l_c) + 1 - sigmoid(beta h)
    discopop:        (1 - m) (-log sigmoid(beta h)) + m exp(-beta h), m = sigmoid(beta h / tau), tau = dpo.discopop_tau

and two without a reference model (none is loaded), on averaged log-probs a_c, a_r:

    simpo:           -log sigmoid(beta (a_c - a_r) - gamma), gamma = dpo.simpo_gamma
    orpo:            NLL(chosen) - beta log sigmoid(log odds(a_c) - log odds(a_r)), odds(a) = e^a / (1 - e^a)

and KTO (Ethayarajh et al., 2024) on unpaired replies judged alone, with r = pi - ref per reply and z the batch's
KL estimate (mean pi - ref over mismatched prompt / reply rows, clamped at 0, no gradient; TRL's KTOTrainer's):

    kto:             desirable: w_d (1 - sigmoid(beta (r - z)));  undesirable: w_u (1 - sigmoid(beta (z - r)))

Reference log-probs come from the batch (`ref_logps`, precomputed) or from a frozen reference
model that `prepare_batch` runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from tierlm.errors import ConfigError
from tierlm.primitives.losses import IGNORE_INDEX, splits_by_rows, token_logprobs
from tierlm.strategies.base import Variant, check_variant

Batch = Mapping[str, torch.Tensor]


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of log p(label) over each row's labelled tokens (B,)."""
    return token_logprobs(logits, labels).sum(dim=-1)


def length_desensitised(labels: torch.Tensor, alpha: float) -> torch.Tensor:
    """LD-DPO's token weights (B, T) for N chosen rows then their N rejected rows: 1 on each response's first
    tokens, as many as the pair's shorter response has, `alpha` on the rest, 0 off the responses.

    >>> labels = torch.tensor([[-100, 5, 6, 7], [-100, 8, -100, -100]])  # a 3-token chosen, a 1-token rejected reply
    >>> length_desensitised(labels, 0.5)
    tensor([[0.0000, 1.0000, 0.5000, 0.5000],
            [0.0000, 1.0000, 0.0000, 0.0000]])
    """
    trained = labels != IGNORE_INDEX
    order, lengths = trained.cumsum(dim=-1), trained.sum(dim=-1)
    n = lengths.shape[0] // 2
    shared = torch.minimum(lengths[:n], lengths[n:]).repeat(2)[:, None]
    return torch.where(order <= shared, 1.0, alpha) * trained


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair (loss, chosen reward, rejected reward); rewards are beta * (policy - reference).

    >>> loss, c, r = dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]),
    ...     beta=0.5)
    >>> round(loss.item(), 4), c.item(), r.item()   # -log sigmoid(0.5 * (1 - (-1)))
    (0.3133, 0.5, -0.5)
    """
    chosen_rewards = beta * (policy_chosen - ref_chosen)
    rejected_rewards = beta * (policy_rejected - ref_rejected)
    return -F.logsigmoid(chosen_rewards - rejected_rewards), chosen_rewards, rejected_rewards


@dataclass(frozen=True)
class PreferenceSettings:
    """What a preference loss reads from the dpo section."""

    beta: float = 0.1
    label_smoothing: float = 0.0  # robust: the assumed flip rate; exo_pair: EXO's epsilon
    simpo_gamma: float = 0.5  # simpo: the target margin
    discopop_tau: float = 0.05  # discopop: the blend's temperature


def _rewards(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings):
    """(h, chosen rewards, rejected rewards): h = (pi_c - ref_c) - (pi_r - ref_r); rewards beta (pi - ref)."""
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    return h, s.beta * (chosen - ref_chosen), s.beta * (rejected - ref_rejected)


def sigmoid(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """DPO (Rafailov et al., 2023): -log sigmoid(beta h)."""
    return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, s.beta)


def robust(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """Robust DPO (Chowdhury et al., 2024) under a flip rate e: (-(1 - e) log sig(beta h) + e log sig(-beta h)) /
    (1 - 2e)."""
    h, rc, rr = _rewards(chosen, rejected, ref_chosen, ref_rejected, s)
    e = s.label_smoothing
    return (-(1 - e) * F.logsigmoid(s.beta * h) + e * F.logsigmoid(-s.beta * h)) / (1 - 2 * e), rc, rr


def hinge(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """SLiC's hinge (Zhao et al., 2023): max(0, 1 - beta h)."""
    h, rc, rr = _rewards(chosen, rejected, ref_chosen, ref_rejected, s)
    return torch.relu(1 - s.beta * h), rc, rr


def ipo(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """IPO (Azar et al., 2023): (h - 1 / (2 beta))^2 on log-probs averaged over each response's tokens."""
    h, rc, rr = _rewards(chosen, rejected, ref_chosen, ref_rejected, s)
    return (h - 1 / (2 * s.beta)) ** 2, rc, rr


def exo_pair(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """EXO (Ji et al., 2024, eq. 16): KL(softmax of beta h over the pair || (1 - e, e)), e = dpo.label_smoothing."""
    h, rc, rr = _rewards(chosen, rejected, ref_chosen, ref_rejected, s)
    e = torch.tensor(s.label_smoothing)
    win, lose = s.beta * h, -s.beta * h
    loss = torch.sigmoid(win) * (F.logsigmoid(win) - torch.log1p(-e)) + torch.sigmoid(lose) * (
        F.logsigmoid(lose) - torch.log(e)
    )
    return loss, rc, rr


def nca_pair(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """NCA (Chen et al., 2024): -log sig(beta l_c) - 1/2 log sig(-beta l_c) - 1/2 log sig(-beta l_r)."""
    _, rc, rr = _rewards(chosen, rejected, ref_chosen, ref_rejected, s)
    return -F.logsigmoid(rc) - 0.5 * F.logsigmoid(-rc) - 0.5 * F.logsigmoid(-rr), rc, rr


def bco_pair(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """BCO's pairwise form (Jung et al., 2024) as TRL's DPOTrainer has it: -log sig(beta l_c) - log sig(-beta l_r)."""
    _, rc, rr = _rewards(chosen, rejected, ref_chosen, ref_rejected, s)
    return -F.logsigmoid(rc) - F.logsigmoid(-rr), rc, rr


def sppo_hard(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """SPPO (Wu et al., 2024) with hard win probabilities: (l_c - 1 / (2 beta))^2 + (l_r + 1 / (2 beta))^2."""
    _, rc, rr = _rewards(chosen, rejected, ref_chosen, ref_rejected, s)
    lc, lr = chosen - ref_chosen, rejected - ref_rejected
    return (lc - 0.5 / s.beta) ** 2 + (lr + 0.5 / s.beta) ** 2, rc, rr


def apo_zero(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """APO-zero (D'Oosterlinck et al., 2024, eq. 7; chosen replies better than the model's): 1 - sig(beta l_c) +
    sig(beta l_r)."""
    _, rc, rr = _rewards(chosen, rejected, ref_chosen, ref_rejected, s)
    return 1 - torch.sigmoid(rc) + torch.sigmoid(rr), rc, rr


def apo_down(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """APO-down (D'Oosterlinck et al., 2024, eq. 8; chosen replies worse than the model's): sig(beta l_c) + 1 -
    sig(beta h)."""
    h, rc, rr = _rewards(chosen, rejected, ref_chosen, ref_rejected, s)
    return torch.sigmoid(rc) + 1 - torch.sigmoid(s.beta * h), rc, rr


def discopop(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """DiscoPOP (Chris Lu et al., 2024, eq. 5): the logistic and exponential losses blended by sig(beta h / tau)."""
    h, rc, rr = _rewards(chosen, rejected, ref_chosen, ref_rejected, s)
    margin = s.beta * h
    blend = torch.sigmoid(margin / s.discopop_tau)
    return -F.logsigmoid(margin) * (1 - blend) + torch.exp(-margin) * blend, rc, rr


def simpo(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """SimPO (Meng et al., 2024), reference-free: -log sigmoid(beta (a_c - a_r) - gamma)."""
    rewards = s.beta * chosen.detach(), s.beta * rejected.detach()
    return -F.logsigmoid(s.beta * (chosen - rejected) - s.simpo_gamma), *rewards


def orpo(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """ORPO (Hong et al., 2024), reference-free: NLL(chosen) - beta log sigmoid(log odds(a_c) - log odds(a_r))."""
    assert chosen_nll is not None, "ORPO adds the chosen responses' NLL"
    log_odds = (chosen - rejected) - (torch.log1p(-chosen.exp()) - torch.log1p(-rejected.exp()))
    return chosen_nll - s.beta * F.logsigmoid(log_odds), s.beta * chosen.detach(), s.beta * rejected.detach()


@dataclass(frozen=True)
class PreferenceLoss(Variant):
    """One `dpo.loss_type`: its per-pair function and what makes it itself, read by `resolve_dpo`, the strategy
    factory (`preference_strategy`), the DPO stage and its loaders. Adding one is a function and a row of
    `PREFERENCE_LOSSES`."""

    about: str
    fn: Callable | None = None
    """(chosen, rejected, ref chosen, ref rejected log-probs (N,), PreferenceSettings, chosen NLL) -> per pair
    (loss, chosen reward, rejected reward); None: KTO's own strategy (`KTOStrategy`)."""
    reference: bool = True
    """It compares with a reference model (frozen, or the data's precomputed log-probs); False: none is loaded."""
    averaged: bool = False
    """Its log-probs are averaged over each response's tokens (the others sum them)."""
    paired: bool = True
    """It reads chosen / rejected pairs; False: unpaired judged replies (KTO's), with a KL estimate's rows."""
    jax: bool = False
    """The JAX backend trains it (`tierlm.primitives.jax_losses.dpo_loss`)."""


SMOOTHING = (
    "dpo.label_smoothing is robust DPO's assumed flip rate and EXO's epsilon: set dpo.loss_type=robust or exo_pair "
    "with 0 < dpo.label_smoothing < 0.5, or neither"
)

PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {
    "sigmoid": PreferenceLoss("DPO (Rafailov et al., 2023)", sigmoid, jax=True),
    "sigmoid_norm": PreferenceLoss("DPO on per-token averaged log-probs", sigmoid, averaged=True),
    "ipo": PreferenceLoss("IPO (Azar et al., 2023), on per-token averaged log-probs", ipo, averaged=True),
    "hinge": PreferenceLoss("SLiC's hinge (Zhao et al., 2023)", hinge),
    "robust": PreferenceLoss(
        "robust DPO under label noise (Chowdhury et al., 2024)",
        robust,
        needs=("label_smoothing",),
        reads=("label_smoothing",),
        why=SMOOTHING,
    ),
    "exo_pair": PreferenceLoss(
        "EXO (Ji et al., 2024), the pairwise form",
        exo_pair,
        needs=("label_smoothing",),
        reads=("label_smoothing",),
        why=SMOOTHING,
    ),  # fmt: skip
    "nca_pair": PreferenceLoss("NCA (Chen et al., 2024), the pairwise form", nca_pair),
    "bco_pair": PreferenceLoss("BCO (Jung et al., 2024), the pairwise form of TRL's DPOTrainer", bco_pair),
    "sppo_hard": PreferenceLoss("SPPO (Wu et al., 2024) with hard win probabilities", sppo_hard),
    "apo_zero": PreferenceLoss("APO-zero (D'Oosterlinck et al., 2024): chosen better than the model's", apo_zero),
    "apo_down": PreferenceLoss("APO-down (D'Oosterlinck et al., 2024): chosen worse than the model's", apo_down),
    "discopop": PreferenceLoss(
        "DiscoPOP (Lu et al., 2024), a discovered blend of logistic and exponential losses",
        discopop,
        reads=("discopop_tau",),
        why="dpo.discopop_tau is DiscoPOP's; dpo.loss_type={name} does not read it",
    ),  # fmt: skip
    "simpo": PreferenceLoss(
        "SimPO (Meng et al., 2024), reference-free",
        simpo,
        reference=False,
        averaged=True,
        reads=("simpo_gamma",),
        why="dpo.simpo_gamma is SimPO's margin; dpo.loss_type={name} does not read it",
    ),
    "orpo": PreferenceLoss(
        "ORPO (Hong et al., 2024), reference-free",
        orpo,
        reference=False,
        averaged=True,
        fixed={"rpo_alpha": 0.0},
        why="dpo.rpo_alpha adds the chosen responses' NLL to a pairwise loss; dpo.loss_type=orpo has its own NLL "
        "term: drop it",
    ),  # fmt: skip
    "kto": PreferenceLoss(
        "KTO (Ethayarajh et al., 2024) on unpaired judged replies",
        paired=False,
        fixed={"reference": "frozen", "rpo_alpha": 0.0},
        reads=("desirable_weight", "undesirable_weight"),
        why={
            "reference": "dpo.loss_type=kto computes its reference log-probs (and the KL rows'): drop dpo.reference",
            "rpo_alpha": "dpo.rpo_alpha adds the chosen responses' NLL to a pairwise loss; dpo.loss_type=kto has no "
            "pairs: drop it",
            "desirable_weight": "dpo.desirable_weight / undesirable_weight are KTO's; dpo.loss_type={name} does not "
            "read them",
            "undesirable_weight": "dpo.desirable_weight / undesirable_weight are KTO's; dpo.loss_type={name} does not "
            "read them",
        },
    ),
}
"""dpo.loss_type -> what it is: the one place a preference loss is named."""


def resolve_dpo(dpo):
    """The `dpo` section, checked against its loss's row (a ConfigError names what contradicts it). Done once, when
    a run's config is resolved.

    >>> from tierlm.config import DPOConfig
    >>> resolve_dpo(DPOConfig(loss_type="simpo", simpo_gamma=1.0)).simpo_gamma
    1.0
    >>> resolve_dpo(DPOConfig(loss_type="simpo", reference="precomputed"))
    Traceback (most recent call last):
    tierlm.errors.ConfigError: dpo.loss_type=simpo uses no reference: drop dpo.reference=precomputed
    """
    row = check_variant(dpo, "loss_type", PREFERENCE_LOSSES, "dpo")
    if not row.reference and dpo.reference == "precomputed":
        raise ConfigError(f"dpo.loss_type={dpo.loss_type} uses no reference: drop dpo.reference=precomputed")
    if dpo.ld_alpha is not None and not (row.paired and row.reference):
        raise ConfigError(
            f"dpo.ld_alpha weights the tails of a pair's responses against a reference; dpo.loss_type="
            f"{dpo.loss_type} has {'no pairs' if not row.paired else 'no reference'}: drop it"
        )
    if dpo.ld_alpha is not None and dpo.reference == "precomputed":
        raise ConfigError(
            "dpo.ld_alpha weights the reference's log-probs too, and precomputed ones are whole sums: use "
            "dpo.reference=frozen, or drop dpo.ld_alpha"
        )
    return dpo


def preference_strategy(dpo, reference=None) -> "DPOStrategy | KTOStrategy":
    """The strategy of a `dpo` section: its loss's row (pairs, or KTO's unpaired replies) and settings; `reference`
    is the frozen reference model (None: precomputed log-probs, or a reference-free loss)."""
    if not PREFERENCE_LOSSES[dpo.loss_type].paired:
        return KTOStrategy(dpo.beta, reference, dpo.desirable_weight, dpo.undesirable_weight)
    gamma = dpo.simpo_gamma if dpo.simpo_gamma is not None else PreferenceSettings.simpo_gamma
    tau = dpo.discopop_tau if dpo.discopop_tau is not None else PreferenceSettings.discopop_tau
    return DPOStrategy(dpo.beta, reference, dpo.loss_type, dpo.label_smoothing, gamma, tau, dpo.ld_alpha, dpo.rpo_alpha)


def preference_loss(
    loss_type: str,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    chosen_nll: torch.Tensor | None = None,
    discopop_tau: float = 0.05,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair (loss, chosen reward, rejected reward) of `loss_type` (the module's docstring has the formulas).
    `chosen` / `rejected` are the policy's sequence log-probs (averaged per token for ipo, simpo and orpo); ORPO
    also takes the chosen responses' mean token NLL.

    >>> loss, _, _ = preference_loss("hinge", torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]),
    ...     torch.tensor([-2.0]), beta=0.25)
    >>> loss.item()   # max(0, 1 - 0.25 * 2)
    0.5
    """
    settings = PreferenceSettings(beta, label_smoothing, simpo_gamma, discopop_tau)
    return PREFERENCE_LOSSES[loss_type].fn(chosen, rejected, ref_chosen, ref_rejected, settings, chosen_nll)


class DPOStrategy:
    """DPO (or `loss_type`) as a strategy for the ordinary `Trainer`: losses are summed per pair and counted in
    pairs."""

    def __init__(
        self,
        beta: float = 0.1,
        reference=None,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        simpo_gamma: float = 0.5,
        discopop_tau: float = 0.05,
        ld_alpha: float | None = None,
        rpo_alpha: float = 0.0,
    ):
        """`reference`: anything with the protocol's `forward(batch, fn)` (a `FrozenReference`); None
        when batches carry precomputed `ref_logps`, or for a reference-free loss. `ld_alpha`: LD-DPO's weight of
        the tokens past the pair's shorter response; `rpo_alpha`: RPO's weight of the chosen responses' NLL."""
        assert beta > 0, f"beta must be > 0, got {beta}"
        self.ld_alpha, self.rpo_alpha = ld_alpha, rpo_alpha
        self.reference, self.loss_type, self.row = reference, loss_type, PREFERENCE_LOSSES[loss_type]
        self.beta, self.settings = beta, PreferenceSettings(beta, label_smoothing, simpo_gamma, discopop_tau)

    def prepare_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        out = dict(batch)
        if not self.row.reference:
            return out
        if "ref_logps" not in out:
            assert self.reference is not None, "DPO needs a reference model or precomputed ref_logps in the batch"
            out["ref_logps"] = self.reference.forward(out, self._logps).wait()["logps"]
        return out

    def _logps(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        return {"logps": self._sequences(token_logprobs(logits, batch["labels"]), batch["labels"])}

    def _sequences(self, token_logps: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each row's response log-prob from its tokens': summed (LD-DPO: the tails weighted), or averaged."""
        weights = (
            (labels != IGNORE_INDEX).float() if self.ld_alpha is None else length_desensitised(labels, self.ld_alpha)
        )
        logps = (token_logps * weights).sum(dim=-1)
        if self.row.averaged:
            logps = logps / (labels != IGNORE_INDEX).sum(dim=-1).clamp(min=1)
        return logps

    def _pairs(self, logits: torch.Tensor, batch: Batch):
        labels = batch["labels"]
        token_logps = token_logprobs(logits, labels)
        policy = self._sequences(token_logps, labels)
        n = policy.shape[0] // 2
        ref = batch["ref_logps"].to(policy.device) if self.row.reference else None
        ref_chosen, ref_rejected = (None, None) if ref is None else (ref[:n], ref[n:])
        nll = -policy[:n]  # the chosen rows' mean token NLL (ORPO's: its log-probs are averaged)
        loss, chosen_rewards, rejected_rewards = self.row.fn(
            policy[:n], policy[n:], ref_chosen, ref_rejected, self.settings, nll
        )
        if self.rpo_alpha:  # RPO: the chosen responses' token-mean NLL over the micro-batch, on every pair
            chosen = labels[:n] != IGNORE_INDEX
            loss = loss - self.rpo_alpha * (token_logps[:n] * chosen).sum() / chosen.sum().clamp(min=1)
        return policy[:n], policy[n:], loss, chosen_rewards, rejected_rewards

    @splits_by_rows(2)  # N chosen rows, then their N rejected rows
    def compute_loss(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        *_, losses, _, _ = self._pairs(logits, batch)
        return losses.sum(), torch.tensor(float(losses.numel()), device=losses.device)

    def compute_metrics(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        chosen, rejected, losses, chosen_rewards, rejected_rewards = self._pairs(logits, batch)
        margin = chosen_rewards - rejected_rewards
        return {
            "loss_sum": losses.sum(),
            "num_pairs": torch.tensor(float(losses.numel())),
            "margin_sum": margin.sum(),
            # A tie (e.g. every pair before the first update, when policy == reference) is half right: chance level.
            "correct": ((margin > 0).float() + 0.5 * (margin == 0).float()).sum(),
            "policy_correct": ((chosen > rejected).float() + 0.5 * (chosen == rejected).float()).sum(),
        }

    # -- the JAX backend's twins (tierlm.primitives.jax_losses.jax_twin), tested equal to the methods above --------
    def jax_logps(self, logits, batch):
        from tierlm.primitives.jax_losses import token_logprobs

        return {"logps": token_logprobs(logits, batch["labels"]).sum(axis=-1)}

    def _jax_pairs(self, logits, batch):
        from tierlm.primitives.jax_losses import dpo_loss as jax_dpo_loss

        policy = self.jax_logps(logits, batch)["logps"]
        ref, n = batch["ref_logps"], policy.shape[0] // 2
        return policy[:n], policy[n:], *jax_dpo_loss(policy[:n], policy[n:], ref[:n], ref[n:], self.beta)

    def jax_compute_loss(self, logits, batch):
        *_, losses, _, _ = self._jax_pairs(logits, batch)
        return losses.sum(), float(losses.shape[0])

    def jax_compute_metrics(self, logits, batch):
        chosen, rejected, losses, chosen_rewards, rejected_rewards = self._jax_pairs(logits, batch)
        margin = chosen_rewards - rejected_rewards
        return {
            "loss_sum": losses.sum(),
            "num_pairs": float(losses.shape[0]),
            "margin_sum": margin.sum(),
            "correct": ((margin > 0) + 0.5 * (margin == 0)).sum(),
            "policy_correct": ((chosen > rejected) + 0.5 * (chosen == rejected)).sum(),
        }

    @staticmethod
    def summarize(totals: Mapping[str, float]) -> dict[str, float]:
        """val_loss, reward_margin, pref_acc (implicit reward prefers chosen) and policy_pref_acc
        (the policy gives the chosen response the higher log-prob) over the eval pairs."""
        n = max(totals["num_pairs"], 1.0)
        return {
            "val_loss": totals["loss_sum"] / n,
            "reward_margin": totals["margin_sum"] / n,
            "pref_acc": totals["correct"] / n,
            "policy_pref_acc": totals["policy_correct"] / n,
        }


class KTOStrategy:
    """KTO (`dpo.loss_type=kto`) for the `Trainer`, on `UnpairedLoader` batches (N replies then N mismatched rows for
    the KL estimate, `kto_label` 1 for a desirable reply); losses are summed per reply and counted in replies. The
    mismatched rows run through the policy with the others (their log-probs detached: the estimate is a baseline).
    Under data parallelism each rank estimates the KL from its own rows (TRL averages the ranks' estimates)."""

    def __init__(self, beta: float, reference=None, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
        assert beta > 0, f"beta must be > 0, got {beta}"
        self.beta, self.reference = beta, reference
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    def prepare_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        out = dict(batch)
        if "ref_logps" not in out:
            assert self.reference is not None, "KTO needs a reference model"
            out["ref_logps"] = self.reference.forward(out, self._logps).wait()["logps"]
        return out

    def _logps(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        return {"logps": sequence_logprobs(logits, batch["labels"])}

    def _terms(self, logits: torch.Tensor, batch: Batch):
        policy = self._logps(logits, batch)["logps"]
        ref = batch["ref_logps"].to(policy.device)
        n = policy.shape[0] // 2
        kl = (policy[n:].detach() - ref[n:]).mean().clamp(min=0)
        ratio, desirable = policy[:n] - ref[:n], batch["kto_label"].to(policy.device) > 0
        losses = torch.where(
            desirable,
            self.desirable_weight * (1 - torch.sigmoid(self.beta * (ratio - kl))),
            self.undesirable_weight * (1 - torch.sigmoid(self.beta * (kl - ratio))),
        )
        return ratio.detach(), desirable, kl, losses

    def compute_loss(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        *_, losses = self._terms(logits, batch)
        return losses.sum(), torch.tensor(float(losses.numel()), device=losses.device)

    def compute_metrics(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        ratio, desirable, kl, losses = self._terms(logits, batch)
        right = torch.where(desirable, ratio > 0, ratio < 0).float() + 0.5 * (ratio == 0).float()
        return {
            "loss_sum": losses.sum(),
            "num_replies": torch.tensor(float(losses.numel())),
            "kl_sum": kl * losses.numel(),
            "desirable": desirable.float().sum(),
            "desirable_reward_sum": (self.beta * ratio * desirable).sum(),
            "undesirable_reward_sum": (self.beta * ratio * ~desirable).sum(),
            "correct": right.sum(),
        }

    @staticmethod
    def summarize(totals: Mapping[str, float]) -> dict[str, float]:
        """val_loss, kl (the batches' mean estimate), the mean implicit reward of desirable and undesirable replies,
        and kto_acc: the share of replies whose implicit reward has their label's sign (ties half)."""
        n, good = max(totals["num_replies"], 1.0), totals["desirable"]
        return {
            "val_loss": totals["loss_sum"] / n,
            "kl": totals["kl_sum"] / n,
            "reward_desirable": totals["desirable_reward_sum"] / max(good, 1.0),
            "reward_undesirable": totals["undesirable_reward_sum"] / max(totals["num_replies"] - good, 1.0),
            "kto_acc": totals["correct"] / n,
        }

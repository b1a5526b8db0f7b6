"""The preference losses `dpo.loss_type` names, each one small function over the same inputs, with its reference.

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
    aot (AOT):       -(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d), d = sort(pi_c - pi_r) - sort(ref_c - ref_r)
                     over the micro-batch's pairs (quantile by quantile); aot_unpaired: d = sort(l_c) - sort(l_r)
    sft:             the chosen responses' token-mean NLL over the micro-batch (RPO's and MPO's generation term)

and f-DPO (Wang et al., 2023; TRL's f_divergence_type) beside sigmoid, hinge, robust, exo_pair and discopop: h =
f'(u_c) - f'(u_r) of the policy / reference ratios u = e^l, f' of `dpo.f_divergence_type` (`F_DIVERGENCES`: the
reverse KL's log u is plain DPO's h);

and two without a reference model (none is loaded), on averaged log-probs a_c, a_r:

    simpo:           -log sigmoid(beta (a_c - a_r) - gamma), gamma = dpo.simpo_gamma
    orpo:            NLL(chosen) - beta log sigmoid(log odds(a_c) - log odds(a_r)), odds(a) = e^a / (1 - e^a)

and KTO (Ethayarajh et al., 2024) on unpaired replies judged alone, with r = pi - ref per reply and z the batch's
KL estimate (mean pi - ref over mismatched prompt / reply rows, clamped at 0, no gradient; TRL's KTOTrainer's):

    kto:             desirable: w_d (1 - sigmoid(beta (r - z)));  undesirable: w_u (1 - sigmoid(beta (z - r)))
    apo_zero_unpaired (APO-zero unpaired, TRL's KTOTrainer's other loss; no KL estimate, no KL rows):
                     desirable: w_d (1 - sigmoid(beta r));        undesirable: w_u sigmoid(beta r)

A list of the paired ones in dpo.loss_type trains them added, each times its dpo.loss_weights weight (TRL's lists:
MPO is [sigmoid, bco_pair, sft] with [0.8, 0.2, 1.0]); WPO (dpo.use_weighting) multiplies each pair's loss by its two
responses' off-policy weights (`tierlm.strategies.dpo.wpo_weights`).

The strategies that train them (the reference's log-probs, the per-token weights, the metrics) are in
`tierlm.strategies.dpo`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tierlm.errors import ConfigError
from tierlm.primitives.losses import IGNORE_INDEX
from tierlm.strategies.base import Variant, check_variants, refuse_on_jax


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


@dataclass(frozen=True)
class PreferenceSettings:
    """What a preference loss reads from the dpo section."""

    beta: float = 0.1
    label_smoothing: float = 0.0  # robust: the assumed flip rate; exo_pair: EXO's epsilon
    simpo_gamma: float = 0.5  # simpo: the target margin
    discopop_tau: float = 0.05  # discopop: the blend's temperature
    f_divergence: str = "reverse_kl"  # f-DPO: the divergence whose f' scores each log-ratio (F_DIVERGENCES)
    f_alpha: float = 0.5  # alpha_divergence's alpha


def _alpha_score(logratio: torch.Tensor, alpha: float) -> torch.Tensor:
    """The alpha-divergence's f'(u) = (u^(alpha - 1) - 1) / (alpha - 1) of u = e^logratio (log u at alpha = 1), its
    exponent capped at 80 as TRL caps it."""
    if abs(alpha - 1.0) < 1e-6:
        return logratio
    return (torch.exp(torch.clamp((alpha - 1.0) * logratio.float(), max=80.0)) - 1.0).to(logratio.dtype) / (alpha - 1.0)


F_DIVERGENCES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "reverse_kl": lambda logratio, alpha: logratio,
    "forward_kl": lambda logratio, alpha: 1.0 - torch.exp(-logratio),
    "js_divergence": lambda logratio, alpha: math.log(2.0) + F.logsigmoid(logratio),
    "alpha_divergence": _alpha_score,
}
"""dpo.f_divergence_type -> f'(u) of the policy / reference ratio u, from log u: the score f-DPO's h subtracts."""


def _rewards(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings):
    """(h, chosen rewards, rejected rewards): h = f'(u_c) - f'(u_r), u = pi / ref (f' of `s.f_divergence`; the reverse
    KL's: h = (pi_c - ref_c) - (pi_r - ref_r)); rewards beta (pi - ref)."""
    score = F_DIVERGENCES[s.f_divergence]
    h = score(chosen - ref_chosen, s.f_alpha) - score(rejected - ref_rejected, s.f_alpha)
    return h, s.beta * (chosen - ref_chosen), s.beta * (rejected - ref_rejected)


def sigmoid(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """DPO (Rafailov et al., 2023): -log sigmoid(beta h)."""
    h, rc, rr = _rewards(chosen, rejected, ref_chosen, ref_rejected, s)
    return -F.logsigmoid(s.beta * h), rc, rr


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
    """ORPO (Hong et al., 2024), reference-free: NLL(chosen) - beta log sigmoid(log odds(a_c) - log odds(a_r)); the
    NLL is each chosen response's mean token NLL, -a_c."""
    log_odds = (chosen - rejected) - (torch.log1p(-chosen.exp()) - torch.log1p(-rejected.exp()))
    return -chosen - s.beta * F.logsigmoid(log_odds), s.beta * chosen.detach(), s.beta * rejected.detach()


def sft(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """The chosen responses' NLL (TRL's "sft" loss type): `chosen_nll` is each pair's share of the batch's token-mean
    NLL over the chosen tokens (their mean over the pairs is it)."""
    assert chosen_nll is not None, "the sft loss is the chosen responses' NLL"
    return chosen_nll, s.beta * chosen.detach(), s.beta * rejected.detach()


def _smoothed(delta: torch.Tensor, s: PreferenceSettings) -> torch.Tensor:
    e = s.label_smoothing
    return -F.logsigmoid(s.beta * delta) * (1 - e) - F.logsigmoid(-s.beta * delta) * e


def aot(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """AOT (Melnyk et al., 2024), paired: the batch's policy margins pi_c - pi_r, sorted, against the reference's,
    sorted — DPO's logistic loss on the quantiles (label-smoothed by dpo.label_smoothing), so the policy's margins
    dominate the reference's in distribution."""
    _, rc, rr = _rewards(chosen, rejected, ref_chosen, ref_rejected, s)
    delta = torch.sort(chosen - rejected).values - torch.sort(ref_chosen - ref_rejected).values
    return _smoothed(delta, s), rc, rr


def aot_unpaired(chosen, rejected, ref_chosen, ref_rejected, s: PreferenceSettings, chosen_nll=None):
    """AOT (Melnyk et al., 2024), unpaired: the batch's chosen log-ratios l_c, sorted, against its rejected ones l_r,
    sorted (the chosen rewards' distribution dominates the rejected's; pairs need not match)."""
    _, rc, rr = _rewards(chosen, rejected, ref_chosen, ref_rejected, s)
    delta = torch.sort(chosen - ref_chosen).values - torch.sort(rejected - ref_rejected).values
    return _smoothed(delta, s), rc, rr


def kto(ratio: torch.Tensor, kl: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO's losses of replies whose policy / reference log-ratio is `ratio`, as desirable and as undesirable ones,
    against the batch's KL estimate `kl` (Ethayarajh et al., 2024, eq. 7)."""
    return 1 - torch.sigmoid(beta * (ratio - kl)), 1 - torch.sigmoid(beta * (kl - ratio))


def apo_zero_unpaired(ratio: torch.Tensor, kl: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """APO-zero's unpaired form (D'Oosterlinck et al., 2024; TRL's KTOTrainer loss_type): a desirable reply's
    likelihood raised, an undesirable one's lowered, each against the reference alone (`kl` unread)."""
    return 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio)


@dataclass(frozen=True)
class PreferenceLoss(Variant):
    """One `dpo.loss_type`: its per-pair function and what makes it itself, read by `resolve_dpo`, the strategy
    factory (`preference_strategy`), the DPO stage and its loaders. Adding one is a function and a row of
    `PREFERENCE_LOSSES`."""

    about: str
    fn: Callable | None = None
    """(chosen, rejected, ref chosen, ref rejected log-probs (N,), PreferenceSettings, chosen NLL) -> per pair
    (loss, chosen reward, rejected reward); for unpaired replies (`KTOStrategy`), (log-ratios (N,), KL estimate,
    beta) -> their (desirable, undesirable) losses."""
    reference: bool = True
    """It compares with a reference model (frozen, or the data's precomputed log-probs); False: none is loaded."""
    averaged: bool = False
    """Its log-probs are averaged over each response's tokens (the others sum them)."""
    paired: bool = True
    """It reads chosen / rejected pairs; False: unpaired judged replies (KTO's), with a KL estimate's rows."""
    kl_rows: bool = False
    """Unpaired: its batches carry KTO's mismatched prompt / reply rows, whose log-ratios estimate the KL."""
    whole_batch: bool = False
    """Its per-pair losses read the other pairs of the micro-batch (AOT sorts them, KTO estimates its KL from them):
    pipeline stages, which see pieces of a micro-batch, cannot run it, and WPO cannot weigh it pair by pair."""
    jax: bool = False
    """The JAX backend trains it (`tierlm.primitives.jax_losses.dpo_loss`)."""


SMOOTHING = (
    "dpo.label_smoothing is robust DPO's assumed flip rate, EXO's epsilon and AOT's smoothing: set dpo.loss_type="
    "robust, exo_pair, aot or aot_unpaired with 0 < dpo.label_smoothing < 0.5, or none of them"
)
AOT = dict(whole_batch=True, reads=("label_smoothing",), why={"label_smoothing": SMOOTHING})  # both forms
UNPAIRED = dict(
    paired=False,
    whole_batch=True,  # KTOStrategy's losses are not split by rows (and KTO's KL reads every row)
    fixed={"reference": "frozen", "rpo_alpha": 0.0},
    reads=("desirable_weight", "undesirable_weight"),
    why={
        "reference": "dpo.loss_type={name} computes its reference log-probs: drop dpo.reference",
        "rpo_alpha": "dpo.rpo_alpha adds the chosen responses' NLL to a pairwise loss; dpo.loss_type={name} has no "
        "pairs: drop it",
        "desirable_weight": "dpo.desirable_weight / undesirable_weight are the unpaired losses' (kto, "
        "apo_zero_unpaired); dpo.loss_type={name} does not read them",
        "undesirable_weight": "dpo.desirable_weight / undesirable_weight are the unpaired losses' (kto, "
        "apo_zero_unpaired); dpo.loss_type={name} does not read them",
    },
)  # the unpaired losses' (kto, apo_zero_unpaired) settings, for `KTOStrategy`
F_DIVERGENCE = ("f_divergence_type", "f_alpha_divergence_coef")  # f-DPO's settings, read by the losses of h alone
F_WHY = dict.fromkeys(
    F_DIVERGENCE,
    "dpo.f_divergence_type reshapes h for sigmoid, hinge, robust, exo_pair and discopop (TRL's: on summed log-probs; "
    "the averaging losses differ from it there): dpo.loss_type={name} does not read it, drop it",
)

PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {
    "sigmoid": PreferenceLoss("DPO (Rafailov et al., 2023)", sigmoid, jax=True, reads=F_DIVERGENCE, why=F_WHY),
    "sigmoid_norm": PreferenceLoss("DPO on per-token averaged log-probs", sigmoid, averaged=True),
    "ipo": PreferenceLoss("IPO (Azar et al., 2023), on per-token averaged log-probs", ipo, averaged=True),
    "hinge": PreferenceLoss("SLiC's hinge (Zhao et al., 2023)", hinge, reads=F_DIVERGENCE, why=F_WHY),
    "robust": PreferenceLoss(
        "robust DPO under label noise (Chowdhury et al., 2024)",
        robust,
        needs=("label_smoothing",),
        reads=("label_smoothing", *F_DIVERGENCE),
        why={"label_smoothing": SMOOTHING, **F_WHY},
    ),
    "exo_pair": PreferenceLoss(
        "EXO (Ji et al., 2024), the pairwise form",
        exo_pair,
        needs=("label_smoothing",),
        reads=("label_smoothing", *F_DIVERGENCE),
        why={"label_smoothing": SMOOTHING, **F_WHY},
    ),  # fmt: skip
    "nca_pair": PreferenceLoss("NCA (Chen et al., 2024), the pairwise form", nca_pair),
    "bco_pair": PreferenceLoss("BCO (Jung et al., 2024), the pairwise form of TRL's DPOTrainer", bco_pair),
    "sppo_hard": PreferenceLoss("SPPO (Wu et al., 2024) with hard win probabilities", sppo_hard),
    "apo_zero": PreferenceLoss("APO-zero (D'Oosterlinck et al., 2024): chosen better than the model's", apo_zero),
    "apo_down": PreferenceLoss("APO-down (D'Oosterlinck et al., 2024): chosen worse than the model's", apo_down),
    "aot": PreferenceLoss(
        "AOT (Melnyk et al., 2024), the paired form: the batch's sorted margins against the reference's", aot, **AOT
    ),
    "aot_unpaired": PreferenceLoss(
        "AOT (Melnyk et al., 2024), the unpaired form: the batch's sorted chosen log-ratios against its rejected",
        aot_unpaired,
        **AOT,
    ),
    "discopop": PreferenceLoss(
        "DiscoPOP (Lu et al., 2024), a discovered blend of logistic and exponential losses",
        discopop,
        reads=("discopop_tau", *F_DIVERGENCE),
        why={"discopop_tau": "dpo.discopop_tau is DiscoPOP's; dpo.loss_type={name} does not read it", **F_WHY},
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
    "sft": PreferenceLoss(
        "the chosen responses' NLL (TRL's sft; beside a pairwise loss in dpo.loss_type, RPO's and MPO's term)",
        sft,
        reference=False,
    ),
    "kto": PreferenceLoss("KTO (Ethayarajh et al., 2024) on unpaired judged replies", kto, kl_rows=True, **UNPAIRED),
    "apo_zero_unpaired": PreferenceLoss(
        "APO-zero's unpaired form (TRL's KTOTrainer), on judged replies without a KL estimate",
        apo_zero_unpaired,
        **UNPAIRED,
    ),
}
"""dpo.loss_type -> what it is: the one place a preference loss is named."""


PYTORCH_ONLY: dict[str, Callable] = {
    "ld_alpha": lambda dpo: dpo.ld_alpha is not None,
    "rpo_alpha": lambda dpo: bool(dpo.rpo_alpha),
    "f_divergence_type": lambda dpo: dpo.f_divergence_type != "reverse_kl",
    "reference_sync_steps": lambda dpo: dpo.reference_sync_steps is not None,
    "loss_weights": lambda dpo: dpo.loss_weights is not None,
    "use_weighting": lambda dpo: dpo.use_weighting,
}
"""dpo.<setting> -> whether a run turns it on: what the PyTorch strategy applies and the JAX twin does not."""


def loss_names(dpo) -> list[str]:
    """The losses `dpo.loss_type` names: one, or several added with `dpo.loss_weights` (TRL's MPO-style lists)."""
    return [dpo.loss_type] if isinstance(dpo.loss_type, str) else list(dpo.loss_type)


def loss_name(dpo) -> str:
    """`dpo.loss_type` as a line names it: sigmoid, or sigmoid,bco_pair,sft."""
    return ",".join(loss_names(dpo))


def combined(rows: list[PreferenceLoss]) -> PreferenceLoss:
    """What several rows trained together are, as one row: a reference when any needs one, pairs and the JAX twin
    when all have them, the whole batch when any reads it.

    >>> combined([PREFERENCE_LOSSES["sigmoid"], PREFERENCE_LOSSES["sft"]]).reference
    True
    """
    if len(rows) == 1:
        return rows[0]
    return PreferenceLoss(
        " + ".join(row.about for row in rows),
        reference=any(row.reference for row in rows),
        paired=all(row.paired for row in rows),
        whole_batch=any(row.whole_batch for row in rows),
        jax=all(row.jax for row in rows),
    )


def preference_row(dpo) -> PreferenceLoss:
    """The row (`combined`, for a list) of a resolved dpo section: whether it loads a reference, reads pairs."""
    return combined([PREFERENCE_LOSSES[name] for name in loss_names(dpo)])


def _check_weighing(dpo, rows: list[PreferenceLoss], name: str) -> None:
    """What weighs the losses of `rows` (dpo.loss_type's): dpo.loss_weights one per loss, RPO's weight or an sft row
    (not both), WPO's per-pair weights only for losses of pairs that stand alone."""
    row = combined(rows)
    if len(rows) > 1 and not row.paired:
        raise ConfigError(
            f"dpo.loss_type={name}: kto and apo_zero_unpaired train on unpaired replies and combine with no other loss"
        )
    if dpo.loss_weights is not None and len(dpo.loss_weights) != len(rows):
        raise ConfigError(
            f"dpo.loss_weights has {len(dpo.loss_weights)} weights for the {len(rows)} losses of dpo.loss_type="
            f"{name}: give one weight per loss"
        )
    if dpo.rpo_alpha and any(r.fn is sft for r in rows):
        raise ConfigError(
            "dpo.rpo_alpha is the weight of an added sft loss, and dpo.loss_type already has one: put its weight in "
            "dpo.loss_weights and drop dpo.rpo_alpha"
        )
    if not row.paired and (dpo.use_weighting or dpo.loss_weights is not None):
        raise ConfigError(
            f"dpo.use_weighting and dpo.loss_weights weigh pairs' losses; dpo.loss_type={name} has no pairs: drop them"
        )
    if dpo.use_weighting and row.whole_batch:
        raise ConfigError(
            f"dpo.use_weighting (WPO) weighs each pair's loss, and dpo.loss_type={name} compares the pairs of a "
            "batch with each other: drop one of them"
        )


def resolve_dpo(dpo, jax: bool = False):
    """The `dpo` section, checked against its loss's row (a ConfigError names what contradicts it; on the JAX backend,
    what its twin lacks), TR-DPO's alpha filled in. Done once, when a run's config is resolved.

    >>> from tierlm.config import DPOConfig
    >>> resolve_dpo(DPOConfig(loss_type="simpo", simpo_gamma=1.0)).simpo_gamma
    1.0
    >>> resolve_dpo(DPOConfig(reference_sync_steps=64)).reference_mixup_alpha
    0.6
    >>> resolve_dpo(DPOConfig(loss_type="simpo", reference="precomputed"))
    Traceback (most recent call last):
    tierlm.errors.ConfigError: dpo.loss_type=simpo uses no reference: drop dpo.reference=precomputed
    """
    rows, name = check_variants(dpo, "loss_type", PREFERENCE_LOSSES, "dpo"), loss_name(dpo)
    row = combined(rows)
    if jax:
        refuse_on_jax(dpo, "dpo", PYTORCH_ONLY, "the PyTorch strategy")
    if jax and not (row.jax and len(rows) == 1):
        twins = [twin for twin, other in PREFERENCE_LOSSES.items() if other.jax]
        raise ConfigError(
            f"the JAX backend trains dpo.loss_type={' / '.join(twins)} alone; dpo.loss_type={name} needs "
            "infra.backend=pytorch"
        )
    _check_weighing(dpo, rows, name)
    if not row.reference and dpo.reference == "precomputed":
        raise ConfigError(f"dpo.loss_type={name} uses no reference: drop dpo.reference=precomputed")
    if dpo.ld_alpha is not None and not (row.paired and row.reference):
        raise ConfigError(
            f"dpo.ld_alpha weights the tails of a pair's responses against a reference; dpo.loss_type="
            f"{name} has {'no pairs' if not row.paired else 'no reference'}: drop it"
        )
    if dpo.f_alpha_divergence_coef != 0.5 and dpo.f_divergence_type != "alpha_divergence":
        raise ConfigError(
            "dpo.f_alpha_divergence_coef is the alpha of dpo.f_divergence_type=alpha_divergence: set that, or drop it"
        )
    if dpo.reference_mixup_alpha is not None and dpo.reference_sync_steps is None:
        raise ConfigError("dpo.reference_mixup_alpha is how far each dpo.reference_sync_steps sync moves the "
                          "reference: set dpo.reference_sync_steps, or drop it")  # fmt: skip
    if dpo.reference_sync_steps is not None and not (row.reference and dpo.reference == "frozen"):
        has = "precomputed log-probs, which cannot move" if row.reference else "no reference"
        raise ConfigError(
            f"dpo.reference_sync_steps moves the reference model toward the policy; dpo.loss_type={name} "
            f"{'with dpo.reference=precomputed ' if row.reference else ''}has {has}: drop it"
        )
    if dpo.ld_alpha is not None and dpo.reference == "precomputed":
        raise ConfigError(
            "dpo.ld_alpha weights the reference's log-probs too, and precomputed ones are whole sums: use "
            "dpo.reference=frozen, or drop dpo.ld_alpha"
        )
    if dpo.reference_sync_steps is not None and dpo.reference_mixup_alpha is None:
        return dpo.model_copy(update={"reference_mixup_alpha": 0.6})  # TRL's
    return dpo

"""The update half of an RL step: a step's rollouts become rows (`rollout_batch`), are scored by the trainer, the
reference, a teacher and the critic (`PolicyUpdate.score`), and train the policy for rl.ppo_epochs
(`PolicyUpdate.apply`). The sampling half is `tierlm.loops.sampling`; the loop that joins them, evaluates and
reports is `tierlm.loops.rl.RLTrainer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tierlm.config import RLConfig
from tierlm.primitives.losses import IGNORE_INDEX
from tierlm.rollout.engine import Rollout
from tierlm.strategies.off_policy import importance_mode, importance_weights
from tierlm.strategies.rl import PolicyGradientStrategy, kl_penalty
from tierlm.strategies.rl_terms import KL_ESTIMATORS

Sums = Callable[[dict[str, float]], dict[str, float]]
SCORING_ONLY = ("sampler_logprobs", "teacher_logprobs", "teacher", "sampler_routes")  # read by scoring, not the loss
ROUTE_COUNTS = ("route_tokens", "route_tokens_agree", "route_decisions", "route_decisions_agree")


def rollout_batch(
    rollouts: list[Rollout], advantages: torch.Tensor, pad_id: int, replay: bool = False, mask_truncated: bool = False
) -> dict[str, torch.Tensor]:
    """Rows of prompt + completion: labels only on tokens the model sampled (prompt, tool results and
    padding are -100; with `mask_truncated`, none on a completion that ran out of tokens before it ended: DAPO's
    overlong filtering), with each row's advantage and the sampler's log-probs aligned to the labels. When every
    completion carries its sampler's expert routes, they come too (-1 on padding): as `routes`, replayed by the
    trainer's forward (`replay`: rollout routing replay), else as `sampler_routes`, only compared with its own.

    >>> from tierlm.rollout.engine import Completion
    >>> cut = Completion(tokens=[7, 8], logprobs=[-1.0, -1.0], mask=[1, 1], finished=False)
    >>> rollout_batch([Rollout([1, 2], cut, 0.0, "")], torch.zeros(1), 0, mask_truncated=True)["labels"]
    tensor([[-100, -100, -100]])
    """
    width = max(len(r.prompt_ids) + len(r.completion.tokens) for r in rollouts) - 1
    n = len(rollouts)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    sampler = torch.zeros(n, width)
    for row, r in enumerate(rollouts):
        ids = r.prompt_ids + r.completion.tokens
        input_ids[row, : len(ids) - 1] = torch.tensor(ids[:-1])
        start = len(r.prompt_ids) - 1  # position whose next token is the first completion token
        if mask_truncated and not r.completion.finished:
            continue
        for j, (token, trained, logp) in enumerate(zip(r.completion.tokens, r.completion.mask, r.completion.logprobs)):
            if trained:
                labels[row, start + j] = token
                sampler[row, start + j] = logp
    batch = {"input_ids": input_ids, "labels": labels, "advantages": advantages.float(), "sampler_logprobs": sampler}
    if rollouts and all(r.completion.routes is not None for r in rollouts):
        routes = torch.full((n, width, *rollouts[0].completion.routes.shape[1:]), -1, dtype=torch.int16)
        for row, r in enumerate(rollouts):
            routes[row, : len(r.completion.routes)] = r.completion.routes
        batch["routes" if replay else "sampler_routes"] = routes
    return batch


class MicroBatch(dict):
    """One micro-batch of a step's rollout batch: its tensors (its `rows` of the batch, cut to its own width), in
    the optimizer step (`share`, of rl.mini_batches) that trains it."""

    rows: torch.Tensor
    share: int = 0


def micro_batches(batch: dict[str, torch.Tensor], size: int, by_length: bool, multiple: int = 16) -> list[MicroBatch]:
    """`batch` cut into micro-batches of at most `size` rows. `by_length`: the rows grouped by the width they use
    (through their last trained token), longest first (each micro-batch keeps its rows in the batch's order), each
    micro-batch cut to its rows' width rounded up to `multiple` (so that a compiled or JAX step meets few shapes):
    a long row's padding is paid by the rows as long as it, not by every micro-batch. Else the rows go in order at
    the batch's width. The same rows train, so the step's loss and gradient sums are the same (their order of
    summation aside).

    >>> labels = torch.full((4, 40), -100)
    >>> for row, width in enumerate([40, 3, 38, 5]):
    ...     labels[row, width - 1] = 1
    >>> batch = {"input_ids": torch.zeros(4, 40, dtype=torch.long), "labels": labels, "advantages": torch.ones(4)}
    >>> [(mb.rows.tolist(), mb["input_ids"].shape[1]) for mb in micro_batches(batch, 2, by_length=True)]
    [([0, 2], 40), ([1, 3], 16)]
    >>> [(mb.rows.tolist(), mb["input_ids"].shape[1]) for mb in micro_batches(batch, 2, by_length=False)]
    [([0, 1], 40), ([2, 3], 40)]
    """
    n, width = batch["labels"].shape
    positions = torch.arange(1, width + 1)
    used = torch.where(batch["labels"] != IGNORE_INDEX, positions, 0).amax(dim=1).clamp(min=1)
    order = sorted(range(n), key=lambda i: -int(used[i])) if by_length and n > size else list(range(n))
    out = []
    for start in range(0, n, size):
        rows = torch.tensor(sorted(order[start : start + size]))
        cut = min(width, -(-int(used[rows].max()) // multiple) * multiple) if by_length else width
        cut_rows = {k: v[rows, :cut] if v.dim() >= 2 and v.shape[1] == width else v[rows] for k, v in batch.items()}
        mb = MicroBatch(cut_rows)
        mb.rows = rows
        out.append(mb)
    return out


def row_advantages(micro: list[MicroBatch], rows: int) -> list[float]:
    """Each row's advantage as its micro-batch holds it after scoring (per-token ones, a critic's or a teacher's: the
    mean over the row's trained tokens)."""
    out = torch.zeros(rows)
    for mb in micro:
        advantages = mb["advantages"].float()
        if advantages.dim() == 2:
            trained = (mb["labels"] != IGNORE_INDEX).float()
            advantages = (advantages * trained).sum(1) / trained.sum(1).clamp(min=1)
        out[mb.rows] = advantages
    return out.tolist()


def balanced_shares(costs: list[float], sizes: list[int]) -> list[list[int]]:
    """The indices of `costs` dealt into shares of `sizes` rows (one per rank, each keeping its number of rows, so
    every rank runs as many micro-batches): the costliest first, each to the share with the least cost that has
    room (longest processing time first); each share in index order.

    >>> balanced_shares([9.0, 8.0, 7.0, 1.0, 1.0, 1.0], [3, 3])  # in order: costs 24 and 3; dealt: 11 and 16
    [[0, 3, 4], [1, 2, 5]]
    >>> balanced_shares([9.0, 8.0, 1.0, 1.0], [2, 2])  # in order: 17 and 2; dealt: 10 and 9
    [[0, 3], [1, 2]]
    """
    assert sum(sizes) == len(costs), f"{len(costs)} rows for shares of {sizes}"
    shares: list[list[int]] = [[] for _ in sizes]
    loads = [0.0] * len(sizes)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        rank = min((r for r in range(len(sizes)) if len(shares[r]) < sizes[r]), key=lambda r: loads[r])
        shares[rank].append(i)
        loads[rank] += costs[i]
    return [sorted(share) for share in shares]


def merged(micro: list[MicroBatch], key: str, shape: torch.Size) -> torch.Tensor:
    """The micro-batches' `key` back at their rows of the whole batch (`shape`), 0 beyond each one's width."""
    out = torch.zeros(shape)
    for mb in micro:
        value = mb[key].float()
        value = value.expand(len(mb.rows), mb["labels"].shape[1]) if value.shape[1] == 1 else value
        out[mb.rows, : value.shape[1]] = value
    return out


@dataclass(frozen=True)
class PolicyUpdate:
    """How the policy (`backend`, through the tier-0 protocol) learns from a step's rollouts under `strategy` (the
    loss of rl.loss), beside the models that score them: `reference` (rl.kl_coef > 0), `teacher` (on-policy
    distillation's `tierlm.loops.teachers.Teachers`, each row scored by its domain's), `critic` (PPO's value
    model, trained beside the policy). `sum_over_ranks` adds a dict of figures over the data-parallel ranks (one
    process: as it is)."""

    backend: Any
    strategy: PolicyGradientStrategy
    rl: RLConfig
    sum_over_ranks: Sums
    reference: Any = None
    teacher: Any = None
    critic: Any = None

    def micro_batches(self, batch: dict[str, torch.Tensor]) -> list[MicroBatch]:
        """`batch` dealt into rl.mini_batches shares (row i to share i mod rl.mini_batches: each a mix of the step's
        prompts and lengths), each cut into rl.micro_batch_size rows, grouped by length with rl.group_by_length
        (`micro_batches`)."""
        k, n = self.rl.mini_batches, batch["labels"].shape[0]
        if k == 1:
            return micro_batches(batch, self.rl.micro_batch_size, self.rl.group_by_length)
        out = []
        for share in range(k):
            rows = torch.arange(share, n, k)
            part = {key: value[rows] for key, value in batch.items()}
            for mb in micro_batches(part, self.rl.micro_batch_size, self.rl.group_by_length):
                mb.rows, mb.share = rows[mb.rows], share
                out.append(mb)
        return out

    def logprobs(self, micro_batch: dict[str, torch.Tensor], routing: dict[str, float] | None = None) -> torch.Tensor:
        """The policy's log-probs of `micro_batch`'s labels now; given the sampler's expert routes, the counts of
        where the policy routed alike are added to `routing` (`ModelFamily.routing_agreement`)."""
        out = self.backend.forward(micro_batch, self.strategy.compute_metrics).wait()
        if routing is not None and "route_tokens" in out:
            for key in ROUTE_COUNTS:
                routing[key] = routing.get(key, 0.0) + float(out[key])
        return out["logprobs"]

    def routing_figures(self, routing: dict[str, float]) -> dict[str, float]:
        """The share of tokens routed alike in every layer and of (token, layer) router decisions alike, trainer
        against sampler, over every rank's rows (nothing when no routes were recorded)."""
        if not routing:
            return {}
        totals = self.sum_over_ranks(routing)
        return {
            "routing_token_agreement": totals["route_tokens_agree"] / max(totals["route_tokens"], 1.0),
            "routing_decision_agreement": totals["route_decisions_agree"] / max(totals["route_decisions"], 1.0),
        }

    def score(
        self,
        micro: list[MicroBatch],
        batch: dict[str, torch.Tensor],
        rewards: torch.Tensor,
        staleness: int,
    ) -> tuple[float, dict[str, float]]:
        """What the update needs beside the rollouts, written into each micro-batch: the trainer's log-probs of the
        sampled tokens (the old log-probs for clipping), the reference's, a teacher's (on-policy distillation: each
        token's advantage is -(reverse KL) there), the critic's advantages, the importance weights of
        rl.importance (the rollouts are `staleness` updates old, or from a sampler whose arithmetic differs).
        Returns the mean |trainer - sampler| log-prob of the trained tokens (the parity check) and the figures of
        what scoring found, before this step's update."""
        routing: dict[str, float] = {}
        for mb in micro:
            mb["old_logprobs"] = self.logprobs(mb, routing)
            if self.reference is not None:
                mb["ref_logprobs"] = self.reference.forward(mb, self.strategy.compute_metrics).wait()["logprobs"]
            if self.teacher is not None:  # each row scored by its domain's teacher (`tierlm.loops.teachers`)
                scores = self.teacher.score(mb)
                mb["teacher_logprobs"] = scores["logprobs"]
                if "topk_ids" in scores:  # distill_topk: the exact KL over the teacher's top-k
                    mb["teacher_topk_ids"], mb["teacher_topk_logprobs"] = scores["topk_ids"], scores["topk_logprobs"]
                else:  # distill: each sampled token's advantage is log p_teacher - log p_student
                    mb["advantages"] = (scores["logprobs"] - mb["old_logprobs"]) * (mb["labels"] != IGNORE_INDEX)
        trained = batch["labels"] != IGNORE_INDEX
        if self.critic is not None:  # per-token advantages from the critic's values (GAE), replacing the group baseline
            self._critic_targets(micro, rewards, trained)
        old = merged(micro, "old_logprobs", trained.shape)
        kl_rows = self._kl_in_reward(micro, rewards, old, trained) if self.rl.kl_in_reward else None
        mode, rl = importance_mode(self.rl), self.rl
        if mode != "none":  # rl.importance's weights of the samples: stale, or from another sampler
            for mb in micro:
                trained_mb = mb["labels"] != IGNORE_INDEX
                mb["importance"] = importance_weights(
                    mb["old_logprobs"], mb["sampler_logprobs"], trained_mb, mode, rl.importance_floor,
                    rl.importance_cap,
                )  # fmt: skip
        figures = self._figures(micro, batch, old, trained, mode, kl_rows)
        figures.update(self.routing_figures(routing))
        if mode != "none":
            figures["staleness"] = staleness
        return figures.pop("gap"), figures

    def _figures(
        self, micro: list[MicroBatch], batch, old: torch.Tensor, trained: torch.Tensor, mode: str, kl_rows
    ) -> dict[str, float]:
        """What scoring found, each figure over every rank's trained tokens (each teacher's: the tokens it scored;
        the KL reward: the rows), their sums added over the ranks at once: the mean |trainer - sampler| log-prob
        (`gap`), the padding's share of the positions computed, the KL to the reference, the importance weights'
        mean and the share they silence or hold at the band's ends, the KL to the teachers."""
        shape, rl = trained.shape, self.rl
        means = {"gap": (old - batch["sampler_logprobs"]).abs()}  # name -> per-token values, averaged over tokens
        if mode != "none":
            weights, low, high = merged(micro, "importance", shape), rl.importance_floor or 0.0, rl.importance_cap
            means["importance_mean"] = weights
            if mode.endswith("mask"):  # the share of trained tokens the band silences
                means["importance_masked"] = (weights == 0).float()
            else:  # the share held at an end of the band
                means["importance_capped"] = ((weights >= (high or math.inf)) | (weights <= low)).float()
        if self.teacher is not None:  # KL(student || teacher) on the sampled tokens (k3, >= 0)
            log_ratio = merged(micro, "teacher_logprobs", shape) - old  # log p_teacher - log p_student
            means["teacher_kl"] = log_ratio.exp() - log_ratio - 1.0
        if self.reference is not None:  # KL(policy || reference) on the sampled tokens
            means["kl"] = kl_penalty(old, merged(micro, "ref_logprobs", shape))
        sums = {name: float((values * trained).sum()) for name, values in means.items()}
        sums.update(tokens=float(trained.sum()), computed=float(sum(mb["labels"].numel() for mb in micro)))
        labels = self.teacher.labels if self.teacher is not None and len(self.teacher.models) > 1 else []
        for index, label in enumerate(labels):  # each teacher's KL, over the tokens it scored
            rows = (batch["teacher"] == index)[:, None] & trained
            sums[f"{label}:kl"], sums[f"{label}:tokens"] = float(means["teacher_kl"][rows].sum()), float(rows.sum())
        if kl_rows is not None:
            sums.update(kl_reward=-rl.kl_coef * float(kl_rows.sum()), rows=float(len(kl_rows)))
        totals = self.sum_over_ranks(sums)
        tokens = totals["tokens"]
        empty = {"importance_mean": 1.0}  # the figure with no trained token
        figures = {name: totals[name] / tokens if tokens else empty.get(name, 0.0) for name in means}
        figures["padding_frac"] = 1.0 - tokens / max(totals["computed"], 1.0)
        figures.update({f"teacher_kl_{label}": totals[f"{label}:kl"] / totals[f"{label}:tokens"] for label in labels
                        if totals[f"{label}:tokens"]})  # fmt: skip
        if kl_rows is not None:
            figures["kl_reward"] = totals["kl_reward"] / max(totals["rows"], 1.0)
        return figures

    def _kl_in_reward(
        self, micro: list[MicroBatch], rewards: torch.Tensor, old: torch.Tensor, trained: torch.Tensor
    ) -> float:
        """rl.kl_in_reward: each row's reward less rl.kl_coef x its rl.kl_estimator estimate summed over its sampled
        tokens, and each micro-batch's advantages made again from those rewards by the loss's baseline (each group
        whole on this rank). Returns each row's summed estimate (the KL reward's figure, `_figures`)."""
        rl = self.rl
        kl = (KL_ESTIMATORS[rl.kl_estimator](old, merged(micro, "ref_logprobs", trained.shape)) * trained).sum(-1)
        advantages = self.strategy.advantages(rewards - rl.kl_coef * kl, rl.group_size, self.sum_over_ranks)
        for mb in micro:
            mb["advantages"] = advantages[mb.rows].to(mb["advantages"].dtype)
        return kl

    def _critic_targets(self, micro: list[MicroBatch], rewards: torch.Tensor, trained: torch.Tensor) -> None:
        """Each micro-batch gets the critic's values at sampling time, the GAE returns and the per-token advantages,
        whitened over the whole step's trained tokens (every rank's)."""
        for mb in micro:
            mb["old_values"] = self.critic.values(mb)
        values = merged(micro, "old_values", trained.shape)
        advantages, returns = self.strategy.token_advantages(rewards, values, trained, self.sum_over_ranks)
        for mb in micro:
            width = mb["labels"].shape[1]
            mb["advantages"], mb["returns"] = advantages[mb.rows, :width], returns[mb.rows, :width]

    def apply(self, micro: list[MicroBatch]) -> dict[str, float]:
        """rl.ppo_epochs passes over the scored `micro` batches, one optimizer step per share of them (rl.mini_batches;
        the critic's beside them); the last step's loss, lr, grad_norm and skipped (and value_loss with a critic).
        The strategy's loss statistics from here on are this step's."""
        self.strategy.take_stats()
        shares = [[mb for mb in micro if mb.share == share] for share in range(self.rl.mini_batches)]
        for _ in range(self.rl.ppo_epochs):
            for share in shares:
                for mb in share:
                    self.backend.forward_backward(
                        {k: v for k, v in mb.items() if k not in SCORING_ONLY}, self.strategy.compute_loss
                    )
                    if self.critic is not None:
                        self.critic.accumulate(mb)
                update = self.backend.optim_step().wait()
                value_update = self.critic.backend.optim_step().wait() if self.critic is not None else None
        figures = {key: update[key] for key in ("loss", "lr", "grad_norm", "skipped")}
        return {**figures, **({"value_loss": value_update["loss"]} if value_update is not None else {})}


def loss_figures(totals: dict[str, float], rl: RLConfig) -> dict[str, float]:
    """What makes the loss visible in the train lines: the share of tokens (GSPO: sequences) whose gradient each
    side of the clip removed, GSPO's mean sequence ratio, VESPO's mean sequence weight, the entropy the bonus read,
    dynamic sampling's dropped groups and extra draws, DAPO's overlong-shaped completions."""
    out = {}
    if totals.get("loss_clip_n_sum"):
        n = totals["loss_clip_n_sum"]
        out.update(clip_low_frac=totals["loss_clip_low_sum"] / n, clip_high_frac=totals["loss_clip_high_sum"] / n)
    if totals.get("loss_rows_sum") and "loss_seq_ratio_sum" in totals:
        out["seq_ratio_mean"] = totals["loss_seq_ratio_sum"] / totals["loss_rows_sum"]
    if totals.get("loss_entropy_n_sum"):
        out["entropy_mean"] = totals["loss_entropy_sum"] / totals["loss_entropy_n_sum"]
    if totals.get("loss_rows_sum") and "loss_vespo_phi_sum" in totals:
        out["vespo_weight_mean"] = totals["loss_vespo_phi_sum"] / totals["loss_rows_sum"]
    if rl.dynamic_sampling:
        out.update(dropped_groups=totals.get("dropped_groups", 0.0), extra_draws=totals.get("extra_draws", 0.0))
    if rl.overlong_buffer:
        out["overlong_frac"] = totals["overlong"] / totals["rows"]
    return out

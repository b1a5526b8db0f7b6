"""The RL loop: sample groups -> score -> advantages -> policy-gradient updates, with pass@k evals.

It speaks to the policy only through the tier-0 protocol (`forward`, `forward_backward`,
`optim_step`, `save_checkpoint`, `load_checkpoint`); generation goes through an `Engine` that
shares the policy's weights. When it evaluates, saves, stops and resumes is the one cadence of
`tierlm.loops.cadence`, as for the `Trainer`.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tierlm.backends.references import follow_policy
from tierlm.config import RLConfig, TrainingConfig
from tierlm.data.tokenizer import Tokenizer
from tierlm.loops import cadence
from tierlm.loops.cadence import Watch
from tierlm.loops.evaluation import evaluate_pass_at_k
from tierlm.loops.off_policy import OffPolicyRollouts
from tierlm.loops.partial import Group, PartialRollouts
from tierlm.loops.policy_update import (
    PolicyUpdate,
    balanced_shares,
    loss_figures,
    merged,
    rollout_batch,
    row_advantages,
)
from tierlm.loops.rewards import (
    reward_components,
    reward_model_figures,
    reward_model_sums,
    reward_term_figures,
    reward_term_sums,
    shape_rewards,
)
from tierlm.loops.rl_figures import partial_figures, progress_line, rollout_records
from tierlm.loops.sampling import RolloutSampler
from tierlm.metrics import MetricsLogger
from tierlm.metrics.flops import flops_line
from tierlm.models import unwrap_model
from tierlm.models.lora import has_lora, is_adapter_key
from tierlm.primitives.losses import IGNORE_INDEX
from tierlm.rollout.adapters import adapter_payload
from tierlm.rollout.engine import Rollout, SamplingEngine
from tierlm.strategies.rl import (
    PolicyGradientStrategy,
    adapted_entropy_coef,
    decoupled_rewards,
    overlong_penalty,
)
from tierlm.tasks import Environment, Task


@dataclass
class RLState:
    step: int = 0
    elapsed_s: float = 0.0
    best_pass_at_1: float | None = None
    initial_pass_at_1: float | None = None
    rollout_tokens: int = 0
    last_eval: dict = field(default_factory=dict)  # the latest eval's figures: a run resumed at its end reports them
    last_eval_step: int = -1
    entropy_coef: float | None = None  # rl.entropy_target: the adaptive coefficient for the next step (None: the first)
    last_entropy: float = math.inf  # and the last step's mean entropy, which gates it


@dataclass
class RLTrainer:
    backend: Any
    strategy: PolicyGradientStrategy
    engine: SamplingEngine
    tokenizer: Tokenizer
    train_task: Task | Environment
    eval_task: Task | Environment
    rl: RLConfig
    config: TrainingConfig
    reference: Any = None
    teacher: Any = None  # on-policy distillation: the teachers scoring the samples (`tierlm.loops.teachers.Teachers`)
    reward_model: Any = None  # rl.reward_model: scores each prompt + completion (`score(sequences)`)
    reward_terms: dict | None = None  # rl.reward_terms: spec -> (function(prompt, completion, reference), weight)
    critic: Any = None  # PPO's value model (tierlm.loops.critic.Critic), trained beside the policy
    write_extra: Callable[[Path], None] | None = None
    kept: list = field(default_factory=list)  # what else checkpoints carry (`tierlm.loops.cadence.Kept`)
    state: RLState = field(default_factory=RLState)
    watch: Watch = field(default_factory=Watch)  # the run's logger, stop signals and monitor, from `train(watch)`
    off_policy: OffPolicyRollouts | None = None  # rl.max_off_policy_steps > 0: the background sampler
    partial: PartialRollouts | None = None  # rl.partial_rollouts: the groups in flight across steps
    _pending: list | None = None  # a checkpoint's pending rollouts (every rank's), until the sampler starts
    _sampling: dict = field(default_factory=dict)  # dynamic sampling's figures of each sampled step
    _rollouts: list = field(default_factory=list)  # rl.log_rollouts: the latest step's records
    sampler: RolloutSampler = field(init=False)  # how prompts are sampled (tierlm.loops.sampling), from the above
    update: PolicyUpdate = field(init=False)  # how the policy learns from them (tierlm.loops.policy_update)

    def __post_init__(self) -> None:
        self.sampler = RolloutSampler(self.engine, self.tokenizer, self.rl, self.config.seed)
        companions = dict(reference=self.reference, teacher=self.teacher, critic=self.critic)
        self.kept = [*self.kept, *follow_policy(self.reference, self.backend)]  # rl.reference_sync_steps
        self.update = PolicyUpdate(self.backend, self.strategy, self.rl, self._sum_over_ranks, **companions)
        if self.rl.partial_rollouts:
            self.partial = PartialRollouts(
                self.engine, self.rl, self.rank, self.world_size, self._prompt_at, self._score_groups
            )

    @property
    def rank(self) -> int:
        return self.backend.rank if self.backend is not None else 0  # pass@k evaluation runs without a backend

    @property
    def world_size(self) -> int:
        return self.backend.world_size if self.backend is not None else 1

    def _sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        return self.backend.all_reduce_sums(values) if self.world_size > 1 else values

    # -- rollouts --------------------------------------------------------------------------
    def sync_sampler(self) -> None:
        """Bring the engine's weights to the policy's (`state.step` updates): a copy where the backend shards them
        (FSDP: collective, every rank gathers the whole model) or the engine holds its own (vLLM); else the engine
        reads the live weights."""
        if self.backend is not None and self.engine.weight_version != self.state.step:
            self.engine.load_weights(self.sampler_weights(whole=self.engine.needs_state), self.state.step)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The policy's weights now, for a sampler's copy (the background sampler's)."""
        return self.sampler_weights(whole=True)

    def sampler_weights(self, whole: bool) -> dict[str, torch.Tensor] | None:
        """What a sampler is given of the policy's weights now: None where it reads the live weights (not `whole`
        and not sharded); else a copy (collective under FSDP) — of a LoRA policy, its adapters alone stamped with
        their version where the engine keeps the base weights (`Engine.takes_adapters`), else every weight."""
        state = self.backend.sampler_state()
        if state is None and not whole:
            return None
        adapters = getattr(self.engine, "takes_adapters", False) and has_lora(unwrap_model(self.backend.export_model))
        if state is None:
            live = unwrap_model(self.backend.export_model).state_dict()
            state = {name: t.detach().clone() for name, t in live.items() if not adapters or is_adapter_key(name)}
        return adapter_payload(state, self.state.step) if adapters else state

    def sample_step(self, step: int) -> list[list[Rollout]]:
        """This rank's share of a step's groups: the plain run's (`whole_groups`), or with rl.partial_rollouts the
        first of the groups in flight to finish (`tierlm.loops.partial`)."""
        return self.partial.sample(step) if self.partial is not None else self.whole_groups(step)

    def whole_groups(self, step: int) -> list[list[Rollout]]:
        """This rank's share of a step's prompts, each group whole on one rank (the backend sums gradients and
        tokens over ranks), each prompt sampled with the generator of its place in the global batch."""
        indices = self._indices(step)
        positions = range(self.rank, len(indices), self.world_size)
        groups = self._groups([indices[p] for p in positions], [self.sampler.generator(step, p) for p in positions])
        return self._with_signal(step, groups) if self.rl.dynamic_sampling else groups

    def _prompt_at(self, start: int) -> tuple[int, list[int], torch.Generator]:
        """A place in the run's stream of prompts (step x rl.prompts_per_step + position): the example, its prompt
        and the generator the plain run samples it with."""
        step, position = divmod(start, self.rl.prompts_per_step)
        index = self._indices(step)[position]
        prompt = self.sampler.prompt(self.train_task.example(index).messages)
        return index, prompt, self.sampler.generator(step, position)

    def _score_groups(self, groups: list[Group]) -> list[list[Rollout]]:
        """Partial rollouts' finished groups, scored as the plain run scores its own."""
        examples = [self.train_task.example(g.index) for g in groups]
        prompts, rows = [g.prompt_ids for g in groups], [g.rows for g in groups]
        return shape_rewards(self.sampler.scored(self.train_task, examples, prompts, rows), examples, self)

    def _groups(self, indices: list[int], generators: list[torch.Generator]) -> list[list[Rollout]]:
        groups = self.sampler.groups(self.train_task, indices, generators, self.rl.group_size, self.rl.temperature)
        if self.reward_model is None and not self.reward_terms:
            return groups
        return shape_rewards(groups, [self.train_task.example(i) for i in indices], self)

    def _with_signal(self, step: int, groups: list[list[Rollout]]) -> list[list[Rollout]]:
        """DAPO's dynamic sampling: groups whose rewards are all equal give no gradient; they are replaced by groups
        of extra prompts (drawn by this rank, a pure function of the seed, step, rank and round) until the share is
        full or rl.max_extra_draws rounds are spent, then padded with signal-free groups."""
        signal = lambda g: len({r.reward for r in g}) > 1  # noqa: E731
        kept, draws = [g for g in groups if signal(g)], 0
        for round_ in range(self.rl.max_extra_draws):
            need = len(groups) - len(kept)
            if need <= 0:
                break
            rng = np.random.default_rng([self.config.seed, step, self.rank, round_, 1])
            indices = [int(i) for i in rng.integers(len(self.train_task), size=need)]
            generators = [self.sampler.generator(step, -2, self.rank, round_, j) for j in range(need)]
            kept += [g for g in self._groups(indices, generators) if signal(g)]
            draws += need
        kept += [g for g in groups if not signal(g)]  # padding, if the draws fell short
        self._sampling[step] = {"dropped_groups": sum(not signal(g) for g in groups), "extra_draws": draws}
        return kept[: len(groups)]

    def _indices(self, step: int) -> list[int]:
        """The prompts of `step`: a fresh permutation of the task per epoch, a pure function of (seed, step)."""
        n, per = len(self.train_task), self.rl.prompts_per_step
        orders: dict[int, np.ndarray] = {}
        out = []
        for k in range(step * per, (step + 1) * per):
            epoch, pos = divmod(k, n)
            if epoch not in orders:
                orders[epoch] = np.random.default_rng([self.config.seed, epoch]).permutation(n)
            out.append(int(orders[epoch][pos]))
        return out

    # -- one step --------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        t0, step = time.perf_counter(), self.state.step
        if self.off_policy is not None:  # sampled in the background, rl.max_off_policy_steps behind
            groups, version = self.off_policy.take(step), self.off_policy.version(step)
            sync, sampling = self.off_policy.snapshot_s, {"time_sampling_s": self.off_policy.sampling_s(step)}
        else:
            self.sync_sampler()
            sync, sampling = time.perf_counter() - t0, {}
            groups, version = self.sample_step(step), self.engine.weight_version
        t1 = time.perf_counter()
        rollouts = [r for g in groups for r in g]
        stamps = {r.completion.weight_version for r in rollouts}
        if self.partial is None:
            assert stamps == {version}, f"step {step} trains on weights {sorted(stamps)}, expected {version}"
        else:  # groups started under older weights, each token stamped with its own
            oldest = min(stamps)
            assert step - oldest <= self.rl.max_staleness, f"step {step} trains on weights {oldest}: past the bound"
            version = oldest
        rl = self.rl
        shaping = [overlong_penalty(len(r.completion.tokens), rl.max_new_tokens, rl.overlong_buffer) for r in rollouts]
        rewards = torch.tensor([r.reward + p for r, p in zip(rollouts, shaping)])
        advanced = rewards  # GDPO: each reward normalised in its group before they are added
        if rl.reward_aggregation == "normalize_then_sum":
            advanced = decoupled_rewards(*reward_components(rollouts, shaping, rl), rl.group_size)
        advantages = self.strategy.advantages(advanced, rl.group_size, self._sum_over_ranks)
        trained, balance = (rollouts, advantages, rewards), {}
        if self.world_size > 1 and rl.balance_ranks:  # the rows dealt over the ranks by their cost
            trained, balance = self._balanced(rollouts, advantages, rewards)
        batch = rollout_batch(trained[0], trained[1], self.tokenizer.pad_id, rl.routing_replay, rl.mask_truncated)
        if self.teacher is not None:  # each row's teacher, by its prompt's domain
            batch["teacher"] = torch.tensor([self.teacher.route(r.domain) for r in trained[0]])
        micro = self.update.micro_batches(batch)
        parity, scoring = self.update.score(micro, batch, trained[2], step - version)
        if rl.log_rollouts and self.rank == 0:  # the first rollouts as trained, logged beside the step's line
            self._rollouts = rollout_records(
                trained[0], row_advantages(micro, len(trained[0])), self.tokenizer.decode, rl.log_rollouts
            )
        t2 = time.perf_counter()
        coef = self._entropy_bonus() if rl.entropy_target is not None else None
        update = self.update.apply(micro)
        t3 = time.perf_counter()
        totals = self._step_totals(step, groups, rollouts, rewards, shaping)
        entropy_control = self._adapt_entropy(coef, totals) if coef is not None else {}
        n, tokens = totals["rows"], totals["tokens"]
        self.state.rollout_tokens += int(tokens)
        reward_mean = totals["reward"] / n
        return {
            **update,
            "reward_mean": reward_mean,
            "reward_std": math.sqrt(max(totals["reward_sq"] / n - reward_mean**2, 0.0) * n / max(n - 1, 1)),
            "groups_with_signal": totals["signal"] / totals["groups"],
            "logprob_abs_diff": parity,
            "completion_len": tokens / n,
            "finished_frac": totals["finished"] / n,
            "tool_calls": totals["tool_calls"],
            "time_generation_s": t1 - t0,  # off-policy: the wait for the background sampler
            **sampling,  # off-policy: the background sampler's own time on this batch
            "time_weight_sync_s": sync,  # the sampler's copy of the weights (FSDP, off-policy)
            "time_scoring_s": t2 - t1,  # scoring: rewards + log-probs
            "time_training_s": t3 - t2,
            "rollout_tokens_per_sec": tokens / max(t1 - t0, 1e-9),  # all ranks together
            "weight_version": version,  # the policy's updates behind this step's rollouts
            **loss_figures(totals, rl),
            **(partial_figures(totals, self.world_size) if self.partial is not None else {}),
            **scoring,
            **balance,
            **reward_model_figures(totals),
            **reward_term_figures(totals),
            **entropy_control,
        }

    def _adapt_entropy(self, coef: float, totals: dict[str, float]) -> dict[str, float]:
        """rl.entropy_target: the next step's coefficient from `coef` and this step's entropy over every rank (in
        `totals`), kept in the loop's state; the train line's figures (this step's bonus, the next coefficient)."""
        applied = self.strategy.settings.entropy_coef
        self.state.last_entropy = totals["loss_entropy_sum"] / max(totals["loss_entropy_n_sum"], 1.0)
        self.state.entropy_coef = adapted_entropy_coef(coef, self.state.last_entropy, self.rl)
        return {"entropy_coef": applied, "entropy_coef_next": self.state.entropy_coef}

    def _entropy_bonus(self) -> float:
        """rl.entropy_target: the adaptive coefficient (rl.entropy_coef at first), set as this step's entropy bonus
        when the last step's entropy was at or below the target, else no bonus (nor in the first step); returned."""
        coef = self.rl.entropy_coef if self.state.entropy_coef is None else self.state.entropy_coef
        applied = coef if self.state.last_entropy <= self.rl.entropy_target else 0.0
        self.strategy.settings = replace(self.strategy.settings, entropy_coef=applied)
        return coef

    def _balanced(self, rollouts, advantages, rewards):
        """Every rank's rows (with their advantages and rewards) dealt over the ranks by their training FLOPs, each
        rank keeping its number of rows (`balanced_shares`); the gradient sums over the ranks, so the step is the
        same. Returns this rank's (rollouts, advantages, rewards) and the imbalance (the costliest rank's FLOPs over
        the mean) before and after."""
        rows = list(zip(rollouts, advantages.tolist(), rewards.tolist()))
        everyone = self.backend.gather_objects(rows)
        every = [row for share in everyone for row in share]
        a, b = flops_line(self.backend.export_model)
        lengths = [len(r.prompt_ids) + len(r.completion.tokens) - 1 for r, _, _ in every]
        costs = [t * (a + b * t) for t in lengths]  # a row of length T: T x its FLOPs per token
        sizes = [len(share) for share in everyone]
        shares = balanced_shares(costs, sizes)

        def imbalance(groups: list[list[int]]) -> float:
            loads = [sum(costs[i] for i in group) for group in groups]
            return max(loads) / max(sum(loads) / len(loads), 1e-9)

        in_order = [list(range(sum(sizes[:r]), sum(sizes[: r + 1]))) for r in range(len(sizes))]
        mine = [every[i] for i in shares[self.rank]]
        rollouts, advantages, rewards = zip(*mine)
        trained = (list(rollouts), torch.tensor(advantages), torch.tensor(rewards))
        return trained, {"rank_imbalance_before": imbalance(in_order), "rank_imbalance": imbalance(shares)}

    def _step_totals(
        self,
        step: int,
        groups: list[list[Rollout]],
        rollouts: list[Rollout],
        rewards: torch.Tensor,
        shaping: list[float],
    ) -> dict[str, float]:
        """The statistics of the whole step (`rollouts`: the groups' rows, one after another), summed over every
        rank's: the loss's, the sampling's, the rewards' and the completions'."""
        nothing_dropped = {"dropped_groups": 0.0, "extra_draws": 0.0} if self.rl.dynamic_sampling else {}
        sampling = self._sampling.pop(step, nothing_dropped)
        if self.partial is not None:  # how old the trained tokens are, and what the rounds did
            sampling.update(self.partial.step_figures(step))
            ages = [(step - v, m) for r in rollouts for v, m in zip(r.completion.versions, r.completion.mask)]
            sampling["token_age_sum"] = float(sum(age for age, m in ages if m))
            sampling["sampled_tokens"] = float(sum(m for _, m in ages))
            sampling["spanning_rows"] = float(sum(len(set(r.completion.versions)) > 1 for r in rollouts))
        return self._sum_over_ranks(
            {
                **{f"loss_{k}": v for k, v in self.strategy.take_stats().items()},
                **sampling,
                "overlong": float(sum(p < 0 for p in shaping)),
                "rows": len(rollouts),
                "groups": len(groups),
                "reward": float(rewards.sum()),
                "reward_sq": float((rewards**2).sum()),
                "signal": float(sum(len({r.reward for r in g}) > 1 for g in groups)),
                "tokens": sum(len(r.completion.tokens) for r in rollouts),
                "finished": float(sum(r.completion.finished for r in rollouts)),
                "tool_calls": float(sum(r.completion.tool_calls for r in rollouts)),
                **(reward_model_sums(groups) if self.reward_model is not None else {}),
                **reward_term_sums(rollouts, self.reward_terms),
            }
        )

    # -- the sampler against the trainer ---------------------------------------------------
    def parity(self) -> dict[str, float]:
        """Step 0's rollouts, sampled by the engine and scored by the trainer: how far apart their log-probs are
        on the sampled tokens (every rank's), and the share of importance ratios beyond rl.importance_cap."""
        self.sync_sampler()
        rollouts = [r for g in self.whole_groups(0) for r in g]
        batch = rollout_batch(rollouts, torch.zeros(len(rollouts)), self.tokenizer.pad_id, self.rl.routing_replay)
        micro = self.update.micro_batches(batch)
        routing: dict[str, float] = {}
        for mb in micro:
            mb["trainer"] = self.update.logprobs(mb, routing)
        trainer = merged(micro, "trainer", batch["labels"].shape)
        gap = (trainer - batch["sampler_logprobs"])[batch["labels"] != IGNORE_INDEX]
        cap = math.log(self.rl.importance_cap) if self.rl.importance_cap is not None else math.inf
        sums = self._sum_over_ranks(
            {"tokens": gap.numel(), "abs": float(gap.abs().sum()), "beyond": float((gap.abs() > cap).sum())}
        )
        largest = float(gap.abs().max()) if gap.numel() else 0.0
        maxima = self.backend.gather_objects(largest) if self.world_size > 1 else [largest]
        tokens = max(sums["tokens"], 1)
        return {
            "tokens": int(sums["tokens"]),
            "mean_abs_gap": sums["abs"] / tokens,
            "max_abs_gap": max(maxima),
            "beyond_cap": sums["beyond"] / tokens,
            **self.update.routing_figures(routing),
        }

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """pass@1 and pass@k over the held-out problems (`tierlm.loops.evaluation.evaluate_pass_at_k`), logged."""
        if self.off_policy is not None:
            self.off_policy.drain()  # the engine is the background sampler's until it is idle
        self.sync_sampler()
        result = evaluate_pass_at_k(self.sampler, self.eval_task, self.rank, self.world_size, self._sum_over_ranks)
        if self.state.step == 0:
            self.state.initial_pass_at_1 = result["pass@1"]
        if self.state.best_pass_at_1 is None or result["pass@1"] > self.state.best_pass_at_1:
            self.state.best_pass_at_1 = result["pass@1"]
        self.state.last_eval, self.state.last_eval_step = result, self.state.step
        self.logger.log({"type": "eval", "step": self.state.step, **result})
        return result

    # -- what the cadence (tierlm.loops.cadence) asks -------------------------------------
    evaluates = True

    def loop_step(self) -> dict[str, float]:
        return self.train_step()

    def checkpoint_metric(self) -> float | None:
        """Retention keeps the lowest metric: 1 - pass@1 of an evaluation at this step."""
        evaluated = self.state.last_eval_step == self.state.step
        return 1.0 - self.state.last_eval["pass@1"] if evaluated else None

    def trainer_state(self) -> dict:
        state = {"loop": asdict(self.state)}
        if self.off_policy is not None:  # every rank's pending batches (collective); the sampler is idle after
            state["pending_rollouts"] = self.backend.gather_objects(self.off_policy.state())
        if self.partial is not None:  # every rank's groups in flight and queued (collective)
            state["partial_rollouts"] = self.backend.gather_objects(self.partial.state())
        return state

    def load_trainer_state(self, state: dict) -> None:
        self.state = RLState(**state["loop"])
        self._pending = state.get("pending_rollouts")
        if self.partial is not None:
            every = state.get("partial_rollouts")
            assert every is not None, "this checkpoint was saved without rl.partial_rollouts: resume without it"
            assert len(every) == self.world_size, "resume at the world size that saved the rollouts in flight"
            self.partial.load_state(every[self.rank])

    def companions(self) -> list:
        return [self.critic.backend] if self.critic is not None else []

    def on_save(self, path: Path) -> None:
        pass

    def resume(self, chosen: Path | None = None) -> Path | None:
        return cadence.resume(self, chosen)

    # -- the loop --------------------------------------------------------------------------
    def after_step(self, metrics: dict[str, float], log: bool) -> None:
        if not log:
            return
        state = self.state
        self.logger.log(
            {
                "type": "train",
                "step": state.step,
                **metrics,
                "rollout_tokens": state.rollout_tokens,
                "elapsed_s": state.elapsed_s,
                "epoch": state.step * self.rl.prompts_per_step / len(self.train_task),  # passes over the prompts
            }
        )
        for record in self._rollouts:  # rl.log_rollouts
            self.logger.log({"type": "rollout", "step": state.step, **record})
        if self.rank == 0:
            print(progress_line(state.step, self.config.num_train_steps, metrics), file=sys.stderr, flush=True)

    def log_eval(self, metrics: dict[str, float]) -> None:
        if self.rank == 0:
            print(
                f"step {self.state.step}: pass@1 {metrics['pass@1']:.3f}, pass@{metrics['k']} {metrics['pass@k']:.3f}",
                file=sys.stderr,
                flush=True,
            )

    @property
    def logger(self) -> MetricsLogger:
        return self.watch.logger

    def train(self, watch: Watch | None = None) -> dict[str, Any]:
        """Train to training.num_train_steps on the one cadence of `tierlm.loops.cadence`, watched by `watch` (the
        run's logger, stop signals and monitor); the run summary."""
        self.watch = watch or self.watch
        if self.rl.max_off_policy_steps:
            self.off_policy = OffPolicyRollouts(
                self.rl.max_off_policy_steps, self.engine, self.sample_step, self.snapshot, self.config.num_train_steps
            )
            if self._pending is not None:
                assert len(self._pending) == self.world_size, "resume at the world size that saved the pending rollouts"
                self.off_policy.load_state(self._pending[self.rank])
        try:
            cadence.run_loop(self)
        finally:
            if self.off_policy is not None:
                self.off_policy.close()
        state = self.state
        return {
            "step": state.step,
            "elapsed_s": state.elapsed_s,
            "initial_pass@1": state.initial_pass_at_1,
            **state.last_eval,
        }

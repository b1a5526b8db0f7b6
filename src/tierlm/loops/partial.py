"""Partial rollouts (rl.partial_rollouts): generation in chunks that carry over from one training step to the next,
so a step waits for enough finished groups, not for its longest sample.

A step's sampling runs rounds under the weights the engine holds then, one at least, until enough groups have
finished. Each round first starts new groups while fewer than the window (rl.rollout_window, this rank's share)
are in flight or queued — prompts in the order the plain run takes them, the oldest first: a windowed FIFO — then
gives every group in flight one chunk (rl.rollout_chunk tokens; a started group's rows are prefilled afresh under
the new weights, `Engine.extend`). A group whose rows are all done (a stop token, rl.max_new_tokens, or the
context) is scored and queued; once the queue holds the step's groups, the step takes them in the order they
started. Every token records the weight version that sampled it and its sampler log-prob (so rl.importance's ratio
is exact per token). The staleness bound: no token of a trained group is more than rl.max_staleness steps older
than the policy that trains it. A group that would pass it is dropped (rl.stale_rollouts=drop, as TRL's async GRPO
does) or, =finish, ended where it is at the last step that may train it and queued unfinished.

Deterministic: which prompts start, how far each group gets in a round and its randomness (a generator per group,
keyed as the plain run keys that prompt, kept across rounds) are a pure function of the seed, the step schedule and
the weights, never of timing; the groups in flight and queued are part of a checkpoint, so a resumed run trains on
the very rollouts the uninterrupted one does. With one chunk holding rl.max_new_tokens and a window of one step's
groups, it is the plain run exactly. Each rank schedules its share of the window over the prompts the plain run
gives it (a run repeats itself at the same number of ranks).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tierlm.config import RLConfig
from tierlm.loops.off_policy import decode_completion, decode_rollout, encode_completion, encode_rollout
from tierlm.rollout.engine import Completion, Rollout, SamplingEngine
from tierlm.rollout.sampling import SamplingParams


@dataclass
class Group:
    """A prompt's group of rows, from its first chunk until a step trains it."""

    start: int  # its place in the run's stream of prompts (step x prompts_per_step + position)
    index: int  # the task's example
    prompt_ids: list[int]
    generator: torch.Generator  # its sampling randomness, carried from round to round
    born: int = -1  # the weight version of its first tokens (-1: not sampled yet)
    rows: list[Completion] = field(default_factory=list)
    rollouts: list[Rollout] | None = None  # scored, once every row is done


class PartialRollouts:
    """The groups in flight and queued of one rank, and the rounds that advance them.

    `prompt_at(start)` is the `(example index, prompt ids, generator)` of a place in the run's stream of prompts;
    `score(groups)` turns finished groups' rows into rollouts (the task's reward, a reward model's).
    """

    def __init__(
        self,
        engine: SamplingEngine,
        rl: RLConfig,
        rank: int,
        world_size: int,
        prompt_at: Callable[[int], tuple[int, list[int], torch.Generator]],
        score: Callable[[list[Group]], list[list[Rollout]]],
    ):
        self.engine, self.rl, self.prompt_at, self.score = engine, rl, prompt_at, score
        per_step = rl.prompts_per_step
        self.positions = list(range(rank, per_step, world_size))  # this rank's places in each step, as plain runs
        self.need = len(self.positions)
        self.window = (rl.rollout_window or 2 * per_step) * self.need // per_step
        self.started = 0  # this rank's prompts started so far
        self.in_flight: list[Group] = []
        self.ready: list[Group] = []
        self.figures: dict[int, dict[str, float]] = {}  # each sampled step's: rounds, groups in flight, stale ones

    def sample(self, step: int) -> list[list[Rollout]]:
        """The groups step `step` trains on (this rank's share), running rounds with the engine's weights until
        enough have finished."""
        figures = {"rollout_rounds": 0.0, "stale_dropped": 0.0, "stale_finished": 0.0}
        oldest = step - self.rl.max_staleness  # the oldest weight version `step` may train on
        fresh = [g for g in self.ready if g.born >= oldest]
        figures["stale_dropped"] += len(self.ready) - len(fresh) + sum(g.born < oldest for g in self.in_flight)
        self.ready, self.in_flight = fresh, [g for g in self.in_flight if g.born >= oldest]
        while True:  # one round at least: the groups in flight go on under every version the engine gets
            self._round()
            figures["rollout_rounds"] += 1
            if len(self.ready) >= self.need:
                break
        if self.rl.stale_rollouts == "finish":  # the last step that may train these: end them where they are
            ending = [g for g in self.in_flight if g.born <= oldest]
            self.in_flight = [g for g in self.in_flight if g.born > oldest]
            self._finish(ending)
            figures["stale_finished"] += len(ending)
        self.ready.sort(key=lambda g: g.start)
        taken, self.ready = self.ready[: self.need], self.ready[self.need :]
        figures["groups_in_flight"] = float(len(self.in_flight) + len(self.ready))
        self.figures[step] = figures
        return [g.rollouts for g in taken]

    def _round(self) -> None:
        """Start prompts while the window has room, give every group in flight a chunk, queue the finished ones."""
        while len(self.in_flight) + len(self.ready) < self.window:
            j, share = divmod(self.started, self.need)
            start = j * self.rl.prompts_per_step + self.positions[share]
            self.in_flight.append(Group(start, *self.prompt_at(start)))
            self.started += 1
        rl, engine = self.rl, self.engine
        chunk = min(rl.rollout_chunk, rl.max_new_tokens)
        new = [g for g in self.in_flight if not g.rows]
        going = [g for g in self.in_flight if g.rows]
        if going:  # first, so a round's work does not depend on which groups just started
            requests = [(g.prompt_ids, [r for r in g.rows if not self._done(g, r)], g.generator) for g in going]
            engine.extend_many(requests, chunk, SamplingParams.of(rl), budget=rl.max_new_tokens)
        if new:
            requests = [(g.prompt_ids, rl.group_size, g.generator) for g in new]
            for g, rows in zip(new, engine.generate_many(requests, chunk, SamplingParams.of(rl))):
                g.rows, g.born = rows, engine.weight_version
        done = [all(self._done(g, r) for r in g.rows) for g in self.in_flight]
        self._finish([g for g, d in zip(self.in_flight, done) if d])
        self.in_flight = [g for g, d in zip(self.in_flight, done) if not d]

    def _finish(self, groups: list[Group]) -> None:
        for g, rollouts in zip(groups, self.score(groups) if groups else []):
            g.rollouts = rollouts
            self.ready.append(g)

    def _done(self, group: Group, row: Completion) -> bool:
        length = len(row.tokens)
        at_context = len(group.prompt_ids) + length >= self.engine.max_len()
        return row.finished or length >= self.rl.max_new_tokens or at_context

    def step_figures(self, step: int) -> dict[str, float]:
        """What sampling step `step` did (rounds, groups left in flight, stale groups dropped or finished)."""
        return self.figures.pop(step, {})

    # -- checkpoints ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """This rank's groups in flight and queued, with their randomness, for a checkpoint (bit-exact)."""

        def encode(g: Group) -> dict[str, Any]:
            return {
                "start": g.start,
                "index": g.index,
                "prompt": g.prompt_ids,
                "born": g.born,
                "generator": base64.b64encode(g.generator.get_state().numpy().tobytes()).decode(),
                "rows": [encode_completion(r) for r in g.rows],
                "rollouts": None if g.rollouts is None else [encode_rollout(r) for r in g.rollouts],
            }

        return {"started": self.started, "in_flight": [encode(g) for g in self.in_flight],
                "ready": [encode(g) for g in self.ready],
                "figures": {str(step): f for step, f in self.figures.items()}}  # fmt: skip

    def load_state(self, state: dict[str, Any]) -> None:
        def decode(record: dict[str, Any]) -> Group:
            generator = torch.Generator(device=self.engine.device)
            raw = bytearray(base64.b64decode(record["generator"]))
            generator.set_state(torch.frombuffer(raw, dtype=torch.uint8))
            rollouts = record["rollouts"]
            return Group(
                record["start"],
                record["index"],
                list(record["prompt"]),
                generator,
                record["born"],
                [decode_completion(r) for r in record["rows"]],
                None if rollouts is None else [decode_rollout(r) for r in rollouts],
            )

        self.started = state["started"]
        self.in_flight = [decode(g) for g in state["in_flight"]]
        self.ready = [decode(g) for g in state["ready"]]
        self.figures = {int(step): f for step, f in state["figures"].items()}  # of batches sampled ahead

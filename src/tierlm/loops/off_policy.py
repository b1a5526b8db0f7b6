"""Asynchronous RL (rl.max_off_policy_steps = k > 0): the rollouts of step n are sampled with the policy of
step n - k, in a background thread, while the steps before n train.

At step n the loop takes step n's rollouts (waiting if they are not done) and first submits the sampling of
step n + k with a snapshot of the weights it has now — so each batch is a pure function of (seed, step,
the weights after max(0, n - k) updates), whatever the threads' timing: an asynchronous run takes exactly
the steps of its synchronous equivalent. The engine samples from a model of its own that each job loads its
snapshot into (the policy's weights change under it meanwhile). A checkpoint holds the pending batches
(sampled, or waited for), every rank's, so a resumed run trains on the very rollouts it would have (prime-rl
and verl's async modes regenerate or drop them instead).
"""

from __future__ import annotations

import base64
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from tierlm.rollout.engine import Completion, Engine, Rollout


def _pack(values, dtype) -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()


def _unpack(text: str, dtype) -> list:
    return np.frombuffer(base64.b64decode(text), dtype=dtype).tolist()


def encode_completion(c: Completion) -> dict[str, Any]:
    """A completion as JSON (token ids and log-probs bit-exact: base64 of int64 / float64).

    >>> c = Completion([3, 4], [-0.1, 0.0], [1, 0], False, 1, 2, [2, 3], [5])
    >>> decode_completion(encode_completion(c)) == c
    True
    """
    return {
        "tokens": _pack(c.tokens, np.int64),
        "logprobs": _pack(c.logprobs, np.float64),
        "mask": _pack(c.mask, np.int64),
        "finished": c.finished,
        "tool_calls": c.tool_calls,
        "weight_version": c.weight_version,
        "versions": _pack(c.versions, np.int64),
        "forced": _pack(c.forced, np.int64),
        **({} if c.routes is None else {"routes": _pack(c.routes, np.int16), "routes_shape": list(c.routes.shape)}),
    }


def decode_completion(record: dict[str, Any]) -> Completion:
    """The completion `encode_completion` wrote, its expert routes too (a mixture-of-experts sampler's).

    >>> c = Completion([3, 4], [-0.1, 0.0], [1, 1], routes=torch.tensor([[[0, 2]], [[1, 3]]], dtype=torch.int16))
    >>> torch.equal(decode_completion(encode_completion(c)).routes, c.routes)
    True
    """
    routes = None
    if "routes" in record:
        routes = torch.tensor(_unpack(record["routes"], np.int16), dtype=torch.int16).view(record["routes_shape"])
    return Completion(
        _unpack(record["tokens"], np.int64),
        _unpack(record["logprobs"], np.float64),
        _unpack(record["mask"], np.int64),
        record["finished"],
        record["tool_calls"],
        record.get("weight_version", 0),
        _unpack(record.get("versions", ""), np.int64),
        _unpack(record.get("forced", ""), np.int64),
        routes,
    )


def encode_rollout(rollout) -> dict[str, Any]:
    """A rollout as JSON (`encode_completion`).

    >>> r = Rollout([1, 2], Completion([3, 4], [-0.1, 0.0], [1, 0], True, 1, 1, [1, 1]), 1.0, "7", domain="sums")
    >>> decode_rollout(encode_rollout(r)) == r
    True
    """
    return {
        "prompt": _pack(rollout.prompt_ids, np.int64),
        **encode_completion(rollout.completion),
        "reward": rollout.reward,
        "text": rollout.text,
        "task_reward": rollout.task_reward,
        "score": rollout.score,
        "domain": rollout.domain,
    }


def decode_rollout(record: dict[str, Any]) -> Rollout:
    return Rollout(
        _unpack(record["prompt"], np.int64),
        decode_completion(record),
        record["reward"],
        record["text"],
        record.get("task_reward"),
        record.get("score"),
        record.get("domain"),
    )


class OffPolicyRollouts:
    """The pending rollout batches of an asynchronous run: one background sampler, `k` steps ahead.

    `sample(step)` makes a step's groups with the engine as loaded; `snapshot()` is the policy's whole
    weights now (collective under FSDP: called on every rank, in the same order); `num_steps` the run's steps.
    """

    def __init__(
        self, k: int, engine: Engine, sample: Callable[[int], list], snapshot: Callable[[], dict], num_steps: int
    ):
        assert k > 0, "on-policy runs sample in the loop"
        self.k, self.engine, self.sample, self.snapshot, self.num_steps = k, engine, sample, snapshot, num_steps
        # One thread of its own for the sampler's math: the training thread keeps the configured ones.
        self.pool = ThreadPoolExecutor(1, "tierlm-rollouts", initializer=torch.set_num_threads, initargs=(1,))
        self.pending: dict[int, Future] = {}
        self.submitted = -1  # the last step whose sampling was submitted
        self.snapshot_s = 0.0  # the time the latest weight snapshot took
        self.busy: dict[int, float] = {}  # the seconds the sampler spent on each step's batch

    def version(self, step: int) -> int:
        """The updates behind the weights step `step` is sampled with."""
        return max(0, step - self.k)

    def take(self, step: int) -> list:
        """Step `step`'s groups, after submitting the sampling of every step up to `step + k` (with the
        weights of now: `step` updates, or the initial ones while the first k steps fill the queue)."""
        weights, self.snapshot_s = None, 0.0
        for later in range(max(self.submitted + 1, step), min(step + self.k, self.num_steps - 1) + 1):
            assert self.version(later) == step, f"step {later} would be sampled {step} updates in, not {later - self.k}"
            if weights is None:
                start = time.perf_counter()
                weights = self.snapshot()
                self.snapshot_s = time.perf_counter() - start
            self.pending[later] = self.pool.submit(self._job, later, weights, step)
            self.submitted = later
        return self.pending.pop(step).result()

    def _job(self, step: int, weights: dict, version: int) -> list:
        start = time.perf_counter()
        self.engine.load_weights(weights, version)
        groups = self.sample(step)
        self.busy[step] = time.perf_counter() - start
        return groups

    def sampling_s(self, step: int) -> float:
        """The seconds the sampler spent on step `step`'s batch (0.0 for a batch a checkpoint held)."""
        return self.busy.pop(step, 0.0)

    def drain(self) -> None:
        """Wait until the sampler is idle (before anything else uses the engine)."""
        for future in self.pending.values():
            future.result()

    def state(self) -> dict[str, Any]:
        """This rank's pending batches (sampled: waited for), for a checkpoint."""
        self.drain()
        return {
            str(step): [[encode_rollout(r) for r in group] for group in future.result()]
            for step, future in sorted(self.pending.items())
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's pending batches (this rank's)."""
        self.pending = {}
        for step, groups in state.items():
            done: Future = Future()
            done.set_result([[decode_rollout(r) for r in group] for group in groups])
            self.pending[int(step)] = done
        self.submitted = max(self.pending, default=-1)

    def close(self) -> None:
        self.pool.shutdown(wait=True)

"""What the RL loop reports beside its train lines: the progress line of a logged step, the rollouts rl.log_rollouts
logs, the partial rollouts' figures and the parity pre-flight's verdict."""

from __future__ import annotations

from typing import Any, Callable

from tierlm.config import RLConfig
from tierlm.errors import ConfigError


def rollout_records(rollouts: list, advantages: list[float], decode: Callable, n: int) -> list[dict[str, Any]]:
    """The first `n` of a step's rollouts (with the advantage each trained on) as rl.log_rollouts logs them.

    >>> from tierlm.rollout.engine import Completion, Rollout
    >>> done = Rollout([1, 2], Completion(tokens=[3], finished=True), 1.0, "3", terms={"m:f": 0.5})
    >>> rollout_records([done], [0.7], lambda ids: " ".join(map(str, ids)), 2)
    [{'index': 0, 'prompt': '1 2', 'completion': '3', 'answer': '3', 'reward': 1.0, 'reward_terms': {'m:f': 0.5},
      'advantage': 0.7, 'completion_tokens': 1, 'finished': True, 'tool_calls': 0, 'weight_version': 0}]
    """
    records = []
    for index, (r, advantage) in enumerate(zip(rollouts[:n], advantages)):
        c = r.completion
        record = {"index": index, "prompt": decode(r.prompt_ids), "completion": decode(c.tokens), "answer": r.text}
        record["reward"] = r.reward
        parts = {"task_reward": r.task_reward, "rm_score": r.score, "reward_terms": dict(r.terms) or None}
        record.update({key: value for key, value in parts.items() if value is not None})
        record.update(advantage=advantage, completion_tokens=len(c.tokens), finished=c.finished)
        records.append({**record, "tool_calls": c.tool_calls, "weight_version": c.weight_version})
    return records


def progress_line(step: int, total: int, metrics: dict[str, float]) -> str:
    """A logged step's line on stderr.

    >>> figures = dict(reward_mean=0.5, loss=0.1, logprob_abs_diff=1e-3, weight_version=3, time_generation_s=1.25,
    ...                time_training_s=0.5)
    >>> progress_line(4, 10, figures)
    'step 4/10 | reward 0.500 | loss 0.1000 | |dlogp| 1.00e-03 | weights v3 | gen 1.2s train 0.5s'
    >>> progress_line(4, 10, {**figures, "routing_token_agreement": 0.875})
    'step 4/10 | reward 0.500 | loss 0.1000 | |dlogp| 1.00e-03 | routed alike 0.875 | weights v3 | gen 1.2s train 0.5s'
    """
    m = metrics
    reward_model = f"rm acc {m['rm_accuracy']:.2f} | " if "rm_accuracy" in m else ""
    routing = f"routed alike {m['routing_token_agreement']:.3f} | " if "routing_token_agreement" in m else ""
    return (
        f"step {step}/{total} | reward {m['reward_mean']:.3f} | loss {m['loss']:.4f} | {reward_model}"
        f"|dlogp| {m['logprob_abs_diff']:.2e} | {routing}weights v{m['weight_version']} | "
        f"gen {m['time_generation_s']:.1f}s "
        f"train {m['time_training_s']:.1f}s"
    )


def partial_figures(totals: dict[str, float], world_size: int) -> dict[str, float]:
    """Partial rollouts in the train lines: the rounds a step ran (per rank), the groups left in flight or queued,
    the stale groups dropped or finished early, the mean age of the trained sampled tokens (optimizer steps between
    the weights that sampled each and the policy training on it) and the share of rows sampled by several versions.

    >>> figures = partial_figures(dict(rollout_rounds=6, groups_in_flight=5, stale_dropped=1, stale_finished=0,
    ...                                token_age_sum=30, sampled_tokens=120, spanning_rows=4, rows=16), world_size=2)
    >>> figures["rollout_rounds"], figures["token_age_mean"], figures["spanning_frac"]
    (3.0, 0.25, 0.25)
    """
    return {
        "rollout_rounds": totals["rollout_rounds"] / world_size,
        "groups_in_flight": float(totals["groups_in_flight"]),
        "stale_dropped": float(totals["stale_dropped"]),
        "stale_finished": float(totals["stale_finished"]),
        "token_age_mean": totals["token_age_sum"] / max(totals["sampled_tokens"], 1.0),
        "spanning_frac": totals["spanning_rows"] / max(totals["rows"], 1),
    }


def check_parity(parity: dict[str, float], rl: RLConfig) -> dict[str, Any]:
    """The pre-flight's verdict: a one-line refusal when the sampler's log-probs are too far from the trainer's for
    the importance ratio to mean anything (mean |gap| per token over rl.parity_tolerance); else the figures."""
    if parity["mean_abs_gap"] > rl.parity_tolerance:
        raise ConfigError(
            f"the sampler's log-probs are {parity['mean_abs_gap']:.3g} per token from the trainer's (largest "
            f"{parity['max_abs_gap']:.3g}; {parity['beyond_cap']:.1%} of ratios beyond rl.importance_cap, over "
            f"{parity['tokens']} tokens), more than rl.parity_tolerance {rl.parity_tolerance:g}: sample in the "
            "trainer's dtype (float32 / bf16 on both sides) or check that the sampler loads the trainer's weights"
        )
    return {"parity": parity}

"""On-policy distillation's teachers (rl.teacher, rl.teachers): frozen models that score the student's samples, each
prompt routed to the teacher of its domain (`TaskExample.domain`: a row's data.domain_column, a synthetic task's
name), the rest to rl.teacher. A micro-batch's rows are split by teacher, each teacher scores its rows in one
forward, and the scores go back to their rows: the log-prob of each sampled token (rl.loss=distill) and, for
rl.loss=distill_topk, the teacher's k likeliest tokens with their log-probs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tierlm.errors import ConfigError
from tierlm.primitives.losses import label_logprobs, vocab_logprobs


@dataclass(frozen=True)
class Teachers:
    """`models`: frozen models (their `forward(batch, fn)`), one per distinct folder; `routes`: a domain -> the
    index of its teacher; `default`: rl.teacher's index (None: every domain must have a route); `labels`: each
    teacher's name in the train lines; `top_k`: the top-k scored for distill_topk (None: the sampled token only);
    `temperature`: the sampling temperature the log-probs are taken under.

    >>> two = Teachers([None, None], routes={"sums": 1}, default=0, labels=["rest", "sums"])
    >>> two.route("sums"), two.route("spelling"), two.route(None)
    (1, 0, 0)
    >>> Teachers([None], routes={"sums": 0}, default=None, labels=["sums"]).route("spelling")
    Traceback (most recent call last):
    tierlm.errors.ConfigError: a prompt of domain 'spelling' has no teacher: rl.teachers routes ['sums']; add it, ...
    """

    models: list[Any]
    routes: dict[str, int]
    default: int | None
    labels: list[str]
    top_k: int | None = None
    temperature: float = 1.0

    def route(self, domain: str | None) -> int:
        """The index of the teacher of a prompt of `domain`."""
        index = self.routes.get(domain, self.default) if domain is not None else self.default
        if index is None:
            raise ConfigError(
                f"a prompt of domain {domain!r} has no teacher: rl.teachers routes {sorted(self.routes)}; add it, or "
                "set rl.teacher for the rest"
            )
        return index

    def _scores(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        vocab = vocab_logprobs(logits, self.temperature)  # once, for the sampled tokens and the top-k alike
        out = {"logprobs": label_logprobs(vocab, batch["labels"])}
        if self.top_k is not None:
            out["topk_logprobs"], out["topk_ids"] = vocab.topk(min(self.top_k, vocab.shape[-1]), dim=-1)
        return out

    def score(self, micro_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each row of `micro_batch` scored by its teacher (`micro_batch["teacher"]`, a teacher index per row): the
        sampled tokens' log-probs (B, T), and with `top_k` the teacher's top-k log-probs and ids (B, T, k)."""
        which = micro_batch["teacher"]
        out: dict[str, torch.Tensor] = {}
        for index in sorted(set(which.tolist())):
            rows = (which == index).nonzero().squeeze(1)
            mine = {key: micro_batch[key][rows] for key in ("input_ids", "labels")}
            scores = self.models[index].forward(mine, self._scores).wait()
            for key, value in scores.items():
                if key not in out:
                    out[key] = torch.zeros((len(which), *value.shape[1:]), dtype=value.dtype)
                out[key][rows] = value
        return out


def check_routes(teachers: dict[str, str], default: str | None, domains: set[str | None]) -> None:
    """Refuse, in one line, training prompts whose `domains` do not match rl.teachers: a domain without a teacher
    (and no rl.teacher `default`), or a route that no prompt takes (a misspelt domain would go to rl.teacher unseen).

    >>> check_routes({"sums": "runs/sums"}, None, {"sums", "arithmetic"})
    Traceback (most recent call last):
    tierlm.errors.ConfigError: training prompts of domain 'arithmetic' have no teacher: rl.teachers routes ['sums'] ...
    """
    named = sorted(str(d) for d in domains)
    unused = sorted(set(teachers) - domains)
    if unused:
        raise ConfigError(
            f"rl.teachers routes {unused} but no training prompt has that domain (theirs: {named}, from "
            "data.domain_column; a synthetic task's is its name): fix the names"
        )
    lost = sorted(str(d) for d in domains if d not in teachers)
    if lost and default is None:
        raise ConfigError(
            f"training prompts of domain {lost[0]!r} have no teacher: rl.teachers routes {sorted(teachers)} and "
            "rl.teacher is unset; add a route, or set rl.teacher for the rest"
        )

"""Several prompts decoded as one batch by the engine's fixed-shape decoder (`Engine.generate_many` and
`Engine.extend_many`): an RL step's prompts in one model step where they took one step each.

Each part — a prompt sampled n ways, or a partial rollout's rows (its prompt and each row's tokens so far) — is
prefilled alone; the decoder right-aligns them to the longest, each shorter one's keys turned by the rotary offset and
the positions before it masked (`tierlm.rollout.static_decode.StaticDecoder.load`), so each row computes what it would
alone to float rounding. Each part's rows draw from its own generator exactly as they would alone, and no more once
they have all stopped (`Engine._decode_rows`' groups). Parts go together only where that holds: each has its own
generator (or sampling is greedy), they take the same number of steps, and the longest prefix leaves room for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BATCH_ROWS = 64
"""The most rows decoded together: an RL step's 8 prompts x 8 samples in one batch. The KV cache grows with the rows:
64 rows of 1,152 positions of the 478 M bench model take 7.5 GB in bf16."""


@dataclass
class Part:
    """One prompt's share of a batch: the `ids` to prefill (1 or len(rows), T), the completions it continues (`rows`,
    new or a partial rollout's), their tool calls in flight, and the generator its rows draw from."""

    ids: torch.Tensor
    rows: list
    calls: list
    generator: torch.Generator | None


Item = tuple[int, int, int, "torch.Generator | None"]
"""(prefix length, rows, steps, generator) of one part to decode."""


def runs(items: list[Item], context: int, temperature: float) -> list[list[int]]:
    """Indices of `items` — `(prefix length, rows, steps, generator)` each — decoded together: consecutive ones of
    the same steps, up to `BATCH_ROWS` rows, whose longest prefix leaves the steps within `context`; each alone when
    they share a generator (their draws would interleave) unless sampling is greedy.

    >>> g = [torch.Generator() for _ in range(4)]
    >>> runs([(10, 30, 20, g[0]), (20, 30, 20, g[1]), (40, 2, 20, g[2]), (5, 4, 20, g[3])], 64, 1.0)
    [[0, 1, 2], [3]]
    >>> runs([(10, 30, 20, g[0]), (20, 30, 9, g[1])], 64, 1.0), runs([(10, 2, 5, g[0]), (9, 2, 5, g[0])], 64, 1.0)
    ([[0], [1]], [[0], [1]])
    """
    generators = [id(g) for *_, g in items if g is not None]
    if temperature != 0 and len(set(generators)) != len(items):
        return [[i] for i in range(len(items))]
    out: list[list[int]] = []
    rows = longest = 0
    for i, (prefix, n, steps, _) in enumerate(items):
        same = bool(out) and steps == items[out[-1][0]][2]
        if same and rows + n <= BATCH_ROWS and max(longest, prefix) + steps <= context:
            out[-1].append(i)
            rows, longest = rows + n, max(longest, prefix)
        else:
            out.append([i])
            rows, longest = n, prefix
    return out


@torch.no_grad()
def decode(engine, parts: list[Part], steps: int, temperature: float, top_k, top_p) -> None:
    """`steps` tokens (at most) for every unfinished row of `parts`, in place, as one batch of `engine`'s
    fixed-shape decoder; a tool result the budget cut is left in its row's `forced` (a partial rollout forces it
    next)."""
    was_training = engine.model.training
    engine.model.eval()
    try:
        prefilled, firsts = [], []
        for part in parts:
            logits, cache = engine.family.prefill(engine.model, part.ids, part.ids.shape[1])
            prefilled.append((cache, len(part.rows)))
            firsts.append(logits.expand(len(part.rows), -1))
        rows = [row for part in parts for row in part.rows]
        decoder = engine.decoders.get(len(rows), max(part.ids.shape[1] for part in parts) + steps)
        decoder.load(prefilled)
        calls = [call for part in parts for call in part.calls]
        groups = [(len(part.rows), part.generator) for part in parts]
        engine._decode_rows(torch.cat(firsts), decoder, rows, calls, steps, temperature, top_k, top_p, None,
                            groups=groups)  # fmt: skip
    finally:
        engine.model.train(was_training)
    for row, pending in zip(rows, calls):
        row.forced = pending.forced

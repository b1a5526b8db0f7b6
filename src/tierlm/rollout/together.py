"""Several prompts decoded as one batch by the engine's fixed-shape decoder (`Engine.generate_many` and
`Engine.extend_many`): an RL step's prompts in one model step where they took one step each.

Each part — a prompt sampled n ways, or a partial rollout's rows (its prompt and each row's tokens so far) — is
prefilled with the others of like length (`prefill`: one forward, right-padded); the decoder right-aligns them to the
longest, each shorter one's keys turned by the rotary offset and the positions before it masked
(`tierlm.rollout.static_decode.StaticDecoder.load`), so each row computes what it would alone to float rounding. Each
part's rows draw from its own generator exactly as they would alone, and no more once they have all stopped
(`Engine._decode_rows`' groups). Parts go together only where that holds: each has its own generator (or sampling is
greedy), they take the same number of steps, and the longest prefix leaves room for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tierlm.models.kv_cache import KVCache

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


def runs(items: list[Item], context: int, greedy: bool = False) -> list[list[int]]:
    """Indices of `items` — `(prefix length, rows, steps, generator)` each — decoded together: consecutive ones of
    the same steps, up to `BATCH_ROWS` rows, whose longest prefix leaves the steps within `context`; each alone when
    they share a generator (their draws would interleave) unless sampling is greedy.

    >>> g = [torch.Generator() for _ in range(4)]
    >>> runs([(10, 30, 20, g[0]), (20, 30, 20, g[1]), (40, 2, 20, g[2]), (5, 4, 20, g[3])], 64)
    [[0, 1, 2], [3]]
    >>> runs([(10, 30, 20, g[0]), (20, 30, 9, g[1])], 64), runs([(10, 2, 5, g[0]), (9, 2, 5, g[0])], 64)
    ([[0], [1]], [[0], [1]])
    """
    generators = [id(g) for *_, g in items if g is not None]
    if not greedy and len(set(generators)) != len(items):
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


def like_lengths(sizes: list[int]) -> list[list[int]]:
    """Indices of `sizes` in groups prefilled together: by length, a group growing while its padding to its longest
    stays below its tokens (each size counted once: a part of several rows of one length weighs as one row).

    >>> like_lengths([30, 5, 28, 6, 7, 200])
    [[1, 3, 4], [2, 0], [5]]
    """
    groups: list[list[int]] = []
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i]):
        group = groups[-1] if groups else None
        if group is not None and (len(group) + 1) * sizes[i] <= 2 * (sum(sizes[j] for j in group) + sizes[i]):
            group.append(i)
        else:
            groups.append([i])
    return groups


@torch.no_grad()
def prefill(model, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, KVCache]]:
    """Prefill `prompts` — each (rows, T) token ids of the native GPT, its rows of one length — a forward for each
    group of like lengths (`like_lengths`), right-padded to its longest: causal attention keeps every row from the
    padding after it, so each computes what it computes alone (to float rounding). Per prompt: the logits of its last
    position (rows, V) and a cache of its rows (views of its group's) at its length.

    On a GPU an eager prefill is host-bound — 14-24 ms at batch 1 for the 478 M bench model on an H200, a few
    hundred kernel launches whatever the prompt's length (docs/benchmarks.md) — so an RL step's prompts pay one or
    two of them, not one each.

    >>> from tierlm.models import GPTConfig, build_gpt
    >>> model = build_gpt(GPTConfig(depth=2, aspect_ratio=32, head_dim=16, vocab_size=100, max_seq_len=64)).eval()
    >>> (logits, cache), (more, theirs) = prefill(model, [torch.tensor([[5, 9, 13]]), torch.tensor([[7, 8]] * 3)])
    >>> logits.shape, cache.length, more.shape, theirs.length, theirs.layers[0].k.shape[0]
    (torch.Size([1, 100]), 3, torch.Size([3, 100]), 2, 3)
    >>> torch.allclose(logits, model(torch.tensor([[5, 9, 13]]))[:, -1], atol=1e-5)
    True
    """
    out: list = [None] * len(prompts)
    dtype = next(model.parameters()).dtype
    for group in like_lengths([prompt.shape[1] for prompt in prompts]):
        longest = max(prompts[i].shape[1] for i in group)
        ids = torch.cat([F.pad(prompts[i], (0, longest - prompts[i].shape[1])) for i in group])
        last = torch.cat([torch.full((prompts[i].shape[0],), prompts[i].shape[1] - 1) for i in group])
        cache = KVCache(model.config, ids.shape[0], longest, ids.device, dtype)
        logits = model(ids, cache=cache, logits_at=last.to(ids.device))
        row = 0
        for i in group:
            rows, size = prompts[i].shape
            out[i] = (logits[row : row + rows], cache.rows(row, row + rows, size))
            row += rows
    return out


@torch.no_grad()
def decode(engine, parts: list[Part], steps: int, params) -> None:
    """`steps` tokens (at most) for every unfinished row of `parts`, in place, as one batch of `engine`'s
    fixed-shape decoder; a tool result the budget cut is left in its row's `forced` (a partial rollout forces it
    next)."""
    was_training = engine.model.training
    engine.model.eval()
    try:
        prefilled = prefill(engine.model, [part.ids for part in parts])
        firsts = [logits.expand(len(part.rows), -1) for (logits, _), part in zip(prefilled, parts)]
        rows = [row for part in parts for row in part.rows]
        decoder = engine.decoders.get(len(rows), max(part.ids.shape[1] for part in parts) + steps)
        decoder.load([(cache, len(part.rows)) for (_, cache), part in zip(prefilled, parts)])
        calls = [call for part in parts for call in part.calls]
        groups = [(len(part.rows), part.generator) for part in parts]
        engine._decode_rows(torch.cat(firsts), decoder, rows, calls, steps, params, None, groups=groups)
    finally:
        engine.model.train(was_training)
    for row, pending in zip(rows, calls):
        row.forced = pending.forced

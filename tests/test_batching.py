"""Continuous batching (`tierlm.rollout.batching`): sequences that join a running batch at different steps, leave
it when done and outlive the model's context together compute what each computes alone."""

from __future__ import annotations

import pytest
import torch

from tierlm.models import GPTConfig, build_gpt
from tierlm.rollout import static_decode, together
from tierlm.rollout.batching import BatchedDecoder
from tierlm.rollout.engine import Engine
from tierlm.rollout.sampling import GREEDY


def _model(max_seq_len: int):
    """A tiny native GPT off its initialisation (whose zero output projections make every block the identity: attention
    would change nothing the tests could see)."""
    torch.manual_seed(0)
    model = build_gpt(
        GPTConfig(depth=2, aspect_ratio=32, head_dim=16, n_kv_head=2, vocab_size=97, max_seq_len=max_seq_len)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def _alone(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their logits, the sequence alone (the engine's own cache)."""
    engine, rows = Engine(model), []
    out = engine.generate(prompt, 1, steps, GREEDY, on_token=lambda r, c: None)[0]
    ids = torch.tensor([prompt + out.tokens[:-1]], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 :]
    rows.extend(out.tokens)
    return rows, logits


@pytest.mark.parametrize("static,device", [(False, "cpu"), (True, "cpu"), ("compiled", "cpu"), (None, "cuda")])
def test_sequences_joining_and_leaving_a_batch_compute_what_each_computes_alone(static, device, monkeypatch):
    """`static`: the step with fixed shapes that CUDA captures in graphs (on CPU run eagerly, its logits returned in
    one buffer overwritten each step as a graph's are): rows and positions rounded up to buckets over views of the
    cache, a tensor position, attention masked over the whole bucket. "compiled": that step compiled on a CPU, over
    the rows in flight and the positions in use (no buckets). On CUDA (scripts/gpu_checks.sh) the decoder's own
    choice: those steps, each a CUDA graph."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    compiled = static == "compiled"
    if compiled:
        monkeypatch.setattr(static_decode, "COMPILE_BACKEND", "aot_eager")  # dynamo's trace, without Inductor's wait
        static = None
    if static and device == "cpu":
        run = static_decode.FixedStep.run

        def run_into_one_buffer(step):  # a CUDA graph's output: the same memory, rewritten by every replay
            logits = run(step)
            if getattr(step, "buffer", None) is None:
                step.buffer = torch.empty_like(logits)
            return step.buffer.copy_(logits)

        monkeypatch.setattr(static_decode.FixedStep, "run", run_into_one_buffer)
    model = _model(48).to(device)
    prompts = {"a": [5, 9, 13], "b": list(range(20, 31)), "c": [7], "d": [3, 1, 4, 1, 5, 9, 2, 6]}
    joins = {"a": 0, "b": 2, "c": 5, "d": 40}  # d joins after the timeline has passed the context: compaction
    lengths = {"a": 30, "b": 12, "c": 40, "d": 6}
    expected = {name: _alone(model, prompts[name], lengths[name]) for name in prompts}

    batch, rows, got, logits_seen = BatchedDecoder(model, max_rows=4, static=static, compile=compiled), [], {}, {}
    fixed = batch.steps is not None
    assert fixed == (static is not False) and (device == "cpu" or batch.steps.graph)
    assert batch.buckets == (fixed and not compiled)
    made = []
    kept = batch.steps.kept if fixed else None
    if fixed:  # the shapes of the steps made: buckets, or the rows in flight and the positions in use
        batch.steps.kept = lambda key, make: (made.append((key, batch.rows, batch.length)), kept(key, make))[1]
    moves: list[int] = []
    shift = batch._shift
    batch._shift = lambda offset: (moves.append(offset), shift(offset))[1]
    for step in range(80):
        for name, at in joins.items():
            if at == step:
                first = batch.join(prompts[name])
                rows.append(name)
                got[name], logits_seen[name] = [int(first.argmax())], [first]
        if not rows:
            continue
        done = [i for i, name in enumerate(rows) if len(got[name]) == lengths[name]]
        order = batch.leave(done)  # the last rows move into the freed places
        rows = [rows[i] for i in order]
        if not rows:
            continue
        used = batch.full_mask[: batch.rows, : batch.length].any(dim=0)  # the rows' kept starts == their masks'
        assert batch._unused() == (int(used.float().argmax()) if used.any() else batch.length)
        logits = batch.step(torch.tensor([got[name][-1] for name in rows], device=device))
        if static is False:  # the eager step reads no mask where every row starts where attention does
            assert (batch.cache.layers[0].mask is None) == (len(set(batch.starts)) == 1)
        for i, name in enumerate(rows):
            got[name].append(int(logits[i].argmax()))
            logits_seen[name].append(logits[i].clone())  # a view valid until the next step
        for k, v in batch.full:  # a row holds nothing but its own keys; nothing at all lies past the furthest reach
            for held in (k.abs().amax(dim=(1, 3)), v.abs().amax(dim=(1, 3))):  # (rows, positions)
                assert not held[: batch.rows][~batch.full_mask[: batch.rows]].any()
                assert not held[:, batch.high :].any() and batch.high <= batch.capacity
    assert batch.rows == 0
    assert not fixed or len(batch.steps.decoders) >= 2  # several buckets of rows
    for (rows, positions), in_flight, length in made:
        if compiled:
            assert rows == in_flight and length < positions <= length + 16, (rows, positions, in_flight, length)
        else:
            assert (rows, positions) == static_decode.bucket(in_flight, length + 1, 48)
    assert any(m > 0 for m in moves) and any(m < 0 for m in moves), moves  # pushed right by b, compacted later
    for name, (tokens, logits) in expected.items():
        assert got[name] == tokens, name
        torch.testing.assert_close(torch.stack(logits_seen[name][: len(tokens)]), logits, atol=1e-4, rtol=1e-4)


def test_requests_from_many_threads_get_what_each_gets_alone():
    """The scheduler's one thread runs every request in flight together; greedy replies equal the engine's alone,
    a request stopped by its caller ends with that reason, and one that never joins is not run."""
    import threading

    from tierlm.rollout.batching import BatchScheduler, Request

    model = _model(64)
    engine = Engine(model, stop_ids=[3])
    prompts = [[5, 9, 13], list(range(20, 31)), [7], [8, 8, 8, 2]]
    alone = [engine.generate(p, 1, 20, GREEDY)[0] for p in prompts]
    scheduler = BatchScheduler(engine, max_rows=2)  # four requests, two rows: two wait their turn
    try:
        requests = [Request(p, 20, temperature=0.0) for p in prompts]
        threads = [threading.Thread(target=scheduler.submit, args=(r,)) for r in requests]
        for t in threads:
            t.start()
        for r in requests:
            assert r.done.wait(timeout=30)
        assert [r.completion.tokens for r in requests] == [a.tokens for a in alone]
        assert [r.reason for r in requests] == ["stop" if a.finished else "length" for a in alone]
        count = iter(range(100))
        stopped = scheduler.submit(
            Request(prompts[0], 20, 0.0, should_stop=lambda: "cancelled" if next(count) >= 3 else None)
        )
        never = scheduler.submit(Request(prompts[1], 20, 0.0, should_stop=lambda: "timeout"))
        assert stopped.done.wait(timeout=30) and never.done.wait(timeout=30)
        assert stopped.reason == "cancelled" and 0 < len(stopped.completion.tokens) <= 3
        assert never.reason == "timeout" and never.completion.tokens == []
    finally:
        scheduler.close()


def test_a_layer_of_the_fixed_shape_step_rebuilds_no_mask_and_negates_nothing():
    """On a GPU the fixed-shape decode step's time is its kernels (~700 of ~2.5 us for a 20-layer model on an H200,
    docs/benchmarks.md), so what a layer adds is counted: the attention mask is built once a step, not in each layer
    (no arange / compare / and a layer), the rotary turn's negation lives in the sine table (no neg a layer), and
    q/k/v and gate/up are one matmul each (four a layer, not seven)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for depth in (1, 3):
        torch.manual_seed(0)
        config = GPTConfig(depth=depth, aspect_ratio=32, head_dim=16, n_kv_head=2, vocab_size=97, max_seq_len=64)
        step = static_decode.StaticDecoder(build_gpt(config).eval(), 2, 64, graph=False)
        step.position.fill_(5)
        with Count() as count:
            step.step(torch.tensor([3, 4]))
        counts.append(count.ops)
    per_layer = {op: (counts[1][op] - counts[0][op]) // 2 for op in counts[1]}
    assert per_layer["mm"] == 4 and per_layer["index_copy_"] == 2  # qkv o gate-up down; the keys and the values
    assert {op: per_layer.get(op, 0) for op in ("arange", "le", "bitwise_and", "neg")} == dict.fromkeys(
        ("arange", "le", "bitwise_and", "neg"), 0
    ), per_layer


def test_a_fixed_shape_batch_looks_at_the_weights_as_sequences_join_not_every_step():
    """Walking a 20-layer model's parameters costs about a step of the GPU's (~0.8 ms): the batch checks whether the
    weights moved (which drops its steps: a CUDA graph reads them where they were) as sequences join."""
    model = _model(48).eval()
    batch = BatchedDecoder(model, max_rows=4, static=True)
    walks = []
    parameters = model.parameters
    model.parameters = lambda *a, **k: (walks.append(1), parameters(*a, **k))[1]
    batch.join([5, 9, 13])
    fed = [5, 9, 13, 1]
    walks.clear()
    for _ in range(5):
        fed.append(int(batch.step(torch.tensor(fed[-1:])).argmax()))
    assert not walks
    with torch.no_grad():  # a new tensor where the head's was: the steps made on the old one are dropped at a join
        model.lm_head.weight = torch.nn.Parameter(2 * model.lm_head.weight)
    batch.join([7])
    assert walks
    logits = batch.step(torch.tensor([fed[-1], 2]))[0]
    with torch.no_grad():
        torch.testing.assert_close(logits, model(torch.tensor([fed]))[0, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("static", [False, True])
def test_prompts_joining_together_are_prefilled_in_batches_and_each_computes_what_it_computes_alone(static):
    """Arrivals prefilled together (right-padded, grouped by length: here two groups, out of the prompts' order)
    take the next rows in their own order and decode as each does alone, beside a row already in flight."""
    model = _model(64)
    prompts = [list(range(20, 31)), [5, 9, 13], [7], [3, 1, 4, 1, 5, 9, 2, 6], list(range(40, 70))]
    assert together.like_lengths([len(p) for p in prompts]) == [[2, 1, 3, 0], [4]]
    steps = 12
    expected = [_alone(model, p, steps) for p in [[8, 8, 2], *prompts]]
    batch = BatchedDecoder(model, max_rows=8, static=static)
    first = batch.join([8, 8, 2])
    logits = batch.step(first.argmax()[None])  # the timeline has moved on when the others join
    got, seen = [[int(first.argmax()), int(logits[0].argmax())]], [[first, logits[0].clone()]]
    joined = batch.join_many(prompts)
    assert batch.rows == 1 + len(prompts) and joined.shape == (len(prompts), model.config.vocab_size)
    for row in joined:
        got.append([int(row.argmax())])
        seen.append([row])
    for _ in range(steps):
        logits = batch.step(torch.tensor([tokens[-1] for tokens in got]))
        for i, row in enumerate(logits):
            got[i].append(int(row.argmax()))
            seen[i].append(row.clone())
    for (tokens, alone_logits), mine, logits in zip(expected, got, seen):
        assert mine[:steps] == tokens[:steps]
        torch.testing.assert_close(torch.stack(logits[:steps]), alone_logits[:steps], atol=1e-4, rtol=1e-4)

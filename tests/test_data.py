"""Sources, synthetic data and loaders: determinism, exact resume, rank sharding, bad input."""

import json

import pytest
import torch

from tierlm.data import ArithmeticTask, PretrainLoader, SFTLoader, load_conversations, load_documents
from tierlm.errors import DataError


def test_arithmetic_splits_are_disjoint_and_deterministic():
    task = ArithmeticTask()
    train = task.problems("train", 3000, seed=1)
    val = task.problems("val", 300, seed=1)
    assert not set(train) & set(val)
    assert task.problems("train", 50, seed=1) == train[:50]
    assert all(p.result == eval(f"{p.a}{p.op}{p.b}") for p in val[:50])  # noqa: S307 (test-only check)


def _docs(n=40):
    return [[0] + list(range(1, 2 + i % 7)) for i in range(n)]


def test_pretrain_loader_resumes_exactly():
    loader = PretrainLoader(_docs(), batch_size=2, seq_len=8, seed=3)
    straight = [loader.next_batch()["tokens"] for _ in range(12)]  # crosses epoch boundaries
    again = PretrainLoader(_docs(), batch_size=2, seq_len=8, seed=3)
    for _ in range(5):
        again.next_batch()
    state = json.loads(json.dumps(again.state_dict()))  # survives JSON
    resumed = PretrainLoader(_docs(), batch_size=2, seq_len=8, seed=3)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, resumed.next_batch()["tokens"]) for a in straight[5:])


def test_pretrain_rank_shards_cover_rows_once():
    docs = _docs()
    full = PretrainLoader(docs, batch_size=1, seq_len=8, seed=0, shuffle=False)
    all_rows = [tuple(full.next_batch()["tokens"][0].tolist()) for _ in range(full.batches_per_epoch)]
    shards = []
    for rank in range(2):
        loader = PretrainLoader(docs, batch_size=1, seq_len=8, seed=0, shuffle=False, rank=rank, world_size=2)
        shards.append([tuple(loader.next_batch()["tokens"][0].tolist()) for _ in range(loader.batches_per_epoch)])
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == sorted(all_rows[: len(shards[0]) + len(shards[1])])


def test_sft_loader_resume_and_truncation(tiny_tokenizer):
    conversations = [p.conversation for p in ArithmeticTask().problems("train", 30, seed=0)]
    conversations.append([{"role": "user", "content": "What is 1 + 1? " * 20}, {"role": "assistant", "content": "2"}])
    loader = SFTLoader(conversations, tiny_tokenizer, batch_size=4, max_seq_len=40, seed=1)
    straight = [loader.next_batch() for _ in range(10)]
    assert loader.num_truncated >= 1  # the long one was seen (3 epochs of 31) and cut to 41 tokens
    assert max(b["tokens"].shape[1] for b in straight) <= 41
    resumed = SFTLoader(conversations, tiny_tokenizer, batch_size=4, max_seq_len=40, seed=1)
    for _ in range(4):
        resumed.next_batch()
    state = resumed.state_dict()
    fresh = SFTLoader(conversations, tiny_tokenizer, batch_size=4, max_seq_len=40, seed=1)
    fresh.load_state_dict(state)
    for expected in straight[4:]:
        got = fresh.next_batch()
        assert torch.equal(got["tokens"], expected["tokens"]) and torch.equal(got["mask"], expected["mask"])


def test_sft_loader_drop_policy(tiny_tokenizer):
    conversations = [p.conversation for p in ArithmeticTask().problems("train", 8, seed=0)]
    conversations[0] = [{"role": "user", "content": "x " * 100}, {"role": "assistant", "content": "y"}]
    loader = SFTLoader(conversations, tiny_tokenizer, batch_size=7, max_seq_len=40, shuffle=False, long_conversations="drop")
    loader.next_batch()
    assert loader.num_dropped == 1


def test_text_jsonl_sources(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\nline two\n\nsecond doc\n")
    assert load_documents(str(tmp_path / "a.txt"), "train", 0, 0) == ["first doc\nline two", "second doc"]
    rows = [{"text": "t"}, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            {"prompt": "p", "completion": "c"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows[1:]) + "\n")
    convs = load_conversations(str(tmp_path / "d.jsonl"), "train", 0, 0)
    assert convs[1] == [{"role": "user", "content": "p"}, {"role": "assistant", "content": "c"}]


@pytest.mark.parametrize(
    "content,loader,match",
    [
        ('{"text": "ok"}\n{"text": oops}\n', load_documents, r"d.jsonl:2: malformed JSON"),
        ('{"body": "x", "id": 1}\n', load_documents, r"no 'text' field; fields present: \['body', 'id'\]"),
        ('{"question": "x"}\n', load_conversations, r"fields present: \['question'\]"),
        ("\n\n", load_documents, "holds no documents"),
    ],
)
def test_bad_input_names_the_problem(tmp_path, content, loader, match):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DataError, match=match):
        loader(str(tmp_path / "d.jsonl"), "train", 0, 0)


def test_missing_dataset_and_unknown_task():
    with pytest.raises(DataError, match="neither an existing file"):
        load_documents("no/such/file.txt", "train", 1, 0)
    with pytest.raises(DataError, match="unknown synthetic task"):
        load_documents("synthetic:chess", "train", 1, 0)

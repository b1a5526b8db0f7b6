"""Sources, packing and loaders: exact resume, rank sharding, mixtures, bad input, flat memory."""

import json

import numpy as np
import pytest
import torch

from tierlm.data import (
    ArithmeticTask,
    Document,
    Documents,
    ListExamples,
    Mixture,
    PackedLoader,
    SourceOptions,
    chat_documents,
    eval_batches,
    open_examples,
    text_documents,
)
from tierlm.errors import DataError
from tierlm.stages import STAGES


def test_arithmetic_splits_are_disjoint_and_deterministic():
    task = ArithmeticTask()
    train = task.problems("train", 3000, seed=1)
    val = task.problems("val", 300, seed=1)
    assert not set(train) & set(val)
    assert task.problem("train", 1234, seed=1) == train[1234]
    assert all(p.result == (p.a + p.b if p.op == "+" else p.a - p.b) for p in val)


def _docs(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return Documents(
        ListExamples([np.arange(1, rng.integers(3, 20)) for _ in range(n)]),
        lambda items: [Document(np.asarray(x)) for x in items],
    )


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode", ["crop", "pad"])
def test_resume_yields_identical_batches(mode):
    kwargs = dict(batch_size=3, seq_len=16, mode=mode, seed=5, buffer_docs=8, document_positions=True)
    straight = PackedLoader(_docs(), **kwargs)
    expected = [straight.next_batch() for _ in range(20)]  # several epochs, with a part-full buffer at each stop
    for stop in (1, 7, 13):
        first = PackedLoader(_docs(), **kwargs)
        for _ in range(stop):
            first.next_batch()
        state = json.loads(json.dumps(first.state_dict()))  # the state survives JSON (it goes in a checkpoint)
        resumed = PackedLoader(_docs(), **kwargs)
        resumed.load_state_dict(state)
        assert all(_same(resumed.next_batch(), e) for e in expected[stop:])


def test_prefetcher_hands_out_the_same_batches_and_resumable_state():
    from tierlm.data import Prefetcher

    kwargs = dict(batch_size=3, seq_len=16, mode="pad", seed=5, buffer_docs=8)
    plain = PackedLoader(_docs(), **kwargs)
    expected = [plain.next_batch() for _ in range(12)]
    prefetched = Prefetcher(PackedLoader(_docs(), **kwargs), depth=3)
    got = [prefetched.next_batch() for _ in range(5)]
    state = prefetched.state_dict()  # the queue already holds later batches; the state is of these 5
    prefetched.close()
    assert all(_same(a, b) for a, b in zip(got, expected))
    resumed = PackedLoader(_docs(), **kwargs)
    resumed.load_state_dict(state)
    assert all(_same(resumed.next_batch(), e) for e in expected[5:])


def test_rows_open_with_the_oldest_document_then_fill_best_fit():
    """Documents of 11, 6, 4, 3 and 13 tokens (unshuffled, then again next epoch) into rows of 16."""
    docs = Documents(
        ListExamples([[9] + [1] * n for n in (10, 5, 3, 2, 12)]), lambda xs: [Document(np.asarray(x)) for x in xs]
    )
    loader = PackedLoader(docs, batch_size=1, seq_len=15, mode="crop", shuffle=False, document_positions=True)
    rows = [loader.next_batch() for _ in range(3)]
    lengths = [np.diff(np.flatnonzero(np.r_[r["position_ids"][0].numpy() == 0, True])).tolist() for r in rows]
    # Row 1: the oldest (11), then the largest that fits 5 (4); 1 token is left and nothing fits, so the
    #        shortest buffered document (3) is cropped to 1 token.
    # Row 2: the oldest (6), then best-fit 6 (next epoch's copy), then 4: full, nothing cropped.
    # Row 3: the oldest (13), then 3.
    assert lengths == [[11, 4, 1], [6, 6, 4], [13, 3]]
    assert all(r["tokens"][0, 0].item() == 9 for r in rows)  # every row starts at a document start
    assert loader.counts["tokens_cropped"] == 2


def test_rows_open_in_arrival_order_so_no_document_waits_long():
    """Largest-first best-fit leaves short documents waiting until the epoch ends; here every row opens
    with the oldest buffered document, so when document i opens a row every earlier one is placed."""
    rng = np.random.default_rng(0)
    sizes = rng.integers(5, 60, size=3000)
    # document i is made of the value i + 1, so rows tell which documents they hold
    docs = Documents(
        ListExamples([np.full(n, i + 1) for i, n in enumerate(sizes)]), lambda xs: [Document(np.asarray(x)) for x in xs]
    )
    loader = PackedLoader(
        docs, batch_size=4, seq_len=127, mode="pad", shuffle=False, buffer_docs=200, document_positions=True
    )
    placed: set[int] = set()
    openers = []
    while len(placed) < 2500:
        batch = loader.next_batch()
        for tokens, positions, mask in zip(batch["tokens"], batch["position_ids"], batch["mask"]):
            opener = int(tokens[0]) - 1
            assert set(range(opener)) <= placed, f"document {opener} opened a row before earlier ones were placed"
            openers.append(opener)
            placed |= {int(t) - 1 for t, m in zip(tokens, mask) if m}
    assert openers == sorted(openers)


def test_pad_mode_never_drops_a_token_and_fills_rows():
    loader_docs = _docs(200, seed=3)
    loader = PackedLoader(loader_docs, batch_size=4, seq_len=63, mode="pad", shuffle=False, buffer_docs=200)
    loader.repeat = False
    placed = sum(int(b["mask"].sum()) for b in loader)
    total = sum(len(d.ids) for d in loader_docs.fetch(range(200)))
    assert placed == total and loader.counts["tokens_cropped"] == 0
    assert loader.stats()["data_fill"] > 0.97


def test_rank_shards_cover_documents_once():
    n = 90
    docs = Documents(
        ListExamples([[i] * (1 + i % 5) for i in range(n)]), lambda xs: [Document(np.asarray(x)) for x in xs]
    )
    seen = []
    for rank in range(3):
        loader = PackedLoader(
            docs, batch_size=2, seq_len=15, mode="pad", seed=2, rank=rank, world_size=3, buffer_docs=16
        )
        loader.repeat = False
        ranks_docs = set()
        for batch in loader:
            for row, mask in zip(batch["tokens"], batch["mask"]):
                ranks_docs |= set(row[mask == 1].tolist())
        seen.append(ranks_docs)
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])
    assert seen[0] | seen[1] | seen[2] == set(range(n))


def test_mixture_weights_epochs_and_determinism():
    a = ListExamples([f"a{i}" for i in range(10)])
    b = ListExamples([f"b{i}" for i in range(4)])
    mix = Mixture([(a, 0.5), (b, 3.0)], seed=1)
    items = mix.fetch(range(len(mix)))
    assert len(mix) == 5 + 12 and sum(x.startswith("b") for x in items) == 12
    assert len(set(x for x in items if x.startswith("a"))) == 5  # a random half, without repeats
    assert Mixture([(a, 0.5), (b, 3.0)], seed=1).fetch(range(len(mix))) == items
    with pytest.raises(DataError, match="weight"):
        Mixture([(a, 0.0)])


def test_packed_row_loss_equals_documents_alone(tiny_tokenizer):
    """SFT packing keeps documents apart: a packed row's loss is the sum of its conversations' losses run alone
    (fp32, <= 1e-5), for the native GPT and a transformers model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tierlm.models import GPTConfig, build_gpt, forward_logits
    from tierlm.primitives import cross_entropy_sum
    from tierlm.strategies import SFTStrategy

    V = tiny_tokenizer.vocab_size
    native = build_gpt(GPTConfig(depth=2, aspect_ratio=32, head_dim=16, vocab_size=V, max_seq_len=256))
    with torch.no_grad():
        for p in native.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        )
    ).eval()
    conversations = [p.conversation for p in ArithmeticTask().problems("train", 6, seed=4)]
    conversations[2] = conversations[2] + [
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes."},
    ]
    docs = Documents(ListExamples(conversations), chat_documents(tiny_tokenizer))
    loader = PackedLoader(
        docs,
        batch_size=1,
        seq_len=127,
        mode="pad",
        shuffle=False,
        document_positions=True,
        pad_id=tiny_tokenizer.pad_id,
    )
    strategy = SFTStrategy()
    raw = loader.next_batch()
    packed = strategy.prepare_batch(raw)
    starts = (raw["position_ids"][0] == 0).nonzero().flatten().tolist() + [raw["tokens"].shape[1]]
    documents = [
        (raw["tokens"][:, a:b], raw["mask"][:, a:b]) for a, b in zip(starts, starts[1:]) if raw["mask"][0, a:b].any()
    ]
    assert len(documents) >= 4, "several conversations share the row"
    for model in (native, hf):
        with torch.no_grad():
            total, n = strategy.compute_loss(forward_logits(model, packed), packed)
            alone, alone_n = 0.0, 0.0
            for ids, mask in documents:  # each conversation of the row, run by itself
                labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
                s, c = cross_entropy_sum(forward_logits(model, {"input_ids": ids[:, :-1]}), labels)
                alone, alone_n = alone + s.item(), alone_n + c.item()
        assert n.item() == alone_n
        assert abs(total.item() - alone) <= 1e-5 * max(1.0, abs(alone)), (type(model).__name__, total.item(), alone)


def test_sources_text_jsonl_parquet_dataset_folder(tmp_path):
    import datasets

    (tmp_path / "a.txt").write_text("first doc\nline two\n\nsecond doc\n")
    assert open_examples(str(tmp_path / "a.txt"), SourceOptions()).fetch([0, 1]) == [
        "first doc\nline two",
        "second doc",
    ]
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"prompt": "p", "completion": "c"},
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    chats = open_examples(str(tmp_path / "d.jsonl"), SourceOptions(kind="chat"))
    assert chats[1] == [{"role": "user", "content": "p"}, {"role": "assistant", "content": "c"}]

    table = datasets.Dataset.from_dict({"body": ["x y", "z"], "id": [1, 2]})
    table.to_parquet(str(tmp_path / "t.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    from tierlm.data import Fields

    options = SourceOptions(fields=Fields(text="body"))
    assert open_examples(str(tmp_path / "t.parquet"), options).fetch([1, 0]) == ["z", "x y"]
    assert open_examples(str(tmp_path / "saved"), options).fetch([0]) == ["x y"]
    with pytest.raises(DataError, match=r"no 'text' field; fields present: \['body', 'id'\]"):
        open_examples(str(tmp_path / "saved"), SourceOptions())


def test_token_files_raw_llmc_and_npy(tmp_path):
    tokens = np.array([0, 5, 6, 7, 0, 8, 9, 0, 4], dtype=np.uint16)
    tokens.tofile(tmp_path / "raw.bin")
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, len(tokens)]
    with open(tmp_path / "llmc.bin", "wb") as f:
        f.write(header.tobytes() + tokens.tobytes())
    np.save(tmp_path / "toks.npy", tokens.astype(np.uint32))
    options = SourceOptions(separator_id=0, vocab_size=10)
    for name in ("raw.bin", "llmc.bin", "toks.npy"):
        docs = open_examples(str(tmp_path / name), options)
        assert [d.tolist() for d in docs.fetch(range(len(docs)))] == [[0, 5, 6, 7], [0, 8, 9], [0, 4]], name
    with pytest.raises(DataError, match=r"token id 9 at position 6 >= vocab size 9"):
        open_examples(str(tmp_path / "raw.bin"), SourceOptions(separator_id=0, vocab_size=9))


def test_token_file_trains_with_flat_resident_memory(tmp_path):
    """A 256 MB token file streams through the loader with resident memory growing far less than its size."""

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    n_tokens = 128 * 1024 * 1024  # 256 MB of uint16
    path = tmp_path / "big.bin"
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for _ in range(16):
            chunk = rng.integers(1, 1000, size=n_tokens // 16, dtype=np.uint16)
            chunk[::997] = 0  # a document every ~1k tokens
            f.write(chunk.tobytes())
    before = rss_mb()
    examples = open_examples(str(path), SourceOptions(separator_id=0, vocab_size=1000))
    loader = PackedLoader(Documents(examples, text_documents(None)), batch_size=8, seq_len=2047, seed=0)
    consumed = 0
    while consumed < n_tokens // 4:  # a quarter of the file, in shuffled document order
        consumed += loader.next_batch()["tokens"].numel()
    growth = rss_mb() - before
    assert growth < 64, f"resident memory grew {growth:.0f} MB while streaming a 256 MB file"


def _write(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


@pytest.mark.parametrize(
    "name,content,kind,match",
    [
        ("d.jsonl", '{"text": "ok"}\n{"text": oops}\n', "text", r"d.jsonl:2: malformed JSON"),
        (
            "d.jsonl",
            '{"body": "x", "id": 1}\n',
            "text",
            r"d.jsonl:1: no 'text' field; fields present: \['body', 'id'\]",
        ),
        ("d.jsonl", '{"question": "x"}\n', "chat", r"fields present: \['question'\]"),
        ("d.jsonl", "[1, 2]\n", "text", r"d.jsonl:1: expected a JSON object, got list"),
        ("d.jsonl", "\n\n", "text", "holds no examples"),
        ("d.txt", b"\xff\xfe bad bytes", "text", "not UTF-8"),
        ("d.txt", "plain text", "chat", "chat examples come from JSONL"),
    ],
)
def test_bad_input_names_the_problem(tmp_path, name, content, kind, match):
    path = _write(tmp_path, name, content)
    with pytest.raises(DataError, match=match):
        open_examples(path, SourceOptions(kind=kind)).fetch([0])


def test_malformed_lines_can_be_skipped_and_counted(tmp_path):
    from tierlm.data.sources import ReadStats

    path = _write(tmp_path, "d.jsonl", '{"text": "a"}\nnot json\n{"text": "b"}\n{"text": \n')
    stats = ReadStats()
    examples = open_examples(path, SourceOptions(on_bad_line="skip"), stats)
    assert examples.fetch(range(len(examples))) == ["a", "b"] and stats.bad_lines_skipped == 2


def test_missing_dataset_and_unknown_task():
    with pytest.raises(DataError, match="neither an existing file"):
        open_examples("no/such/file.txt", SourceOptions())
    with pytest.raises(DataError, match="unknown synthetic task"):
        open_examples("synthetic:chess", SourceOptions())


def test_eval_batches_are_one_fixed_pass():
    loader = PackedLoader(_docs(30), batch_size=4, seq_len=31, mode="pad", seed=0)
    first = eval_batches(loader, 100)
    assert _same(first[0], eval_batches(loader, 100)[0]) and len(first) == len(eval_batches(loader, 100))
    total_docs = sum(int((b["tokens"] == 1).sum()) for b in first)
    assert total_docs == 30  # each document once (every document starts with token 1)


def test_split_long_documents_trains_on_every_token_once_per_epoch():
    """tinyshakespeare in paragraphs at context 64: cropping drops most of the text; splitting drops
    nothing (counted token by token over one pass)."""
    from collections import Counter

    from tierlm.data import Documents, PackedLoader, SourceOptions, open_examples, text_documents, train_char_tokenizer

    examples = open_examples("builtin:tinyshakespeare", SourceOptions())
    tokenizer = train_char_tokenizer(examples.fetch(range(len(examples))))
    documents = Documents(examples, text_documents(tokenizer))
    expected = Counter()
    for doc in documents.fetch(range(len(documents))):
        expected.update(doc.ids.tolist())

    def one_pass(split: bool) -> tuple[Counter, dict]:
        loader = PackedLoader(documents, 12, 64, seed=0, split_long=split)
        loader.repeat = False
        seen = Counter()
        for batch in loader:
            seen.update(batch["tokens"].flatten().tolist())
        return seen, loader.stats()

    seen, stats = one_pass(split=True)
    assert stats["data_cropped_frac"] == 0
    missing = expected - seen
    assert not seen - expected  # nothing twice
    assert sum(missing.values()) < 12 * 65  # only the last, partial batch of the pass (rows are never padded)
    cropped_seen, cropped_stats = one_pass(split=False)
    assert cropped_stats["data_cropped_frac"] > 0.5 and sum(cropped_seen.values()) < 0.5 * sum(expected.values())


def test_split_documents_resume_exactly_mid_document():
    from tierlm.data import Document, Documents, PackedLoader
    from tierlm.data.sources import ListExamples

    rng = np.random.default_rng(0)
    docs = [Document(rng.integers(0, 100, size=n)) for n in rng.integers(5, 200, size=60)]
    documents = Documents(ListExamples(docs), lambda items: list(items))
    reference = PackedLoader(documents, 4, 32, seed=3, split_long=True, buffer_docs=8)
    batches = [reference.next_batch() for _ in range(30)]
    resumed = PackedLoader(documents, 4, 32, seed=3, split_long=True, buffer_docs=8)
    for _ in range(11):
        resumed.next_batch()
    state = resumed.state_dict()
    assert any(state["offsets"]), "the test needs a checkpoint taken while a document is half placed"
    again = PackedLoader(documents, 4, 32, seed=3, split_long=True, buffer_docs=8)
    again.load_state_dict(state)
    for expected in batches[11:]:
        assert torch.equal(again.next_batch()["tokens"], expected["tokens"])


def test_stream_mode_reads_a_text_file_as_consecutive_windows():
    """data.stream: the whole text (blank lines and all) as one token stream, every window of a row
    once per epoch, the held-out tail after it."""
    from collections import Counter

    from tierlm.builders.loaders import build_loaders
    from tierlm.config import TierlmConfig
    from tierlm.data import train_char_tokenizer
    from tierlm.data.sources import builtin_corpus

    text = builtin_corpus("builtin:tinyshakespeare").read_text()
    tokenizer = train_char_tokenizer([text])
    config = TierlmConfig.load("gpt2-shakespeare-char", ["data.stream=true"])
    train, val = build_loaders(config, STAGES["pretrain"], tokenizer)
    ids = tokenizer.encode(text)
    cut = int(len(ids) * 0.9)
    expected = Counter(tuple(ids[i * 64 : i * 64 + 65]) for i in range((cut - 1) // 64))
    train.repeat = False
    seen = Counter(tuple(row) for batch in train for row in batch["tokens"].tolist())
    assert seen == expected and train.stats()["data_cropped_frac"] == 0
    assert val.next_batch()["tokens"][0].tolist() == ids[cut : cut + 65]


def test_stream_mode_reads_a_folder_of_llmc_shards_holding_out_its_val_shard(tmp_path, tiny_tokenizer):
    """llm.c's FineWeb layout (`*_train_*.bin` shards and one `*_val_*.bin`): the train shards are one stream (a
    window runs across a shard boundary), the val shard is held out whole and scored once; a shard made with
    another tokenizer is one line."""
    from tierlm.builders.loaders import build_loaders
    from tierlm.config import TierlmConfig
    from tierlm.data.windows import eval_batches, eval_protocol

    def shard(name: str, tokens: np.ndarray) -> None:
        header = np.zeros(256, dtype=np.int32)
        header[:3] = [20240520, 1, len(tokens)]
        (tmp_path / "fineweb" / name).write_bytes(header.tobytes() + tokens.astype(np.uint16).tobytes())

    (tmp_path / "fineweb").mkdir()
    rng = np.random.default_rng(0)
    first, second, held = (rng.integers(0, tiny_tokenizer.vocab_size, n) for n in (50, 31, 28))
    shard("edufineweb_val_000000.bin", held)
    shard("edufineweb_train_000001.bin", first)
    shard("edufineweb_train_000002.bin", second)
    folder = f"data.dataset_name={tmp_path / 'fineweb'}"
    config = TierlmConfig.load("tiny_pretrain", [folder, "data.stream=true", "data.max_seq_length=8"])
    train, val = build_loaders(config, STAGES["pretrain"], tiny_tokenizer)
    stream = np.concatenate([first, second])
    train.repeat = False
    rows = sorted(tuple(row) for batch in train for row in batch["tokens"].tolist())
    assert rows == sorted(tuple(stream[i * 8 : i * 8 + 9].tolist()) for i in range((len(stream) - 1) // 8))
    assert tuple(stream[48:57].tolist()) in rows  # across the shard boundary
    scored = eval_batches(val, None)
    assert torch.equal(torch.cat([b["tokens"] for b in scored])[:, :-1].flatten(), torch.from_numpy(held[:24]))
    assert eval_protocol(val, scored).startswith("every held-out token once: the 24 targets")
    vocab = tiny_tokenizer.vocab_size
    shard("edufineweb_train_000003.bin", np.array([1, 2, vocab]))
    with pytest.raises(DataError, match=rf"edufineweb_train_000003.bin: token id {vocab} >= vocab size {vocab}"):
        build_loaders(config, STAGES["pretrain"], tiny_tokenizer)

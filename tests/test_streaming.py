"""data.streaming: a dataset read as a stream (datasets' IterableDataset over local parquet shards, as
the Hub would serve them; never the network) — exact resume from the loader state, every row once per
epoch, disjoint ranks, and a real pretraining process killed and resumed bit-exactly."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY, kill_at_checkpoint, run_main
from tierlm.builders.loaders import build_loaders
from tierlm.config import TierlmConfig
from tierlm.data import RankSlice
from tierlm.stages import STAGES


def parquet_shards(root, shards: int = 3, rows: int = 20, words: int = 12):
    """A folder of parquet shards named as the Hub names them (train-0000x-of-0000n.parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        texts = [
            " ".join(f"w{(s * 31 + i * 7 + k) % 50}" for k in range(words + (i % 9))) + f" shard {s} row {i}."
            for i in range(rows)
        ]
        pq.write_table(
            pa.table({"text": texts, "id": list(range(rows))}),
            root / f"train-{s:05d}-of-{shards:05d}.parquet",
            row_group_size=16,
        )
    return root


def _config(folder, *overrides):
    return TierlmConfig.load(
        "tiny_pretrain",
        [
            *TINY,
            f"data.dataset_name={folder}",
            "data.streaming=true",
            "data.shuffle_buffer_size=50",
            "data.packing_buffer=20",
            "data.eval_stream_examples=10",
            *overrides,
        ],
    )


def _batches(loader, n):
    return [loader.next_batch()["tokens"].clone() for _ in range(n)]


@pytest.mark.parametrize("split_long", ["split", "crop"])
def test_resume_from_the_loader_state_is_exact(tmp_path, tiny_tokenizer, split_long):
    """Batches after load_state_dict (through JSON, as a checkpoint stores it) equal the uninterrupted ones,
    across block boundaries and the end of the stream (3 x 20 rows, 50-row blocks: several epochs)."""
    config = _config(
        parquet_shards(tmp_path / "shards"), f"data.long_documents={split_long}", "data.shuffle_buffer_size=16"
    )
    straight, _ = build_loaders(config, STAGES["pretrain"], tiny_tokenizer)
    expected = _batches(straight, 60)
    assert straight.epoch >= 2, "the test must cross the end of the stream"
    assert straight.stats()["epoch"] == straight.epoch  # a stream's passes: whole ones (its length is unknown)
    for cut in (1, 17, 41):
        first, _ = build_loaders(config, STAGES["pretrain"], tiny_tokenizer)
        _batches(first, cut)
        state = json.loads(json.dumps(first.state_dict()))
        first.close()
        resumed, _ = build_loaders(config, STAGES["pretrain"], tiny_tokenizer)
        resumed.load_state_dict(state)
        assert all(torch.equal(a, b) for a, b in zip(_batches(resumed, 60 - cut), expected[cut:])), (
            f"diverged after a resume at {cut}"
        )
        assert len(json.dumps(state)) < 20000, "the state holds positions, not documents"


def test_one_epoch_reads_every_row_once_and_evaluation_is_held_out(tmp_path, tiny_tokenizer):
    config = _config(parquet_shards(tmp_path / "shards"), "data.long_documents=split")
    train, val = build_loaders(config, STAGES["pretrain"], tiny_tokenizer)
    rows = []  # what each loader read: stream row texts, through the same conversion
    seen = []
    train.to_documents = lambda rs, first, f=train.to_documents: (seen.extend(r["text"] for r in rs), f(rs, first))[1]
    train.repeat = False
    while True:
        try:
            train.next_batch()
        except StopIteration:
            break
    val.to_documents = lambda rs, first, f=val.to_documents: (rows.extend(r["text"] for r in rs), f(rs, first))[1]
    val.rewind()
    val.repeat = False
    list(val)
    assert len(seen) == len(set(seen)) == 3 * 20 - 10 and len(rows) == 10 and not set(rows) & set(seen)
    assert train.counts["tokens_in"] == sum(len(tiny_tokenizer.encode(t)) + 1 for t in seen)


def test_ranks_train_disjoint_rows_of_the_single_process_batch(tmp_path, tiny_tokenizer):
    config = _config(parquet_shards(tmp_path / "shards"))
    single, _ = build_loaders(config, STAGES["pretrain"], tiny_tokenizer, world_size=2)
    ranks = [
        RankSlice(build_loaders(config, STAGES["pretrain"], tiny_tokenizer, world_size=2)[0], r, 2) for r in range(2)
    ]
    for _ in range(5):
        whole = single.next_batch()["tokens"]
        parts = [r.next_batch()["tokens"] for r in ranks]
        assert torch.equal(torch.cat(parts), whole) and parts[0].shape[0] == whole.shape[0] // 2


def test_an_eval_split_and_a_hub_layout(tmp_path, tiny_tokenizer):
    from test_hub_data import parquet_folder

    folder = parquet_folder(
        tmp_path / "fineweb",
        {
            "train": [{"text": f"train doc {i} " * 5} for i in range(40)],
            "validation": [{"text": f"held doc {i} " * 5} for i in range(6)],
        },
    )
    train, val = build_loaders(_config(folder), STAGES["pretrain"], tiny_tokenizer)
    assert "held doc" in tiny_tokenizer.decode(val.next_batch()["tokens"][0].tolist())
    assert "held doc" not in tiny_tokenizer.decode(train.next_batch()["tokens"].view(-1).tolist())


@pytest.mark.slow
def test_streamed_pretraining_killed_and_resumed_is_bit_identical(tmp_path):
    folder = parquet_shards(tmp_path / "shards", shards=2, rows=300)
    args = [
        "pretrain",
        "--config",
        "configs/tiny_pretrain.yaml",
        *TINY,
        f"data.dataset_name={folder}",
        "data.streaming=true",
        "data.shuffle_buffer_size=64",
        "data.packing_buffer=32",
        "data.eval_stream_examples=16",
        "training.num_train_steps=24",
        "training.save_steps=8",
        "training.logging_steps=1",
        "training.eval_steps=12",
    ]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    result = run_main(*args, f"infra.output_dir={straight}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    kill_at_checkpoint(args, killed, 8)
    result = run_main(*args, f"infra.output_dir={killed}", "--resume")
    assert result.returncode == 0, result.stderr[-3000:]

    def losses(run):
        return [
            (r["step"], r["loss"])
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["type"] == "train"
        ]

    assert losses(killed) == losses(straight) and len(losses(straight)) == 24

    def epochs(run):
        return [r["epoch"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "epoch" in r]

    assert epochs(killed) == epochs(straight) and len(epochs(straight)) == 24  # logged, and resumed with the data
    from safetensors.torch import load_file

    a, b = load_file(straight / "model" / "model.safetensors"), load_file(killed / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sft_streams_an_ultrachat_like_folder(tmp_path):
    from test_hub_data import hub_folder

    folder = hub_folder(tmp_path / "ultrachat", {"train_sft": 60, "test_sft": 8})
    result = run_main(
        "sft",
        "--config",
        "tiny_pretrain",
        *TINY,
        f"data.dataset_name={folder}",
        "data.streaming=true",
        "data.split=train_sft",
        "data.eval_split=test_sft",
        "data.shuffle_buffer_size=16",
        "training.num_train_steps=3",
        "training.eval_steps=3",
        "data.max_seq_length=64",
        f"infra.output_dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"eval"' in line
    ]
    assert evals and evals[-1]["val_loss"] > 0

"""The Qwen3 encoder–decoder (issue 18): initialised from a decoder-only Qwen3 it is that model before
training, its cross-attention is wired, and a packed row computes what its examples compute alone."""

from __future__ import annotations

import pytest
import torch

from tierlm.models.qwen3_encdec.model import Qwen3EncDecConfig, build_qwen3_encdec, initialize_from_qwen3


@pytest.fixture(scope="module")
def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=120,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(config).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_initialised_from_qwen3_the_decoder_is_the_source_model(qwen3, tied):
    if tied:
        from transformers import Qwen3ForCausalLM

        qwen3 = Qwen3ForCausalLM(
            qwen3.config.__class__(**{**qwen3.config.to_dict(), "tie_word_embeddings": True})
        ).eval()
    model = initialize_from_qwen3(qwen3, num_sentinel_tokens=10).eval()
    assert model.config.vocab_size == 120 + 10 + 3 and model.config.tie_word_embeddings == tied
    ids = torch.randint(0, 120, (2, 17))
    encoder_input = torch.randint(0, 133, (2, 9))
    with torch.no_grad():
        want = qwen3(ids).logits
        got = model(encoder_input, ids)
    torch.testing.assert_close(got[..., :120], want, rtol=0, atol=1e-5)  # whatever the encoder reads
    # The cross-attention is wired: once its output projection is not zero, the encoder matters.
    with torch.no_grad():
        for block in model.decoder_blocks:
            block.cross.o_proj.weight.normal_(std=0.05)
        a, b = model(encoder_input, ids), model(torch.randint(0, 133, (2, 9)), ids)
    assert not torch.allclose(a, b, atol=1e-4)


def test_a_packed_row_computes_its_examples_alone():
    torch.manual_seed(1)
    model = build_qwen3_encdec(
        Qwen3EncDecConfig(
            vocab_size=60,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        )
    ).eval()
    with torch.no_grad():
        for module in model.modules():  # the fresh model's residual projections are zero: make everything matter
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(std=0.2)
    examples = [
        (torch.randint(0, 60, (5,)), torch.randint(0, 60, (4,))),
        (torch.randint(0, 60, (7,)), torch.randint(0, 60, (3,))),
    ]
    from tierlm.data.ul2 import UL2DataCollator

    batch = UL2DataCollator(max_encoder_length=14, max_decoder_length=9, pad_token_id=0, eos_token_id=1)(
        [(e.tolist(), d.tolist()) for e, d in examples]
    )
    assert batch["input_ids"].shape[0] == 1  # both in one row
    with torch.no_grad():
        packed = model(
            batch["input_ids"],
            batch["decoder_input_ids"],
            batch["encoder_segment_ids"],
            batch["decoder_segment_ids"],
            batch["encoder_positions"],
            batch["decoder_positions"],
        )
        for segment, (enc, dec) in enumerate(examples, start=1):
            alone = model(enc[None], torch.cat([torch.tensor([0]), dec])[None])[0]
            torch.testing.assert_close(packed[0][batch["decoder_segment_ids"][0] == segment], alone, rtol=0, atol=1e-5)


def _tiny_model():
    torch.manual_seed(2)
    model = build_qwen3_encdec(
        Qwen3EncDecConfig(
            vocab_size=60,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
        )
    ).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(std=0.2)
    return model


def test_incremental_decoding_equals_the_full_forward():
    """The engine's path (encode once, cross-attention keys once, one target token at a time) gives the
    teacher-forced logits; repeating the cache for several samples copies it row for row."""
    from tierlm.models import family_of

    model, family = _tiny_model(), None
    family = family_of(model)
    prompt, targets = torch.randint(0, 60, (2, 9)), torch.randint(0, 60, (2, 6))
    with torch.no_grad():
        full = model(prompt, torch.cat([torch.zeros(2, 1, dtype=torch.long), targets], dim=1))
        logits, cache = family.prefill(model, prompt, 16)
        steps = [logits] + [family.decode(model, targets[:, i], cache) for i in range(targets.shape[1])]
    torch.testing.assert_close(torch.stack(steps, dim=1), full, rtol=0, atol=1e-5)
    with torch.no_grad():
        logits, cache = family.prefill(model, prompt[:1], 16)
        family.repeat_cache(cache, 3)
        again = family.decode(model, targets[0, :1].repeat(3), cache)
    torch.testing.assert_close(again, full[0, 1].expand(3, -1), rtol=0, atol=1e-5)


def test_saved_and_loaded_as_a_tierlm_folder(tmp_path):
    from tierlm.builders.model import new_model
    from tierlm.config import TierlmConfig
    from tierlm.models import family_for_folder, load_pretrained_model, save_model_folder

    config = TierlmConfig.load("ul2-tiny", ["model.depth=1"])
    model = new_model(config, 300, "cpu")
    assert (
        type(model).__name__ == "Qwen3ForSeq2SeqLM"
        and model.config.hidden_size == 64
        and model.config.num_key_value_heads == 2
    )
    save_model_folder(model, tmp_path / "m")
    assert family_for_folder(tmp_path / "m").name == "qwen3_encdec" and not (tmp_path / "m" / "config.json").exists()
    loaded = load_pretrained_model(tmp_path / "m")
    ids, dec = torch.randint(0, 300, (1, 7)), torch.randint(0, 300, (1, 4))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, dec), model(ids, dec), rtol=0, atol=0)


@pytest.mark.slow
def test_ul2_pretraining_saves_and_resumes_exactly(tmp_path):
    import json

    from safetensors.torch import load_file

    from conftest import resume_from_checkpoint, run_main

    args = [
        "pretrain",
        "--config",
        "ul2-tiny",
        "model.depth=1",
        "tokenizer.vocab_size=300",
        "tokenizer.num_train_docs=300",
        "training.num_train_steps=6",
        "training.save_steps=3",
        "training.eval_steps=6",
        "training.eval_batches=2",
        "training.logging_steps=1",
        "training.warmup_steps=1",
        "training.per_device_train_batch_size=4",
        "data.max_encoder_length=64",
        "data.max_decoder_length=32",
        "infra.progress_bar=false",
    ]
    import shutil

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = run_main(*args, f"infra.output_dir={straight}")
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.copytree(straight, resumed)  # the same run, rolled back to its step 3 and resumed in this process
    resume_from_checkpoint(args, resumed, 3, in_process=True)

    def lines(run, kind):
        return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]

    assert [(r["step"], r["loss"]) for r in lines(resumed, "train")][-3:] == [
        (r["step"], r["loss"]) for r in lines(straight, "train")
    ][-3:]
    assert lines(straight, "eval")[-1]["val_loss"] == lines(resumed, "eval")[-1]["val_loss"]
    # tokens_seen counts the decoder's rows (4 x 32 a step: the plan's and the FLOPs' tokens), not the encoder's 64
    assert [r["tokens_seen"] for r in lines(straight, "train")] == [4 * 32 * s for s in range(1, 7)]
    epochs = [r["epoch"] for r in lines(straight, "train")]
    assert 0 < epochs[0] <= epochs[-1] and epochs == [r["epoch"] for r in lines(resumed, "train")]
    a, b = load_file(straight / "model" / "model.safetensors"), load_file(resumed / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from tierlm.data import load_tokenizer

    tokenizer = load_tokenizer(straight / "model")
    assert "<extra_id_31>" in tokenizer.hf.get_vocab()
    saved = json.loads((straight / "model" / "tierlm_model.json").read_text())
    assert saved["decoder_start_token_id"] == tokenizer.pad_id  # generation starts where training's decoder rows start
    sample = run_main(
        "sample",
        "--checkpoint",
        straight,
        "--prompt",
        "[R]ROMEO: what light <extra_id_0> window breaks",
        "--max-new-tokens",
        "6",
    )
    assert sample.returncode == 0 and not sample.stderr.strip(), sample.stderr[
        -2000:
    ]  # 6 steps in, it may well answer end-of-text at once


@pytest.mark.slow
def test_two_rank_fsdp_trains_as_one_process(tmp_path):
    """FSDP2 shards the encoder's and the decoder's blocks (the family's two block lists); 2 ranks x 4 rows
    of the global UL2 batch compute what 1 process x 8 rows does."""
    import json

    from conftest import run_main
    from forked import ranks

    common = [
        "pretrain",
        "--config",
        "ul2-tiny",
        "model.depth=1",
        "tokenizer.vocab_size=300",
        "tokenizer.num_train_docs=300",
        "training.num_train_steps=4",
        "training.warmup_steps=0",
        "training.eval_steps=4",
        "training.eval_batches=2",
        "training.save_steps=0",
        "training.logging_steps=1",
        "data.max_encoder_length=64",
        "data.max_decoder_length=32",
        "infra.progress_bar=false",
    ]
    one = run_main(*common, "training.per_device_train_batch_size=8", f"infra.output_dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    two = ranks(
        "-m",
        "tierlm",
        *common,
        "training.per_device_train_batch_size=4",
        "infra.distributed_type=fsdp",
        f"infra.output_dir={tmp_path / 'two'}",
    )
    assert two.returncode == 0, two.stderr[-3000:]

    def records(run):
        return [
            r
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["type"] in ("train", "eval")
        ]

    a, b = records(tmp_path / "one"), records(tmp_path / "two")
    assert [(r["type"], r["step"]) for r in a] == [(r["type"], r["step"]) for r in b] and len(a) == 6  # eval at 0 and 4
    for x, y in zip(a, b):
        key = "loss" if x["type"] == "train" else "val_loss"
        assert abs(x[key] - y[key]) <= 1e-5, (x, y)


@pytest.mark.slow
def test_ul2_starts_from_a_decoder_only_qwen3_folder_and_reads_a_stream(tmp_path, tiny_tokenizer):
    """Seed 002's path in the CLI: model.model_name_or_path names a transformers Qwen3 folder (with its
    tokenizer), the run extends the tokenizer with sentinels and mode tokens and starts both stacks from
    the Qwen3 (`initialize_from_qwen3`: before training the decoder is the source model), and UL2 reads
    its text as a stream (parquet shards, data.streaming)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from conftest import run_main
    from test_streaming import parquet_shards
    from tierlm.builders.model import build_model
    from tierlm.builders.tokenizer import run_tokenizer
    from tierlm.config import TierlmConfig
    from tierlm.models import family_for_folder

    torch.manual_seed(0)
    vocab = len(tiny_tokenizer.hf)
    source = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            tie_word_embeddings=True,
        )
    ).eval()
    source.save_pretrained(tmp_path / "qwen3")
    tiny_tokenizer.save(tmp_path / "qwen3")
    data = parquet_shards(tmp_path / "data", words=40)
    overrides = [
        f"model.model_name_or_path={tmp_path / 'qwen3'}",
        f"data.dataset_name={data}",
        "data.streaming=true",
        "data.shuffle_buffer_size=8",
        "data.eval_stream_examples=8",
        "data.max_encoder_length=64",
        "data.max_decoder_length=32",
        "training.num_train_steps=3",
        "training.eval_steps=3",
        "training.eval_batches=2",
        "training.warmup_steps=1",
        "training.per_device_train_batch_size=2",
        "training.save_steps=3",
        "infra.progress_bar=false",
        f"infra.output_dir={tmp_path / 'run'}",
    ]

    config = TierlmConfig.load("ul2-tiny", overrides)
    tokenizer = run_tokenizer(config, "text", tmp_path / "qwen3", None, None)
    model = build_model(config, tokenizer, torch.device("cpu"), tmp_path / "qwen3").eval()
    assert type(model).__name__ == "Qwen3ForSeq2SeqLM" and tokenizer.vocab_size == vocab + 32 + 3
    assert model.config.decoder_start_token_id == tokenizer.pad_id
    ids = torch.randint(0, vocab, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(
            model(torch.randint(0, tokenizer.vocab_size, (2, 5)), ids)[..., :vocab],
            source(ids).logits,
            rtol=0,
            atol=1e-5,
        )

    result = run_main("pretrain", "--config", "ul2-tiny", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    assert family_for_folder(tmp_path / "run" / "model").name == "qwen3_encdec"

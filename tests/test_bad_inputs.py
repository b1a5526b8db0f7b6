"""Every bad input is one line, exit 2, nothing written — over every command.

Each case runs `tierlm.commands.cli.main(argv)` in this process (a traceback would fail the test as an
error) inside an empty working folder, after an optional setup that writes the bad input. It
asserts exit code 2, exactly one stderr line `tierlm: error: ...` matching what the case names,
and that neither the working folder nor the shared trained runs changed by a single byte.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from conftest import CHAT, RL, TINY
from tierlm.commands.cli import main


@pytest.fixture(scope="session")
def runs(tiny_runs):
    return tiny_runs


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root`: a file's SHA-256, a link's target, a folder's mark (links never followed)."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                out[key] = "link:" + os.readlink(path)
            elif path.is_dir():
                out[key] = "dir"
            else:
                out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


# -- setups: each writes a bad input into the working folder w (r: the shared runs) ---------
def write(name: str, data: str | bytes) -> Callable[[Path, Path], None]:
    def setup(w: Path, r: Path) -> None:
        (w / name).parent.mkdir(parents=True, exist_ok=True)
        (w / name).write_bytes(data.encode() if isinstance(data, str) else data)

    return setup


def hub_layout(name: str) -> Callable[[Path, Path], None]:
    """A dataset folder laid out as the Hub serves HuggingFaceH4/ultrachat_200k (train_sft / test_sft)."""

    def setup(w: Path, r: Path) -> None:
        from test_hub_data import hub_folder

        hub_folder(w / name, {"train_sft": 20, "test_sft": 4})

    return setup


def copy_run(name: str, then: Callable[[Path], None] | None = None) -> Callable[[Path, Path], None]:
    def setup(w: Path, r: Path) -> None:
        shutil.copytree(r / name, w / name, symlinks=True)
        if then is not None:
            then(w / name)

    return setup


def both(*setups):
    def setup(w: Path, r: Path) -> None:
        for s in setups:
            s(w, r)

    return setup


def latest_checkpoint(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


NESTED = "[" * 100_000 + "]" * 100_000
NON_UTF8 = b"\xff\xfe\x00bad \x80\x81 bytes\n"
LONG_CHAT = json.dumps(
    {"messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok " * 400}]}
)
GOOD_CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})


def npy(array) -> Callable[[Path, Path], None]:
    def setup(w: Path, r: Path) -> None:
        np.save(w / "tokens.npy", array, allow_pickle=True)

    return setup


def flip_byte(relative: str):
    def then(run: Path) -> None:
        path = run / relative
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    return then


@dataclass
class Case:
    id: str
    argv: list[str]
    expect: str
    setup: Callable[[Path, Path], None] | None = None


ABL = [a for a in TINY if not a.startswith("infra.output_dir")]  # an ablation's folder is --out
SPEED = [a for a in ABL if not a.startswith("model.depth")]  # a speedrun's depth is --depth
PRE, SFT_CFG, DPO_CFG, RL_CFG = (
    "configs/tiny_pretrain.yaml",
    "configs/tiny_sft.yaml",
    "configs/tiny_dpo.yaml",
    "configs/tiny_rl.yaml",
)
REPO = Path(__file__).resolve().parents[1]


def t5_folder(name: str) -> Callable[[Path, Path], None]:
    """A tiny transformers T5 folder (an encoder-decoder transformers has no causal LM for) at `name`."""

    def setup(work: Path, runs: Path) -> None:
        from transformers import T5Config, T5ForConditionalGeneration

        from tierlm.data import load_tokenizer

        config = T5Config(vocab_size=600, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
        T5ForConditionalGeneration(config).save_pretrained(work / name)
        load_tokenizer(runs / "pre" / "model").save(work / name)

    return setup


def gpt2_folder(name: str) -> Callable[[Path, Path], None]:
    """A tiny transformers GPT-2 folder (with a tokenizer) at `name`."""

    def setup(work: Path, runs: Path) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel

        from tierlm.data import load_tokenizer

        GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=600, n_positions=64)).save_pretrained(
            work / name
        )
        load_tokenizer(runs / "pre" / "model").save(work / name)

    return setup


def cfg(name: str) -> str:
    return str(REPO / name)


NEFTUNE = ["training.neftune_noise_alpha=5"]
CASES = [
    # -- config files and overrides (through `config show` and the stages) ---------------
    Case("config-missing-file", ["config", "show", "--config", "nope.yaml"], "does not exist"),
    Case("config-unknown-preset", ["config", "show", "--config", "gpt2-nonesuch"], "neither a file nor a preset"),
    Case(
        "unknown-builtin-corpus",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "data.dataset_name=builtin:nope"],
        "unknown corpus",
    ),
    Case(
        "config-yaml-syntax",
        ["config", "show", "--config", "c.yaml"],
        "not valid YAML",
        write("c.yaml", "model: [1, 2\n"),
    ),
    Case(
        "config-not-utf8", ["config", "show", "--config", "c.yaml"], "UTF-8|not valid YAML", write("c.yaml", NON_UTF8)
    ),
    Case(
        "config-binary",
        ["config", "show", "--config", "c.yaml"],
        "not valid YAML|UTF-8|mapping",
        write("c.yaml", bytes(range(256))),
    ),
    Case("config-scalar", ["config", "show", "--config", "c.yaml"], "must hold a mapping", write("c.yaml", "42\n")),
    Case("config-list", ["config", "show", "--config", "c.yaml"], "must hold a mapping", write("c.yaml", "- a\n- b\n")),
    Case(
        "config-is-a-folder",
        ["config", "show", "--config", "d"],
        "not a file|does not exist",
        lambda w, r: (w / "d").mkdir(),
    ),
    Case(
        "config-unknown-section",
        ["config", "show", "--config", "c.yaml"],
        "unknown key foo",
        write("c.yaml", "foo: {}\n"),
    ),
    Case("config-section-not-mapping", ["config", "show", "training=5"], "training"),
    Case("override-without-equals", ["config", "show", "training.seed"], "must look like section.key=value"),
    Case("override-yaml-syntax", ["config", "show", "training.learning_rate=[1,"], "training.learning_rate"),
    Case("override-unknown-key", ["config", "show", "training.learnin_rate=1"], "did you mean training.learning_rate"),
    Case("override-wrong-type", ["config", "show", "training.seed=abc"], "training.seed"),
    Case(
        "compile-unknown-scope",
        ["config", "show", "infra.compile=blocks"],
        "infra.compile is true .each block., false or model",
    ),
    Case(
        "std-unknown-scope",
        ["config", "show", "rl.normalize_std=global"],
        r"rl.normalize_std is true or group .each group's std., batch .the step's. or false, got 'global'",
    ),
    Case(
        "compile-model-with-fsdp",
        ["config", "show", "infra.compile=model", "infra.distributed_type=fsdp"],
        r"infra.compile=model compiles the whole forward in one process or under DDP, not with "
        r"infra.distributed_type=fsdp",
    ),
    Case(
        "override-bad-interpolation", ["config", "show", "training.seed=${nope}"], "cannot apply overrides|interpolat"
    ),
    Case("seed-negative", ["pretrain", "--config", cfg(PRE), *TINY, "training.seed=-1"], "training.seed must be >= 0"),
    Case(
        "seed-huge",
        ["pretrain", "--config", cfg(PRE), *TINY, "training.seed=100000000000000000000000"],
        "training.seed must be <",
    ),
    Case(
        "learning-rate-negative",
        ["pretrain", "--config", cfg(PRE), *TINY, "training.learning_rate=-1"],
        "learning_rate must be > 0",
    ),
    Case("warmup-too-long", ["pretrain", "--config", cfg(PRE), *TINY, "training.warmup_steps=5"], "warmup_steps"),
    # -- pretrain ------------------------------------------------------------------------------
    Case("pretrain-missing-data", ["pretrain", "--config", cfg(PRE), *TINY, "data.dataset_name=nope.txt"], "nope.txt"),
    Case(
        "pretrain-unknown-synthetic",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.dataset_name=synthetic:nope"],
        "unknown synthetic task",
    ),
    Case(
        "pretrain-text-not-utf8",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.dataset_name=d.txt"],
        "not UTF-8",
        write("d.txt", NON_UTF8),
    ),
    Case(
        "pretrain-empty-text",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.dataset_name=d.txt"],
        "no examples",
        write("d.txt", "\n\n"),
    ),
    Case(
        "pretrain-jsonl-not-utf8",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.dataset_name=d.jsonl"],
        "d.jsonl:1",
        write("d.jsonl", NON_UTF8),
    ),
    Case(
        "pretrain-jsonl-nested",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.dataset_name=d.jsonl"],
        "d.jsonl:1.*nested",
        write("d.jsonl", NESTED + "\n"),
    ),
    Case(
        "pretrain-jsonl-array",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.dataset_name=d.jsonl"],
        "expected a JSON object",
        write("d.jsonl", "[1, 2]\n"),
    ),
    Case(
        "pretrain-jsonl-no-text",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.dataset_name=d.jsonl"],
        "no 'text' field",
        write("d.jsonl", '{"body": "x"}\n'),
    ),
    Case(
        "pretrain-npy-pickled",
        [
            "pretrain",
            "--config",
            cfg(PRE),
            *TINY,
            "data.dataset_name=tokens.npy",
            "model.tokenizer_name_or_path={pre}/model",
        ],
        "tokens.npy",
        npy(np.array([{"a": 1}], dtype=object)),
    ),
    Case(
        "pretrain-npy-garbage",
        [
            "pretrain",
            "--config",
            cfg(PRE),
            *TINY,
            "data.dataset_name=tokens.npy",
            "model.tokenizer_name_or_path={pre}/model",
        ],
        "tokens.npy",
        write("tokens.npy", b"\x93NUMPY garbage here"),
    ),
    Case(
        "pretrain-npy-negative-ids",
        [
            "pretrain",
            "--config",
            cfg(PRE),
            *TINY,
            "data.dataset_name=tokens.npy",
            "model.tokenizer_name_or_path={pre}/model",
        ],
        "negative token id",
        npy(np.array([0, 5, -3, 7], dtype=np.int32)),
    ),
    Case(
        "pretrain-npy-2d",
        [
            "pretrain",
            "--config",
            cfg(PRE),
            *TINY,
            "data.dataset_name=tokens.npy",
            "model.tokenizer_name_or_path={pre}/model",
        ],
        "1-D integer",
        npy(np.zeros((3, 3), dtype=np.int32)),
    ),
    Case(
        "pretrain-bin-odd-size",
        [
            "pretrain",
            "--config",
            cfg(PRE),
            *TINY,
            "data.dataset_name=t.bin",
            "model.tokenizer_name_or_path={pre}/model",
        ],
        "whole number",
        write("t.bin", b"\x01\x00\x02"),
    ),
    Case(
        "pretrain-token-file-no-tokenizer",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.dataset_name=tokens.npy"],
        "already tokenized",
        npy(np.arange(10, dtype=np.int32)),
    ),
    Case(
        "pretrain-missing-path-like-name",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.dataset_name=data/train.parquet"],
        "neither an existing file or folder nor a hub dataset id",
    ),
    Case(
        "pretrain-streaming-a-text-file",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.dataset_name=d.txt", "data.streaming=true"],
        "read in place without it",
        write("d.txt", "some text\n"),
    ),
    Case(
        "pretrain-streaming-and-stream",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.stream=true", "data.streaming=true"],
        "set one",
    ),
    Case(
        "pretrain-streaming-empty-folder",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.dataset_name=empty", "data.streaming=true"],
        "empty",
        lambda w, r: (w / "empty").mkdir(),
    ),
    Case(
        "pretrain-data-files-missing",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.dataset_name=json", "data.data_files=nope-*.jsonl"],
        "cannot open dataset 'json'",
    ),
    Case(
        "pretrain-streaming-eval-split-on-a-file",
        [
            "pretrain",
            "--config",
            cfg(PRE),
            *TINY,
            "data.dataset_name=d.jsonl",
            "data.streaming=true",
            "data.eval_split=test",
        ],
        "no named splits",
        write("d.jsonl", '{"text": "a b c"}\n' * 30),
    ),
    Case(
        "pretrain-shuffle-buffer-zero",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.shuffle_buffer_size=0"],
        "shuffle_buffer_size",
    ),
    Case(
        "pretrain-ul2-task-weights",
        ["pretrain", "--config", "ul2-tiny", *TINY, "data.ul2_task_weights=[1,1]"],
        "data.ul2_task_weights",
    ),
    Case(
        "ul2-from-a-decoder-only-tierlm-model",
        ["pretrain", "--config", "ul2-tiny", *TINY, "model.model_name_or_path={pre}/model"],
        "holds a 'gpt' model but model.architecture is 'qwen3_encdec'",
    ),
    Case(
        "ul2-from-a-gpt2-transformers-folder",
        ["pretrain", "--config", "ul2-tiny", *TINY[3:], "model.model_name_or_path=gpt2"],  # no shape: the folder's
        "holds a 'gpt2' model; an encoder-decoder starts from a decoder-only Qwen3",
        gpt2_folder("gpt2"),
    ),
    Case(
        "jax-with-bf16",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.backend=jax", "training.bf16=true"],
        "infra.backend=jax does not do training.bf16",
    ),
    Case(
        "jax-with-adamw-spam",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.backend=jax", "training.optimizer=adamw_spam"],
        "infra.backend=jax does not do training.optimizer=adamw_spam",
    ),
    Case(
        "jax-with-an-encoder-decoder",
        ["pretrain", "--config", "ul2-tiny", *TINY, "model.n_kv_head=1", "infra.backend=jax"],
        "no twin of the qwen3_encdec family",
    ),
    Case("backend-unknown", ["pretrain", "--config", cfg(PRE), *TINY, "infra.backend=tensorflow"], "infra.backend"),
    Case(
        "sft-an-encoder-decoder",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path=null", "model.architecture=qwen3_encdec"],
        "encoder-decoder model trains with `tierlm pretrain`",
    ),
    Case(
        "pretrain-synthetic-1e12",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.num_synthetic_examples=1e12"],
        "needs at least .*index",
    ),
    Case(
        "pretrain-seq-len-1e8",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.max_seq_length=100000000"],
        "needs at least",
    ),
    Case(
        "pretrain-memory-limit-too-small",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.max_memory_gb=0.02"],
        "needs about .* per rank but .* the largest part is",
    ),
    Case(
        "pretrain-auto-batch-nothing-fits",
        [
            "pretrain",
            "--config",
            cfg(PRE),
            *TINY,
            "training.per_device_train_batch_size=auto",
            "infra.max_memory_gb=0.05",
        ],
        "not even one row",
    ),
    Case(
        "pretrain-batch-size-word",
        ["pretrain", "--config", cfg(PRE), *TINY, "training.per_device_train_batch_size=big"],
        "must be auto or a number of rows",
    ),
    Case(
        "pretrain-batch-size-zero",
        ["pretrain", "--config", cfg(PRE), *TINY, "training.per_device_train_batch_size=0"],
        "must be auto or a number of rows",
    ),
    Case(
        "pretrain-memory-limit-negative",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.max_memory_gb=-1"],
        "max_memory_gb must be > 0",
    ),
    Case("pretrain-fp16-on-cpu", ["pretrain", "--config", cfg(PRE), *TINY, "training.fp16=true"], "needs a CUDA GPU"),
    Case(
        "pretrain-fp16-and-bf16",
        ["pretrain", "--config", cfg(PRE), *TINY, "training.fp16=true", "training.bf16=true"],
        "two precisions",
    ),
    Case(
        "pretrain-unknown-sharding",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.fsdp_sharding_strategy=ZERO3"],
        "fsdp_sharding_strategy",
    ),
    Case("plan-memory-limit-word", ["plan", "--config", cfg(PRE), "infra.max_memory_gb=lots"], "max_memory_gb"),
    Case(
        "sft-hub-split-missing",
        [
            "sft",
            "--config",
            cfg(SFT_CFG),
            *CHAT,
            "model.model_name_or_path={pre}",
            "data.dataset_name=uc",
            "data.split=train",
        ],
        "has splits train_sft, test_sft; there is no 'train'",
        hub_layout("uc"),
    ),
    Case(
        "sft-hub-eval-split-missing",
        [
            "sft",
            "--config",
            cfg(SFT_CFG),
            *CHAT,
            "model.model_name_or_path={pre}",
            "data.dataset_name=uc",
            "data.split=train_sft",
            "data.eval_split=validation",
        ],
        "there is no 'validation'",
        hub_layout("uc"),
    ),
    Case(
        "sft-hub-unknown-config",
        [
            "sft",
            "--config",
            cfg(SFT_CFG),
            *CHAT,
            "model.model_name_or_path={pre}",
            "data.dataset_name=uc",
            "data.split=train_sft",
            "data.dataset_config=fr",
        ],
        "config 'fr'",
        hub_layout("uc"),
    ),
    Case(
        "sft-sharegpt-unknown-speaker",
        [
            "sft",
            "--config",
            cfg(SFT_CFG),
            *CHAT,
            "model.model_name_or_path={pre}",
            "data.dataset_name=c.jsonl",
            "data.messages_column=conversations",
        ],
        "known speakers",
        write("c.jsonl", '{"conversations": [{"from": "wizard", "value": "x"}]}\n'),
    ),
    Case(
        "sft-eval-split-on-a-file",
        [
            "sft",
            "--config",
            cfg(SFT_CFG),
            *CHAT,
            "model.model_name_or_path={pre}",
            "data.dataset_name=c.jsonl",
            "data.eval_split=test",
        ],
        "no named splits",
        write("c.jsonl", GOOD_CHAT + "\n"),
    ),
    Case(
        "pretrain-unknown-architecture",
        ["pretrain", "--config", cfg(PRE), *TINY, "model.architecture=nonesuch"],
        "nonesuch",
    ),
    Case(
        "pretrain-a-transformers-encoder-decoder-by-name",
        ["pretrain", "--config", cfg(PRE), *TINY, "model.architecture=t5"],
        "model.architecture 't5' is not a decoder-only causal LM",
    ),
    Case(
        "plan-a-transformers-vision-model-by-name",
        ["plan", "--config", cfg(PRE), *TINY, "model.architecture=vit", "--vocab-size", "64"],
        "model.architecture 'vit' is not a decoder-only causal LM",
    ),
    Case(
        "sft-from-a-t5-folder",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path=t5"],
        "holds a model whose model_type 't5' is not a decoder-only causal LM",
        t5_folder("t5"),
    ),
    Case("pretrain-bad-kv-heads", ["pretrain", "--config", cfg(PRE), *TINY, "model.n_kv_head=3"], "n_kv_head"),
    Case(
        "pretrain-tiny-vocab",
        ["pretrain", "--config", cfg(PRE), *TINY, "tokenizer.vocab_size=10"],
        "vocab_size must be >=",
    ),
    Case(
        "pretrain-missing-model",
        ["pretrain", "--config", cfg(PRE), *TINY, "model.model_name_or_path=./nope"],
        "does not exist",
    ),
    Case(
        "pretrain-missing-mixture-part",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.mixture=[{dataset_name: nope.jsonl}]"],
        "nope.jsonl",
    ),
    Case(
        "pretrain-missing-eval-data",
        ["pretrain", "--config", cfg(PRE), *TINY, "data.eval_dataset_name=nope.jsonl"],
        "nope.jsonl",
    ),
    Case("pretrain-output-is-a-file", ["pretrain", "--config", cfg(PRE), *TINY], "is a file", write("out", "x")),
    Case(
        "pretrain-output-not-a-run",
        ["pretrain", "--config", cfg(PRE), *TINY],
        "holds no tierlm run",
        write("out/notes.txt", "mine"),
    ),
    Case(
        "pretrain-output-not-writable",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.output_dir=/proc/tierlm_run"],
        "cannot write",
    ),
    Case(
        "pretrain-other-shape-same-dir",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.output_dir=pre", "model.depth=2"],
        "model.depth=1.*2",
        copy_run("pre"),
    ),
    Case(
        "pretrain-other-data-same-dir",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.output_dir=pre", "data.dataset_name=d.jsonl"],
        "data.dataset_name",
        both(copy_run("pre"), write("d.jsonl", '{"text": "x"}\n')),
    ),
    Case(
        "pretrain-bad-tokenizer-json",
        ["pretrain", "--config", cfg(PRE), *TINY, "model.tokenizer_name_or_path=tok"],
        "tokenizer",
        write("tok/tokenizer.json", "{not json"),
    ),
    Case(
        "pretrain-corrupt-run-json",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.output_dir=pre"],
        "run.json",
        copy_run("pre", lambda run: (run / "run.json").write_text("{oops")),
    ),
    # -- SFT -----------------------------------------------------------------------------------
    Case(
        "sft-into-pretrain-run",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path={pre}", "infra.output_dir=pre"],
        "holds a pretrain run",
        copy_run("pre"),
    ),
    Case(
        "sft-plain-text",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path={pre}", "data.dataset_name=d.txt"],
        "chat examples come from JSONL",
        write("d.txt", "hello\n"),
    ),
    Case(
        "sft-jsonl-not-utf8",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path={pre}", "data.dataset_name=d.jsonl"],
        "d.jsonl:1",
        write("d.jsonl", NON_UTF8),
    ),
    Case(
        "sft-jsonl-nested",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path={pre}", "data.dataset_name=d.jsonl"],
        "d.jsonl:1.*nested",
        write("d.jsonl", NESTED + "\n"),
    ),
    Case(
        "sft-messages-not-list",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path={pre}", "data.dataset_name=d.jsonl"],
        "non-empty list",
        write("d.jsonl", '{"messages": "hi"}\n'),
    ),
    Case(
        "sft-bad-role",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path={pre}", "data.dataset_name=d.jsonl"],
        "role 'wizard'",
        write("d.jsonl", '{"messages": [{"role": "wizard", "content": "x"}]}\n'),
    ),
    Case(
        "sft-drop-every-conversation",
        [
            "sft",
            "--config",
            cfg(SFT_CFG),
            *CHAT,
            "model.model_name_or_path={pre}",
            "data.dataset_name=d.jsonl",
            "data.long_conversations=drop",
        ],
        "longer than",
        write("d.jsonl", (LONG_CHAT + "\n") * 30),
    ),
    Case(
        "sft-stream",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path={pre}", "data.stream=true"],
        "pretraining option",
    ),
    Case(
        "sft-bad-train-on",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path={pre}", "data.train_on=some"],
        "data.train_on",
    ),
    Case(
        "sft-corrupt-weights",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path=pre"],
        "damaged.*model.safetensors",
        copy_run("pre", flip_byte("model/model.safetensors")),
    ),
    Case(
        "sft-different-model-weights",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path=pre/model"],
        "pre/model",
        copy_run("pre", lambda run: _swap_weights(run)),
    ),
    Case(
        "sft-lora-from-scratch",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path=null", "model.lora.r=4"],
        "starts from a trained|adapters on a trained model",
    ),
    Case(
        "pretrain-lora-from-scratch",
        ["pretrain", "--config", cfg(PRE), *TINY, "model.lora.r=4"],
        "adapters on a trained model",
    ),
    Case(
        "sft-lora-unknown-target",
        [
            "sft",
            "--config",
            cfg(SFT_CFG),
            *CHAT,
            "model.model_name_or_path={pre}",
            "model.lora.r=4",
            "model.lora.target_modules=[wq_nope]",
        ],
        "model.lora.target_modules",
    ),
    Case(
        "sft-lora-negative-rank",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path={pre}", "model.lora.r=-1"],
        "model.lora.r",
    ),
    Case(
        "sft-4bit-on-cpu",
        [
            "sft",
            "--config",
            cfg(SFT_CFG),
            *CHAT,
            "model.model_name_or_path={pre}",
            "model.lora.r=4",
            "model.load_in_4bit=true",
        ],
        "needs a CUDA GPU",
    ),
    Case(
        "sft-4bit-without-lora",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path={pre}", "model.load_in_4bit=true"],
        "set model.lora.r",
    ),
    Case("export-adapter-of-a-full-run", ["export", "{pre}", "out_adapter", "--adapter-only"], "has no LoRA adapter"),
    # -- DPO -----------------------------------------------------------------------------------
    Case(
        "dpo-without-model",
        ["dpo", "--config", cfg(DPO_CFG), *CHAT, "model.model_name_or_path=null"],
        "starts from a trained",
    ),
    Case(
        "dpo-missing-chosen",
        ["dpo", "--config", cfg(DPO_CFG), *CHAT, "model.model_name_or_path={sft}", "data.dataset_name=p.jsonl"],
        "p.jsonl:1",
        write("p.jsonl", '{"prompt": "a", "rejected": "b"}\n'),
    ),
    Case(
        "kto-rows-without-labels",
        [
            "dpo",
            "--config",
            cfg(DPO_CFG),
            *CHAT,
            "model.model_name_or_path={sft}",
            "data.dataset_name=u.jsonl",
            "dpo.loss_type=kto",
        ],
        r"u.jsonl:1: no 'label' field",
        write("u.jsonl", '{"prompt": "1 + 1", "completion": "2"}\n'),
    ),  # fmt: skip
    Case(
        "dpo-not-utf8",
        ["dpo", "--config", cfg(DPO_CFG), *CHAT, "model.model_name_or_path={sft}", "data.dataset_name=p.jsonl"],
        "p.jsonl",
        write("p.jsonl", NON_UTF8),
    ),
    Case(
        "dpo-nested",
        ["dpo", "--config", cfg(DPO_CFG), *CHAT, "model.model_name_or_path={sft}", "data.dataset_name=p.jsonl"],
        "p.jsonl:1",
        write("p.jsonl", NESTED + "\n"),
    ),
    Case(
        "dpo-longer-than-context",
        ["dpo", "--config", cfg(DPO_CFG), *CHAT, "model.model_name_or_path={sft}", "data.dataset_name=p.jsonl"],
        "fits in",
        write("p.jsonl", (json.dumps({"prompt": "w " * 300, "chosen": "a", "rejected": "b"}) + "\n") * 40),
    ),
    Case(
        "rm-replies-longer-than-context",  # DPO would keep their first tokens; a reward model drops such pairs
        [
            "rm",
            "--config",
            cfg("configs/tiny_rm.yaml"),
            *CHAT,
            "model.model_name_or_path={sft}",
            "data.dataset_name=p.jsonl",
            "data.max_seq_length=32",
        ],  # fmt: skip
        "fits in",
        write("p.jsonl", (json.dumps({"prompt": "1 + 1?", "chosen": "2 " * 60, "rejected": "3 " * 60}) + "\n") * 40),
    ),
    Case(
        "dpo-streaming",
        ["dpo", "--config", cfg(DPO_CFG), *CHAT, "model.model_name_or_path={sft}", "data.streaming=true"],
        "drop data.mixture / data.streaming",
    ),
    Case(
        "dpo-hub-split-missing",
        [
            "dpo",
            "--config",
            cfg(DPO_CFG),
            *CHAT,
            "model.model_name_or_path={sft}",
            "data.dataset_name=uc",
            "data.split=train_prefs",
        ],
        "there is no 'train_prefs'",
        hub_layout("uc"),
    ),
    Case(
        "dpo-string-replies-without-prompt",
        ["dpo", "--config", cfg(DPO_CFG), *CHAT, "model.model_name_or_path={sft}", "data.dataset_name=p.jsonl"],
        "needs a prompt column",
        write("p.jsonl", '{"chosen": "a", "rejected": "b"}\n' * 4),
    ),
    Case(
        "dpo-beta-zero",
        ["dpo", "--config", cfg(DPO_CFG), *CHAT, "model.model_name_or_path={sft}", "dpo.beta=0"],
        "dpo.beta must be > 0",
    ),
    Case(
        "dpo-robust-without-label-smoothing",
        ["dpo", "--config", cfg(DPO_CFG), *CHAT, "model.model_name_or_path={sft}", "dpo.loss_type=robust"],
        "robust DPO's assumed flip rate",
    ),
    Case(
        "dpo-simpo-with-precomputed-reference",
        [
            "dpo",
            "--config",
            cfg(DPO_CFG),
            *CHAT,
            "model.model_name_or_path={sft}",
            "dpo.loss_type=simpo",
            "dpo.reference=precomputed",
        ],
        "dpo.loss_type=simpo uses no reference",
    ),
    Case(
        "dpo-reference-sync-under-lora",
        [
            "dpo",
            "--config",
            cfg(DPO_CFG),
            *CHAT,
            "model.model_name_or_path={sft}",
            "dpo.reference_sync_steps=4",
            "model.lora.r=4",
        ],
        "under model.lora the reference is the base with the adapters off, no copy",
    ),  # fmt: skip
    Case(
        "dpo-synthetic-1e12",
        ["dpo", "--config", cfg(DPO_CFG), *CHAT, "model.model_name_or_path={sft}", "data.num_synthetic_examples=1e12"],
        "needs at least",
    ),
    # -- RL and eval ---------------------------------------------------------------------------
    Case("chat-missing-checkpoint", ["chat", "--checkpoint", "nope"], "nope"),
    Case("serve-port-out-of-range", ["serve", "--checkpoint", "{sft}", "--port", "70000"], "--port must be in"),
    Case("serve-timeout-zero", ["serve", "--checkpoint", "{sft}", "--timeout", "0"], "--timeout must be > 0"),
    Case("serve-queue-negative", ["serve", "--checkpoint", "{sft}", "--max-queue", "-1"], "--max-queue must be >= 0"),
    Case("serve-empty-api-key", ["serve", "--checkpoint", "{sft}", "--api-key", " "], "--api-key is empty"),
    Case(
        "serve-vllm-server-down",
        ["serve", "--checkpoint", "{sft}", "--engine", "vllm", "--vllm-url", "http://127.0.0.1:9", "--port", "1"],
        r"no vLLM server answers at http://127.0.0.1:9/v1/models",
    ),
    Case(
        "serve-vllm-url-without-engine",
        ["serve", "--checkpoint", "{sft}", "--vllm-url", "http://127.0.0.1:9"],
        r"--vllm-url names a vLLM server .* for --engine vllm",
    ),
    Case(
        "serve-compile-vllm",
        ["serve", "--checkpoint", "{sft}", "--engine", "vllm", "--compile"],
        r"--compile compiles tierlm's own decode step, not --engine vllm's",
    ),
    Case("chat-temperature-negative", ["chat", "--checkpoint", "{sft}", "--temperature", "-1"], "temperature"),
    Case("push-bad-repo-id", ["push", "{sft}", "--repo", "no-slash", "--dry-run"], "is not a Hub repository id"),
    Case("push-not-a-run", ["push", "nope", "--repo", "me/x", "--dry-run"], "nope"),
    Case(
        "eval-harness-unknown-task",
        ["eval", "--checkpoint", "{pre}", "--harness", "hellaswagg"],
        "no task 'hellaswagg' .did you mean hellaswag",
    ),
    Case(
        "eval-harness-no-tasks",
        ["eval", "--checkpoint", "{pre}", "--harness", " , "],
        "give task names separated by commas",
    ),
    Case(
        "eval-harness-include-path-missing",
        ["eval", "--checkpoint", "{pre}", "--harness", "x", "--include-path", "tasks"],
        "is not a folder",
    ),
    Case(
        "eval-harness-limit-zero",
        ["eval", "--checkpoint", "{pre}", "--harness", "x", "--limit", "0"],
        "--limit: must be > 0",
    ),
    Case(
        "eval-harness-negative-fewshot",
        ["eval", "--checkpoint", "{pre}", "--harness", "x", "--num-fewshot", "-1"],
        "must be >= 0",
    ),
    Case(
        "eval-harness-with-config",
        ["eval", "--checkpoint", "{pre}", "--harness", "x", "--config", "tiny_rl"],
        "drop --config",
    ),
    Case("eval-limit-without-harness", ["eval", "--checkpoint", "{sft}", "--limit", "3"], "add --harness TASKS"),
    Case(
        "eval-harness-missing-checkpoint",
        ["eval", "--checkpoint", "./nope", "--harness", "lambada_openai"],
        "nope does not exist",
    ),
    Case("report-not-a-run", ["report", "data"], "has no metrics.jsonl lines", write("data/d.txt", "hello\n")),
    Case("report-several-without-out", ["report", "{pre}", "{sft}"], "give --out DIR"),
    Case("report-out-is-a-file", ["report", "{pre}", "{sft}", "--out", "f.txt"], "is a file", write("f.txt", "x")),
    Case(
        "rl-critic-without-ppo",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.algorithm=grpo", "rl.critic=true"],
        "rl.critic trains PPO's value model: set rl.loss=ppo",
    ),
    Case(
        "tensor-parallel-without-torchrun",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.tensor_parallel_size=2"],
        "run under `torchrun",
    ),
    Case(
        "pipeline-parallel-size-zero",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.pipeline_parallel_size=0"],
        "pipeline_parallel_size",
    ),
    Case(
        "pipeline-schedule-unknown",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.pipeline_schedule=zigzag"],
        "pipeline_schedule",
    ),
    Case(
        "sequence-parallel-without-tensor-parallel",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.sequence_parallel=true"],
        "set infra.tensor_parallel_size > 1",
    ),
    Case(
        "sequence-parallel-without-vocab-parallel",
        [
            "pretrain",
            "--config",
            cfg(PRE),
            *TINY,
            "infra.tensor_parallel_size=2",
            "infra.sequence_parallel=true",
            "infra.vocab_parallel=false",
        ],
        "needs infra.vocab_parallel=true",
    ),
    Case(
        "rl-tensor-parallel",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "infra.tensor_parallel_size=2"],
        "tierlm rl shards the data .ddp. or the weights .fsdp. over ranks, not tensor",
    ),
    Case(
        "rl-importance-unknown",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.importance=icepop"],
        "rl.importance must be one of 'none', 'token_truncate'",
    ),
    Case(
        "rl-sapo-with-a-clip",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.loss=sapo", "rl.clip_high=0.3"],
        "rl.loss=sapo gates the ratio softly instead of clipping it",
    ),
    Case(
        "rl-batch-std-on-its-own-baseline",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "rl.loss=rloo",
            "rl.normalize_std=batch",
        ],
        r"rl.loss=rloo has its own baseline .leave-one-out.: drop rl.normalize_std",
    ),
    Case(
        "rl-reference-sync-under-lora",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "rl.kl_coef=0.1",
            "rl.reference_sync_steps=2",
            "model.lora.r=4",
        ],
        "rl.reference_sync_steps moves a reference copy toward the policy; under model.lora",
    ),  # fmt: skip
    Case(
        "rl-vespo-shape-without-vespo",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.loss=dapo", "rl.vespo_k_pos=1"],
        "shape VESPO's sequence weights: set rl.loss=vespo",
    ),
    Case(
        "rl-kl-in-reward-without-kl",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.kl_in_reward=true"],
        "rl.kl_in_reward moves the KL penalty into each completion's reward; with rl.kl_coef=0 there is none",
    ),
    Case(
        "rl-kl-in-reward-with-a-critic",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "rl.kl_in_reward=true",
            "rl.kl_coef=0.1",
            "rl.loss=ppo",
            "rl.critic=true",
        ],  # fmt: skip
        "rl.loss=ppo's advantages are not the rewards'",
    ),
    Case(
        "rl-off-policy-mask-negative",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.off_policy_mask=-1"],
        "off_policy_mask",
    ),
    Case(
        "rl-gae-lambda-above-1",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.gae_lambda=1.5"],
        "gae_lambda",
    ),
    Case(
        "rl-without-model",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path=null"],
        "starts from a trained",
    ),
    Case(  # the user's reward is tried on a held-out example before anything is printed or written
        "rl-user-reward-returns-text",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.reward=text_reward:reward"],
        r"rl.reward text_reward:reward returned 'ten' \(str\); it must return a float",
        write("text_reward.py", "def reward(prompt, completion, reference):\n    return 'ten'\n"),
    ),
    Case(
        "rl-user-reward-raises",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.reward=raising_reward:reward"],
        r"rl.reward raising_reward:reward raised ZeroDivisionError: division by zero when tried on a held-out example",
        write("raising_reward.py", "def reward(prompt, completion, reference):\n    return 1 / 0\n"),
    ),
    Case(
        "rl-missing-question",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "data.dataset_name=q.jsonl"],
        "q.jsonl:1",
        write("q.jsonl", '{"answer": "#### 3"}\n' * 4),
    ),
    Case(
        "rl-not-utf8",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "data.dataset_name=q.jsonl"],
        "q.jsonl",
        write("q.jsonl", NON_UTF8),
    ),
    Case(
        "rl-nested",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "data.dataset_name=q.jsonl"],
        "q.jsonl:1",
        write("q.jsonl", NESTED + "\n"),
    ),
    Case(
        "rl-prompt-longer-than-context",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "data.dataset_name=q.jsonl"],
        "longer than",
        write("q.jsonl", (json.dumps({"question": "w " * 3000, "answer": "#### 3"}) + "\n") * 4),
    ),
    Case(
        "rl-answer-pattern-not-a-regex",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "data.answer_pattern=(["],
        "data.answer_pattern",
    ),
    Case(
        "rl-answer-pattern-finds-nothing",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "data.dataset_name=q.jsonl",
            r"data.answer_pattern=boxed\{(\d+)\}",
        ],
        "q.jsonl:1.*extraction rule",
        write("q.jsonl", '{"question": "1+2?", "answer": "#### 3"}\n' * 4),
    ),
    Case(
        "rl-mixture",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "data.mixture=[{dataset_name: 'synthetic:arithmetic', weight: 1}]",
        ],
        "drop data.mixture",
    ),
    Case(
        "rl-auto-batch",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "training.per_device_train_batch_size=auto",
        ],
        "rl.micro_batch_size",
    ),
    Case(
        "rl-group-of-one",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.group_size=1"],
        "rl.group_size",
    ),
    Case(
        "rl-synthetic-1e12",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "data.num_synthetic_examples=1e12"],
        "needs at least",
    ),
    Case(
        "rl-vllm-not-installed",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "engine.kind=vllm"],
        r"engine.kind=vllm needs vLLM in this Python .*scripts/setup_vllm.sh",
    ),
    Case(
        "rl-vllm-server-down",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "engine.kind=vllm",
            "engine.vllm_url=http://127.0.0.1:9",
        ],
        r"no vLLM server answers at http://127.0.0.1:9/v1/models",
    ),
    Case(
        "rl-vllm-url-without-engine",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "engine.vllm_url=http://127.0.0.1:9"],
        "engine.vllm_url names a vLLM server for engine.kind=vllm",
    ),
    Case(
        "rl-vllm-url-not-http",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "engine.kind=vllm",
            "engine.vllm_url=x:1",
        ],
        "engine.vllm_url must be an http",
    ),
    Case(
        "rl-compile-vllm",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "engine.kind=vllm",
            "engine.compile=true",
        ],
        "engine.compile compiles tierlm's own engine",
    ),
    Case(
        "rl-partial-staleness-below-the-lag",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "rl.partial_rollouts=true",
            "rl.max_off_policy_steps=2",
            "rl.max_staleness=1",
        ],
        "rl.max_staleness .1. is below rl.max_off_policy_steps .2.",
    ),
    Case(
        "rl-partial-window-below-a-step",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "rl.partial_rollouts=true",
            "rl.rollout_window=1",
        ],
        "rl.rollout_window .1. must hold a step's groups",
    ),
    Case(
        "rl-partial-with-dynamic-sampling",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "rl.partial_rollouts=true",
            "rl.loss=dapo",
        ],
        "set rl.dynamic_sampling=false or drop rl.partial_rollouts",
    ),
    Case(
        "rl-partial-chunk-zero",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.rollout_chunk=0"],
        "rl.rollout_chunk",
    ),
    Case(
        "rl-partial-unknown-stale-mode",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.stale_rollouts=keep"],
        "rl.stale_rollouts must be one of 'drop' or 'finish', got 'keep'",
    ),
    Case(
        "rl-partial-on-an-environment",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "rl.partial_rollouts=true",
            "data.dataset_name=synthetic:arithmetic_chain",
        ],
        "an environment's episodes are sampled whole",
    ),
    Case(
        "rl-off-policy-out-of-range",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.max_off_policy_steps=9"],
        "rl.max_off_policy_steps",
    ),
    Case(
        "rl-clip-low-above-high",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "rl.loss=dapo",
            "rl.clip_low=0.3",
            "rl.clip_high=0.2",
        ],
        r"rl.clip_low \(0.3\) > rl.clip_high \(0.2\)",
    ),
    Case(
        "rl-loss-and-algorithm-disagree",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.loss=gspo", "rl.algorithm=grpo"],
        "rl.algorithm=grpo and rl.loss=gspo disagree",
    ),
    Case(
        "rl-unknown-loss",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.loss=grpoo"],
        "rl.loss",
    ),
    Case(
        "rl-teacher-with-another-vocabulary",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.loss=distill", "rl.teacher=t"],
        r"rl.teacher t has another vocabulary \(\d+ tokens, the policy's \d+",
        lambda work, runs: _other_vocabulary(runs / "sft" / "model", work / "t"),
    ),
    Case(
        "rl-teachers-route-a-domain-no-prompt-has",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "rl.loss=distill",
            "rl.teachers={arithmetc: {sft}}",
            "rl.teacher={sft}",
        ],  # fmt: skip
        r"rl.teachers routes \['arithmetc'\] but no training prompt has that domain \(theirs: \['arithmetic'\]",
    ),
    Case(
        "rl-teachers-leave-a-domain-without-a-teacher",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "rl.loss=distill_topk",
            "data.dataset_name=d.jsonl",
            "rl.teachers={add: {sft}}",
        ],  # fmt: skip
        r"training prompts of domain 'sub' have no teacher: rl.teachers routes \['add'\] and rl.teacher is unset",
        write(
            "d.jsonl",
            '{"question": "1 + 2?", "answer": "3", "domain": "add"}\n'
            '{"question": "5 - 2?", "answer": "3", "domain": "sub"}\n' * 3,
        ),  # fmt: skip
    ),
    Case(
        "rl-teachers-with-another-vocabulary",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "rl.loss=distill",
            "rl.teachers={arithmetic: t}",
        ],  # fmt: skip
        r"rl.teacher t has another vocabulary \(\d+ tokens, the policy's \d+",
        lambda work, runs: _other_vocabulary(runs / "sft" / "model", work / "t"),
    ),
    Case(
        "rl-teachers-without-a-distill-loss",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.teachers={arithmetic: {sft}}"],
        "rl.loss=distill learns from rl.teacher's log-probs",
    ),
    Case(
        "rl-distill-top-k-on-the-sampled-token-loss",
        [
            "rl",
            "--config",
            cfg(RL_CFG),
            *RL,
            "model.model_name_or_path={sft}",
            "rl.loss=distill",
            "rl.teacher={sft}",
            "rl.distill_top_k=8",
        ],  # fmt: skip
        "rl.distill_top_k is the top-k of on-policy distillation's exact KL: set rl.loss=distill_topk",
    ),
    Case(
        "rl-domain-not-a-string",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "data.dataset_name=d.jsonl"],
        r"the 'domain' field names the prompt's domain, a string; got \['a'\]",
        write("d.jsonl", '{"question": "1 + 2?", "answer": "3", "domain": ["a"]}\n' * 4),
    ),
    Case(
        "rl-reward-model-not-a-classifier",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.reward_model={sft}"],
        r"rl.reward_model: .*model is not a reward model \(architectures \['Qwen3ForCausalLM'\]",
    ),
    Case(
        "rl-teacher-missing",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.loss=distill", "rl.teacher=nope"],
        "nope",
    ),
    Case(
        "eval-vllm-server-down",
        [
            "eval",
            "--checkpoint",
            "{sft}",
            "--config",
            cfg(RL_CFG),
            "engine.kind=vllm",
            "engine.vllm_url=http://127.0.0.1:9",
        ],
        r"no vLLM server answers at http://127.0.0.1:9",
    ),
    Case("eval-missing-checkpoint", ["eval", "--checkpoint", "./nope", "--config", cfg(RL_CFG)], "does not exist"),
    Case(
        "eval-checkpoint-is-file",
        ["eval", "--checkpoint", "f.txt", "--config", cfg(RL_CFG)],
        "holds no model|not a",
        write("f.txt", "x"),
    ),
    Case(
        "eval-bad-override",
        ["eval", "--checkpoint", "{sft}", "--config", cfg(RL_CFG), "rl.eval_k=0"],
        "rl.eval_k must be > 0",
    ),
    # -- sample --------------------------------------------------------------------------------
    Case("sample-missing-checkpoint", ["sample", "--checkpoint", "./nope", "--prompt", "hi"], "does not exist"),
    Case(
        "sample-zero-tokens",
        ["sample", "--checkpoint", "{sft}", "--prompt", "hi", "--max-new-tokens", "0"],
        "max-new-tokens",
    ),
    Case(
        "sample-negative-temperature",
        ["sample", "--checkpoint", "{sft}", "--prompt", "hi", "--temperature", "-1"],
        "temperature",
    ),
    Case("sample-top-p-above-one", ["sample", "--checkpoint", "{sft}", "--prompt", "hi", "--top-p", "2"], "top-p"),
    Case(
        "sample-repetition-penalty-out-of-range",
        ["sample", "--checkpoint", "{sft}", "--prompt", "hi", "--repetition-penalty", "0"],
        r"--repetition-penalty: must be in \(0, 2\]",
    ),
    Case("sample-top-k-zero", ["sample", "--checkpoint", "{sft}", "--prompt", "hi", "--top-k", "0"], "top-k"),
    Case(
        "sample-prompt-longer-than-context", ["sample", "--checkpoint", "{sft}", "--prompt", "w " * 3000], "longer than"
    ),
    Case(
        "sample-not-an-int",
        ["sample", "--checkpoint", "{sft}", "--prompt", "hi", "--max-new-tokens", "many"],
        "whole number",
    ),
    Case(
        "sample-bad-device",
        ["sample", "--checkpoint", "{sft}", "--prompt", "hi", "--device-type", "tpu"],
        "invalid choice",
    ),
    Case(
        "sample-corrupt-weights",
        ["sample", "--checkpoint", "pre", "--prompt", "hi"],
        "damaged.*model.safetensors",
        copy_run("pre", flip_byte("model/model.safetensors")),
    ),
    Case(
        "sample-corrupt-tokenizer",
        ["sample", "--checkpoint", "pre", "--prompt", "hi"],
        "damaged.*tokenizer.json",
        copy_run("pre", flip_byte("model/tokenizer.json")),
    ),
    Case(
        "sample-corrupt-training-meta",
        ["sample", "--checkpoint", "pre", "--prompt", "hi"],
        "training_meta.json",
        copy_run("pre", lambda run: (run / "model" / "training_meta.json").write_text("{broken")),
    ),
    Case(
        "sample-corrupt-checkpoint",
        ["sample", "--checkpoint", "ck", "--prompt", "hi"],
        "damaged",
        lambda w, r: (
            shutil.copytree(latest_checkpoint(r / "pre"), w / "ck"),
            flip_byte("model/model.safetensors")(w / "ck"),
        ),
    ),
    Case("unknown-command", ["fly"], "invalid choice"),
    Case("missing-required-argument", ["sample", "--prompt", "hi"], "required"),
    # -- export --------------------------------------------------------------------------------
    Case("export-missing", ["export", "./nope", "out"], "does not exist"),
    Case("export-target-not-empty", ["export", "{pre}", "out"], "not empty", write("out/x.txt", "mine")),
    Case("export-target-is-file", ["export", "{pre}", "out"], "is a file", write("out", "x")),
    Case("export-into-its-input", ["export", "pre", "pre/exported"], "overlaps the input", copy_run("pre")),
    Case(
        "export-symlink-inside",
        ["export", "pre", "out"],
        "symbolic link",
        copy_run(
            "pre",
            lambda run: (
                (run / "model" / "model.safetensors").unlink()
                or os.symlink("/etc/hostname", run / "model" / "model.safetensors")
            ),
        ),
    ),
    Case("export-unwritable-target", ["export", "{pre}", "/proc/tierlm_export"], "could not write|cannot write"),
    # -- average -------------------------------------------------------------------------------
    Case("average-one-input", ["average", "{pre}", "--out", "avg"], "at least 2"),
    Case("average-missing-input", ["average", "{pre}", "./nope", "--out", "avg"], "does not exist"),
    Case(
        "average-target-not-empty", ["average", "{pre}", "{pre}", "--out", "avg"], "not empty", write("avg/x", "mine")
    ),
    Case("average-into-an-input", ["average", "pre", "pre", "--out", "pre/avg"], "overlaps the input", copy_run("pre")),
    Case(
        "average-different-models",
        ["average", "{pre}", "pre", "--out", "avg"],
        "same weights",
        copy_run("pre", lambda run: _swap_weights(run)),
    ),
    Case(
        "average-corrupt-input",
        ["average", "pre", "{pre}", "--out", "avg"],
        "damaged",
        copy_run("pre", flip_byte("model/model.safetensors")),
    ),
    # -- tokenizer -----------------------------------------------------------------------------
    Case("tokenizer-missing-data", ["tokenizer", "train", "--data", "nope.txt", "--out", "tok"], "nope.txt"),
    Case(
        "tokenizer-target-not-empty",
        ["tokenizer", "train", "--data", "synthetic:arithmetic", "--out", "tok", "--num-docs", "50"],
        "not empty",
        write("tok/x", "mine"),
    ),
    Case(
        "tokenizer-target-is-file",
        ["tokenizer", "train", "--data", "synthetic:arithmetic", "--out", "tok", "--num-docs", "50"],
        "is a file",
        write("tok", "x"),
    ),
    Case(
        "tokenizer-vocab-too-small",
        [
            "tokenizer",
            "train",
            "--data",
            "synthetic:arithmetic",
            "--out",
            "tok",
            "--vocab-size",
            "10",
            "--num-docs",
            "50",
        ],
        "vocab_size must be >=",
    ),
    Case(
        "tokenizer-negative-docs",
        ["tokenizer", "train", "--data", "synthetic:arithmetic", "--out", "tok", "--num-docs", "-5"],
        "must be > 0",
    ),
    Case(
        "tokenizer-bad-kind",
        ["tokenizer", "train", "--data", "synthetic:arithmetic", "--out", "tok", "--kind", "word"],
        "invalid choice",
    ),
    Case(
        "tokenizer-not-utf8",
        ["tokenizer", "train", "--data", "d.txt", "--out", "tok"],
        "not UTF-8",
        write("d.txt", NON_UTF8),
    ),
    # -- optimizers and the plan (the scaling laws) ---------------------------------------
    Case(
        "optimizer-unknown",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "training.optimizer=sgd"],
        "training.optimizer must be one of",
    ),
    Case(
        "muon-refinements-without-muon",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "training.muon_refinements=[normuon]"],
        "training.muon_refinements refine Muon",
    ),
    Case(
        "muon-refinement-unknown",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "training.optimizer=muon", "training.muon_refinements=[nor]"],
        "must be one of 'polar_express'",
    ),
    Case(
        "role-lr-too-large",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "training.matrix_lr=2"],
        "training.matrix_lr must be < 1",
    ),
    Case(
        "batch-auto-without-horizon",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "training.total_batch_size=auto"],
        "set training.target_param_data_ratio",
    ),
    Case(
        "batch-not-a-number",
        ["plan", "--config", "tiny_pretrain", *TINY, "training.total_batch_size=big"],
        "auto or a number of tokens",
    ),
    Case(
        "batch-not-a-multiple",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "training.total_batch_size=1000"],
        "must be a multiple of one micro-batch",
    ),
    Case(
        "batch-and-accumulation",
        [
            "pretrain",
            "--config",
            "tiny_pretrain",
            *TINY,
            "training.total_batch_size=1024",
            "training.gradient_accumulation_steps=3",
        ],
        "not both",
    ),
    Case(
        "horizon-for-sft",
        ["sft", "--config", "tiny_sft", *CHAT, "model.model_name_or_path={pre}", "training.target_param_data_ratio=10"],
        "pretrain from scratch",
    ),
    Case(
        "batch-tokens-for-dpo",
        ["dpo", "--config", "tiny_dpo", *CHAT, "model.model_name_or_path={sft}", "training.total_batch_size=4096"],
        "pairs or rollouts",
    ),
    Case(
        "horizon-warmup-too-long",
        [
            "pretrain",
            "--config",
            "tiny_pretrain",
            *TINY,
            "training.target_param_data_ratio=0.01",
            "training.num_train_steps=null",
            "training.warmup_steps=5",
        ],
        "derived num_train_steps",
    ),
    Case(
        "steps-null-without-horizon",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "training.num_train_steps=null"],
        "set training.target_param_data_ratio",
    ),
    Case(
        "batch-scaled-lr-above-one",
        [
            "pretrain",
            "--config",
            "tiny_pretrain",
            *TINY,
            "training.total_batch_size=8388608",
            "training.learning_rate=0.5",
        ],
        "learning rate comes to",
    ),
    Case(
        "window-pattern-bad",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "model.window_pattern=SXL"],
        "model.window_pattern must be",
    ),
    Case(
        "moe-more-picks-than-experts",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "model.moe.num_experts=2", "model.moe.experts_per_token=3"],
        r"model.moe.experts_per_token \(3\) must be at most model.moe.num_experts \(2\)",
    ),
    Case(
        "moe-on-gpt2",
        ["pretrain", "--config", cfg(PRE), *TINY, "model.moe.num_experts=4", "model.architecture=gpt2"],
        "model.moe.num_experts has no effect on a gpt2 model",
    ),
    Case(
        "expert-parallel-in-one-process",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "model.moe.num_experts=4", "infra.expert_parallel_size=2"],
        r"infra.expert_parallel_size=2 shares out the experts over that many ranks: run under `torchrun",
    ),
    Case(
        "expert-parallel-with-deepspeed",
        [
            "pretrain",
            "--config",
            "tiny_pretrain",
            *TINY,
            "infra.expert_parallel_size=2",
            "infra.distributed_type=deepspeed",
        ],  # fmt: skip
        "infra.expert_parallel_size runs beside DDP or FSDP2",
    ),
    Case(
        "expert-parallel-with-fsdp-offload",
        [
            "pretrain",
            "--config",
            "tiny_pretrain",
            *TINY,
            "infra.expert_parallel_size=2",
            "infra.distributed_type=fsdp",
            "infra.cpu_offload=true",
        ],  # fmt: skip
        "drop infra.cpu_offload and infra.fsdp_sharding_strategy=HYBRID_SHARD",
    ),
    Case(
        "routing-replay-on-a-dense-policy",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "rl.routing_replay=true"],
        "rl.routing_replay replays the experts a mixture-of-experts policy chose, and this policy has none",
    ),
    Case(
        "fp8-on-cpu",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "training.fp8=true"],
        "needs an H100-class CUDA GPU",
    ),
    Case(
        "prune-sparsity-too-high",
        [
            "pretrain",
            "--config",
            "tiny_pretrain",
            *TINY,
            "training.optimizer=adamw_prune",
            "training.prune_sparsity=1.5",
        ],
        "training.prune_sparsity must be < 1",
    ),
    Case(
        "prune-unknown-score",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "training.prune_score=random"],
        "training.prune_score must be one of",
    ),
    Case(
        "ablate-bad-variant", ["ablate", "--config", "tiny_pretrain", *ABL, "--variants", "V0,big"], "neither a V-step"
    ),
    Case(
        "ablate-variant-changes-budget",
        [
            "ablate",
            "--config",
            "tiny_pretrain",
            *ABL,
            "--variant",
            "base:training.learning_rate=1e-3",
            "--variant",
            "short:training.num_train_steps=1",
            "--out",
            "abl",
        ],
        "same data order and token budget",
    ),
    Case(
        "ablate-bad-seeds",
        ["ablate", "--config", "tiny_pretrain", *ABL, "--variants", "V0", "--seeds", "0,x"],
        "--seeds: must be comma-separated whole numbers",
    ),
    Case("ablate-no-config", ["ablate", "--variants", "V0"], "needs --config"),
    Case("ablate-report-not-an-ablation", ["ablate", "--report", "."], "holds no ablation"),
    Case(
        "ablate-variant-bad-override",
        ["ablate", "--config", "tiny_pretrain", *ABL, "--variant", "x:training.learnin_rate=1", "--out", "abl"],
        "did you mean training.learning_rate",
    ),
    Case("speedrun-depth-zero", ["speedrun", "--depth", "0"], "must be > 0"),
    Case("speedrun-core-not-a-bundle", ["speedrun", "--core", "nowhere", *SPEED], "is not a CORE eval bundle"),
    Case(
        "core-bundle-not-a-bundle",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "training.core_bundle=b"],
        "is not a CORE eval bundle: no eval_meta_data.csv",
        write("b/core.yaml", "icl_tasks: []\n"),
    ),
    Case(
        "core-bundle-in-rl",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "training.core_bundle=b"],
        "training.core_bundle measures a language model during token-row training; rl does not",
    ),
    Case(
        "core-bundle-tensor-parallel",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "training.core_bundle=b", "infra.tensor_parallel_size=2"],
        "training.core_bundle scores a decoder-only model",
    ),
    Case(
        "neftune-in-dpo",
        ["dpo", "--config", cfg(DPO_CFG), *CHAT, "model.model_name_or_path={sft}", *NEFTUNE],
        "training.neftune_noise_alpha noises the embeddings of supervised fine-tuning; dpo does not take it",
    ),
    Case(
        "neftune-tensor-parallel",
        [
            "sft",
            "--config",
            cfg(SFT_CFG),
            *CHAT,
            "model.model_name_or_path={pre}",
            *NEFTUNE,
            "infra.tensor_parallel_size=2",
        ],
        "training.neftune_noise_alpha noises a PyTorch model's embedding table whole on each rank",
    ),
    Case("profile-steps-backwards", ["config", "show", "training.profile_steps=[3,2]"], "1 <= first <= last"),
    Case(
        "profile-steps-past-the-end",
        ["config", "show", "training.num_train_steps=5", "training.warmup_steps=0", "training.profile_steps=[4,6]"],
        "training.profile_steps ends at step 6, after the run's last",
    ),
    Case(
        "profile-steps-jax",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "infra.backend=jax", "training.profile_steps=[1,1]"],
        "training.profile_steps traces PyTorch's operators",
    ),
    Case("neftune-not-positive", ["config", "show", "training.neftune_noise_alpha=0"], "must be > 0"),
    Case(
        "sft-loss-unknown",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path={pre}", "training.sft_loss=focal"],
        "training.sft_loss=focal is not one of nll, dft",
    ),
    Case(
        "sft-loss-in-pretraining",
        ["pretrain", "--config", cfg(PRE), *TINY, "training.sft_loss=dft"],
        "training.sft_loss is supervised fine-tuning's loss; pretrain does not take it",
    ),
    Case(
        "core-steps-negative",
        ["pretrain", "--config", "tiny_pretrain", *TINY, "training.core_steps=-1"],
        "core_steps",
    ),
    Case("speedrun-out-is-a-file", ["speedrun", "--out", "f", *SPEED], "is a file", write("f", "x")),
    Case("plan-bad-stage", ["plan", "--stage", "finetune"], "invalid choice"),
    Case("plan-bad-speed", ["plan", "--config", "tiny_pretrain", *TINY, "--tokens-per-sec", "-3"], "must be > 0"),
    Case("plan-bad-world-size", ["plan", "--config", "tiny_pretrain", *TINY, "--world-size", "0"], "must be > 0"),
    Case(
        "plan-speed-and-measure",
        ["plan", "--config", "tiny_pretrain", *TINY, "--measure", "--tokens-per-sec", "5"],
        "not allowed with",
    ),
    Case(
        "tokenizer-into-its-input",
        ["tokenizer", "train", "--data", "data", "--out", "data/tok"],
        "overlaps the input",
        write("data/d.txt", "hello world\n"),
    ),
    # -- overrides a command cannot honour: refused, never dropped -----------------------------
    Case(
        "pretrain-dpo-key",
        ["pretrain", "--config", cfg(PRE), *TINY, "dpo.beta=0.2"],
        r"dpo.beta has no effect on `tierlm pretrain`: dpo.\* is read by tierlm dpo",
    ),
    Case(
        "sft-rl-key",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path={pre}", "rl.group_size=4"],
        r"rl.group_size has no effect on `tierlm sft`: rl.\* is read by tierlm rl",
    ),
    Case(
        "dpo-rl-key",
        ["dpo", "--config", cfg(DPO_CFG), *CHAT, "model.model_name_or_path={sft}", "rl.kl_coef=0.1"],
        "rl.kl_coef has no effect on `tierlm dpo`",
    ),
    Case(
        "rl-dpo-key",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "dpo.beta=0.2"],
        "dpo.beta has no effect on `tierlm rl`",
    ),
    Case(
        "rl-ablation-key",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "ablation.seeds=[1]"],
        "ablation.seeds has no effect on `tierlm rl`: ablation.* is read by tierlm ablate",
    ),
    Case(
        "sft-shape-of-a-started-model",
        ["sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path={pre}", "model.depth=8"],
        "model.depth shapes a model built from scratch, but `tierlm sft` starts from .*pre",
    ),
    Case(
        "dpo-variant-of-a-started-model",
        ["dpo", "--config", cfg(DPO_CFG), *CHAT, "model.model_name_or_path={sft}", "model.variant=V3"],
        "model.variant has no effect on a gpt model, which reads model.depth",
    ),
    Case(
        "rl-nested-shape-of-a-started-model",
        ["rl", "--config", cfg(RL_CFG), *RL, "model.model_name_or_path={sft}", "model.ra.r=4"],
        "model.ra.r has no effect on a gpt model",
    ),
    Case(
        "pretrain-setting-the-family-does-not-read",
        ["pretrain", "--config", cfg(PRE), *TINY, "model.window_pattern=SL", "model.architecture=gpt2"],
        "model.window_pattern has no effect on a gpt2 model",
    ),
    Case(
        "plan-rl-key-for-pretrain",
        ["plan", "--config", cfg(PRE), *TINY, "rl.group_size=2"],
        "rl.group_size has no effect on `tierlm plan`",
    ),
    Case(
        "plan-shape-of-a-started-model",
        ["plan", "--stage", "sft", "--config", cfg(SFT_CFG), *CHAT, "model.model_name_or_path={pre}", "model.depth=3"],
        "model.depth shapes a model built from scratch, but `tierlm plan` starts from",
    ),
    Case(
        "eval-training-key",
        ["eval", "--checkpoint", "{sft}", "--config", cfg(RL_CFG), "training.learning_rate=0.1"],
        r"training.learning_rate has no effect on `tierlm eval`, which reads rl.\*, engine.\*, data.\*, training.seed",
    ),
    Case(
        "eval-model-override",
        ["eval", "--checkpoint", "{sft}", "--config", cfg(RL_CFG), "model.model_name_or_path={pre}"],
        "does not take model.model_name_or_path: the model is --checkpoint",
    ),
    Case(
        "eval-output-dir",
        ["eval", "--checkpoint", "{sft}", "--config", cfg(RL_CFG), "infra.output_dir=out"],
        "infra.output_dir has no effect on `tierlm eval`",
    ),
    Case(
        "eval-device-twice",
        ["eval", "--checkpoint", "{sft}", "--config", cfg(RL_CFG), "--device-type", "cpu", "infra.device_type=cpu"],
        "give the device once",
    ),
    Case(
        "sample-takes-no-overrides",
        ["sample", "--checkpoint", "{sft}", "--prompt", "hi", "training.seed=3"],
        "unrecognized arguments: training.seed=3",
    ),
    Case(
        "ablate-output-dir",
        ["ablate", "--config", "tiny_pretrain", *TINY, "--variants", "V0"],
        "does not take infra.output_dir: the ablation folder is --out",
    ),
    Case(
        "ablate-output-dir-after-the-flags",
        ["ablate", "--config", "tiny_pretrain", *ABL, "--variants", "V0", "infra.output_dir=x"],
        "does not take infra.output_dir: the ablation folder is --out",
    ),
    Case(
        "ablate-variant-output-dir",
        ["ablate", "--config", "tiny_pretrain", *ABL, "--variant", "x:infra.output_dir=y", "--out", "abl"],
        "does not take infra.output_dir",
    ),
    Case(
        "ablate-seed-override",
        ["ablate", "--config", "tiny_pretrain", *ABL, "--variants", "V0", "training.seed=3"],
        "does not take training.seed: each replicate's seed comes from --seeds",
    ),
    Case(
        "ablate-variant-reads-nothing",
        ["ablate", "--config", "tiny_pretrain", *ABL, "--variant", "x:rl.group_size=3", "--out", "abl"],
        "rl.group_size has no effect on `tierlm ablate`",
    ),
    Case(
        "ablate-variants-twice",
        ["ablate", "--config", "tiny_pretrain", *ABL, "--variants", "V0", "ablation.variants=[V1]"],
        "ablation.variants and its flag .--variants. both given",
    ),
    Case(
        "ablate-seeds-twice",
        ["ablate", "--config", "tiny_pretrain", *ABL, "--variants", "V0", "--seeds", "1", "ablation.seeds=[2]"],
        "ablation.seeds and its flag .--seeds. both given",
    ),
    Case(
        "speedrun-output-dir-override",
        ["speedrun", *SPEED, "infra.output_dir=o"],
        "does not take infra.output_dir: the speedrun places",
    ),
    Case("speedrun-depth-override", ["speedrun", "model.depth=3"], "does not take model.depth: the depth is --depth"),
    Case(
        "speedrun-data-override",
        ["speedrun", "data.dataset_name=x.txt"],
        "does not take data.dataset_name: the pretraining data is --pretrain-data",
    ),
    Case("speedrun-dpo-key", ["speedrun", "dpo.beta=0.3"], "dpo.beta has no effect on `tierlm speedrun`"),
    # -- an ablation checks every variant before its first run --------------------------------
    Case(
        "ablate-variant-not-a-step",
        ["ablate", "--config", "gpt2-shakespeare-char", "--variants", "V0,V99", "--seeds", "0", "--out", "abl"],
        "variant V99: model.variant 'V99' is not a V-series step",
    ),
    Case(
        "ablate-variant-missing-data",
        ["ablate", "--config", "tiny_pretrain", *ABL, "--variant", "b:data.dataset_name=missing.txt", "--out", "abl"],
        "variant b: dataset 'missing.txt' is neither an existing file",
    ),
    Case(
        "ablate-variant-not-causal",
        ["ablate", "--config", "tiny_pretrain", *ABL, "--variant", "t5:model.architecture=t5", "--out", "abl"],
        "variant t5: model.architecture 't5' is not a decoder-only causal LM",
    ),
    Case(
        "ablate-sft-variant-not-utf8",
        [
            "ablate",
            "--stage",
            "sft",
            "--config",
            cfg(SFT_CFG),
            *[a for a in CHAT if not a.startswith("infra.output_dir")],
            "model.model_name_or_path={pre}",
            "--variant",
            "own:data.dataset_name=c.jsonl",
            "--out",
            "abl",
        ],
        "variant own: .*c.jsonl",
        write("c.jsonl", b"\xff\xfe not text\n"),
    ),
    # -- DeepSpeed, epochs, resuming from any checkpoint, the FSDP2 story's names, pretrained GPT-2 variants ---
    Case(
        "deepspeed-without-a-launcher",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.distributed_type=deepspeed"],
        "runs under a launcher",
    ),
    Case(
        "deepspeed-for-dpo",
        ["dpo", "--config", cfg(DPO_CFG), *CHAT, "model.model_name_or_path={sft}", "infra.distributed_type=deepspeed"],
        "does not run under DeepSpeed",
    ),
    Case(
        "dpo-loss-weights-one-short",
        [
            "dpo",
            "--config",
            cfg(DPO_CFG),
            *CHAT,
            "model.model_name_or_path={sft}",
            "dpo.loss_type=[sigmoid,bco_pair,sft]",
            "dpo.loss_weights=[0.8,0.2]",
        ],
        "dpo.loss_weights has 2 weights for the 3 losses of dpo.loss_type=sigmoid,bco_pair,sft",
    ),
    Case(
        "kto-under-pipeline-stages",
        [
            "dpo",
            "--config",
            cfg(DPO_CFG),
            *CHAT,
            "model.model_name_or_path={sft}",
            "dpo.loss_type=kto",
            "infra.pipeline_parallel_size=2",
        ],
        "compares the rows of the whole batch",
    ),
    Case(
        "dpo-pairs-that-do-not-split-into-pipeline-pieces",
        [
            "dpo",
            "--config",
            cfg(DPO_CFG),
            *CHAT,
            "model.model_name_or_path={sft}",
            "training.per_device_train_batch_size=3",
            "infra.pipeline_parallel_size=2",
        ],
        "a multiple of 2",
    ),
    Case(
        "deepspeed-setting-without-deepspeed",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.deepspeed_offload_optimizer=true"],
        "is a DeepSpeed setting",
    ),
    Case(
        "deepspeed-param-offload-at-stage-2",
        [
            "pretrain",
            "--config",
            cfg(PRE),
            *TINY,
            "infra.distributed_type=deepspeed",
            "infra.deepspeed_zero_stage=2",
            "infra.deepspeed_offload_params=true",
        ],
        "deepspeed_zero_stage=3",
    ),
    Case(
        "deepspeed-with-tensor-parallel",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.distributed_type=deepspeed", "infra.tensor_parallel_size=2"],
        "shards by ZeRO",
    ),
    Case(
        "deepspeed-with-fsdp-offload",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.distributed_type=deepspeed", "infra.cpu_offload=true"],
        "FSDP's",
    ),
    Case(
        "epochs-with-a-horizon",
        ["pretrain", "--config", cfg(PRE), *TINY, "training.num_train_epochs=1", "training.target_param_data_ratio=10"],
        "keep one",
    ),
    Case(
        "epochs-with-steps",
        ["pretrain", "--config", cfg(PRE), *TINY, "training.num_train_epochs=1", "training.num_train_steps=5"],
        "num_train_steps=null",
    ),
    Case(
        "epochs-too-few-for-a-step",
        ["pretrain", "--config", cfg(PRE), *TINY, "training.num_train_epochs=0.001", "training.num_train_steps=null"],
        "make no whole step",
    ),
    Case(
        "epochs-not-positive",
        ["pretrain", "--config", cfg(PRE), *TINY, "training.num_train_epochs=0"],
        "num_train_epochs",
    ),
    Case(
        "resume-from-nowhere",
        ["pretrain", "--config", cfg(PRE), *TINY, "--resume-from", "./nowhere"],
        "is not a checkpoint folder",
    ),
    Case(
        "resume-from-another-shape",
        ["pretrain", "--config", cfg(PRE), *TINY, "model.depth=2", "--resume-from", "{pre}/checkpoints/step_3"],
        "was run with model.depth=1",
    ),
    Case(
        "num-gpus-not-launched",
        ["pretrain", "--config", cfg(PRE), *TINY, "infra.num_gpus=8"],
        "infra.num_gpus=8 but 1 rank",
    ),
    Case(
        "story-name-and-tierlm-name-disagree",
        ["pretrain", "--config", "story.yaml"],
        "infra.logging_dir=b is tierlm's training.logging_dir",
        write("story.yaml", "training:\n  logging_dir: a\ninfra:\n  logging_dir: b\n"),
    ),
    Case(
        "eval-samples-against-eval-batches",
        ["pretrain", "--config", cfg(PRE), *TINY, "training.eval_samples=64", "training.eval_batches=1"],
        "keep one",
    ),
    Case(
        "accelerate-config-as-tierlm-config",
        ["pretrain", "--config", "accelerate_fsdp2"],
        "Accelerate's launcher config",
    ),
    Case(
        "gpt2-variant-that-cannot-start-as-pretrained",
        [
            "pretrain",
            "--config",
            cfg(PRE),
            *TINY[3:],
            "model.architecture=gpt2",
            "model.model_name_or_path=gpt2",
            "model.variant=V11",
        ],
        "cannot start as the pretrained GPT-2",
        gpt2_folder("gpt2"),
    ),
    Case(
        "gpt2-variant-of-a-hub-id",
        [
            "pretrain",
            "--config",
            cfg(PRE),
            *TINY[3:],
            "model.architecture=gpt2",
            "model.model_name_or_path=openai-community/gpt2",
            "model.variant=V3",
        ],
        "download openai-community/gpt2 first",
    ),
]


def _other_vocabulary(model: Path, out: Path) -> None:
    """A copy of a model folder whose tokenizer is another one (a character vocabulary)."""
    from tierlm.data import train_char_tokenizer

    shutil.copytree(model, out)
    (out / "training_meta.json").unlink()
    train_char_tokenizer(["abc 123"]).save(out)


def _swap_weights(run: Path) -> None:
    """Replace a run's weights with another model's (other shapes), recording them as its own."""
    from safetensors.torch import save_file

    from tierlm.checkpoint import file_manifest
    from tierlm.models import GPTConfig, build_gpt

    other = build_gpt(GPTConfig(depth=1, aspect_ratio=16, head_dim=16, vocab_size=50, max_seq_len=16))
    from tierlm.models.gpt.hf_export import to_hf_name

    save_file(
        {to_hf_name(k): v.contiguous() for k, v in other.state_dict().items()}, run / "model" / "model.safetensors"
    )
    meta = json.loads((run / "model" / "training_meta.json").read_text())
    meta["manifest"] = file_manifest(run / "model", exclude=("training_meta.json",))
    (run / "model" / "training_meta.json").write_text(json.dumps(meta))


def test_the_table_is_broad():
    commands = {c.argv[0] for c in CASES}
    assert len(CASES) >= 60, len(CASES)
    assert {
        "pretrain",
        "sft",
        "dpo",
        "rl",
        "eval",
        "sample",
        "export",
        "average",
        "tokenizer",
        "config",
        "plan",
        "ablate",
        "speedrun",
    } <= commands


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_written(case, runs, tmp_path, monkeypatch, capsys):
    if case.id == "rl-vllm-not-installed" and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this Python")
    work = tmp_path / "w"
    work.mkdir()
    monkeypatch.chdir(work)
    if case.setup is not None:
        case.setup(work, runs)
    before, shared = snapshot(work), snapshot(runs)
    capsys.readouterr()
    argv = [a.replace("{pre}", str(runs / "pre")).replace("{sft}", str(runs / "sft")) for a in case.argv]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    captured = capsys.readouterr()
    err = captured.err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"exit {code}; stderr:\n{err}"
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    assert lines[0].startswith("tierlm: error: "), lines[0]
    assert re.search(case.expect, lines[0], re.IGNORECASE), f"{lines[0]!r} does not match {case.expect!r}"
    assert snapshot(work) == before, "the command changed the working folder"
    assert not captured.out.strip(), f"printed before the refusal:\n{captured.out}"
    assert snapshot(runs) == shared, "the command changed a shared run"

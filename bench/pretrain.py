"""Pretraining speed: tierlm against a minimal hand-written PyTorch loop and transformers `Trainer`.

    .venv/bin/python bench/pretrain.py [--repeats 3] [--steps 30] [--shape default|small]

Every contender trains the same model from the same seed on the same pre-tokenized
tinyshakespeare. `--shape default`: the native GPT (depth 4, width 256, vocab 4096 BPE), batch
8 x 256 tokens. `--shape small`: the `gpt2-shakespeare-char` shape, GPT-2 with 4 layers, 4 heads,
128 wide (~0.8M parameters), characters, batch 12 x 64 tokens, where a step's arithmetic is small and
per-step overheads show. Both: the same global batch,
fp32, AdamW (lr 1e-3, betas 0.9/0.95, no weight decay), 5 warm-up steps then cosine decay, and
gradient clipping at 1.0. Tokens/s are over the steps after the first 5 (compilation of nothing,
allocator warm-up); evaluation, logging and checkpointing sit outside that window.
  - tierlm: `tierlm pretrain` on the token file (packed rows, prefetching loader, the full Trainer);
  - tierlm-jax: the same with `infra.backend=jax` (the default shape only: the JAX backend has the native GPT);
  - hand-loop: model, fused AdamW, `F.cross_entropy`, random windows of the token stream;
  - hf-trainer: transformers `Trainer` on the same windows (the GPT wrapped to return its loss).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import parser, run  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
SHAPES = {
    "default": {"batch": 8, "seq": 256, "tokenizer": "bpe"},
    "small": {"batch": 12, "seq": 64, "tokenizer": "char"},
}
WARMUP, LR = 5, 1e-3
SHAPE = "default"
BATCH, SEQ = SHAPES[SHAPE]["batch"], SHAPES[SHAPE]["seq"]


def use_shape(name: str) -> None:
    global SHAPE, BATCH, SEQ
    SHAPE, BATCH, SEQ = name, SHAPES[name]["batch"], SHAPES[name]["seq"]


def work() -> Path:
    return Path(tempfile.gettempdir()) / f"tierlm_bench_pretrain_{SHAPE}"


def prepare() -> tuple[Path, Path]:
    """A tokenizer trained on tinyshakespeare (4,096-token BPE, or characters) and the text as a uint16
    token file (paragraphs as documents)."""
    from tierlm.data import load_tokenizer, train_bpe_tokenizer, train_char_tokenizer

    tok_dir, bin_path = work() / "tokenizer", work() / "shakespeare.bin"
    if not bin_path.is_file():
        work().mkdir(parents=True, exist_ok=True)
        paragraphs = [p for p in DATA.read_text().split("\n\n") if p.strip()]
        tokenizer = (
            train_char_tokenizer(paragraphs)
            if SHAPES[SHAPE]["tokenizer"] == "char"
            else train_bpe_tokenizer(paragraphs, 4096)
        )
        tokenizer.save(tok_dir)
        tokenizer = load_tokenizer(tok_dir)
        ids = []
        for ids_ in tokenizer.encode_batch(paragraphs):
            ids += [tokenizer.document_separator_id] + ids_
        np.asarray(ids, dtype=np.uint16).tofile(bin_path)
    return tok_dir, bin_path


def gpt(vocab: int):
    from tierlm.models import GPTConfig, build_gpt
    from tierlm.models.gpt2.family import GPT2_FAMILY
    from tierlm.models.gpt2.model import GPT2Config

    torch.manual_seed(0)
    if SHAPE == "small":
        return GPT2_FAMILY.build_from_config(
            GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=vocab, block_size=2048)
        )
    return build_gpt(GPTConfig(depth=4, aspect_ratio=64, head_dim=64, n_kv_head=2, vocab_size=vocab, max_seq_len=SEQ))


def model_overrides() -> list[str]:
    if SHAPE == "small":
        return ["model.architecture=gpt2", "model.depth=4", "model.aspect_ratio=32", "model.head_dim=32"]
    return [
        "model.architecture=gpt",
        "model.depth=4",
        "model.aspect_ratio=64",
        "model.head_dim=64",
        "model.n_kv_head=2",
    ]


def schedule(total: int):
    return lambda step: (
        (step + 1) / WARMUP
        if step < WARMUP
        else 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / max(1, total - WARMUP)))
    )


def windows(bin_path: Path, steps: int):
    tokens = torch.from_numpy(np.fromfile(bin_path, dtype=np.uint16).astype(np.int64))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - SEQ - 1, (BATCH,), generator=g)
        rows = torch.stack([tokens[s : s + SEQ + 1] for s in starts])
        yield rows[:, :-1], rows[:, 1:]


def result(times: dict[int, float], total: int) -> dict:
    timed = total - WARMUP
    return {"tokens_per_sec": timed * BATCH * SEQ / (times[total] - times[WARMUP]), "timed_steps": timed}


def tierlm(args) -> dict:
    from tierlm.config import TierlmConfig
    from tierlm.stages import run_stage

    tok_dir, bin_path = prepare()
    out = Path(tempfile.mkdtemp(prefix="tierlm_bench_run_"))
    total = WARMUP + args.steps
    config = TierlmConfig.load(
        None,
        [
            *model_overrides(),
            f"model.tokenizer_name_or_path={tok_dir}",
            f"data.dataset_name={bin_path}",
            f"data.max_seq_length={SEQ}",
            f"training.per_device_train_batch_size={BATCH}",
            f"training.learning_rate={LR}",
            "training.adam_beta2=0.95",
            f"training.num_train_steps={total}",
            f"training.warmup_steps={WARMUP}",
            "training.lr_scheduler_type=cosine",
            "training.min_lr_ratio=0.0",
            "training.max_grad_norm=1.0",
            "training.eval_steps=0",
            "training.eval_batches=1",
            f"training.logging_steps={WARMUP}",
            "training.save_steps=0",
            f"infra.output_dir={out}",
            "infra.device_type=cpu",
            "infra.progress_bar=false",
            *args.overrides,
        ],
    )
    run_stage(config, "pretrain")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["elapsed_s"] for r in lines if r["type"] == "train"}
    return result(times, total)


def hand_loop(args) -> dict:
    from tierlm.data import load_tokenizer

    tok_dir, bin_path = prepare()
    model = gpt(load_tokenizer(tok_dir).vocab_size)
    total = WARMUP + args.steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(total))
    times, start = {}, time.perf_counter()
    for step, (x, y) in enumerate(windows(bin_path, total), start=1):
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        times[step] = time.perf_counter() - start
    return result(times, total)


def hf_trainer(args) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from tierlm.data import load_tokenizer

    tok_dir, bin_path = prepare()
    total = WARMUP + args.steps

    class WithLoss(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, labels):
            logits = self.model(input_ids)
            return {"loss": F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1)), "logits": logits}

    rows = [{"input_ids": x[i], "labels": y[i]} for x, y in windows(bin_path, total) for i in range(BATCH)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.start = {}, None

        def on_train_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, a, state, *rest, **k):
            self.times[state.global_step] = time.perf_counter() - self.start

    clock = Clock()
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="tierlm_bench_hf_"),
        max_steps=total,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        adam_beta1=0.9,
        adam_beta2=0.95,
        weight_decay=0.0,
        lr_scheduler_type="cosine",
        warmup_steps=WARMUP,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        logging_steps=10_000,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    Trainer(
        model=WithLoss(gpt(load_tokenizer(tok_dir).vocab_size)),
        args=training_args,
        train_dataset=rows,
        callbacks=[clock],
    ).train()
    return result(clock.times, total)


def tierlm_jax(args) -> dict:
    """tierlm with infra.backend=jax (the same run; jax.jit's compilation falls in the untimed warm-up)."""
    args.overrides = [*args.overrides, "infra.backend=jax"]
    return tierlm(args)


CONTENDERS = {"tierlm": tierlm, "tierlm-jax": tierlm_jax, "hand-loop": hand_loop, "hf-trainer": hf_trainer}

if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=30, help="timed steps (after 5 warm-up steps)")
    p.add_argument("--shape", choices=list(SHAPES), default="default", help="model and batch (see the docstring)")
    p.add_argument("--overrides", nargs="*", default=[], help="extra tierlm config overrides (section.key=value)")
    args = p.parse_args()
    use_shape(args.shape)
    if args.contender is None:
        prepare()
        print(
            f"pretrain ({SHAPE}), batch {BATCH} x {SEQ} tokens, {args.steps} timed steps, {args.threads} threads",
            file=sys.stderr,
        )
    argv = [
        f"--steps={args.steps}",
        f"--threads={args.threads}",
        f"--shape={args.shape}",
        "--overrides",
        *args.overrides,
    ]
    run(CONTENDERS, args, argv, "tokens_per_sec", "hand-loop")

"""SFT speed on long-tailed conversations: tierlm against transformers `Trainer` with padding and TRL `SFTTrainer`.

    .venv/bin/python bench/sft.py [--repeats 3] [--steps 15]

Every contender trains the same transformers Qwen3 model (the native GPT's architecture: depth 4,
width 256, vocab 4,096, exported once from one seed) on the same 1,000 conversations of
log-normal length cut from tinyshakespeare (see bench/packing.py), rendered by the same chat
template (turns of median 15 and 30 words: median ~190 tokens a conversation, a tail to
thousands), with rows of at most 512 tokens, 8 rows per step, fp32, AdamW (lr 1e-4), 5 warm-up
steps. The figure is trained tokens/s: tokens that carry loss (never padding) over the steps after
the first 5.
  - tierlm: `tierlm sft` (best-fit packing, padding-free rows, loss on assistant tokens) on the
    same weights as a native GPT (the LM head fused into the loss: no (B, T, V) logits);
  - tierlm-hf-model: the same, training the transformers model itself (its own attention; the
    head fused into the loss as well);
  - hf-trainer-padded: transformers `Trainer`, one conversation per row padded to the longest in
    the batch, loss on assistant tokens;
  - trl-defaults: TRL `SFTTrainer` with its defaults (no packing; loss on every token);
  - trl-packed: TRL with `packing=True` (best-fit, padding-free) and `assistant_only_loss=True`.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import parser, run  # noqa: E402
from packing import long_tailed_conversations  # noqa: E402
from pretrain import DATA, prepare  # noqa: E402

WORK = Path(tempfile.gettempdir()) / "tierlm_bench_sft"
ROWS, SEQ, WARMUP, LR, CONVERSATIONS = 8, 512, 5, 1e-4, 1000
# The chat template with TRL's {% generation %} markers around what the assistant writes (the
# rendering is unchanged; TRL needs the markers to mask everything else).
GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|assistant_start|>' }}{% generation %}{{ message['content'] + "
    "'<|assistant_end|>' }}"
    "{% endgeneration %}{% else %}{{ '<|' + message['role'] + '_start|>' + message['content'] + '<|' + message['role'] "
    "+ '_end|>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant_start|>' }}{% endif %}"
)


def setup() -> tuple[Path, Path, Path]:
    """(tokenizer, transformers model folder, conversations JSONL), made once; the same weights as
    a native GPT folder in WORK / "native"."""
    from tierlm.models import GPTConfig, build_gpt, save_model_folder
    from tierlm.models.gpt.hf_export import to_hf_config

    tok_dir, _ = prepare()
    model_dir, data = WORK / "model", WORK / "conversations.jsonl"
    if not (model_dir / "model.safetensors").is_file():
        from transformers import Qwen3ForCausalLM

        from tierlm.data import load_tokenizer

        WORK.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        config = GPTConfig(
            depth=4,
            aspect_ratio=64,
            head_dim=64,
            n_kv_head=2,
            vocab_size=load_tokenizer(tok_dir).vocab_size,
            max_seq_len=2048,
        )
        gpt = build_gpt(config)
        hf = Qwen3ForCausalLM(to_hf_config(config))
        from tierlm.models.gpt.hf_export import to_hf_name

        hf.load_state_dict({to_hf_name(k): v for k, v in gpt.state_dict().items()}, strict=False)
        hf.save_pretrained(model_dir)
        save_model_folder(gpt, WORK / "native")
        with open(data, "w") as f:
            # Turns of median 15 and 30 words: conversations of median ~190 tokens with a tail far past a row.
            for conversation in long_tailed_conversations(
                DATA.read_text(), CONVERSATIONS, seed=0, user_words=15, assistant_words=30
            ):
                f.write(json.dumps({"messages": conversation}) + "\n")
    return tok_dir, model_dir, data


def rate(times: dict[int, float], trained: dict[int, int], total: int) -> dict:
    return {
        "trained_tokens_per_sec": (trained[total] - trained[WARMUP]) / (times[total] - times[WARMUP]),
        "timed_steps": total - WARMUP,
    }


def tierlm(args, native: bool) -> dict:
    from tierlm.config import TierlmConfig
    from tierlm.stages import run_stage

    tok_dir, model_dir, data = setup()
    model_dir = WORK / "native" if native else model_dir
    out, total = Path(tempfile.mkdtemp(prefix="tierlm_bench_sft_")), WARMUP + args.steps
    config = TierlmConfig.load(
        None,
        [
            f"model.model_name_or_path={model_dir}",
            f"model.tokenizer_name_or_path={tok_dir}",
            f"data.dataset_name={data}",
            f"data.max_seq_length={SEQ}",
            "data.val_fraction=0.01",
            "data.long_conversations=truncate",
            f"training.per_device_train_batch_size={ROWS}",
            f"training.learning_rate={LR}",
            f"training.num_train_steps={total}",
            f"training.warmup_steps={WARMUP}",
            "training.lr_scheduler_type=constant",
            "training.eval_steps=0",
            "training.eval_batches=1",
            "training.logging_steps=1",
            "training.save_steps=0",
            f"infra.output_dir={out}",
            "infra.device_type=cpu",
            "infra.progress_bar=false",
        ],
    )
    run_stage(config, "sft")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    return rate({r["step"]: r["elapsed_s"] for r in lines}, {r["step"]: r["trained_tokens"] for r in lines}, total)


class Clock:
    """A transformers TrainerCallback timing steps and counting trained tokens (built lazily: transformers imports
    slowly)."""

    @staticmethod
    def make():
        from transformers import TrainerCallback

        class _Clock(TrainerCallback):
            def __init__(self):
                self.times, self.trained, self.start, self.count, self.shapes = {}, {}, None, 0, []

            def on_train_begin(self, *a, **k):
                self.start = time.perf_counter()

            def on_step_end(self, a, state, *rest, **k):
                self.times[state.global_step] = time.perf_counter() - self.start
                self.trained[state.global_step] = self.count

        return _Clock()


def counting(collate, clock):
    """Wrap a collator to count the tokens that carry loss in each batch it hands out."""

    def wrapped(rows):
        batch = collate(rows)
        clock.count += int((batch["labels"][:, 1:] != -100).sum())  # the model shifts: the first label never counts
        clock.shapes.append(tuple(batch["input_ids"].shape))
        return batch

    return wrapped


def hf_trainer_padded(args) -> dict:
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from tierlm.data import load_tokenizer

    tok_dir, model_dir, data = setup()
    tokenizer, total = load_tokenizer(tok_dir), WARMUP + args.steps
    rows = []
    for line in data.read_text().splitlines():
        ids, mask = tokenizer.render_conversation(json.loads(line)["messages"])
        ids, mask = ids[:SEQ], mask[:SEQ]
        rows.append({"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask)]})

    def pad(batch):
        width = max(len(r["input_ids"]) for r in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_id)
        labels = torch.full((len(batch), width), -100)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r["input_ids"])
            ids[i, :n], labels[i, :n], attention[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
        return {"input_ids": ids, "labels": labels, "attention_mask": attention}

    clock = Clock.make()
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="tierlm_bench_hf_"),
        max_steps=total,
        per_device_train_batch_size=ROWS,
        learning_rate=LR,
        warmup_steps=WARMUP,
        lr_scheduler_type="constant_with_warmup",
        optim="adamw_torch_fused",
        logging_steps=10_000,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        remove_unused_columns=False,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    Trainer(
        model=model, args=training_args, train_dataset=rows, data_collator=counting(pad, clock), callbacks=[clock]
    ).train()
    return rate(clock.times, clock.trained, total)


def trl(args, packed: bool) -> dict:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok_dir, model_dir, data = setup()
    tokenizer, total = AutoTokenizer.from_pretrained(tok_dir), WARMUP + args.steps
    extra = {}
    if packed:
        tokenizer.chat_template = GENERATION_TEMPLATE
        extra = {"packing": True, "assistant_only_loss": True}
    config = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="tierlm_bench_trl_"),
        max_steps=total,
        per_device_train_batch_size=ROWS,
        learning_rate=LR,
        warmup_steps=WARMUP,
        lr_scheduler_type="constant_with_warmup",
        optim="adamw_torch_fused",
        logging_steps=10_000,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        max_length=SEQ,
        seed=0,
        **extra,
    )
    clock = Clock.make()
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=config,
        train_dataset=load_dataset("json", data_files=str(data), split="train"),
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.data_collator = counting(trainer.data_collator, clock)
    trainer.train()
    print("batch shapes:", clock.shapes[:3], file=sys.stderr)
    return rate(clock.times, clock.trained, total)


CONTENDERS = {
    "tierlm": lambda a: tierlm(a, native=True),
    "tierlm-hf-model": lambda a: tierlm(a, native=False),
    "hf-trainer-padded": hf_trainer_padded,
    "trl-defaults": lambda a: trl(a, packed=False),
    "trl-packed": lambda a: trl(a, packed=True),
}

if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=15, help="timed steps (after 5 warm-up steps)")
    args = p.parse_args()
    if args.contender is None:
        setup()
        print(f"sft, {ROWS} rows of <= {SEQ} tokens, {args.steps} timed steps, {args.threads} threads", file=sys.stderr)
    run(
        CONTENDERS,
        args,
        [f"--steps={args.steps}", f"--threads={args.threads}"],
        "trained_tokens_per_sec",
        "hf-trainer-padded",
    )

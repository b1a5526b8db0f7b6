"""A conversation's training tokens and a completion's answer text at a large vocabulary.

    .venv/bin/python bench/chat_rendering.py [--checkpoint runs/tiny_sft] [--vocab 151000]

SFT renders every conversation to ids and a mask (`Tokenizer.render_conversation`), RL reads every completion's answer
(`tierlm.rollout.text.answer_text`): per item, so anything per call that grows with the vocabulary is paid once per
conversation or completion, and anything that grows with a conversation's length times its turns is paid by the
long multi-turn conversations of real SFT data (timed too: ten exchanges, each answer calling the calculator, 4,411
tokens with the main job's tokenizer). The checkpoint's tokenizer (its chat template, special tokens and merges) is
timed as it is and with its vocabulary padded to `--vocab` entries (tokens no text produces: the ids of every text
stay the same, as checked), Qwen3's size by default. Prints milliseconds per call, the best of 3 rounds.
"""

from __future__ import annotations

import argparse
import json
import time

from tokenizers import Tokenizer as RustTokenizer
from transformers import PreTrainedTokenizerFast

from tierlm.checkpoint.load import resolve_model_location
from tierlm.data.tokenizer import Tokenizer, load_tokenizer
from tierlm.rollout.text import answer_text
from tierlm.special_tokens import TOOL_CALL_END, TOOL_CALL_START, TOOL_RESULT_END, TOOL_RESULT_START

CONVERSATION = [
    {"role": "user", "content": "What is 23 + 45?"},
    {
        "role": "assistant",
        "content": f"{TOOL_CALL_START}23 + 45{TOOL_CALL_END}{TOOL_RESULT_START}68{TOOL_RESULT_END} 23 + 45 = 68",
    },
]

LONG = [
    message
    for turn in range(10)
    for message in (
        {"role": "user", "content": f"What is {turn}23 + 456? " * 20},
        {
            "role": "assistant",
            "content": (
                f"{TOOL_CALL_START}{turn}23 + 456{TOOL_CALL_END}{TOOL_RESULT_START}{turn}579{TOOL_RESULT_END} "
                + f"{turn}23 + 456 = {turn}579. " * 10
            ),
        },
    )
]


def padded(tokenizer: Tokenizer, size: int) -> Tokenizer:
    """`tokenizer` with its model's vocabulary padded to `size` entries that no merge produces."""
    spec = json.loads(tokenizer.hf.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    first = len(vocab) + len(tokenizer.hf.added_tokens_encoder)
    for i in range(size - len(tokenizer.hf)):
        vocab[f"\u4e00{i}"] = first + i
    special = {k: getattr(tokenizer.hf, k) for k in ("bos_token", "eos_token", "pad_token") if getattr(tokenizer.hf, k)}
    hf = PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(json.dumps(spec)), **special)
    hf.chat_template = tokenizer.hf.chat_template
    return Tokenizer(hf)


def best_ms(call, rounds: int = 3, n: int = 20) -> float:
    call()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            call()
        best = min(best, (time.perf_counter() - start) / n * 1000)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="runs/tiny_sft", help="a run, checkpoint or model folder")
    parser.add_argument("--vocab", type=int, default=151_000)
    args = parser.parse_args()
    small = load_tokenizer(resolve_model_location(args.checkpoint))
    large = padded(small, args.vocab)
    ids, mask = small.render_conversation(CONVERSATION)
    answer = small.encode(CONVERSATION[1]["content"])
    assert large.render_conversation(CONVERSATION) == (ids, mask) and large.encode(CONVERSATION[1]["content"]) == answer
    for tokenizer in (small, large):
        rendering = best_ms(lambda: tokenizer.render_conversation(CONVERSATION))
        long = best_ms(lambda: tokenizer.render_conversation(LONG), n=5)
        reading = best_ms(lambda: answer_text(tokenizer, answer))
        print(
            json.dumps(
                {
                    "vocab": len(tokenizer.hf),
                    "render_conversation_ms": round(rendering, 3),
                    "long_conversation_ms": round(long, 2),
                    "long_conversation_tokens": len(tokenizer.render_conversation(LONG)[0]),
                    "answer_text_ms": round(reading, 4),
                }
            )
        )


if __name__ == "__main__":
    main()

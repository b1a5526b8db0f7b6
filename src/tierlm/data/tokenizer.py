"""Tokenizers: train a byte-level BPE or a character-level one, or load any transformers tokenizer.

Whatever the source, a `Tokenizer` wraps a transformers fast tokenizer, so it saves to a folder
that `AutoTokenizer.from_pretrained` loads, chat template included. Conversations render through
that template; the loss mask marks assistant content and its end-of-turn token.
"""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from tierlm.errors import DataError, ModelLoadError, first_line
from tierlm.special_tokens import (  # noqa: F401  (BOS, PAD, UNK, SPECIAL_TOKENS: this module's names too)
    ASSISTANT_END,
    ASSISTANT_START,
    BOS,
    PAD,
    ROLES,
    SPECIAL_TOKENS,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESULT_END,
    TOOL_RESULT_START,
    UNK,
)

TOOL_MARKERS = (TOOL_CALL_START, TOOL_CALL_END, TOOL_RESULT_START, TOOL_RESULT_END)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '_start|>' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}{% set call = call['function'] if call['function'] is defined else "
    "call %}"
    "{{ '"
    + TOOL_CALL_START
    + "' + ({'name': call['name'], 'arguments': call['arguments']} | tojson) + '"
    + TOOL_CALL_END
    + "' }}"
    "{% endfor %}"
    "{{ '<|' + message['role'] + '_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT_START + "' }}{% endif %}"
)
"""tierlm's own template: role markers around each turn; an assistant's structured `tool_calls` (if any)
as <|tool_call_start|>{"name", "arguments"}<|tool_call_end|> after its text."""
# GPT-4-style split, but every digit alone: arithmetic is learnable when numbers are digit sequences.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
TRAIN_ON = ("all_assistant", "last_assistant", "everything")


def _wrap(tokenizer_object) -> "Tokenizer":
    """A trained tokenizer as transformers holds it: tierlm's special tokens, the chat template, and `<|bos|>` (the
    document separator tierlm pretrains after) added when special tokens are asked for, as Llama's adds <s> — so
    `AutoTokenizer(folder)(text)` and clients that rely on it (lm-evaluation-harness's API models, vLLM) see a text as
    the model was trained to. tierlm itself encodes without special tokens and places the separator itself."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    bos = tokenizer_object.token_to_id(BOS)
    tokenizer_object.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_object,
        bos_token=BOS,
        eos_token=ASSISTANT_END,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens=SPECIAL_TOKENS[3:],  # chat and tool markers: skipped when decoding for people
        chat_template=CHAT_TEMPLATE,
    )
    return Tokenizer(hf)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> "Tokenizer":
    """Train a byte-level BPE (the `tokenizers` library) with tierlm's chat special tokens.

    >>> tok = train_bpe_tokenizer(["What is 12 + 7? 12 + 7 = 19."] * 20, vocab_size=300)
    >>> tok.decode(tok.encode("What is 3 + 4?"))
    'What is 3 + 4?'
    """
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as RawTokenizer

    floor = 256 + len(SPECIAL_TOKENS)
    if vocab_size < floor:
        raise DataError(
            f"BPE vocab_size must be >= {floor} (256 bytes + {len(SPECIAL_TOKENS)} special tokens), got {vocab_size}"
        )
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(texts, trainer)
    return _wrap(raw)


def train_char_tokenizer(texts: Iterable[str]) -> "Tokenizer":
    """A character-level tokenizer over the characters seen in `texts` (unknown ones map to <|unk|>).

    >>> tok = train_char_tokenizer(["hello world"])
    >>> len(tok.encode("hello")), tok.decode(tok.encode("hello"))
    (5, 'hello')
    """
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    chars = sorted(set().union(*(set(t) for t in texts)))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    raw = RawTokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    raw.decoder = decoders.Fuse()
    return _wrap(raw)


def load_tokenizer(name_or_path: str | Path, trust_remote_code: bool = False) -> "Tokenizer":
    """Any transformers tokenizer by hub id or folder (including ones tierlm saved)."""
    from transformers import AutoTokenizer

    from tierlm.primitives.hub import HubUnreachable, hub_access

    try:
        with hub_access(name_or_path, "tokenizer"):  # a Hub id on a machine without the Hub: one line, no retries
            hf = AutoTokenizer.from_pretrained(str(name_or_path), trust_remote_code=trust_remote_code)
    except HubUnreachable:
        raise
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load tokenizer {str(name_or_path)!r}: {first_line(e)}") from e
    if not getattr(hf, "is_fast", False):
        raise ModelLoadError(
            f"tokenizer {str(name_or_path)!r} has no fast (Rust) version; tierlm needs one for offsets"
        )
    return Tokenizer(hf)


class Tokenizer:
    """A transformers fast tokenizer plus what training needs: BOS, stop tokens, chat masks, bytes per token."""

    def __init__(self, hf):
        self.hf = hf
        self._token_bytes: torch.Tensor | None = None
        self._stop_ids: list[int] | None = None
        self._token_ids: dict[str, int | None] = {}

    # -- basics ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def token_id(self, token: str) -> int | None:
        """The id of `token` (added tokens included), None where the vocabulary has no such token; each token looked
        up once. transformers' `get_vocab()` builds the whole vocabulary every call — ~150 ms at a 151k-token
        vocabulary — which a per-conversation or per-completion lookup paid every time.

        >>> tok = train_char_tokenizer(["abc"])
        >>> tok.token_id("<|assistant_end|>") == tok.hf.get_vocab()["<|assistant_end|>"], tok.token_id("nope")
        (True, None)
        """
        if token not in self._token_ids:
            self._token_ids[token] = self.hf.get_vocab().get(token)
        return self._token_ids[token]

    def tool_ids(self) -> tuple[int, int, int, int] | None:
        """The ids of the four tool markers — call start, call end, result start, result end — or None where the
        vocabulary lacks any of them (a model that never learnt to call tools).

        >>> tok = train_char_tokenizer(["abc"])
        >>> tok.tool_ids() == tuple(tok.hf.get_vocab()[t] for t in TOOL_MARKERS)
        True
        """
        ids = tuple(self.token_id(t) for t in TOOL_MARKERS)
        return None if None in ids else ids

    @property
    def bos_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def document_separator_id(self) -> int:
        """The token that starts every pretraining document: BOS, else EOS (e.g. Qwen has no BOS)."""
        token_id = self.hf.bos_token_id if self.hf.bos_token_id is not None else self.hf.eos_token_id
        assert token_id is not None, "tokenizer has neither a BOS nor an EOS token"
        return token_id

    @property
    def pad_id(self) -> int:
        for token_id in (self.hf.pad_token_id, self.hf.eos_token_id, 0):
            if token_id is not None:
                return token_id
        return 0

    @property
    def stop_ids(self) -> list[int]:
        """Tokens that end a generated answer: end of turn / EOS, and BOS (a new document)."""
        if self._stop_ids is None:
            vocab = self.hf.get_vocab()
            ids = {self.hf.eos_token_id, self.hf.bos_token_id} | {
                vocab[t] for t in (ASSISTANT_END, "<|im_end|>", "<|eot_id|>") if t in vocab
            }
            self._stop_ids = sorted(i for i in ids if i is not None)
        return self._stop_ids

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def encode_stream(self, text: str) -> np.ndarray:
        """`encode(text)` as an int32 array, for a whole file. A character-level tokenizer (`train_char_tokenizer`'s,
        also once saved and loaded) maps each character through a table: tinyshakespeare's 1.1M characters in 0.01 s
        against the Rust tokenizer's 0.9 s, the same ids (unknown characters to <|unk|>; a text holding an added
        token's string, which the tokenizer would match whole, takes `encode`). Any other tokenizer: `encode`.

        >>> tok = train_char_tokenizer(["hello world"])
        >>> tok.encode_stream("hold 'em").tolist() == tok.encode("hold 'em")
        True
        """
        table = self.char_table
        if table is None or any(added in text for added in self.hf.added_tokens_encoder):
            return np.asarray(self.encode(text), dtype=np.int32)
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        return table[np.minimum(points, len(table) - 1)]

    @functools.cached_property
    def char_table(self) -> np.ndarray | None:
        """Code point -> id (int32; past the last character seen, <|unk|>) when the tokenizer is one word per character
        (no normaliser, every character split alone, a word-level vocabulary), else None."""
        spec = json.loads(self.hf.backend_tokenizer.to_str())
        model, split = spec["model"], spec.get("pre_tokenizer") or {}
        per_character = split.get("pattern") == {"Regex": "[\\s\\S]"} and split.get("behavior") == "Isolated"
        if model["type"] != "WordLevel" or spec.get("normalizer") is not None or not per_character:
            return None
        chars = {ord(t): i for t, i in model["vocab"].items() if len(t) == 1}
        table = np.full(max(chars, default=0) + 2, model["vocab"][model["unk_token"]], dtype=np.int32)
        table[list(chars)] = list(chars.values())
        return table

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.hf(list(texts), add_special_tokens=False)["input_ids"] if texts else []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`: transformers' decode, through the Rust tokenizer's own where transformers would add
        nothing to it (no clean-up of spaces) — a third of the time a call (7 us against 16 for a 64-token reply),
        which a server pays for every token of every reply it streams."""
        hf = self.hf
        if getattr(hf, "clean_up_tokenization_spaces", False) or not hasattr(hf, "backend_tokenizer"):
            return hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return hf.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.hf.save_pretrained(path)
        return path

    def token_bytes(self) -> torch.Tensor:
        """UTF-8 bytes of each token (V,), 0 for special tokens: the denominator of bits per byte."""
        if self._token_bytes is None:
            special = set(self.hf.all_special_ids) | {i for i, t in self.hf.added_tokens_decoder.items() if t.special}
            byte_level = type(self.hf.backend_tokenizer.decoder).__name__ == "ByteLevel"
            counts = []
            for token_id in range(self.vocab_size):
                if token_id in special:
                    counts.append(0)
                elif byte_level:  # each character of a byte-level token stands for one byte
                    counts.append(len(self.hf.convert_ids_to_tokens(token_id) or ""))
                else:
                    counts.append(len(self.hf.decode([token_id]).encode("utf-8")))
            self._token_bytes = torch.tensor(counts, dtype=torch.int32)
        return self._token_bytes

    # -- chat ------------------------------------------------------------------------------
    def _render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None) -> str:
        """The template's text; a conversation's `tools` (function schemas) go to the template too."""
        return self.hf.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def render_conversation(self, messages: list[dict], train_on: str = "all_assistant") -> tuple[list[int], list[int]]:
        """Token ids and a 0/1 mask of the tokens to train on.

        Trained: each assistant message's content and its end-of-turn token (and with
        `train_on="last_assistant"` only the last one's; with "everything" all tokens), except those
        of a `Conversation`'s prompt (its first `prompt_turns` messages, a prompt/completion row's). The
        rendering is the chat template's, so it is the same one sampling uses.

        >>> tok = train_char_tokenizer(["What is 1+1? 2"])
        >>> chat = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]
        >>> ids, mask = tok.render_conversation(chat)
        >>> [tok.decode([i]) for i, m in zip(ids, mask) if m]
        ['2', '<|assistant_end|>']
        """
        check_conversation(messages)
        if not self.has_chat_template:
            raise DataError(
                "this tokenizer has no chat template; SFT needs one (train a tierlm tokenizer or use a chat model's)"
            )
        if train_on not in TRAIN_ON:
            raise DataError(f"train_on must be one of {list(TRAIN_ON)}, got {train_on!r}")
        tools, prompt_turns = getattr(messages, "tools", None), getattr(messages, "prompt_turns", 0)
        full = self._render(messages, tools=tools)
        spans = []  # character spans of assistant turns (content + end of turn), with their prompt
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i < prompt_turns:
                continue
            prefix = self._render(messages[:i], add_generation_prompt=True, tools=tools)
            upto = full if i == len(messages) - 1 else self._render(messages[: i + 1], tools=tools)
            if not (upto.startswith(prefix) and full.startswith(upto)):
                raise DataError(
                    "the chat template does not render conversations prefix-stably; cannot locate assistant turns"
                )
            spans.append((len(prefix), len(upto), prefix))
        encoding = self.hf(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoding["input_ids"]
        pairs = encoding["offset_mapping"]  # (start, end) tuples: fromiter reads them 3x faster than asarray
        offsets = np.fromiter(itertools.chain.from_iterable(pairs), np.int64, 2 * len(pairs)).reshape(-1, 2)
        starts = offsets[:, 0]
        trained = spans[-1:] if train_on == "last_assistant" else spans
        mask = np.ones(len(ids), dtype=np.int64) if train_on == "everything" else np.zeros(len(ids), dtype=np.int64)
        turns = []  # token index ranges of the trained turns
        for lo, hi, _ in trained:
            first, last = np.searchsorted(starts, lo, "left"), np.searchsorted(starts, hi, "left")
            mask[first:last] = 1
            turns.append((int(first), int(last)))
        self._check_turns(ids, offsets, mask, trained, turns)
        if train_on != "everything":
            self._mask_tool_results(ids, mask)
        return ids, mask.tolist()

    def _mask_tool_results(self, ids: list[int], mask: np.ndarray) -> None:
        """Tool results inside assistant turns (<|tool_start|> ... <|tool_end|>) come from the tool,
        not the model: never trained on (the engine splices them in at sampling time)."""
        start, end = self.token_id(TOOL_RESULT_START), self.token_id(TOOL_RESULT_END)
        if start is None or end is None:
            return
        tokens = np.asarray(ids)
        opens, closes = np.flatnonzero(tokens == start), np.flatnonzero(tokens == end)
        for first in opens:  # from each start marker through the next end marker (or the end), inclusive
            after = closes[np.searchsorted(closes, first) :]
            mask[first : (after[0] + 1 if len(after) else len(ids))] = 0

    def _check_turns(self, ids: list[int], offsets: np.ndarray, mask: np.ndarray, spans: list, turns: list) -> None:
        """Guardrails: each trained turn's end-of-turn token is labelled, and the ids before each
        turn are exactly what sampling would feed the model (`render_for_completion`).

        Special tokens split the text before BPE runs, so only the text after the last special
        token of the prompt can tokenise differently; that tail is what gets re-encoded.
        """
        stops, special = set(self.stop_ids), set(self.hf.added_tokens_decoder)  # added tokens split the text
        for (_, _, prefix), (first, last) in zip(spans, turns):
            if not any(ids[i] in stops and mask[i] for i in range(first, last)):
                raise DataError(
                    "an assistant turn has no labelled end-of-turn token: the model would never learn to stop; "
                    "check the tokenizer's chat template and eos token"
                )
            k = next((i for i in range(first - 1, -1, -1) if ids[i] in special), -1)  # the last one before the turn
            tail_start = int(offsets[k, 1]) if k >= 0 else 0
            tail = (
                self.hf(prefix[tail_start:], add_special_tokens=False)["input_ids"] if tail_start < len(prefix) else []
            )
            if ids[k + 1 : first] != tail:
                raise DataError(
                    "training and sampling render different prompt tokens for an assistant turn; "
                    "the chat template or tokenizer is not prefix-stable"
                )

    def continuation_ids(self, history: list[dict], new_messages: list[dict]) -> list[int]:
        """Ids that follow a rendered `history` (ending with an assistant turn) when `new_messages`
        arrive, through the next assistant header: how a multi-turn episode continues the tokens
        the model already produced, without re-tokenising them."""
        check_conversation(history + new_messages, needs_assistant=False)
        tools = getattr(history, "tools", None)
        before = self._render(history, tools=tools)
        after = self._render(list(history) + new_messages, add_generation_prompt=True, tools=tools)
        if not after.startswith(before):
            raise DataError("the chat template does not render conversations prefix-stably; cannot continue an episode")
        return self.hf(after[len(before) :], add_special_tokens=False)["input_ids"]

    def render_for_completion(self, messages: list[dict]) -> list[int]:
        """Prompt ids that end with the assistant header, ready for the model to answer."""
        check_conversation(messages, needs_assistant=False)
        rendered = self._render(messages, add_generation_prompt=True, tools=getattr(messages, "tools", None))
        return self.hf(rendered, add_special_tokens=False)["input_ids"]


def check_conversation(messages: list[dict], needs_assistant: bool = True) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError("a conversation must be a non-empty list of {role, content} messages")
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not isinstance(message, dict) or "role" not in message or ("content" not in message and not calls):
            raise DataError(f"message {i} must have 'role' and 'content', got {message!r:.80}")
        if message["role"] not in ROLES:
            raise DataError(f"message {i} has role {message['role']!r}; roles are {list(ROLES)}")
        if not isinstance(message.get("content"), str) and not (calls and message.get("content") is None):
            raise DataError(f"message {i} content must be a string, got {type(message['content']).__name__}")
        if calls is not None and (
            message["role"] != "assistant"
            or not isinstance(calls, list)
            or not all(isinstance(c, dict) and "name" in c.get("function", c) for c in calls)
        ):
            raise DataError(
                f"message {i}: tool_calls belong to an assistant turn, as a list of "
                "{type: function, function: {name, arguments}}"
            )
    if needs_assistant and not any(m["role"] == "assistant" for m in messages):
        raise DataError("a training conversation needs at least one assistant message")

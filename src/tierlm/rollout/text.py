"""Token ids and text around the engine: the prompt as a model is fed it, the answer a reward reads, a completion
for people (tool calls shown as [calculator: 23 + 45 -> 68])."""

from __future__ import annotations

from tierlm.rollout.tools import TOOL_CALL_END, TOOL_CALL_START, TOOL_RESULT_END, TOOL_RESULT_START


def answer_text(tokenizer, tokens: list[int]) -> str:
    """What the model answered, for rewards: the text after its last tool result (all of it without tools)."""
    end = tokenizer.token_id(TOOL_RESULT_END)
    last = max((i for i, t in enumerate(tokens) if t == end), default=-1) if end is not None else -1
    return tokenizer.decode(tokens[last + 1 :], skip_special_tokens=True)


def prompt_tokens(tokenizer, text: str, chat: bool, system: str | None = None) -> list[int]:
    """A prompt as the model is fed it: a user turn (after the `system` message, if any) ready for the assistant's
    answer (chat models), or the raw text after the document separator (base models)."""
    if chat:
        system_turn = [{"role": "system", "content": system}] if system is not None else []
        return tokenizer.render_for_completion([*system_turn, {"role": "user", "content": text}])
    assert system is None, "a system message is a chat model's"
    return [tokenizer.document_separator_id] + tokenizer.encode(text)


def encoder_prompt_tokens(tokenizer, text: str) -> list[int]:
    """An encoder-decoder's prompt (for the encoder): the text, opened by [S] (continue it, prefix LM) unless
    it names its mode itself ([R] / [X] / [S]; write <extra_id_0> where a span should be filled).

    >>> from tierlm.data import train_bpe_tokenizer
    >>> from tierlm.data.seq2seq_tokenizer import Qwen3EncoderDecoderTokenizer
    >>> tok = Qwen3EncoderDecoderTokenizer(train_bpe_tokenizer(["to be or not"] * 10, 300), num_sentinel_tokens=2)
    >>> first = encoder_prompt_tokens(tok, "to be")[:1]
    >>> [tok.decode([i]) for i in first], encoder_prompt_tokens(tok, "[R]to <extra_id_0>")[0] == tok.mode_ids["R"]
    (['[S]'], True)
    """
    from tierlm.data.ul2 import MODE_TOKENS

    ids = tokenizer.encode(text)
    modes = tokenizer.hf.convert_tokens_to_ids(list(MODE_TOKENS.values()))
    return ids if ids and ids[0] in modes else [modes[list(MODE_TOKENS).index("S")], *ids]


def readable_text(tokenizer, tokens: list[int]) -> str:
    """A completion for people: tool calls shown as [calculator: 23 + 45 -> 68], other markers dropped.

    >>> from tierlm.data import train_char_tokenizer
    >>> tok = train_char_tokenizer(["0123456789 +="])
    >>> ids = tok.encode("<|tool_call_start|>2 + 3<|tool_call_end|><|tool_start|>5<|tool_end|>"
    ...                  "2 + 3 = 5<|assistant_end|>")
    >>> readable_text(tok, ids)
    '[calculator: 2 + 3 -> 5] 2 + 3 = 5'
    """
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    for marker, shown in (
        (TOOL_CALL_START, "[calculator: "),
        (TOOL_CALL_END, " -> "),
        (TOOL_RESULT_START, ""),
        (TOOL_RESULT_END, "] "),
    ):
        text = text.replace(marker, shown)
    special = set(tokenizer.hf.all_special_tokens) | set(getattr(tokenizer.hf, "extra_special_tokens", None) or [])
    for token in special:
        text = text.replace(token, "")
    return text.strip()

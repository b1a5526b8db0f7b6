"""Tokenizers and chat rendering: exact masks on hand-written conversations."""

import pytest
from transformers import AutoTokenizer

from tierlm.data import load_tokenizer, train_char_tokenizer
from tierlm.errors import DataError

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6"},
]


def _trained(tokenizer, ids, mask):
    return tokenizer.decode([i for i, m in zip(ids, mask) if m])


def test_bpe_round_trip_and_digits_split(tiny_tokenizer):
    text = "What is 123 + 45? 123 + 45 = 168"
    ids = tiny_tokenizer.encode(text)
    assert tiny_tokenizer.decode(ids) == text
    assert tiny_tokenizer.decode(tiny_tokenizer.encode("168")[:1]) == "1"  # every digit is its own token


def test_decode_is_transformers_decode(tiny_tokenizer, tmp_path):
    """`Tokenizer.decode` (the Rust tokenizer's own where transformers adds nothing) gives transformers' text, special
    tokens kept or skipped, for a BPE and a character tokenizer; with spaces cleaned up, through transformers'."""
    chars = train_char_tokenizer(["What is 12 + 3? It is 15 ."])
    for tokenizer in (tiny_tokenizer, chars):
        ids = tokenizer.render_for_completion([{"role": "user", "content": "What is 12 + 3 ?"}]) + tokenizer.encode(
            "It is 15 ."
        )
        for skip in (False, True):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == tokenizer.hf.decode(ids, skip_special_tokens=skip)
    cleaning = load_tokenizer(tiny_tokenizer.save(tmp_path))
    cleaning.hf.clean_up_tokenization_spaces = True
    calls, decode = [], cleaning.hf.decode
    cleaning.hf.decode = lambda *args, **kwargs: calls.append(args) or decode(*args, **kwargs)
    cleaning.decode(tiny_tokenizer.encode("It is 15 ."))
    assert len(calls) == 1


def test_masks_exactly_assistant_content_and_end_of_turn(tiny_tokenizer):
    ids, mask = tiny_tokenizer.render_conversation(CONVERSATION)
    pieces = [tiny_tokenizer.decode([i]) for i in ids]
    trained = [p for p, m in zip(pieces, mask) if m]
    assert trained == ["4", "<|assistant_end|>", "6", "<|assistant_end|>"]
    # Everything else, including both assistant_start headers, is masked.
    assert pieces.count("<|assistant_start|>") == 2 and all(
        not m for p, m in zip(pieces, mask) if p in ("<|assistant_start|>", "<|bos|>", "<|user_end|>")
    )


def test_conversations_and_answers_look_their_tokens_up_once(tiny_tokenizer, tmp_path):
    """transformers' `get_vocab()` builds the whole vocabulary each call (~150 ms at 151k tokens): rendering many
    conversations and reading many answers looks the tool markers up once, with the same masks and texts."""
    from tierlm.rollout.text import answer_text

    fresh = load_tokenizer(tiny_tokenizer.save(tmp_path))
    calls, get_vocab = [], fresh.hf.get_vocab
    fresh.hf.get_vocab = lambda: calls.append(1) or get_vocab()
    call = "<|tool_call_start|>2 + 2<|tool_call_end|><|tool_start|>4<|tool_end|> It is 4"
    conversation = [*CONVERSATION[:2], {"role": "assistant", "content": call}]
    for _ in range(5):
        ids, mask = fresh.render_conversation(conversation)
        assert _trained(fresh, ids, mask) == "<|tool_call_start|>2 + 2<|tool_call_end|> It is 4<|assistant_end|>"
        assert answer_text(fresh, fresh.encode(call)) == " It is 4"
    assert len(calls) <= 3  # the stop tokens, and the tool result's two markers: once each


def test_train_on_settings(tiny_tokenizer):
    ids, mask = tiny_tokenizer.render_conversation(CONVERSATION, train_on="last_assistant")
    assert _trained(tiny_tokenizer, ids, mask) == "6<|assistant_end|>"
    ids, mask = tiny_tokenizer.render_conversation(CONVERSATION, train_on="everything")
    assert all(mask)


def test_sampling_prompt_is_a_prefix_of_the_training_rendering(tiny_tokenizer):
    ids, _ = tiny_tokenizer.render_conversation(CONVERSATION[:3])
    prompt = tiny_tokenizer.render_for_completion(CONVERSATION[:2])
    assert ids[: len(prompt)] == prompt and tiny_tokenizer.decode(ids[len(prompt) :]) == "4<|assistant_end|>"


def test_saved_folder_loads_in_transformers_with_chat_template(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True).endswith(
        "<|assistant_start|>"
    )
    again = load_tokenizer(tmp_path)
    assert again.render_conversation(CONVERSATION) == tiny_tokenizer.render_conversation(CONVERSATION)


def test_char_tokenizer_and_token_bytes():
    tok = train_char_tokenizer(["hello wörld, é"])
    ids = tok.encode("hello")
    assert len(ids) == 5 and tok.decode(ids) == "hello"
    nbytes = tok.token_bytes()
    assert nbytes[tok.encode("é")[0]] == 2 and nbytes[tok.bos_id] == 0


def test_a_whole_file_encodes_to_the_tokenizers_own_ids(tiny_tokenizer, tmp_path):
    from tierlm.data.sources import builtin_corpus

    shakespeare = builtin_corpus("builtin:tinyshakespeare").read_text()
    tok = train_char_tokenizer([shakespeare[:50_000]])  # the rest holds characters this one never saw
    tok.save(tmp_path / "chars")
    odd = "héllo ✓ 𝄞 wörld\r\n\t" + "".join(map(chr, range(0, 300, 7)))
    for tokenizer in (tok, load_tokenizer(tmp_path / "chars")):  # as trained, and as saved and loaded again
        assert tokenizer.char_table is not None
        for text in (shakespeare, odd, "", "a<|bos|>b<|user_start|>"):  # added tokens' strings take encode's path
            assert tokenizer.encode_stream(text).tolist() == tokenizer.hf(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.char_table is None  # byte-level BPE: encode's path
    assert tiny_tokenizer.encode_stream("What is 12 + 7?").tolist() == tiny_tokenizer.encode("What is 12 + 7?")


def test_bpe_token_bytes(tiny_tokenizer):
    nbytes = tiny_tokenizer.token_bytes()
    text = "What is 12 + 7?"
    assert sum(int(nbytes[i]) for i in tiny_tokenizer.encode(text)) == len(text.encode())


@pytest.mark.parametrize(
    "conversation,match",
    [
        ([], "non-empty"),
        ([{"role": "user", "content": "hi"}], "at least one assistant"),
        ([{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}], "role 'robot'"),
        ([{"role": "user"}], "'role' and 'content'"),
    ],
)
def test_bad_conversations(tiny_tokenizer, conversation, match):
    with pytest.raises(DataError, match=match):
        tiny_tokenizer.render_conversation(conversation)


def test_guardrail_end_of_turn_must_be_labelled(tiny_tokenizer):
    """A template that never closes the assistant's turn would train a model that never stops."""
    import copy

    broken = copy.deepcopy(tiny_tokenizer)
    broken.hf.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '_start|>' + m['content'] }}"
        "{% if m['role'] != 'assistant' %}{{ '<|' + m['role'] + '_end|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant_start|>' }}{% endif %}"
    )
    with pytest.raises(DataError, match="no labelled end-of-turn token"):
        broken.render_conversation(CONVERSATION)


def test_guardrail_training_and_sampling_prompts_agree(tiny_tokenizer, monkeypatch):
    """If the prompt tokenises differently alone than inside the conversation, sampling would see other ids.

    The header here ends in plain text ("A:"), which is what gets re-encoded; a tokenizer that encodes
    that text one token short on its own stands in for one whose merges cross the boundary."""
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.hf.chat_template = tok.hf.chat_template.replace("'<|assistant_start|>'", "'<|assistant_start|>A:'").replace(
        "'<|' + message['role'] + '_start|>'",
        "'<|' + message['role'] + '_start|>' + ('A:' if message['role'] == 'assistant' else '')",
    )
    ids, mask = tok.render_conversation(CONVERSATION)  # consistent tokenizer: passes
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "4<|assistant_end|>6<|assistant_end|>"
    original = type(tok.hf).__call__

    def drifting(self, text, *args, **kwargs):
        out = original(self, text, *args, **kwargs)
        if isinstance(text, str) and text.endswith("A:") and "return_offsets_mapping" not in kwargs:
            out["input_ids"] = out["input_ids"][:-1]
        return out

    monkeypatch.setattr(type(tok.hf), "__call__", drifting)
    with pytest.raises(DataError, match="training and sampling render different prompt tokens"):
        tok.render_conversation(CONVERSATION)

"""data.chat_template: named templates and Jinja files for tokenizers without one, and tool use in the
template's own convention (tools / tool_calls), saved with the tokenizer so other runtimes render the
same text."""

from __future__ import annotations

import json

import pytest

from conftest import CHAT, TINY, run_main
from tierlm.data import load_tokenizer, train_bpe_tokenizer
from tierlm.data.chat_templates import set_chat_template
from tierlm.data.rows import Conversation
from tierlm.errors import ConfigError, DataError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]


def tool_conversation() -> Conversation:
    return Conversation(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": CALL},
            {"role": "tool", "content": '{"celsius": 21}'},
            {"role": "assistant", "content": "21 C and sunny."},
        ],
        TOOLS,
    )


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    """A base tokenizer with ChatML's markers but no template, as many base models ship."""
    texts = ["Weather in Paris? It is 21 C and sunny.", '{"name": "get_weather", "arguments": {"city": "Paris"}}'] * 50
    tokenizer = train_bpe_tokenizer(texts, vocab_size=400)
    tokenizer.hf.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.hf.chat_template = None
    folder = tmp_path_factory.mktemp("chatml_base")
    tokenizer.save(folder)
    return folder


def test_chatml_renders_tool_calls_and_trains_only_the_assistant(chatml_tokenizer, tmp_path):
    tokenizer = set_chat_template(load_tokenizer(chatml_tokenizer), "chatml")
    text = tokenizer._render(tool_conversation(), tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.loads(text.split("<tools>\n")[1].split("\n</tools>")[0]) == TOOLS[0]
    assert (
        '<|im_start|>assistant\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
        in text
    )
    assert '<|im_start|>user\n<tool_response>\n{"celsius": 21}\n</tool_response><|im_end|>' in text
    ids, mask = tokenizer.render_conversation(tool_conversation())
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in trained
    assert (
        "21 C and sunny.<|im_end|>" in trained
        and "celsius" not in trained
        and "Tools" not in trained
        and "Paris?" not in trained
    )
    im_end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tokenizer.stop_ids
    # Saved with the tokenizer: transformers (and every runtime reading chat_template) renders the same text.
    tokenizer.save(tmp_path / "tok")
    from transformers import AutoTokenizer

    assert (
        AutoTokenizer.from_pretrained(tmp_path / "tok").apply_chat_template(
            list(tool_conversation()), tools=TOOLS, tokenize=False
        )
        == text
    )


def test_the_tierlm_template_renders_structured_tool_calls():
    tokenizer = train_bpe_tokenizer(["What is the weather?"] * 20, vocab_size=300)
    conversation = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": CALL}]
    ids, mask = tokenizer.render_conversation(conversation)
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert (
        trained
        == '<|tool_call_start|>{"name": "get_weather", "arguments": {"city": "Paris"}}<|tool_call_end|><|assistant_end|>'
    )
    plain = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert (
        tokenizer._render(plain) == "<|bos|><|user_start|>a<|user_end|><|assistant_start|>b<|assistant_end|>"
    )  # unchanged


def test_templates_that_cannot_work_are_refused(chatml_tokenizer, tmp_path):
    plain = train_bpe_tokenizer(["hello there"] * 20, vocab_size=300)
    with pytest.raises(
        ConfigError,
        match=r"needs the tokens <\|im_start\|>, <\|im_end\|>.*use a template whose markers it has \(tierlm\)",
    ):
        set_chat_template(plain, "chatml")
    with pytest.raises(ConfigError, match="neither a template name"):
        set_chat_template(plain, "vicuna")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ConfigError, match="does not render a conversation"):
        set_chat_template(plain, str(bad))
    good = tmp_path / "mine.jinja"
    good.write_text(
        "{% for m in messages %}<|{{ m.role }}_start|>{{ m.content }}<|{{ m.role }}_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant_start|>{% endif %}"
    )
    assert set_chat_template(plain, str(good)).hf.chat_template == good.read_text()
    with pytest.raises(DataError, match="tool_calls belong to an assistant turn"):
        plain.render_conversation(
            [{"role": "user", "content": "x", "tool_calls": CALL}, {"role": "assistant", "content": "y"}]
        )


def test_sft_with_tools_from_a_dataset_and_chatml(chatml_tokenizer, tmp_path):
    """A base tokenizer without a template, a dataset whose tools column is a JSON string (as the Hub's
    tool-use sets store it), data.chat_template=chatml; the SFT model's tokenizer carries the template."""
    rows = [
        {
            "messages": [dict(m, content=m["content"].replace("Paris", city)) for m in tool_conversation()],
            "tools": json.dumps(TOOLS),
        }
        for city in ["Paris", "Rome", "Oslo", "Lima"] * 10
    ]
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pre = run_main(
        "pretrain",
        "--config",
        "tiny_pretrain",
        *[a for a in TINY if not a.startswith("tokenizer.")],  # the given tokenizer's vocabulary is its own
        f"model.tokenizer_name_or_path={chatml_tokenizer}",
        f"infra.output_dir={tmp_path / 'pre'}",
    )
    assert pre.returncode == 0, pre.stderr[-2000:]
    sft = run_main(
        "sft",
        "--config",
        "configs/tiny_sft.yaml",
        *CHAT,
        f"model.model_name_or_path={tmp_path / 'pre'}",
        f"data.dataset_name={data}",
        "data.chat_template=chatml",
        "data.max_seq_length=256",
        f"infra.output_dir={tmp_path / 'sft'}",
    )
    assert sft.returncode == 0, sft.stderr[-3000:]
    saved = load_tokenizer(tmp_path / "sft" / "model")
    assert "<tool_call>" in saved.hf.chat_template and "<|im_start|>" in saved.hf.chat_template

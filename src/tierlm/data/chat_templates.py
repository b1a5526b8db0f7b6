"""Chat templates for tokenizers that have none, or another one (`data.chat_template`): a named
template or a Jinja file, set on the run's tokenizer and saved with it, so the exported model renders
conversations (and tool calls) the way training did, in transformers and every runtime that reads
`chat_template` from the tokenizer.

Tool use follows the template's own convention: a conversation's `tools` (function schemas) and an
assistant turn's `tool_calls` (`[{"type": "function", "function": {"name", "arguments"}}]`) are handed
to the template, and `tool` turns carry the results. Under "chatml" that is the Hermes / Qwen form
(`<tools>` in the system turn, `<tool_call>{json}</tool_call>` in the reply, `<tool_response>` in a
user turn) that vLLM's and llama.cpp's tool parsers read.
"""

from __future__ import annotations

from pathlib import Path

from tierlm.data.tokenizer import CHAT_TEMPLATE, Tokenizer
from tierlm.errors import ConfigError, first_line

CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '"
    ' + \'<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n\''
    " + '</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set call = call.function if call.function is defined else call %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{{- call.arguments if call.arguments is string else (call.arguments | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TEMPLATES = {"tierlm": CHAT_TEMPLATE, "chatml": CHATML_TEMPLATE}
"""Named templates: tierlm's own (its tokenizers' role markers) and ChatML with Hermes-style tool calls."""

MARKERS = {"tierlm": ("<|assistant_start|>", "<|assistant_end|>"), "chatml": ("<|im_start|>", "<|im_end|>")}


def resolve_chat_template(spec: str) -> str:
    """The Jinja source `data.chat_template` names: a template name or a .jinja file.

    >>> resolve_chat_template("chatml") == CHATML_TEMPLATE
    True
    """
    if spec in TEMPLATES:
        return TEMPLATES[spec]
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"data.chat_template={spec}: neither a template name ({', '.join(TEMPLATES)}) nor a Jinja file"
        )
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"data.chat_template={spec}: cannot read it ({first_line(e)})") from None


def set_chat_template(tokenizer: Tokenizer, spec: str) -> Tokenizer:
    """Give `tokenizer` the template `spec` names, after checking it renders: its markers must be single
    tokens of this tokenizer (a stop token the model can emit), and a conversation must render."""
    import jinja2

    source = resolve_chat_template(spec)
    vocab = tokenizer.hf.get_vocab()
    missing = [m for m in MARKERS.get(spec, ()) if m not in vocab]
    if missing:
        raise ConfigError(
            f"data.chat_template={spec} needs the tokens {', '.join(missing)}, which this tokenizer does not have; "
            f"use a template whose markers it has "
            f"({', '.join(n for n, ms in MARKERS.items() if all(m in vocab for m in ms)) or 'a Jinja file'})"
        )
    previous = tokenizer.hf.chat_template
    tokenizer.hf.chat_template = source
    try:
        tokenizer.hf.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], tokenize=False
        )
    except (jinja2.TemplateError, TypeError, ValueError) as e:
        tokenizer.hf.chat_template = previous
        raise ConfigError(
            f"data.chat_template={spec}: the template does not render a conversation ({first_line(e)})"
        ) from None
    tokenizer._stop_ids = None  # the stop tokens follow the template's end-of-turn marker
    return tokenizer

"""The special tokens of tierlm's own tokenizers and chat format, spelled once.

Every tier that writes or reads them imports them from here: the tokenizer registers them (in this
order: their ids), the chat template renders the role markers, tasks write tool calls with them in
their demonstrations, and the generation engine runs a tool when the model closes a call.

>>> SPECIAL_TOKENS[:3], TOOL_CALL_START, TOOL_RESULT_START
(['<|bos|>', '<|pad|>', '<|unk|>'], '<|tool_call_start|>', '<|tool_start|>')
"""

BOS, PAD, UNK = "<|bos|>", "<|pad|>", "<|unk|>"
ROLES = ("system", "user", "assistant", "tool")
ASSISTANT_START, ASSISTANT_END = "<|assistant_start|>", "<|assistant_end|>"
TOOL_CALL_START, TOOL_CALL_END = "<|tool_call_start|>", "<|tool_call_end|>"
"""Around the model's request to a tool (trained on)."""
TOOL_RESULT_START, TOOL_RESULT_END = "<|tool_start|>", "<|tool_end|>"
"""Around the tool's answer, spliced in by the engine (the tool role's markers; masked from the loss)."""

SPECIAL_TOKENS = (
    [BOS, PAD, UNK]
    + [f"<|{role}_{edge}|>" for role in ROLES for edge in ("start", "end")]
    + [TOOL_CALL_START, TOOL_CALL_END]
)

"""Tokenizers for encoder–decoder models trained with UL2: any tokenizer (tierlm's or a transformers
one) extended with the sentinels `<extra_id_0>` ... `<extra_id_{N-1}>` and the mode tokens `[R]`, `[X]`,
`[S]` as special tokens. Saved, the folder reloads with `transformers.AutoTokenizer` with the same ids.
"""

from __future__ import annotations

from pathlib import Path

from tierlm.data.tokenizer import Tokenizer, load_tokenizer
from tierlm.data.ul2 import MODE_TOKENS, sentinel_token


class Qwen3EncoderDecoderTokenizer(Tokenizer):
    """A tokenizer with UL2's sentinel and mode tokens (named for the Qwen3 encoder-decoder; nothing in it is
    Qwen-specific).

    >>> from tierlm.data import train_bpe_tokenizer
    >>> tok = Qwen3EncoderDecoderTokenizer(train_bpe_tokenizer(["a b c"] * 10, 300), num_sentinel_tokens=4)
    >>> len(tok.sentinel_ids), sorted(tok.mode_ids), tok.decode(tok.sentinel_ids[:2])
    (4, ['R', 'S', 'X'], '<extra_id_0><extra_id_1>')
    """

    def __init__(self, tokenizer: Tokenizer, num_sentinel_tokens: int = 100):
        assert num_sentinel_tokens > 0, f"num_sentinel_tokens must be > 0, got {num_sentinel_tokens}"
        hf = tokenizer.hf
        wanted = [sentinel_token(i) for i in range(num_sentinel_tokens)] + list(MODE_TOKENS.values())
        vocab = hf.get_vocab()
        missing = [t for t in wanted if t not in vocab]
        if missing:  # in order: <extra_id_i> gets the i-th new id
            hf.add_tokens(missing, special_tokens=True)
        super().__init__(hf)
        self.num_sentinel_tokens = num_sentinel_tokens
        ids = hf.convert_tokens_to_ids(wanted)
        self.sentinel_ids: list[int] = ids[:num_sentinel_tokens]
        self.mode_ids: dict[str, int] = dict(zip(MODE_TOKENS, ids[num_sentinel_tokens:]))

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, num_sentinel_tokens: int = 100, trust_remote_code: bool = False):
        """A saved or hub tokenizer, extended (tokens it already has are reused, so a saved one reloads as it was)."""
        return cls(load_tokenizer(name_or_path, trust_remote_code), num_sentinel_tokens)

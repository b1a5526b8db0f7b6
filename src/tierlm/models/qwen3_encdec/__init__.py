"""The Qwen3 encoder-decoder trained with UL2 denoising: the model (`model`) and its family adapter (`family`)."""

from tierlm.models.qwen3_encdec.model import (
    Qwen3EncDecConfig,
    Qwen3ForSeq2SeqLM,
    build_qwen3_encdec,
    initialize_from_qwen3,
)

__all__ = ["Qwen3EncDecConfig", "Qwen3ForSeq2SeqLM", "build_qwen3_encdec", "initialize_from_qwen3"]

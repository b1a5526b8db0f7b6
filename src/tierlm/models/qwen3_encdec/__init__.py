"""The Qwen3 encoder-decoder trained with UL2 denoising: the model (`model`) and its family adapter (`family`)."""

from tierlm.models.qwen3_encdec import model
from tierlm.models.qwen3_encdec.model import (
    Qwen3EncDecConfig,
    Qwen3ForSeq2SeqLM,
    build_qwen3_encdec,
    initialize_from_qwen3,
)

__all__ = ["Qwen3EncDecConfig", "Qwen3ForSeq2SeqLM", "build_qwen3_encdec", "initialize_from_qwen3"]


def __getattr__(name: str):
    """Every name of `tierlm.models.qwen3_encdec.model`, as when this package was one module."""
    return getattr(model, name)

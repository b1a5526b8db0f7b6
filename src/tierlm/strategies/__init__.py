"""Strategies: what is optimised. Each supplies prepare_batch, compute_loss and compute_metrics."""

from tierlm.strategies.base import CrossEntropyStrategy, TrainingStrategy
from tierlm.strategies.pretrain import PretrainStrategy
from tierlm.strategies.seq2seq import Seq2SeqStrategy
from tierlm.strategies.sft import SFTStrategy

__all__ = ["CrossEntropyStrategy", "PretrainStrategy", "SFTStrategy", "Seq2SeqStrategy", "TrainingStrategy"]

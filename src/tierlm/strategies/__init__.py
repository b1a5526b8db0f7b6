"""Strategies: what is optimised. Each supplies prepare_batch, compute_loss and compute_metrics."""

from tierlm.strategies.base import CrossEntropyStrategy, TrainingStrategy
from tierlm.strategies.pretrain import PretrainStrategy
from tierlm.strategies.rl import GRPOStrategy, PPOStrategy, ReinforceStrategy
from tierlm.strategies.seq2seq import Seq2SeqStrategy
from tierlm.strategies.sft import SFTStrategy

__all__ = [
    "CrossEntropyStrategy",
    "GRPOStrategy",
    "PPOStrategy",
    "PretrainStrategy",
    "ReinforceStrategy",
    "SFTStrategy",
    "Seq2SeqStrategy",
    "TrainingStrategy",
]

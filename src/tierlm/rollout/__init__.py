"""Rollouts: the batched KV-cache generation engine, tools, and a full-recompute reference sampler."""

from tierlm.rollout.engine import Completion, Engine, SamplingEngine
from tierlm.rollout.sampling import generate, sample_next_token
from tierlm.rollout.text import answer_text, readable_text
from tierlm.rollout.tools import Calculator, Tool

__all__ = [
    "Calculator",
    "Completion",
    "Engine",
    "SamplingEngine",
    "Tool",
    "answer_text",
    "generate",
    "readable_text",
    "sample_next_token",
]

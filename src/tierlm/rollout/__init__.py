"""Rollouts: sampling from a model."""

from tierlm.rollout.sampling import generate, sample_next_token

__all__ = ["generate", "sample_next_token"]

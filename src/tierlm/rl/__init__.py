"""Reinforcement learning: tasks and rewards, the RL loop and pass@k."""

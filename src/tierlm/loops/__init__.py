"""The training loops over the tier-0 protocol: `trainer` (pretraining, SFT, DPO) and `rl` (rollouts,
rewards, policy-gradient updates, pass@k; `critic`: PPO's value model), on one `cadence` (when to
evaluate, save, keep, stop and resume), stopped cleanly by `signals`."""

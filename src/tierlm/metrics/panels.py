"""The plots every run's report draws (`tierlm.metrics.report.draw_panels`): one row per PNG in `plots/`, the series
it draws from the run's metrics.jsonl. A stage or loss that logs a new figure adds its row here."""

from __future__ import annotations

# (file, title, x, [(label, record type, key)]): a plot is drawn when one of its series has points.
PANELS = [
    ("loss_steps", "loss", "step", [("train (EMA)", "train", "loss_ema"), ("validation", "eval", "val_loss")]),
    (
        "loss_tokens",
        "loss against tokens",
        "tokens_seen",
        [("train (EMA)", "train", "loss_ema"), ("validation", "eval", "val_loss")],
    ),
    ("lr", "learning rate", "step", [("lr", "train", "lr")]),
    ("grad_norm", "gradient norm (before clipping)", "step", [("grad norm", "train", "grad_norm")]),
    (
        "throughput",
        "tokens per second",
        "step",
        [("tokens/s", "train", "tokens_per_sec"), ("trained tokens/s", "train", "trained_tokens_per_sec")],
    ),
    ("mfu", "model FLOPs utilisation", "step", [("MFU", "train", "mfu")]),
    ("core", "CORE (mean centred accuracy, in-context tasks)", "step", [("CORE", "core", "core")]),
    (
        "memory",
        "memory (MB)",
        "step",
        [("resident (process)", "train", "rss_mb"), ("peak allocated (GPU)", "train", "gpu_peak_mb")],
    ),
    (
        "reward",
        "reward and pass@k",
        "step",
        [
            ("train reward", "train", "reward_mean"),
            ("held-out pass@1", "eval", "pass@1"),
            ("held-out pass@k", "eval", "pass@k"),
        ],
    ),
    ("kl", "KL to the reference", "step", [("KL", "train", "kl")]),
    (
        "rl_phases",
        "time per RL step (s)",
        "step",
        [
            ("generation", "train", "time_generation_s"),
            ("scoring", "train", "time_scoring_s"),
            ("training", "train", "time_training_s"),
        ],
    ),
    ("value_loss", "critic value loss", "step", [("value loss", "train", "value_loss")]),
    (
        "rl_clip",
        "share of tokens (GSPO: sequences) the clip silenced",
        "step",
        [("lower clip", "train", "clip_low_frac"), ("upper clip", "train", "clip_high_frac")],
    ),
    ("seq_ratio", "GSPO / LUSPO: mean sequence importance ratio", "step", [("ratio", "train", "seq_ratio_mean")]),
    ("vespo_weight", "VESPO: mean sequence weight phi(w)", "step", [("phi", "train", "vespo_weight_mean")]),
    (
        "importance",
        "rl.importance: mean weight, share held at the band's ends or masked",
        "step",
        [
            ("mean", "train", "importance_mean"),
            ("held", "train", "importance_capped"),
            ("masked", "train", "importance_masked"),
        ],
    ),
    ("teacher_kl", "distillation: KL(student || teacher) on the samples", "step", [("KL", "train", "teacher_kl")]),
    (
        "dynamic_sampling",
        "dynamic sampling: groups without signal and extra prompts drawn",
        "step",
        [("dropped groups", "train", "dropped_groups"), ("extra draws", "train", "extra_draws")],
    ),
    (
        "rm_accuracy",
        "reward model: held-out pair accuracy (tierlm rm); agreement with the task's verifier (RL)",
        "step",
        [("pair accuracy", "eval", "rm_acc"), ("agrees with verifier", "train", "rm_accuracy")],
    ),
    (
        "rm_score",
        "reward model: mean score",
        "step",
        [("rollouts", "train", "rm_score_mean"), ("held-out pairs", "eval", "score_mean")],
    ),
    (
        "kto",
        "KTO: the KL baseline and the share of replies whose implicit reward has their label's sign",
        "step",
        [("KL estimate", "eval", "kl"), ("label accuracy", "eval", "kto_acc")],
    ),
    (
        "dpo",
        "DPO: reward margin and preference accuracy",
        "step",
        [("reward margin", "eval", "reward_margin"), ("preference accuracy", "eval", "pref_acc")],
    ),
]

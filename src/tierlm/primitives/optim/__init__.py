"""Optimizers by parameter role: the container and its builders (`container`), AdamW, Muon, SPAM and pruning
(`adam`, `muon`, `spam`, `prune`), and their functional and JAX forms (`functional`, `jax`)."""

from tierlm.primitives.optim.container import (  # noqa: F401
    OPTIMIZERS,
    ROLES,
    OptimizerBuilder,
    OptimizerContainer,
    RoleSettings,
    build_adamw,
    build_adamw_prune,
    build_adamw_spam,
    build_muon,
    build_optimizer,
    create_adamw_optimizer,
    create_muon_optimizer,
    inner_optimizers,
    optimizer_metrics,
    parameter_roles,
    register_optimizer,
    split_decay_params,
    width_lr_scale,
)

__all__ = [
    "OPTIMIZERS",
    "OptimizerBuilder",
    "OptimizerContainer",
    "ROLES",
    "RoleSettings",
    "build_adamw",
    "build_adamw_prune",
    "build_adamw_spam",
    "build_muon",
    "build_optimizer",
    "create_adamw_optimizer",
    "create_muon_optimizer",
    "inner_optimizers",
    "optimizer_metrics",
    "parameter_roles",
    "register_optimizer",
    "split_decay_params",
    "width_lr_scale",
]

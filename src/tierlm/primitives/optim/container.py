"""Tier 1: optimizers. Parameter groups are a function of (model, config), not a model method.

A step may drive several optimizers (Muon for the hidden matrices, AdamW for the rest):
`OptimizerContainer` steps them as one, shows one list of parameter groups to the LR schedule, and
is saved as one state (keyed by parameter name, see `tierlm.checkpoint`). Every optimizer is built
from parameter *roles* — matrix, embedding, unembedding, scalar — each with its own LR.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.optim import Optimizer

from tierlm.errors import ConfigError
from tierlm.primitives.optim.muon import Muon
from tierlm.primitives.optim.prune import AdamWPrune
from tierlm.primitives.optim.spam import AdamWSPAM

ROLES = ("matrix", "embedding", "unembedding", "scalar")


def split_decay_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decayed, not decayed) trainable parameters.

    Matrices are decayed; biases, norm weights (every parameter with fewer than 2 dims) and
    embedding tables are not. Tied parameters appear once.

    >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    >>> decay, no_decay = split_decay_params(model)
    >>> [tuple(p.shape) for p in decay], sorted(tuple(p.shape) for p in no_decay)
    ([(4, 4)], [(4,), (4,), (4,), (10, 4)])
    """
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if param.ndim < 2 or id(param) in embedding_ids:
            no_decay.append(param)
        else:
            decay.append(param)
    return decay, no_decay


def _fusable(params: list[nn.Parameter]) -> bool:
    """Can torch's fused AdamW kernel take these (floating point, on the CPU or a GPU)?"""
    return all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)


def create_adamw_optimizer(
    model: nn.Module,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    exclude_norms_biases_embeddings: bool = False,
    fused: bool | None = None,
) -> Optimizer:
    """AdamW over the model's trainable parameters (defaults from nanochat: beta2 = 0.95).

    `exclude_norms_biases_embeddings=True` puts biases, norm weights and embeddings in a group
    with weight decay 0. `fused=None` uses the fused kernel when every parameter is on the CPU or a
    GPU (4x faster than the per-tensor loop on CPU for a 10M-parameter model).

    >>> model = nn.Linear(10, 10)
    >>> optimizer = create_adamw_optimizer(model, lr=1e-4)
    >>> optimizer.param_groups[0]["lr"]
    0.0001
    >>> groups = create_adamw_optimizer(model, 1e-3, weight_decay=0.1,
    ...     exclude_norms_biases_embeddings=True).param_groups
    >>> [(len(g["params"]), g["weight_decay"]) for g in groups]
    [(1, 0.1), (1, 0.0)]
    """
    if not 0 < lr < 1.0:
        raise ConfigError(f"lr must be in (0, 1), got {lr}")
    for i, beta in enumerate(betas):
        if not 0 <= beta < 1:
            raise ConfigError(f"beta{i + 1} must be in [0, 1), got {beta}")
    if eps <= 0:
        raise ConfigError(f"eps must be > 0, got {eps}")
    if weight_decay < 0:
        raise ConfigError(f"weight_decay must be >= 0, got {weight_decay}")

    if exclude_norms_biases_embeddings:
        decay, no_decay = split_decay_params(model)
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
    else:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    all_params = [p for g in groups for p in g["params"]]
    if not all_params:
        raise ConfigError("the model has no trainable parameters")
    if fused is None:
        fused = _fusable(all_params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused or None)


def parameter_roles(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Trainable parameters by role: `embedding` (input tables: tokens, positions), `unembedding`
    (the output head, `model.get_output_embeddings()` or a module named `lm_head`; a head tied to
    the token embedding counts here), `scalar` (every parameter with fewer than 2 dims: norms,
    biases, gates) and `matrix` (the other 2-D weights: attention and MLP).

    >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    >>> {role: [tuple(p.shape) for p in ps] for role, ps in parameter_roles(model).items()}
    {'matrix': [(4, 4)], 'embedding': [(10, 4)], 'unembedding': [], 'scalar': [(4,), (4,), (4,)]}
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module  # the wrapper hides the model's attributes (its head)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "lm_head", None)
    head_ids = (
        {id(head.weight)}
        if isinstance(head, nn.Module) and isinstance(getattr(head, "weight", None), torch.Tensor)
        else set()
    )
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - head_ids
    roles: dict[str, list[nn.Parameter]] = {role: [] for role in ROLES}
    seen: set[int] = set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if id(param) in head_ids:
            roles["unembedding"].append(param)
        elif id(param) in embedding_ids:
            roles["embedding"].append(param)
        elif param.ndim < 2:
            roles["scalar"].append(param)
        else:
            roles["matrix"].append(param)
    return roles


class OptimizerContainer(Optimizer):
    """Several optimizers stepped as one.

    `param_groups` is the concatenation of the inner optimizers' groups (the same dicts), so one
    LR scheduler drives them all; `step`, `zero_grad` and `state_dict` go to each. A checkpoint
    saves the inner optimizers' states together, keyed by parameter name.

    >>> a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    >>> both = OptimizerContainer([torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.AdamW(b.parameters(), lr=0.01)])
    >>> [g["lr"] for g in both.param_groups]
    [0.1, 0.01]
    """

    def __init__(self, optimizers: list[Optimizer]):
        assert optimizers, "an OptimizerContainer needs at least one optimizer"
        params = [id(p) for o in optimizers for g in o.param_groups for p in g["params"]]
        assert len(params) == len(set(params)), "a parameter belongs to one optimizer of the container"
        self.optimizers = list(optimizers)
        # Optimizer.__init__ is not called: the groups and state live in the inner optimizers.
        self.defaults = {}
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        assert len(state_dict["optimizers"]) == len(self.optimizers), (
            "a container's state loads into the same optimizers"
        )
        for optimizer, state in zip(self.optimizers, state_dict["optimizers"]):
            optimizer.load_state_dict(state)

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError("add groups to one of the container's optimizers (container.optimizers[i])")

    def __repr__(self) -> str:
        return f"OptimizerContainer({', '.join(type(o).__name__ for o in self.optimizers)})"


def inner_optimizers(optimizer: Optimizer) -> list[Optimizer]:
    """The optimizers a step drives: a container's, or the optimizer itself.

    >>> sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    >>> inner_optimizers(sgd) == [sgd]
    True
    """
    return list(optimizer.optimizers) if isinstance(optimizer, OptimizerContainer) else [optimizer]


def width_lr_scale(model_dim: int, reference_dim: int = 768) -> float:
    """nanochat's LR factor for the AdamW roles (embedding, unembedding): (d_model / 768) ** -0.5.

    >>> width_lr_scale(768), round(width_lr_scale(192), 3)
    (1.0, 2.0)
    """
    return (model_dim / reference_dim) ** -0.5


@dataclass
class RoleSettings:
    """The LR and weight decay of each parameter role, and the optimizer hyperparameters."""

    matrix_lr: float
    embedding_lr: float
    unembedding_lr: float
    scalar_lr: float
    weight_decay: float = 0.0
    """Applied to the matrices (the other roles decay only with `decay_all`)."""
    decay_all: bool = False
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    muon_momentum: float = 0.95
    ns_steps: int = 5
    distributed: bool = False
    """Muon: every rank holds the full gradients (DDP) and shares the orthogonalisations."""
    options: dict[str, Any] = field(default_factory=dict)
    """Optimizer-specific settings (AdamWSPAM: theta, interval, warmup; AdamWPrune: score,
    final_sparsity, warmup, frequency, total_steps; Muon: refinements, beta2)."""

    def lr(self, role: str) -> float:
        return getattr(self, f"{role}_lr")


def _role_groups(roles: dict[str, list[nn.Parameter]], settings: RoleSettings, names: tuple[str, ...]) -> list[dict]:
    groups = []
    for role in names:
        if roles[role]:
            decay = settings.weight_decay if role == "matrix" or settings.decay_all else 0.0
            groups.append({"params": roles[role], "lr": settings.lr(role), "weight_decay": decay, "role": role})
    return groups


def _adamw(groups: list[dict], settings: RoleSettings) -> Optimizer:
    for i, beta in enumerate(settings.betas):
        if not 0 <= beta < 1:
            raise ConfigError(f"beta{i + 1} must be in [0, 1), got {beta}")
    params = [p for g in groups for p in g["params"]]
    if any(hasattr(p, "expert_mesh") for p in params) and any(hasattr(p, "device_mesh") for p in params):
        # A rank's own experts (plain tensors) beside FSDP2's DTensors: torch's fused and foreach kernels take one
        # kind of tensor per call, its per-tensor loop takes both, and the groups stay one process's (checkpoints
        # reshard between layouts only when the groups match).
        return torch.optim.AdamW(groups, betas=settings.betas, eps=settings.eps, fused=False, foreach=False)
    fused = _fusable(params) or None
    return torch.optim.AdamW(groups, betas=settings.betas, eps=settings.eps, fused=fused)


def _check_lrs(settings: RoleSettings) -> None:
    for role in ROLES:
        if not 0 < settings.lr(role) < 1:
            raise ConfigError(f"{role}_lr must be in (0, 1), got {settings.lr(role)}")
    if settings.weight_decay < 0:
        raise ConfigError(f"weight_decay must be >= 0, got {settings.weight_decay}")


def build_adamw(model: nn.Module, settings: RoleSettings) -> Optimizer:
    """AdamW over every role, each role a parameter group with its own LR.

    >>> model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    >>> settings = RoleSettings(matrix_lr=0.02, embedding_lr=0.2, unembedding_lr=0.004, scalar_lr=0.5, weight_decay=0.1)
    >>> [(g["role"], g["lr"], g["weight_decay"]) for g in build_adamw(model, settings).param_groups]
    [('matrix', 0.02, 0.1), ('embedding', 0.2, 0.0), ('scalar', 0.5, 0.0)]
    """
    _check_lrs(settings)
    groups = _role_groups(parameter_roles(model), settings, ROLES)
    if not groups:
        raise ConfigError("the model has no trainable parameters")
    return _adamw(groups, settings)


def build_muon(model: nn.Module, settings: RoleSettings) -> Optimizer:
    """Muon over the hidden matrices, AdamW over embeddings, the head and scalars: one container.

    >>> model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    >>> settings = RoleSettings(matrix_lr=0.02, embedding_lr=0.2, unembedding_lr=0.004, scalar_lr=0.5)
    >>> [type(o).__name__ for o in inner_optimizers(build_muon(model, settings))]
    ['Muon', 'AdamW']
    """
    _check_lrs(settings)
    roles = parameter_roles(model)
    if not roles["matrix"]:
        raise ConfigError("training.optimizer=muon needs 2-D hidden weights; this model has none (use adamw)")
    muon = Muon(
        roles["matrix"],
        lr=settings.matrix_lr,
        momentum=settings.muon_momentum,
        ns_steps=settings.ns_steps,
        weight_decay=settings.weight_decay,
        distributed=settings.distributed,
        **settings.options,
    )
    muon.param_groups[0]["role"] = "matrix"
    rest = _role_groups(roles, settings, ("embedding", "unembedding", "scalar"))
    return OptimizerContainer([muon, _adamw(rest, settings)] if rest else [muon])


def build_adamw_spam(model: nn.Module, settings: RoleSettings) -> Optimizer:
    """AdamWSPAM (momentum reset, post-reset warm-up, spike clipping) over every role."""
    _check_lrs(settings)
    groups = _role_groups(parameter_roles(model), settings, ROLES)
    return AdamWSPAM(groups, betas=settings.betas, eps=settings.eps, **settings.options)


def build_adamw_prune(model: nn.Module, settings: RoleSettings) -> Optimizer:
    """AdamWPrune over every role, pruning the hidden matrices (embeddings, head and scalars stay dense)."""
    _check_lrs(settings)
    groups = _role_groups(parameter_roles(model), settings, ROLES)
    for group in groups:
        group["prune"] = group["role"] == "matrix"
    if any(hasattr(p, "device_mesh") for g in groups for p in g["params"]):
        raise ConfigError(
            "training.optimizer=adamw_prune needs whole matrices for its global threshold: use DDP, not FSDP"
        )
    return AdamWPrune(groups, betas=settings.betas, eps=settings.eps, **settings.options)


def optimizer_metrics(optimizer: Optimizer) -> dict[str, float]:
    """What an optimizer reports about itself for the train lines (e.g. AdamWPrune's sparsity)."""
    out: dict[str, float] = {}
    for inner in inner_optimizers(optimizer):
        if hasattr(inner, "metrics"):
            out.update(inner.metrics())
    return out


OptimizerBuilder = Callable[[nn.Module, RoleSettings], Optimizer]
OPTIMIZERS: dict[str, OptimizerBuilder] = {
    "adamw": build_adamw,
    "muon": build_muon,
    "adamw_spam": build_adamw_spam,
    "adamw_prune": build_adamw_prune,
}


def register_optimizer(name: str, builder: OptimizerBuilder) -> None:
    """Make `training.optimizer: <name>` build with `builder(model, settings)`."""
    OPTIMIZERS[name] = builder


def build_optimizer(name: str, model: nn.Module, settings: RoleSettings) -> Optimizer:
    """The optimizer `name` (a key of `OPTIMIZERS`) over `model`'s parameter roles.

    >>> model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    >>> opt = build_optimizer("muon", model, RoleSettings(0.02, 0.2, 0.004, 0.01))
    >>> opt, [(g["role"], g["lr"]) for g in opt.param_groups]
    (OptimizerContainer(Muon, AdamW), [('matrix', 0.02), ('embedding', 0.2), ('scalar', 0.01)])
    """
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; known: {', '.join(sorted(OPTIMIZERS))}")
    return OPTIMIZERS[name](model, settings)


def create_muon_optimizer(
    model: nn.Module,
    matrix_lr: float = 0.02,
    embedding_lr: float = 0.2,
    unembedding_lr: float = 0.004,
    scalar_lr: float = 0.004,
    weight_decay: float = 0.0,
    momentum: float = 0.95,
    adam_betas: tuple[float, float] = (0.8, 0.95),
    scale_by_width: bool = True,
    model_dim: int | None = None,
) -> OptimizerContainer:
    """Muon for the hidden matrices and AdamW for the rest (nanochat's optimizer), as one container.

    With `scale_by_width`, the AdamW roles' LRs are multiplied by (d_model / 768) ** -0.5 as
    nanochat does; `model_dim` defaults to the token embedding's width.

    >>> model = nn.Sequential(nn.Embedding(10, 192), nn.Linear(192, 192))
    >>> opt = create_muon_optimizer(model)
    >>> [(g["role"], round(g["lr"], 4)) for g in opt.param_groups]
    [('matrix', 0.02), ('embedding', 0.4), ('scalar', 0.004)]
    """
    scale = 1.0
    if scale_by_width:
        roles = parameter_roles(model)
        table = (roles["embedding"] or roles["unembedding"] or [None])[0]
        dim = model_dim or (table.shape[-1] if table is not None else None)
        scale = width_lr_scale(dim) if dim else 1.0
    settings = RoleSettings(
        matrix_lr,
        embedding_lr * scale,
        unembedding_lr * scale,
        scalar_lr,
        weight_decay,
        betas=adam_betas,
        eps=1e-10,
        muon_momentum=momentum,
    )
    return build_muon(model, settings)

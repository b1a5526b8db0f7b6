"""The optimizer a config asks for: each parameter role's learning rate (explicit, else the optimizer's
default, Muon's scaled by the model's width) and the optimizer-specific options, as `RoleSettings`."""

from __future__ import annotations

from torch import nn

from tierlm.config import TierlmConfig
from tierlm.models import unwrap_model
from tierlm.primitives.optim import ROLES, RoleSettings, parameter_roles, width_lr_scale

MUON_DEFAULT_LRS = {"matrix": 0.02, "embedding": 0.2, "unembedding": 0.004}  # at d_model 768 (nanochat)


def model_width(model: nn.Module) -> int:
    """d_model: the width of the token embedding (or of the head), trained or frozen (LoRA).

    >>> model_width(nn.Sequential(nn.Embedding(10, 4).requires_grad_(False), nn.Linear(4, 4)))
    4
    """
    inner = unwrap_model(model)
    table = next((m.weight for m in inner.modules() if isinstance(m, nn.Embedding)), None)
    if table is None:
        head = (
            inner.get_output_embeddings()
            if hasattr(inner, "get_output_embeddings")
            else getattr(inner, "lm_head", None)
        )
        assert isinstance(head, nn.Module), f"{type(inner).__name__} has neither an embedding nor an output head"
        table = head.weight
    return int(table.shape[-1])


def positions_only(model: nn.Module) -> bool:
    """The embedding role holds tables but not the token table, which is the tied head (GPT-2: its learned position
    table alone).

    >>> class Tied(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.wte, self.wpe = nn.Embedding(50, 8), nn.Embedding(16, 8)
    ...         self.lm_head = nn.Linear(8, 50, bias=False)
    ...         self.lm_head.weight = self.wte.weight
    >>> positions_only(Tied()), positions_only(nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50)))
    (True, False)
    """
    roles = parameter_roles(unwrap_model(model))
    if not roles["embedding"] or not roles["unembedding"]:
        return False
    vocab = roles["unembedding"][0].shape[0]
    return all(table.shape[0] != vocab for table in roles["embedding"])


def role_learning_rates(config: TierlmConfig, width: int | None, positions: bool = False) -> dict[str, float]:
    """Each role's peak LR before batch scaling: explicit, else the optimizer's default. Muon's defaults are
    nanochat's, scaled by width; where the embedding role holds only position tables (`positions_only`: the token
    table is the tied head), it takes the head's: a table added to the token embeddings moves at their pace
    (nanochat's token-embedding LR, 0.49 at width 128, trained GPT-2 to 3.06 where the head's gave 2.04:
    docs/benchmarks.md)."""
    tr = config.training
    defaults = {role: tr.learning_rate for role in ROLES}
    if tr.optimizer == "muon":
        scale = width_lr_scale(width) if width else 1.0
        defaults.update(
            matrix=MUON_DEFAULT_LRS["matrix"],
            embedding=MUON_DEFAULT_LRS["unembedding" if positions else "embedding"] * scale,
            unembedding=MUON_DEFAULT_LRS["unembedding"] * scale,
        )
    explicit = {role: getattr(tr, f"{role}_lr") for role in ROLES}
    return {role: explicit[role] if explicit[role] is not None else defaults[role] for role in ROLES}


def optimizer_settings(config: TierlmConfig, width: int | None, distributed: bool = False) -> RoleSettings:
    """The optimizer's settings for `config` (roles' LRs, decay, betas, optimizer-specific options)."""
    tr = config.training
    lrs = role_learning_rates(config, width)
    options = {
        "adamw_spam": dict(theta=tr.spam_theta, interval=tr.spam_interval, warmup=tr.spam_warmup),
        "adamw_prune": dict(
            score=tr.prune_score,
            final_sparsity=tr.prune_sparsity,
            warmup=tr.prune_warmup,
            frequency=tr.prune_frequency,
            total_steps=tr.num_train_steps,
            seed=tr.seed,
        ),
        "muon": dict(refinements=tuple(tr.muon_refinements), beta2=tr.muon_beta2),
    }.get(tr.optimizer, {})
    return RoleSettings(
        lrs["matrix"],
        lrs["embedding"],
        lrs["unembedding"],
        lrs["scalar"],
        tr.weight_decay,
        tr.decay_norms_and_embeddings,
        (tr.adam_beta1, tr.adam_beta2),
        tr.adam_epsilon,
        tr.muon_momentum,
        distributed=distributed,
        options=options,
    )

"""What is optimised: a strategy turns loader batches into model batches and defines the loss."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from tierlm.errors import ConfigError
from tierlm.primitives.losses import (
    IGNORE_INDEX,
    cross_entropy_sum,
    get_labels,
    label_cross_entropy_only,
    per_token_cross_entropy,
    token_weights,
)

Batch = Mapping[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Variant:
    """What a row of a variant table (`RL_LOSSES`, `PREFERENCE_LOSSES`) says about its section's other settings;
    `check_variant` reads it, so no validator anywhere asks a variant's name."""

    fixed: dict[str, Any] = field(default_factory=dict)
    """Settings the variant fixes: set to anything else, refused."""
    needs: tuple[str, ...] = ()
    """Settings it cannot run without: left at their defaults, refused ("a|b": one of them at least)."""
    reads: tuple[str, ...] = ()
    """Opt-in settings only some variants read: set for a variant that does not read them, refused with the line of
    one that does."""
    why: str | dict[str, str] = ""
    """The one line that refuses a setting (or one line per setting); `{name}` is the chosen variant's name."""

    def line(self, setting: str, name: str) -> str:
        why = self.why.get(setting, "") if isinstance(self.why, dict) else self.why
        return why.format(name=name)


def check_variant(section, key: str, table: Mapping[str, Variant], prefix: str) -> Variant:
    """The row of `table` that `section.<key>` names, after refusing in one line (a ConfigError) every setting of
    `section` that contradicts it.

    >>> from pydantic import BaseModel
    >>> class Section(BaseModel):
    ...     kind: str = "a"
    ...     width: int = 0
    >>> table = {"a": Variant(), "b": Variant(reads=("width",), why="width is b's: set kind=b")}
    >>> check_variant(Section(kind="b", width=3), "kind", table, "s") is table["b"]
    True
    >>> check_variant(Section(width=3), "kind", table, "s")
    Traceback (most recent call last):
    tierlm.errors.ConfigError: width is b's: set kind=b
    """
    return check_variants(section, key, table, prefix)[0]


def check_variants(section, key: str, table: Mapping[str, Variant], prefix: str) -> list[Variant]:
    """`check_variant` where `section.<key>` may name several rows that run together (a list: TRL's combined
    preference losses): each row's fixed and needed settings hold, and a setting is refused only when none of
    them reads it.

    >>> from pydantic import BaseModel
    >>> class Section(BaseModel):
    ...     kind: str | list[str] = "a"
    ...     width: int = 0
    >>> table = {"a": Variant(), "b": Variant(reads=("width",), why="width is b's: set kind=b")}
    >>> len(check_variants(Section(kind=["a", "b"], width=3), "kind", table, "s"))
    2
    """
    names = getattr(section, key)
    names = [names] if isinstance(names, str) else list(names)
    for name in names:
        if name not in table:
            raise ConfigError(f"{prefix}.{key}={name} is not one of {', '.join(table)}: pick one of them")
    rows, fields, shown = [table[name] for name in names], type(section).model_fields, ",".join(names)
    default = lambda setting: fields[setting].get_default(call_default_factory=True)  # noqa: E731
    for name, row in zip(names, rows):
        for setting, value in row.fixed.items():
            if getattr(section, setting) not in (default(setting), value):
                raise ConfigError(row.line(setting, name))
        for need in row.needs:
            settings = need.split("|")
            if all(getattr(section, setting) == default(setting) for setting in settings):
                raise ConfigError(row.line(settings[0], name))
    read = {setting for row in rows for setting in row.reads}
    for other in table.values():
        for setting in set(other.reads) - read:
            if getattr(section, setting) != default(setting):
                raise ConfigError(other.line(setting, shown))
    return rows


def refuse_on_jax(section, prefix: str, pytorch_only: Mapping[str, Any], what: str) -> None:
    """Refuse in one line (a ConfigError) the first setting of `pytorch_only` (name -> whether `section` turns it
    on) that a run on the JAX backend sets: `what` (the PyTorch losses, the PyTorch strategy) applies it, the JAX
    twins do not.

    >>> from types import SimpleNamespace
    >>> refuse_on_jax(SimpleNamespace(bonus=1.0), "rl", {"bonus": lambda rl: bool(rl.bonus)}, "the PyTorch losses")
    Traceback (most recent call last):
    tierlm.errors.ConfigError: rl.bonus is applied by the PyTorch losses: drop it, or set infra.backend=pytorch
    """
    for name, on in pytorch_only.items():
        if on(section):
            raise ConfigError(f"{prefix}.{name} is applied by {what}: drop it, or set infra.backend=pytorch")


@runtime_checkable
class TrainingStrategy(Protocol):
    def prepare_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Loader batch -> model batch (`input_ids`, `labels`, ...)."""
        ...

    def compute_loss(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, number of loss units); the backend normalises over the whole step."""
        ...

    def compute_metrics(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """Summable eval statistics of one batch (sums and counts, never means)."""
        ...


class CrossEntropyStrategy:
    """Next-token cross-entropy on the labelled positions, with bits-per-byte in eval.

    `token_bytes` (V,) gives each token's UTF-8 length (0 for special tokens); with it the eval
    reports bits per byte, a tokenizer-independent measure, over tokens that carry bytes.
    """

    LOSS_FUNCTIONS = ("cross_entropy",)

    def __init__(self, token_bytes: torch.Tensor | None = None, loss_fn: str = "cross_entropy"):
        """`loss_fn`: the trainer API's name for the loss (`SFTStrategy(loss_fn="cross_entropy")`); cross-entropy is
        the one."""
        if loss_fn not in self.LOSS_FUNCTIONS:
            raise ValueError(f"loss_fn must be one of {list(self.LOSS_FUNCTIONS)}, got {loss_fn!r}")
        self.token_bytes, self.loss_fn = token_bytes, loss_fn

    def prepare_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Packed rows (B, T+1) -> `input_ids` (B, T) and `labels` (B, T), the next tokens.

        A label is -100 where the loader's `mask` says not to train, and, when rows carry
        `position_ids`, at the last token of each document: it never predicts the next one.
        A batch that already has `input_ids` is passed through.
        """
        if "input_ids" in batch:
            return dict(batch)
        tokens = batch["tokens"]
        labels = tokens[:, 1:].clone()
        if "mask" in batch:
            labels[batch["mask"][:, 1:] == 0] = IGNORE_INDEX
        out = {"input_ids": tokens[:, :-1], "labels": labels}
        if "position_ids" in batch:
            positions = batch["position_ids"]
            labels[positions[:, 1:] == 0] = IGNORE_INDEX
            out["position_ids"] = positions[:, :-1]
        return out

    @label_cross_entropy_only
    def compute_loss(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return cross_entropy_sum(logits, get_labels(batch), batch.get("loss_mask"))

    @label_cross_entropy_only
    def compute_metrics(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        labels = get_labels(batch)
        weights = token_weights(labels, batch.get("loss_mask"))  # (B, T)
        losses = per_token_cross_entropy(logits, labels)  # (B, T) nats
        metrics = {"loss_sum": (losses * weights).sum(), "num_tokens": weights.sum()}
        if self.token_bytes is not None:
            nbytes = self.token_bytes.to(labels.device)[labels.clamp(min=0)].float() * weights
            metrics["bpb_nats"] = (losses * (nbytes > 0)).sum()
            metrics["num_bytes"] = nbytes.sum()
        return metrics

    # -- the JAX backend's twins (tierlm.primitives.jax_losses.jax_twin), tested equal to the methods above --------
    def jax_compute_loss(self, logits, batch):
        from tierlm.primitives.jax_losses import cross_entropy_sum

        return cross_entropy_sum(logits, get_labels(batch), batch.get("loss_mask"))

    def jax_compute_metrics(self, logits, batch):
        import jax.numpy as jnp

        from tierlm.primitives.jax_losses import per_token_cross_entropy
        from tierlm.primitives.jax_losses import token_weights as jax_token_weights

        labels = get_labels(batch)
        weights = jax_token_weights(labels, batch.get("loss_mask"))
        losses = per_token_cross_entropy(logits, labels)
        metrics = {"loss_sum": (losses * weights).sum(), "num_tokens": weights.sum()}
        if self.token_bytes is not None:
            nbytes = jnp.asarray(self.token_bytes.numpy(), dtype=jnp.float32)[jnp.maximum(labels, 0)] * weights
            metrics["bpb_nats"] = (losses * (nbytes > 0)).sum()
            metrics["num_bytes"] = nbytes.sum()
        return metrics

    @staticmethod
    def summarize(totals: Mapping[str, float]) -> dict[str, float]:
        """Eval line values from summed `compute_metrics` outputs.

        >>> out = CrossEntropyStrategy.summarize({"loss_sum": 6.0, "num_tokens": 3.0, "bpb_nats": 6.0,
        ...     "num_bytes": 4.0})
        >>> out["val_loss"], round(out["val_bpb"], 4)  # 6 nats over 4 bytes = 1.5 / ln 2 bits per byte
        (2.0, 2.164)
        """
        out = {"val_loss": totals["loss_sum"] / max(totals["num_tokens"], 1.0)}
        if totals.get("num_bytes"):
            out["val_bpb"] = totals["bpb_nats"] / (math.log(2) * totals["num_bytes"])
        return out

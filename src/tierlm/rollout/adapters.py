"""LoRA syncs of the adapters alone: a sampler that keeps the policy's base weights (tierlm's engine on a copy, vLLM)
is sent the adapters stamped with the weight version they are, and refuses a stale one."""

from __future__ import annotations

import torch

from tierlm.models.lora import is_adapter_key

ADAPTER_VERSION = "adapter.weight_version"
"""The key of an adapter-only sync's version stamp (`adapter_payload`)."""


def adapter_payload(state: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """A LoRA policy's adapters out of its weights `state`, stamped with the weight `version` they are, for a
    sampler that keeps the base weights (`Engine.load_weights` checks the stamp).

    >>> state = {"q.base_layer.weight": torch.ones(2, 2), "q.lora_A.default.weight": torch.zeros(1, 2)}
    >>> sorted(adapter_payload(state, 3)), int(adapter_payload(state, 3)[ADAPTER_VERSION])
    (['adapter.weight_version', 'q.lora_A.default.weight'], 3)
    """
    adapters = {key: value for key, value in state.items() if is_adapter_key(key)}
    return {**adapters, ADAPTER_VERSION: torch.tensor(version)}


def stamped_adapters(payload: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """The adapters of an `adapter_payload`, refused (RuntimeError) unless it is stamped with `version`: a stale
    adapter is never sampled with.

    >>> stamped_adapters(adapter_payload({"q.lora_A.default.weight": torch.zeros(1, 2)}, 3), 4)
    Traceback (most recent call last):
    RuntimeError: the adapters of weight version 3 were offered as version 4
    """
    adapters = dict(payload)
    stamped = int(adapters.pop(ADAPTER_VERSION))
    if stamped != version:
        raise RuntimeError(f"the adapters of weight version {stamped} were offered as version {version}")
    return adapters

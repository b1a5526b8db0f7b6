"""Dropout turned off in a model that learns from its own samples or against a reference (TRL's `disable_dropout`,
on by default in its DPO, KTO, reward and GRPO trainers).

RL scores a step's rollouts with the policy in evaluation mode (the old log-probs its ratio divides by) and trains it
in training mode; DPO's reference scores in evaluation mode what the policy trains on. With dropout on in training,
the two forwards are different functions: PPO's ratio is off 1 on-policy and the DPO margin off 0 at the start, by
noise alone. Turning every dropout to 0 makes them one. Models that carry dropout: GPT-2's research family with
model.dropout, and transformers' models whose configs keep it (GPT-2's 0.1, OPT's, Phi's).
"""

from __future__ import annotations

from torch import nn


def disable_dropout(model: nn.Module) -> int:
    """Every dropout of `model` set to 0: its `nn.Dropout` modules (what TRL's `disable_dropout_in_model` sets; the
    GPT-2 family's attention reads its kernel's rate from one, as transformers' GPT-2 does) and the float
    `attention_dropout` that transformers' Llama-style attention passes to its kernel. Returns how many were on.

    >>> from tierlm.models.gpt2.model import GPT2, GPT2Config
    >>> import torch
    >>> model = GPT2(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, block_size=8, dropout=0.2)).train()
    >>> ids = torch.arange(8)[None]
    >>> bool((model(ids) == model(ids)).all())
    False
    >>> disable_dropout(model), bool((model(ids) == model.eval()(ids)).all())  # embeddings, attention, residual, MLP
    (4, True)
    """
    on = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            module.p, on = 0.0, on + 1
        if isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0:
            module.attention_dropout, on = 0.0, on + 1
    return on

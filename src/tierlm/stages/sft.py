"""Supervised fine-tuning: conversations, trained on the assistant's tokens only.

    tierlm sft --config configs/tiny_sft.yaml

Each conversation is rendered by the tokenizer's chat template with a mask that marks the assistant's
content and its end-of-turn token (tool results inside an assistant turn are the tool's, not trained);
conversations are packed into padded rows, each attending only to itself.
"""

from __future__ import annotations

import torch

from tierlm.builders.stage import Stage
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError
from tierlm.run import Run
from tierlm.stages.pretrain import train_on_rows
from tierlm.strategies.sft import SFT_LOSSES


class SFT(Stage):
    deepspeed = True
    name = "sft"
    example_kind = "chat"
    chat = True
    packing = "pad"
    isolate_documents = True
    supervised = True

    def trace_batch(self, config: TierlmConfig, rows: int, tokens: int):
        batch, loss = super().trace_batch(config, rows, tokens)
        batch["position_ids"] = torch.arange(tokens).expand(rows, tokens).contiguous()  # packed conversations
        strategy = SFT_LOSSES[config.training.sft_loss]()
        return batch, strategy.compute_loss  # the planner fuses the LM head where the loss allows it

    def resolve_section(self, config: TierlmConfig) -> TierlmConfig:
        if config.training.sft_loss not in SFT_LOSSES:
            raise ConfigError(
                f"training.sft_loss={config.training.sft_loss} is not one of {', '.join(SFT_LOSSES)}: pick one of them"
            )
        return config

    def run(self, run: Run, callbacks: list | None = None) -> dict:
        return train_on_rows(run, SFT_LOSSES[run.config.training.sft_loss], callbacks or [])

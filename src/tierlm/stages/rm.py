"""Reward modelling: a chat model with a scalar head learns to score the chosen reply of each preference pair
above the rejected one (the Bradley–Terry loss), judged by held-out pair accuracy; the final model is a
transformers `...ForSequenceClassification` folder that `tierlm rl ... rl.reward_model=RUN/model` rewards with.

    tierlm rm --config configs/tiny_rm.yaml
"""

from __future__ import annotations

import torch

from tierlm.builders.loaders import build_pair_loaders
from tierlm.builders.model import build_model
from tierlm.builders.stage import Stage
from tierlm.config import TierlmConfig
from tierlm.errors import ConfigError
from tierlm.models.reward import add_score_head
from tierlm.run import Run
from tierlm.stages.with_trainer import train_with_trainer
from tierlm.strategies.reward import RewardStrategy


class RewardModel(Stage):
    name = "rm"
    section = "rm"
    example_kind = "preference"
    chat = True
    generates = False  # it scores text
    starts_from_trained = True
    no_dropout = True
    packing = None
    token_rows = False
    rows_per_example = 2  # a pair's chosen and rejected rows

    def parallelism(self, config: TierlmConfig, launched: bool) -> TierlmConfig:
        infra = config.infra
        if infra.tensor_parallel_size > 1 or infra.pipeline_parallel_size > 1:
            raise ConfigError("tierlm rm shards by data (ddp, fsdp): drop infra.tensor/pipeline_parallel_size")
        return config

    def trace_batch(self, config: TierlmConfig, rows: int, tokens: int):
        ids = torch.zeros(rows, tokens, dtype=torch.long)
        return {"input_ids": ids, "score_index": torch.zeros(rows, dtype=torch.long)}, RewardStrategy(0).compute_loss

    def run(self, run: Run, callbacks: list | None = None) -> dict:
        config, tokenizer = run.choose_batch_size(), run.tokenizer
        if config.model.lora.r:
            raise ConfigError("tierlm rm trains the whole model and its new score head: drop model.lora.r")
        if config.infra.backend != "pytorch":
            raise ConfigError("tierlm rm runs on infra.backend=pytorch")
        model = add_score_head(build_model(config, tokenizer, run.device, run.pretrained), tokenizer.pad_id)
        # a reward is read at a reply's last token: an over-long pair is dropped whole (TRL's RewardTrainer), never cut
        train_loader, eval_loader = build_pair_loaders(
            config, tokenizer, run.data_rank, run.data_parallel_size, long_conversations="drop"
        )
        config = run.resolve(model, train_loader)
        strategy = RewardStrategy(tokenizer.pad_id, config.rm.center_rewards_coefficient)
        return train_with_trainer(run, model, strategy, train_loader, eval_loader, callbacks or [])

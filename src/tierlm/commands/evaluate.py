"""`tierlm eval --checkpoint RUN [--config RL_CONFIG]`: pass@1 / pass@k of a chat model on the held-out
tasks an RL config names, sampled by the generation engine (no training)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from tierlm.build.engine import build_engine
from tierlm.build.tasks import open_tasks
from tierlm.checkpoint.folders import verified_model_location
from tierlm.config import TierlmConfig
from tierlm.data import load_tokenizer
from tierlm.errors import ConfigError
from tierlm.loops.rl import RLTrainer
from tierlm.models import load_pretrained_model
from tierlm.primitives import resolve_device


def run_eval(config: TierlmConfig, checkpoint: str) -> dict:
    """pass@1 / pass@k of a chat model on the held-out problems the RL config names (no training)."""
    location = verified_model_location(checkpoint)
    tokenizer = load_tokenizer(location, config.model.trust_remote_code)
    if not tokenizer.has_chat_template:
        raise ConfigError(f"{checkpoint} has no chat template: pass@k evaluates chat models")
    torch.manual_seed(config.training.seed)
    model = load_pretrained_model(location, device=resolve_device(config.infra.device_type, config.infra.gpu_rank))
    eval_task = open_tasks(config)[1]
    with tempfile.TemporaryDirectory(prefix="tierlm-sampler-") as folder:  # rl.engine=vllm: its model folder
        engine = build_engine(config.rl, model, tokenizer, Path(folder))
        try:
            trainer = RLTrainer(None, None, engine, tokenizer, None, eval_task, config.rl, config.training)
            return trainer.evaluate()
        finally:
            engine.close()

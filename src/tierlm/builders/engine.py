"""The rollout engine a config asks for (rl.engine): tierlm's own, or vLLM in this process or behind a server."""

from __future__ import annotations

import copy
from pathlib import Path

from torch import nn

from tierlm.config import RLConfig
from tierlm.errors import ConfigError
from tierlm.models import family_of, unwrap_model
from tierlm.rollout.engine import Engine
from tierlm.rollout.tools import Calculator, PythonTool


def build_engine(
    rl: RLConfig,
    model: nn.Module,
    tokenizer,
    folder: Path | None,
    sharded: bool = False,
    world_size: int = 1,
    task=None,
):
    """An engine sampling `model` with the run's tools (rl.tools, and those its `task` declares): tierlm's own on
    the policy's live weights, or on a whole copy of its own (loaded with the policy's weights at each sync) when the
    policy will be `sharded` (FSDP) or sampling runs ahead of training (off-policy); or vLLM, which holds weights of
    its own (a model folder under `folder`, which tierlm's engine does not need)."""
    tools = [{"calculator": Calculator, "python": PythonTool}[name]() for name in rl.tools]
    tools += list(getattr(task, "tools", {}).values())
    if rl.engine == "native":
        own_copy = sharded or rl.max_off_policy_steps > 0
        return Engine(copy.deepcopy(model) if own_copy else model, tokenizer.stop_ids, tokenizer, tools)
    if world_size > 1 and rl.vllm_url is None:
        raise ConfigError(
            "under torchrun rl.engine=vllm samples through one vLLM server: set rl.vllm_url (vLLM in each trainer "
            "process is not supported), or keep rl.engine=native"
        )
    if world_size > 1 and rl.max_off_policy_steps:
        raise ConfigError(
            "rl.max_off_policy_steps with a vLLM server runs in one trainer process (ranks would push weights the "
            "others still sample with): drop torchrun or set rl.max_off_policy_steps=0"
        )
    from tierlm.rollout.vllm import VLLMEngine

    assert folder is not None, "vLLM loads the policy from a model folder: give build_engine one"

    inner = unwrap_model(model)
    max_len = family_of(inner).max_seq_len(inner) or 2048
    return VLLMEngine(
        inner, tokenizer.stop_ids, tokenizer, tools, folder, max_len, rl.vllm_url, rl.vllm_gpu_memory_utilization
    )


def engine_name(rl: RLConfig) -> str:
    """What samples a run's rollouts, in words."""
    if rl.engine == "native":
        return "tierlm's engine"
    return f"the vLLM server at {rl.vllm_url}" if rl.vllm_url else "vLLM in this process"

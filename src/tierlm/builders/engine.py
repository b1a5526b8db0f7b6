"""The sampling engines, one row each of `ENGINES`: tierlm's own KV-cache engine, or vLLM in this process or behind
a server. `EngineSettings` is what builds one: the config's engine section (which RL runs and `tierlm eval` read from
the config, and `tierlm chat` and `tierlm serve` fill from their flags) with the tools the model may call and whether
sampling runs ahead of training."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torch import nn

from tierlm.config import EngineConfig, TierlmConfig
from tierlm.errors import ConfigError
from tierlm.models import family_of, unwrap_model
from tierlm.rollout.engine import Engine, SamplingEngine, check_compile
from tierlm.rollout.tools import Calculator, PythonTool

TOOLS = {"calculator": Calculator, "python": PythonTool}
"""rl.tools' names -> the tools."""


@dataclass(frozen=True)
class EngineSettings:
    kind: str = "native"
    """A row of `ENGINES`."""
    vllm_url: str | None = None
    """vllm: the base URL of a vLLM server (None: vLLM in this process)."""
    gpu_memory_utilization: float = 0.3
    """vllm in this process on a GPU: the share of GPU memory it may take."""
    tools: tuple[str, ...] = ()
    """Tools the model may call (`TOOLS`' names)."""
    off_policy: bool = False
    """Sampling runs ahead of training (rl.max_off_policy_steps > 0): the engine samples weights of its own."""
    routing_replay: bool = False
    """The trainer replays the experts the engine chose (rl.routing_replay): the engine must record them."""
    compile: bool = False
    """native: `torch.compile` the decode step (engine.compile)."""

    @classmethod
    def of(cls, config: TierlmConfig) -> EngineSettings:
        """The engine a run's config asks for: its engine section, with the rl section's tools, off-policy steps and
        routing replay."""
        rl = config.rl
        settings = cls.from_section(config.engine, tuple(rl.tools), rl.max_off_policy_steps > 0)
        return dataclasses.replace(settings, routing_replay=rl.routing_replay)

    @classmethod
    def from_section(
        cls, engine: EngineConfig, tools: tuple[str, ...] = (), off_policy: bool = False
    ) -> EngineSettings:
        """`engine` (a validated engine section: `tierlm chat` and `tierlm serve` make one from their flags).

        >>> EngineSettings.from_section(EngineConfig(kind="vllm", vllm_url="http://127.0.0.1:8000")).vllm_url
        'http://127.0.0.1:8000'
        """
        return cls(
            engine.kind, engine.vllm_url, engine.gpu_memory_utilization, tools, off_policy, compile=engine.compile
        )


def native(settings: EngineSettings, model: nn.Module, tokenizer, tools, folder, sharded: bool, world_size: int):
    """tierlm's engine on the policy's live weights, or on a whole copy of its own (loaded with the policy's weights
    at each sync) when the policy will be `sharded` (FSDP) or sampling runs ahead of training (off-policy)."""
    own_copy = sharded or settings.off_policy
    if settings.compile:
        check_compile(model)  # before a copy is made (the engine checks it again)
    model = copy.deepcopy(model) if own_copy else model
    return Engine(model, tokenizer.stop_ids, tokenizer, tools, compile=settings.compile)


def vllm(settings: EngineSettings, model: nn.Module, tokenizer, tools, folder, sharded: bool, world_size: int):
    """vLLM, which holds weights of its own: a model folder under `folder` it loads, in this process or the server's."""
    if world_size > 1 and settings.vllm_url is None:
        raise ConfigError(
            "under torchrun engine.kind=vllm samples through one vLLM server: set engine.vllm_url (vLLM in each "
            "trainer process is not supported), or keep engine.kind=native"
        )
    if world_size > 1 and settings.off_policy:
        raise ConfigError(
            "rl.max_off_policy_steps with a vLLM server runs in one trainer process (ranks would push weights the "
            "others still sample with): drop torchrun or set rl.max_off_policy_steps=0"
        )
    from tierlm.rollout.vllm import VLLMEngine

    assert folder is not None, "vLLM loads the policy from a model folder: give build_engine one"
    inner = unwrap_model(model)
    max_len = family_of(inner).max_seq_len(inner) or 2048
    url, share = settings.vllm_url, settings.gpu_memory_utilization
    return VLLMEngine(inner, tokenizer.stop_ids, tokenizer, tools, folder, max_len, url, share)


@dataclass(frozen=True)
class EngineKind:
    build: Callable[..., SamplingEngine]
    describe: Callable[[EngineSettings], str]
    """The engine in words, for the run's notes."""
    needs_folder: bool = False
    """It loads the policy from a model folder (the caller gives it a scratch folder)."""
    batches_replies: bool = False
    """`tierlm serve` batches concurrent replies on it (continuous batching) and streams token by token."""
    records_routes: bool = False
    """It records the experts a mixture-of-experts model sends each token to (rollout routing replay)."""
    samples_each_token: bool = False
    """It samples token by token in this process, so a reply can be run on past a stop token (`ignore_eos`)."""


ENGINES: dict[str, EngineKind] = {
    "native": EngineKind(
        native, lambda s: "tierlm's engine", batches_replies=True, records_routes=True, samples_each_token=True
    ),
    "vllm": EngineKind(
        vllm,
        lambda s: f"the vLLM server at {s.vllm_url}" if s.vllm_url else "vLLM in this process",
        needs_folder=True,
    ),
}
"""engine.kind (`tierlm chat / serve --engine`) -> the engine: the one place an engine is named."""


def build_engine(
    settings: EngineSettings,
    model: nn.Module,
    tokenizer,
    folder: Path | None = None,
    sharded: bool = False,
    world_size: int = 1,
    task=None,
) -> SamplingEngine:
    """The engine `settings` asks for, sampling `model` with its tools (and those the `task` declares)."""
    tools = [TOOLS[name]() for name in settings.tools] + list(getattr(task, "tools", {}).values())
    if settings.routing_replay:
        check_routing_replay(settings, model)
    return ENGINES[settings.kind].build(settings, model, tokenizer, tools, folder, sharded, world_size)


def check_routing_replay(settings: EngineSettings, model: nn.Module) -> None:
    """Refuse rl.routing_replay, in one line, where nothing records routes to replay: a dense policy (or one whose
    family does not route through tierlm's layers, as a transformers MoE), or an engine that does not record them."""
    inner = unwrap_model(model)
    if not hasattr(inner, "moe_layers") or not inner.moe_layers():
        raise ConfigError(
            "rl.routing_replay replays the experts a mixture-of-experts policy chose, and this policy has none (a "
            "native GPT with model.moe.num_experts > 0 has): drop rl.routing_replay"
        )
    if not ENGINES[settings.kind].records_routes:
        raise ConfigError(
            f"rl.routing_replay needs the experts the sampler chose, and engine.kind={settings.kind} does not hand "
            "them to tierlm (vLLM 0.32 returns them only from its Model Runner V2, which needs Triton: not on a "
            "CPU; docs/moe.md): use engine.kind=native"
        )

"""Typed config sections (`sections`, `model`), YAML files and `key=value` overrides (`files`), what a
launcher such as `accelerate launch` says (`launchers`), and the presets shipped in `presets/`."""

from tierlm.config.model import (
    DelayConfig,
    KVPruningConfig,
    LoraConfig,
    ModelConfig,
    RAConfig,
    RMLPConfig,
    Section,
    TokenizerConfig,
)
from tierlm.config.sections import (
    AblationConfig,
    DataConfig,
    DPOConfig,
    EngineConfig,
    FullConfig,
    InfraConfig,
    MixtureComponent,
    RewardModelConfig,
    RLConfig,
    TierlmConfig,
    TrainingConfig,
)

__all__ = [
    "AblationConfig",
    "DPOConfig",
    "DataConfig",
    "DelayConfig",
    "EngineConfig",
    "FullConfig",
    "InfraConfig",
    "KVPruningConfig",
    "LoraConfig",
    "MixtureComponent",
    "ModelConfig",
    "RAConfig",
    "RLConfig",
    "RewardModelConfig",
    "RMLPConfig",
    "Section",
    "TierlmConfig",
    "TokenizerConfig",
    "TrainingConfig",
]

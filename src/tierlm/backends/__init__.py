"""Tier 0 (protocol, backends), with the tier-1 primitives and tier-2 factories users reach for:

    from tierlm.backends import create_pytorch_backend  # tier 2: one call
    from tierlm.backends import load_hf_model, create_adamw_optimizer, PyTorchTrainingBackend  # tiers 1 + 0

`parallelize` is the one order of the model transforms every backend applies.
"""

from tierlm.backends.distributed import DDPTrainingBackend, DistributedTrainingBackend, FSDPTrainingBackend
from tierlm.backends.factory import (
    JaxBackend,
    MegatronBackend,
    PyTorchBackend,
    create_backend_with_scheduler,
    create_ddp_backend,
    create_fsdp_backend,
    create_pytorch_backend,
)
from tierlm.backends.options import BackendOptions
from tierlm.backends.protocol import TrainFuture, TrainingBackend
from tierlm.backends.pytorch import PyTorchTrainingBackend, loss_sum_and_count
from tierlm.backends.references import FrozenReference
from tierlm.backends.state import GradientInfo, ModelState
from tierlm.primitives import (
    compute_device_map_single_gpu,
    create_adamw_optimizer,
    create_cross_entropy_loss,
    create_warmup_cosine_scheduler,
    create_warmup_scheduler,
    load_hf_model,
    parse_dtype,
    resolve_device,
)

__all__ = [
    "BackendOptions",
    # tier 2
    "JaxBackend",
    "MegatronBackend",
    "PyTorchBackend",
    "create_backend_with_scheduler",
    "create_ddp_backend",
    "create_fsdp_backend",
    "create_pytorch_backend",
    # tier 1
    "compute_device_map_single_gpu",
    "create_adamw_optimizer",
    "create_cross_entropy_loss",
    "create_warmup_cosine_scheduler",
    "create_warmup_scheduler",
    "load_hf_model",
    "parse_dtype",
    "resolve_device",
    # tier 0
    "DDPTrainingBackend",
    "DistributedTrainingBackend",
    "FSDPTrainingBackend",
    "FrozenReference",
    "GradientInfo",
    "ModelState",
    "PyTorchTrainingBackend",
    "TrainFuture",
    "TrainingBackend",
    "loss_sum_and_count",
]

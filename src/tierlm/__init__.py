"""tierlm: train language models through every stage from one small protocol.

Tiers, each built only from those below it:
  3 application   `tierlm` CLI, `tierlm.trainer.Trainer`, recipes
  2 convenience   `tierlm.backends.create_pytorch_backend`, `create_backend_with_scheduler`
  1 primitives    `tierlm.primitives` (dtype, device, model loading, optimizers, losses, schedules)
  0 protocol      `tierlm.backends.TrainingBackend`, `TrainFuture`, `PyTorchTrainingBackend`
"""

__version__ = "0.1.0"

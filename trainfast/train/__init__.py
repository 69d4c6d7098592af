"""Training: the trainer (`fit`), checkpoints, metrics and curves, and DDP under torchrun."""

from trainfast.train.trainer import FitResult, fit

__all__ = ["FitResult", "fit"]

"""Training: `fit` (fit.py tells a run's story and names the rooms it calls), checkpoints,
metrics and curves, and DDP under torchrun."""

from trainfast.train.fit import FitResult, fit

__all__ = ["FitResult", "fit"]

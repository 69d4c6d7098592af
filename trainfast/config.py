"""Typed configs, one per component, with every default in one place.

NOTE: imports nothing of ours but errors (which imports nothing); every room may import it.
Each field's docstring is the one line that `--help` and the docs repeat.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields

from trainfast.errors import TrainfastError


@dataclass
class PackConfig:
    """How `trainfast pack` turns a source into a pack."""

    size: tuple[int, int] | None = None
    """Target (height, width) of every image in the pack; None: arrays keep their own (files need one)."""
    resize: str = "stretch"
    """stretch (ignore aspect), fit (pad with black to keep aspect) or crop (centre crop)."""
    channels: int = 3
    """3 for RGB, 1 for grayscale; every input mode is converted (grayscale arrays too: channels=1 keeps them)."""
    encoding: str = "auto"
    """raw (uint8 arrays; fastest to read) or jpeg (small on disk); auto: jpeg above 256×256."""
    quality: int = 90
    """JPEG quality for encoding=jpeg."""
    workers: int = 0
    """Decoding processes; 0 means one per usable core."""
    on_error: str = "skip"
    """skip: leave bad inputs out and list them; fail: stop at the first, write nothing."""
    limit: int = 0
    """Pack only the first N inputs of the shuffled order (0: all)."""
    seed: int = 0
    """Seed of the order in which the inputs are stored."""
    chunk: int = 512
    """Inputs per unit of work; a rerun after a kill skips the chunks already done."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Augment:
    """Batched augmentations, run on the device after the copy (no per-sample Python).

    Geometric ones run on uint8 NHWC before conversion; colour ones on the float batch.
    """

    crop_pad: int = 0
    """Random crop after padding each side by this many pixels (reflect padding)."""
    translate: int = 0
    """Random shift by up to this many pixels, zero-filled."""
    flip: bool = False
    """Random horizontal flip. Off by default: it breaks text such as plates."""
    brightness: float = 0.0
    """Multiply each image by 1 + U(-b, b)."""
    contrast: float = 0.0
    """Scale each image's deviation from its mean by 1 + U(-c, c)."""
    cutout: int = 0
    """Zero one random square of this side per image."""

    def __post_init__(self):
        for name in ("crop_pad", "translate", "cutout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TrainfastError(f"augment {name} must be a whole number of pixels ≥ 0, not {value!r}")
        for name in ("brightness", "contrast"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise TrainfastError(f"augment {name} must be a number from 0 to 1 (the largest change, as a share), "
                                     f"not {value!r}")
        if not isinstance(self.flip, bool):
            raise TrainfastError(f"augment flip must be True or False, not {self.flip!r}")

    @property
    def active(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    @property
    def geometric(self) -> bool:
        return bool(self.crop_pad or self.translate or self.flip)


def as_augment(augment) -> Augment | None:
    """An Augment, or a dict of its fields (as a notebook user writes it), as an Augment."""
    if augment is None or isinstance(augment, Augment):
        return augment
    if isinstance(augment, dict):
        known = [f.name for f in fields(Augment)]
        unknown = sorted(str(k) for k in set(augment) - set(known))
        if unknown:
            raise TrainfastError(f"augment: {', '.join(unknown)} is not an augmentation trainfast has "
                                 f"({', '.join(known)})")
        return Augment(**augment)
    raise TrainfastError(f"augment must be a trainfast.Augment (or a dict of its fields), not {type(augment).__name__}")


def check_pin(pin) -> dict:
    """fit's `pin`: a dict of Speed's fields, each checked as Speed checks it."""
    if pin is None:
        return {}
    if not isinstance(pin, dict):
        raise TrainfastError(f"pin must be a dict of speed settings (such as {{'batch_size': 64}}), not "
                             f"{type(pin).__name__}")
    known = [f.name for f in fields(Speed)]
    unknown = sorted(str(k) for k in set(pin) - set(known))
    if unknown:
        raise TrainfastError(f"pin: {', '.join(unknown)} is not a speed setting ({', '.join(known)})")
    Speed(**pin)  # each value checked
    return dict(pin)


PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


@dataclass
class Speed:
    """The speed settings that `trainfast tune` measures and `trainfast train` uses."""

    precision: str = "fp32"
    """fp32; tf32 (fp32 with TF32 matmuls, CUDA ≥ sm80); bf16 autocast (CPUs with AVX512-BF16/AMX, CUDA ≥ sm80);
    fp16 autocast + GradScaler (CUDA)."""
    channels_last: bool = False
    """Model and batches in channels_last (NHWC) memory, the layout fast conv kernels want."""
    compile: bool = False
    """torch.compile the model (its compile time is paid once, at the start)."""
    batch_size: int = 128
    """Images per step (per process under torchrun)."""
    threads: int = 0
    """Intra-op CPU threads; 0 leaves torch's default."""
    rewrites: tuple[str, ...] = ()
    """Exact rewrite passes run on the model (trainfast.models.rewrite), e.g. pool_before_relu."""

    def __post_init__(self):
        self.rewrites = tuple(self.rewrites)  # from JSON it arrives as a list
        if self.precision not in PRECISIONS:
            raise TrainfastError(f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        for name, least in (("batch_size", 1), ("threads", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise TrainfastError(f"{name} must be a whole number ≥ {least}, not {value!r}")
        most = os.cpu_count() or 1
        if self.threads > most:  # more would only start threads (100000 of them exhausted the machine's processes)
            raise TrainfastError(f"threads must be at most this machine's {most} logical CPUs, not {self.threads}")

    def label(self) -> str:
        parts = [self.precision] + (["channels_last"] if self.channels_last else []) \
            + (["compile"] if self.compile else []) + [f"batch {self.batch_size}"] \
            + ([f"{self.threads} threads"] if self.threads else []) + (["rewrites"] if self.rewrites else [])
        return " + ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


OPTIMIZERS = ("sgd", "adamw", "rmsprop")


def check_optimizer(name: str) -> None:
    """One line where `name` is not an optimizer trainfast builds (fit's config, tune, step.make_optimizer)."""
    if name not in OPTIMIZERS:
        raise TrainfastError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {name!r}")
SCHEDULES = ("onecycle", "cosine", "constant")
BASE_LR = {"sgd": 0.2, "adamw": 6e-3, "rmsprop": 1e-3}
"""Each optimizer's default peak rate at BASE_BATCH, scaled to the run's batch by scale_lr
(adamw: 3e-3 at 64, plate_net's measured rate)."""
BASE_BATCH = 256
SQRT_SCALED = ("adamw", "rmsprop")


def scale_lr(optimizer: str, lr: float, from_batch: int, to_batch: int) -> float:
    """A peak rate that suits `from_batch`, for `to_batch`: linearly for SGD (Goyal et al., 2017),
    by the square root for the adaptive optimizers (Malladi et al., 2022)."""
    ratio = to_batch / from_batch
    return lr * (ratio ** 0.5 if optimizer in SQRT_SCALED else ratio)


def default_lr(optimizer: str, batch: int) -> float:
    """The optimizer's default peak learning rate for a (global) batch."""
    return scale_lr(optimizer, BASE_LR[optimizer], BASE_BATCH, batch)


@dataclass
class TrainConfig:
    """How `trainfast train` / `trainfast.fit` trains; written to config.json in the run directory."""

    epochs: int = 10
    """Passes over the training data."""
    optimizer: str = "adamw"
    """adamw (the default: it trains networks without normalisation too), sgd (Nesterov momentum) or rmsprop."""
    lr: float = 0.0
    """Peak learning rate; 0: the optimizer's default for the batch (see lr_test)."""
    momentum: float = 0.9
    """SGD momentum (Nesterov) / RMSprop momentum."""
    weight_decay: float = 5e-4
    """L2 weight decay (decoupled for AdamW)."""
    schedule: str = "onecycle"
    """onecycle, cosine (with warm-up) or constant."""
    warmup: float = 0.2
    """Warm-up, as a fraction of all steps (onecycle's rise; cosine's linear ramp)."""
    label_smoothing: float = 0.0
    """Cross-entropy label smoothing."""
    clip: float = 0.0
    """Clip the gradient norm to this (0: off)."""
    val_fraction: float = 0.1
    """Held-out share of the training pack when no validation pack is given."""
    patience: int = 0
    """Stop after this many epochs without a better validation score (0: never)."""
    save_every: int = 0
    """Also checkpoint every N steps inside an epoch (0: at the end of each epoch only)."""
    seed: int = 0
    """Seed of the weights, the order and the augmentations."""
    deterministic: bool = False
    """Deterministic kernels (cuDNN, cuBLAS): the same seed gives the same weights on the same device; can be slower."""
    lr_test: bool = False
    """With lr 0: a learning-rate range test on the training data may lower the optimizer's default rate
    (scaled from batch 256). Off by default: its short test lowered AdamW's rate 4-10× on outside models
    and cost them held-out accuracy (docs/TRAINING.md)."""
    tune_share: float = 0.1
    """The most of the planned training time that tuning may take (0: no bound)."""
    minutes: float = 0.0
    """A wall-clock budget for the epochs (0: none): where the epochs so far say the rest will not fit, the run
    is shortened to the epochs that do, its learning rate annealed over the shorter plan."""
    loss_watch: bool = True
    """Say so when the training loss has not left chance (ln K) after max(2, 30%) of the epochs, or diverges; stop
    the run where going on cannot help (a diverging loss, or every output frozen). A first attempt at the default
    learning rate (lr 0) starts over once instead, from its first weights, at half that rate."""

    def to_dict(self) -> dict:
        return asdict(self)

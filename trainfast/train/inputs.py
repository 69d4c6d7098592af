"""What fit is given, read and checked before anything runs: the config, the model (by name or
object), the data (a pack, its path, a Loader or arrays) and whether the model fits the data.
Every mistake is one line naming the argument or file."""

from __future__ import annotations

import math

import numpy as np
import torch

from trainfast import models
from trainfast import step as _step
from trainfast.config import SCHEDULES, TrainConfig, check_optimizer
from trainfast.data.format import Pack, as_pack
from trainfast.data.loader import Loader
from trainfast.data.arrays import pack_arrays
from trainfast.data.pack import is_arrays
from trainfast.errors import TrainfastError


def model_and_name(model) -> tuple[torch.nn.Module, str]:
    try:
        return models.load(model)
    except ValueError as e:
        raise TrainfastError(str(e)) from None


def check_fits(model: torch.nn.Module, pk: Pack, say=None, out: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
    """The pack's images and labels must be what the model takes and predicts: checked with one
    forward pass of two of the pack's images (on the model's device, in eval mode, no gradient), which also
    materialises lazy modules (nn.LazyLinear) before an optimizer needs their parameters. `say`
    is told which part of the output is trained on where the model returns more than logits,
    and of a head wider than the pack's classes. `out`: the model's output for images of this
    shape where it is known (no forward pass then). Returns the classes per prediction that the
    data has (the loss watch's chance level is ln of this), and the output."""
    h, w, c = pk.shape
    want = getattr(model, "input_shape", None)
    if want is not None and tuple(want) != (c, h, w):
        raise TrainfastError(f"{pk.path} holds {c}×{h}×{w} images; the model takes {'×'.join(map(str, want))}")
    out = model_output(model, pk, say) if out is None else out
    need = pk.sequence_length
    classes = len(pk.alphabet) if need else len(pk.classes or [])
    if need:
        if out.dim() != 3 or out.shape[1] != need or out.shape[2] < classes:
            raise TrainfastError(f"{pk.path} has sequence labels ({need} × {classes} characters); the model "
                                 f"predicts {'×'.join(map(str, out.shape[1:]))} per image: it needs "
                                 f"(N, {need}, {classes}) logits")
    elif out.dim() != 2 or out.shape[1] < classes:
        raise TrainfastError(f"{pk.path} has {classes} classes; the model predicts "
                             f"{'×'.join(map(str, out.shape[1:]))} per image: it needs (N, {classes}) "
                             "logits (the last layer's width, e.g. num_classes=" + str(classes) + ")")
    if out.shape[-1] > classes and say is not None:
        say(f"note: the model predicts {out.shape[-1]} classes and {pk.path} has {classes}: the other "
            f"{out.shape[-1] - classes} outputs are trained toward never; a head of {classes} "
            f"(num_classes={classes}) is the usual fit")
    return classes or int(out.shape[-1]), out


def model_output(model: torch.nn.Module, pk: Pack, say=None) -> torch.Tensor:
    """The model's logits for two of the pack's images, or one line saying why there are none."""
    x = torch.from_numpy(np.stack([pk.image(i) for i in range(min(2, len(pk)))])).permute(0, 3, 1, 2).float() / 255
    return _step.first_forward(model, x, f"{pk.path}'s images", say)


def check_config(cfg: TrainConfig) -> None:
    for name in ("epochs", "seed", "patience", "save_every"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TrainfastError(f"{name} must be a whole number ≥ 0, not {value!r}")
    check_optimizer(cfg.optimizer)
    if cfg.schedule not in SCHEDULES:
        raise TrainfastError(f"schedule must be one of {', '.join(SCHEDULES)}, not {cfg.schedule!r}")
    if cfg.epochs < 1:
        raise TrainfastError(f"epochs must be ≥ 1, not {cfg.epochs}")
    if not 0 <= cfg.val_fraction < 1:
        raise TrainfastError(f"val_fraction must be in [0, 1), not {cfg.val_fraction}")
    for name, low, high in (("lr", 0, None), ("momentum", 0, 1), ("weight_decay", 0, None), ("warmup", 0, 1),
                            ("label_smoothing", 0, 1), ("clip", 0, None), ("tune_share", 0, 1),
                            ("patience", 0, None), ("save_every", 0, None), ("minutes", 0, None)):
        value = getattr(cfg, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= low
                and (high is None or value <= high)):
            span = f"in [{low}, {high}]" if high is not None else f"≥ {low}"
            raise TrainfastError(f"{name} must be {span}, not {value!r}")


def training_pack(data, pin: dict | None, say, what: str = "train") -> tuple[Pack, dict | None]:
    """fit's data as a Pack: a Pack or its path; a Loader (its pack, and its batch size pinned);
    or (images, labels) arrays, packed once into trainfast's cache and reused while they are the same."""
    if isinstance(data, Loader):
        pin = {**(pin or {}), "batch_size": (pin or {}).get("batch_size") or data.batch_size}
        say(f"{what}: the Loader's pack {data.pack.path}, at batch {pin['batch_size']} (fit makes its own Loader, "
            "with its augmentations and held-out split)")
        return data.pack, pin
    if is_arrays(data):
        pk, notes = pack_arrays(*data, name=f"{what} arrays")
        h, w, c = pk.shape
        say(f"{what}: packed the ({len(pk)} images {h}×{w}×{c}, labels) arrays into {pk.path} (reused while "
            "the arrays are the same)" + "".join(f"; {n}" for n in notes))
        return pk, pin
    return as_pack(data, f"fit's {what} data"), pin


def _label_names(pk: Pack) -> str:
    if pk.alphabet:
        return f"alphabet {pk.alphabet!r}"
    names = pk.classes or []
    return ", ".join(names[:5]) + (f", … ({len(names)})" if len(names) > 5 else "")


def held_out(train_pk: Pack, val_pk: Pack | None, cfg: TrainConfig):
    """(validation pack, training indices, validation indices): without a validation pack,
    cfg.val_fraction of the training pack, by a seeded permutation, the same on every rank."""
    if val_pk is not None or cfg.val_fraction <= 0:
        return val_pk, None, None
    order = np.random.default_rng([cfg.seed, 7919]).permutation(len(train_pk))
    n_val = max(1, int(len(train_pk) * cfg.val_fraction))
    return train_pk, np.sort(order[n_val:]), np.sort(order[:n_val])


def check_trainable(net: torch.nn.Module, name: str) -> None:
    params = list(net.parameters())
    if not any(p.requires_grad for p in params):
        raise TrainfastError(f"{name}: nothing to train: " + (f"all {sum(p.numel() for p in params):,} parameters are "
                                                              "frozen (requires_grad=False)" if params else
                                                              "the model has no parameters"))


def check_val_fits(net: torch.nn.Module, val_pk: Pack, train_pk: Pack, out: torch.Tensor) -> None:
    """The validation pack fits the model as the training pack does (`out`: the model's output on
    the training pack's images), and labels the same classes."""
    check_fits(net, val_pk, out=out if val_pk.shape == train_pk.shape else None)
    a, b = sorted((val_pk.classes or [], train_pk.classes or []), key=len)
    if val_pk.alphabet != train_pk.alphabet or b[:len(a)] != a:  # a split may lack the last classes, no more
        raise TrainfastError(f"{val_pk.path} labels other classes than {train_pk.path} "
                             f"({_label_names(val_pk)} vs {_label_names(train_pk)}): its accuracy would "
                             "compare mismatched labels")


def check_batch_fits(pk: Pack, n_train: int, batch: int, processes: int) -> None:
    """A pinned batch must fit in each process's share of the training images."""
    if n_train // processes >= batch:
        return
    held = f" ({len(pk) - n_train} held out for validation)" if n_train < len(pk) else ""
    per = f" per process ({processes} processes)" if processes > 1 else ""
    raise TrainfastError(f"{pk.path}: {n_train} training images{held} are too few for batch size "
                         f"{batch}{per}: give a batch size of at most {n_train // processes}")

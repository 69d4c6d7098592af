"""The learning rate, measured on the user's own data: a short range test.

From a copy of the model, a few dozen to a hundred training steps are taken with the
learning rate rising geometrically from LO to HI; the loss, smoothed, falls, bottoms out
and then climbs. The rate at the bottom is about as high as training can go, so a tenth of
it is a peak the run can take (under a warm-up schedule). The test is one of the known ways
to set a rate (Smith, "Cyclical learning rates", 2017); it costs a share of one epoch and is
cached per model, data and settings like the speed settings.

The test checks the optimizer's default rate; it does not replace it (`peak`): where a
tenth of the bottom is below the default, the run takes the lower rate; where it is above,
the run keeps the default. A short test's bottom is noisy (23 steps on cifar_resnet put it
anywhere from 0.03 to 0.21 across seeds) and it lies past the best rate for a whole run:
each rate the test raised above the default reached the target later (docs/TRAINING.md).
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass, field

import torch

from trainfast import hardware
from trainfast import step as _step

LO, HI = 1e-6, 10.0
STEPS = 100  # the most steps a test takes
SMOOTH = 0.9  # exponential smoothing of the loss (bias-corrected) over STEPS; less over fewer steps
STOP = 4.0  # stop once the smoothed loss exceeds this multiple of its lowest value
MIN_DROP = 0.05  # the lowest smoothed loss must be this far below the first, or no rate is chosen
FACTOR = 0.1  # the run's peak rate, as a share of the rate at the lowest loss


@dataclass
class RangeTest:
    lr: float | None  # None: no rate made the loss fall (see note)
    at_min: float | None = None  # the rate at the lowest smoothed loss
    steps: int = 0
    points: list[tuple[float, float]] = field(default_factory=list)  # (rate, smoothed loss)
    note: str = ""
    cached: bool = False

    def peak(self, default: float) -> float:
        """The run's peak rate: `default` (the optimizer's, for the run's batch), lowered to
        the test's rate where that is lower; the default where the test found no rate."""
        return default if self.lr is None else min(self.lr, default)

    def sentence(self, default: float, optimizer: str) -> str:
        head = f"learning rate range test ({self.steps} steps{', cached' if self.cached else ''}): "
        if self.lr is None:
            return f"{head}{self.note}; using {optimizer}'s default {default:.2g}"
        low = f"the loss is lowest at {self.at_min:.2g}, and a tenth of that is {self.lr:.2g}"
        if self.lr < default:
            return f"{head}{low}, below {optimizer}'s default {default:.2g}: the run peaks at {self.lr:.2g}"
        return f"{head}{low}, not below {optimizer}'s default: the run peaks at the default {default:.2g}"


def key(net, batches_id: str, optimizer: str, speed, device) -> str:
    structure = hardware.model_key(net)
    text = f"{structure}|{batches_id}|{optimizer}|{speed.label()}|{hardware.machine_key(device)}"
    return hashlib.sha1(text.encode()).hexdigest()


def range_test(net: torch.nn.Module, batch, make_optimizer, speed, device: torch.device, steps: int = STEPS,
               label_smoothing: float = 0.0) -> RangeTest:
    """Train a copy of `net` for up to `steps` steps on batches `batch(i)`, the rate rising from
    LO to HI; `make_optimizer(params, lr)` builds the run's optimizer. The model, the global
    random streams and the caller's data position are left as they were."""
    model = copy.deepcopy(net).train()
    opt = make_optimizer(model.parameters(), LO)
    scaler = _step.make_scaler(speed, device)
    devices = [device] if device.type == "cuda" else []
    points, avg, best, first = [], 0.0, math.inf, None
    beta = max(0.5, 1 - (1 - SMOOTH) * STEPS / max(steps, 1))  # the same lag in rate over fewer, larger rises
    with torch.random.fork_rng(devices=devices):
        for i in range(steps):
            lr = LO * (HI / LO) ** (i / max(steps - 1, 1))
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = batch(i)
            x, y = _step.to_device(x, y, speed, device)
            loss, _ = _step.forward_loss(model, x, y, speed, device, label_smoothing)
            _step.backward(loss, scaler)
            _step.optimizer_step(opt, scaler)
            value = float(loss.detach())  # one read per step: this is a short measurement, not training
            if not math.isfinite(value):
                break
            avg = beta * avg + (1 - beta) * value
            smooth = avg / (1 - beta ** (i + 1))
            first = smooth if first is None else first
            points.append((lr, smooth))
            best = min(best, smooth)
            if smooth > STOP * best and i > 5:
                break
    if not points:
        return RangeTest(None, steps=0, note="the loss was not finite at the lowest rate")
    low_lr, low = min(points, key=lambda p: p[1])
    if not low < (1 - MIN_DROP) * first:  # (a loss already at 0 does not fall either)
        return RangeTest(None, None, len(points), points,
                         note=f"no rate from {LO:g} to {points[-1][0]:.2g} lowered the loss by {MIN_DROP:.0%}")
    return RangeTest(FACTOR * low_lr, low_lr, len(points), points)


def cached_range_test(net, batch, make_optimizer, speed, device, batches_id: str, optimizer: str,
                      steps: int = STEPS, label_smoothing: float = 0.0, say=None) -> RangeTest:
    """range_test, or its cached answer for the same model, data, optimizer, settings and machine
    (an entry that does not read as one is said and measured again)."""
    k = key(net, batches_id, optimizer, speed, device)
    kept = hardware.cached_entry("lr.json", k, _from_cache, "learning-rate test", say)
    if kept is not None:
        return kept
    r = range_test(net, batch, make_optimizer, speed, device, steps, label_smoothing)
    cache = hardware.read_cache("lr.json")
    cache[k] = {"lr": r.lr, "at_min": r.at_min, "steps": r.steps, "note": r.note}
    hardware.write_cache("lr.json", cache)
    return r


def _from_cache(c: dict) -> RangeTest:
    """A cached test: both rates positive numbers (or both None: no rate found), its steps a
    count, its note text; else ValueError."""
    if (c["lr"] is None) != (c["at_min"] is None):
        raise ValueError("one rate recorded without the other")
    lr, at_min = (None, None) if c["lr"] is None else (hardware.positive(c["lr"], "lr"),
                                                       hardware.positive(c["at_min"], "at_min"))
    if isinstance(c["steps"], bool) or not isinstance(c["steps"], int) or c["steps"] < 0 \
            or not isinstance(c["note"], str):
        raise ValueError(f"steps {c['steps']!r} or note {c['note']!r} is not what a test records")
    return RangeTest(lr, at_min, c["steps"], [], c["note"], cached=True)

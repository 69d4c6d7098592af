"""The batch, raced to a loss: where tune timed a larger batch clearly faster than a smaller
one, each trains a copy of the model from the same weights, on the same images in the same
order, for the same wall time, and the one whose loss on a fixed set of training images is
lowest after it wins.

Why measure: in a given time a larger batch sees more images but takes fewer optimizer steps.
The images needed to reach a loss grow with the batch once it passes the gradient's noise
scale (McCandlish et al., "An empirical model of large-batch training", 2018), and that scale
depends on the model, the data and how far training has got. At about the same rate the
smaller batch is never later (as many images, more steps), so the race runs only where the
rates differ by RACE_GAIN or more; settings that are both slower and larger are never raced.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from trainfast import hardware, units
from trainfast import step as _step
from trainfast.config import Speed

RACE_GAIN = 1.1  # race only when the fastest batch runs this much faster than the smallest one raced
RACE_SHARE = 0.05  # all laps together: at most this share of the planned training time
MIN_LAP_STEPS = 20  # a lap must fit this many steps of the largest batch, or there is no race
MAX_LAP_S = 10.0
MAX_LAPS = 3
PROBE_IMAGES = 512  # the training images each lap's loss is measured on (a seeded sample)
WARMUP = 0.2  # the rate rises linearly over this share of a lap's expected steps
TIE = 0.01  # a loss within 1% of the rule's choice keeps the rule's choice
_clock = time.perf_counter  # tests replace it


@dataclass
class Lap:
    speed: Speed
    images_per_s: float  # as tune timed it
    lr: float
    steps: int = 0
    lap_images_per_s: float = 0.0  # as the lap ran, data path included
    loss: float | None = None

    def to_dict(self) -> dict:
        return {**asdict(self), "speed": asdict(self.speed), "label": self.speed.label()}

    @classmethod
    def from_dict(cls, d: dict) -> Lap:
        return cls(**{**{k: v for k, v in d.items() if k != "label"}, "speed": Speed(**d["speed"])})


def _cached_laps(entry, laps: list[Lap], device) -> list[Lap]:
    """The cached laps of a race of `laps`: the same entrants, each a setting this device runs,
    with positive rates, a step count and a finite loss (or none); else ValueError."""
    done = [Lap.from_dict(d) for d in entry]
    if [lap.speed.label() for lap in done] != [lap.speed.label() for lap in laps]:
        raise ValueError("its entrants are not this race's")
    for lap in done:
        reason = _step.check(lap.speed, device)
        if reason:
            raise ValueError(reason)
        hardware.positive(lap.images_per_s, "images_per_s")
        hardware.positive(lap.lr, "lr")
        if isinstance(lap.steps, bool) or not isinstance(lap.steps, int) or lap.steps < 0 \
                or not (lap.loss is None or (isinstance(lap.loss, (int, float)) and math.isfinite(lap.loss))):
            raise ValueError(f"a lap of {lap.steps!r} steps to loss {lap.loss!r}")
    return done


def contenders(fastest: dict[int, tuple[float, Speed]]) -> list[tuple[float, Speed]]:
    """From tune's fastest setting at each batch ({batch: (rate, speed)}), the ones worth a lap:
    each batch that runs faster than every smaller one (a larger batch that is not faster has
    fewer steps and no more images: it cannot be sooner), at most MAX_LAPS of them, the fastest
    and the smallest always among them; [] where those two are within RACE_GAIN of each other."""
    front, best_rate = [], 0.0
    for b in sorted(fastest):
        rate, speed = fastest[b]
        if rate > best_rate:
            front.append((rate, speed))
            best_rate = rate
    if len(front) < 2 or front[-1][0] < RACE_GAIN * front[0][0]:
        return []
    if len(front) > MAX_LAPS:  # the smallest, the fastest, and the one in between nearest each's geometric mean
        mid = math.sqrt(front[0][1].batch_size * front[-1][1].batch_size)
        inner = min(front[1:-1], key=lambda f: abs(math.log(f[1].batch_size / mid)))
        front = [front[0], inner, front[-1]]
    return front


def lap_seconds(front: list[tuple[float, Speed]], planned_images: int) -> float | None:
    """Each lap's length: the laps together take RACE_SHARE of the planned training at the
    fastest rate (MAX_LAP_S at most); None where that cannot fit MIN_LAP_STEPS steps of the
    largest batch."""
    rate, speed = max(front, key=lambda f: f[0])
    lap = min(MAX_LAP_S, RACE_SHARE * planned_images / rate / len(front))
    return lap if lap * rate / speed.batch_size >= MIN_LAP_STEPS else None


def _epochs(loader):
    """The loader's batches, epoch after epoch, for as long as the caller takes them."""
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        yield from loader


def run_lap(net: torch.nn.Module, lap: Lap, loader, probe, make_optimizer: Callable, device: torch.device,
            seconds: float, label_smoothing: float = 0.0, seed: int = 0) -> Lap:
    """Train a copy of `net` at lap.speed for `seconds` of wall time (after two steps that pay
    one-time warm-ups) on `loader`, then measure its mean loss in fp32 on the `probe` batches."""
    speed = replace(lap.speed, compile=False)  # a lap is too short to win back a compile
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = _step.prepare(copy.deepcopy(net), speed, device).train()
        opt = make_optimizer(model.parameters(), lap.lr)
        scaler = _step.make_scaler(speed, device)
        expected = max(1, seconds * lap.images_per_s / speed.batch_size)
        start, done = None, 0
        for x, y in _epochs(loader):
            for g in opt.param_groups:
                g["lr"] = lap.lr * min(1.0, (done + 1) / max(1.0, WARMUP * expected))
            x, y = _step.to_device(x, y, speed, device)
            loss, _ = _step.forward_loss(model, x, y, speed, device, label_smoothing)
            _step.backward(loss, scaler)
            _step.optimizer_step(opt, scaler)
            done += 1
            if done == 2 or (done > 2 and (device.type != "cuda" or done % 8 == 0)):  # NOTE: a sync every 8 on CUDA
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if start is None:
                    start, counted = _clock(), done
                elif _clock() - start >= seconds:
                    break
        elapsed = _clock() - start
        model.eval()
        total, n = 0.0, 0
        with torch.no_grad():
            for x, y in probe:
                x, y = _step.to_device(x, y, speed, device)
                loss, _ = _step.forward_loss(model, x, y, replace(speed, precision="fp32"), device, label_smoothing)
                total, n = total + float(loss) * len(x), n + len(x)
    loss = total / max(n, 1)
    return replace(lap, steps=done, lap_images_per_s=(done - counted) * speed.batch_size / max(elapsed, 1e-9),
                   loss=loss if math.isfinite(loss) else None)


def choose(laps: list[Lap], rule: Speed) -> Speed:
    """The lowest loss after the lap; the rule's choice where it is within TIE of that."""
    done = [lap for lap in laps if lap.loss is not None]
    if not done:
        return rule
    best = min(done, key=lambda lap: lap.loss)
    kept = next((lap for lap in done if lap.speed.label() == rule.label()), None)
    return kept.speed if kept is not None and kept.loss <= best.loss * (1 + TIE) else best.speed


def table(laps: list[Lap], chosen: Speed, seconds: float, probe_images: int, cached: bool = False) -> str:
    w = max(44, *(len(lap.speed.label()) for lap in laps))
    lines = [(f"raced to a loss{' (cached)' if cached else ''}: each trains a copy from the same weights on the same "
              f"images for {seconds:.1f} s; its loss on {probe_images:,} training images after (lower: sooner to a "
              "target loss)"),
             f"      {'settings':{w}s} {'images/s':>9s} {'in lap':>9s} {'steps':>6s} {'lr':>8s} {'loss':>7s}"]
    for lap in laps:
        loss = f"{lap.loss:7.4f}" if lap.loss is not None else f"{'—':>7s}"
        mark = "  ← chosen" if lap.speed.label() == chosen.label() else ""
        lines.append(f"      {lap.speed.label():{w}s} {units.rate(lap.images_per_s):>9s} {units.rate(lap.lap_images_per_s):>9s} "
                     f"{lap.steps:6d} {lap.lr:8.2g} {loss}{mark}")
    return "\n".join(lines)


def key(net, data_id: str, laps: list[Lap], optimizer: str, seconds: float, device) -> str:
    structure = hardware.model_key(net)
    entrants = [(lap.speed.label(), round(lap.lr, 12)) for lap in laps]
    text = f"{structure}|{data_id}|{entrants}|{optimizer}|{seconds:.1f}|{hardware.machine_key(device)}"
    return hashlib.sha1(text.encode()).hexdigest()


def race(net, laps: list[Lap], make_loader: Callable, probe, make_optimizer: Callable, device, seconds: float,
         data_id: str, optimizer: str, label_smoothing: float = 0.0, seed: int = 0,
         say=None) -> tuple[list[Lap], bool]:
    """run_lap for each lap, or the cached laps of the same race (same model, data, entrants,
    optimizer, length and machine; an entry that does not read as them is said and raced
    again); (laps, cached)."""
    k = key(net, data_id, laps, optimizer, seconds, device)
    kept = hardware.cached_entry("race.json", k, lambda e: _cached_laps(e, laps, device), "race", say)
    if kept is not None:
        return kept, True
    done = [run_lap(net, lap, make_loader(lap.speed.batch_size), probe, make_optimizer, device, seconds,
                    label_smoothing, seed) for lap in laps]
    cache = hardware.read_cache("race.json")
    cache[k] = [lap.to_dict() for lap in done]
    hardware.write_cache("race.json", cache)
    return done, False

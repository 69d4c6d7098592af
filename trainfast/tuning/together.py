"""Timing several settings at once, their steps interleaved (A B C, B C A, ...), so that the
machine's drift and its slow spells fall on all of them alike.

On a shared CPU one timing swings by 10-30% and the machine's own speed drifts ~20% within
half an hour (issue 51.4): timed one after another, three CIFAR settings ranked by which ran
in a quiet moment. Timed together, each setting's turns sit between the others', and the
median of its turns' rates is compared: a spell that slows one turn slows its neighbours'
too, and one slow turn does not move a median.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from trainfast import step as _step
from trainfast.config import Speed
from trainfast.diagnose.timing import synthetic_batches
from trainfast.errors import in_words
from trainfast.tuning.measure import MAX_STEPS, MIN_SECONDS, prepared
from trainfast.tuning.result import Trial

TURN_S = 0.05  # a turn is as many steps as span about this (one step for most CPU steps; many for tiny ones)
MIN_TURNS = 3  # the least turns each setting gets: a median of fewer is one timing


@dataclass
class _Contender:
    speed: Speed
    net: torch.nn.Module
    opt: torch.optim.Optimizer
    loss: float
    data: list
    steps: int = 1  # per turn
    times: list[float] = field(default_factory=list)  # seconds of each timed turn

    def turn(self, device: torch.device, threads: int) -> float:
        """Run this setting's steps for one turn; their seconds, the device synchronised after."""
        torch.set_num_threads(self.speed.threads or threads)
        t = time.perf_counter()
        for i in range(self.steps):
            x, y = _step.to_device(*self.data[i % len(self.data)], self.speed, device)
            loss, _ = _step.forward_loss(self.net, x, y, self.speed, device)
            _step.backward(loss)
            _step.optimizer_step(self.opt)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t


def measure_together(model, shape, out_shape, speeds: list[Speed], device, *, warmup: int = 2,
                     min_seconds: float = MIN_SECONDS, optimizer: str = "adamw") -> list[Trial]:
    """A Trial per setting of `speeds` (in order), timed together: each on its own copy of the
    model with its optimizer, warmed up, then in turns (the order rotating each round) until
    each has MIN_TURNS turns and min_seconds of them, or MAX_STEPS steps. A setting's rate is
    its batch over the median of its turns' seconds per step. A setting that fails or runs out
    of memory gets a Trial saying so and leaves the others timing. No torch.compile here (a
    compile is timed alone, with its own warm-up); fp16's loss scaling neither (CUDA: timed
    alone too). The caller's thread count is left as found."""
    threads, rows, alive, data = torch.get_num_threads(), {}, [], {}
    try:
        for i, s in enumerate(speeds):
            try:
                if s.batch_size not in data:
                    data[s.batch_size] = synthetic_batches(shape, out_shape, s.batch_size, device, n=2)
                net, loss = prepared(model, shape, out_shape, s, device)
                opt = _step.make_optimizer(optimizer, net.parameters(), 1e-4, device)
                c = _Contender(s, net, opt, loss, data[s.batch_size])
                for _ in range(max(warmup, 1)):
                    first = c.turn(device, threads)
                c.steps = max(1, min(MAX_STEPS // MIN_TURNS, math.ceil(TURN_S / max(first, 1e-9))))
                alive.append((i, c))
            except torch.cuda.OutOfMemoryError:
                rows[i] = Trial(s, None, note="out of memory")
            except Exception as e:  # noqa: BLE001 - a setting that fails is left out, with the reason
                rows[i] = Trial(s, None, note=f"failed: {in_words(e, 80)}")
        r = 0
        while alive and any(len(c.times) < MIN_TURNS or (sum(c.times) < min_seconds
                                                          and len(c.times) * c.steps < MAX_STEPS)
                            for _, c in alive):
            for i, c in alive[r % len(alive):] + alive[:r % len(alive)]:
                try:
                    c.times.append(c.turn(device, threads))
                except Exception as e:  # noqa: BLE001 - e.g. out of memory beside the others' copies
                    rows[i] = Trial(c.speed, None, note=f"failed: {in_words(e, 80)}")
                    alive = [(j, d) for j, d in alive if j != i]
            r += 1
        for i, c in alive:
            rate = c.speed.batch_size * c.steps / statistics.median(c.times)
            rows[i] = Trial(c.speed, rate, c.loss)
    finally:
        torch.set_num_threads(threads)
    return [rows[i] for i in range(len(speeds))]

"""A gain measured the way the user will feel it.

The way the script trains now and each new way run in turns, the same number of images each,
warm (each ran once before the clock), in several rounds whose order rotates, so that a change
of load or of the page cache falls on all of them alike. The gain is the median round's ratio;
the range of the rounds' ratios is how far it may move, more so where other programs hold cores.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainfast import hardware

ROUNDS = 3


@dataclass
class Felt:
    """One new way against the current one: seconds per image in each round, both sides."""

    current: list[float]
    new: list[float]
    images: int  # per side and round
    other_cores: float | None = None

    @property
    def ratios(self) -> list[float]:
        return [c / max(n, 1e-12) for c, n in zip(self.current, self.new, strict=True)]

    @property
    def gain(self) -> float:
        return statistics.median(self.ratios)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.ratios), max(self.ratios)

    def words(self) -> str:
        """'×1.71–×1.94 over 3 interleaved rounds of 64 images each way' and, on a busy machine,
        how much the gain may move."""
        lo, hi = self.spread
        s = f"×{lo:.2f}–×{hi:.2f} over {len(self.current)} interleaved rounds of {self.images} images each way"
        if hardware.is_busy(self.other_cores):
            s += (f"; other programs held {self.other_cores:.1f} cores meanwhile, so the gain may move by that "
                  "much or more as their load changes")
        return s


def steps_per_round(budget_s: float, step_s: float, most: int) -> int:
    """Steps for each way in a round so that the rounds (and the warm-up run) of the current way,
    at `step_s` a step, take about `budget_s`: 2 at least, `most` at most."""
    return int(min(most, max(2, budget_s / ((ROUNDS + 1) * max(step_s, 1e-3)))))


def interleaved(current: Callable[[], float], *new: Callable[[], float], images: int,
                rounds: int = ROUNDS) -> list[Felt]:
    """Run `current` and each of `new` (each runs its share of work and returns seconds per
    image) once to warm, then `rounds` times in rotating order; one Felt per new way."""
    sides = (current, *new)
    for run in sides:
        run()
    times: list[list[float]] = [[] for _ in sides]
    with hardware.OtherLoad() as load:
        for r in range(rounds):
            for k in range(len(sides)):
                i = (k + r) % len(sides)
                times[i].append(sides[i]())
    return [Felt(times[0], t, images, load.cores) for t in times[1:]]


def drawing(batches) -> Callable[[int], float]:
    """A function that draws `k` batches from the iterable `batches` and returns the seconds it
    took; it goes on where the last call stopped and starts over when the iterable runs out."""
    it = None

    def draw(k: int) -> float:
        nonlocal it
        t0 = time.perf_counter()
        for _ in range(k):
            try:
                if it is None:
                    raise StopIteration
                next(it)
            except StopIteration:
                it = iter(batches)
                next(it)
        return time.perf_counter() - t0

    return draw

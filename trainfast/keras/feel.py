"""Keras's fixes measured the way the user will feel them (diagnose.felt): the script's own
model fed from the script's own data, from a pack of its files, and a copy with the settings
`tune` chose, in turns, the same images each, warm."""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable
from dataclasses import dataclass

import keras
import numpy as np

from trainfast.diagnose.felt import Felt, interleaved, steps_per_round
from trainfast.keras import threads as backend_threads
from trainfast.keras.settings import KerasSetting, batch_ends, copy_with

MAX_STEPS = 8  # the script's steps per side and round, at most


@dataclass
class Feed:
    """Batches one after another: `next()` gives the next (x, y)."""

    next: Callable[[], tuple]
    batch_size: int
    workers: int = 1

    def rebatched(self, batch_size: int) -> Feed:
        """Batches of `batch_size`: as many of these joined as make it (a whole multiple)."""
        m = max(1, batch_size // self.batch_size)
        if m == 1:
            return self

        def joined():
            parts = [self.next() for _ in range(m)]
            return tuple(np.concatenate([p[j] for p in parts]) for j in range(2))

        return Feed(joined, m * self.batch_size, self.workers)


def script_feed(fit_args, skip: int, batch_size: int) -> Feed | None:
    """The script's own batches again, going on from the `skip` it drew (the files an epoch
    would read next): its PyDataset, generator, tf.data Dataset or arrays as it gave them to
    `fit`; None for data that cannot be drawn again."""
    if fit_args is None:
        return None
    x, y, _ = fit_args
    if isinstance(x, keras.utils.PyDataset):
        try:
            n = len(x)
        except (TypeError, NotImplementedError):
            return None
        index = itertools.count(skip)
        return Feed(lambda: tuple(x[next(index) % n])[:2], batch_size, int(getattr(x, "workers", 1) or 1)) \
            if n else None
    if isinstance(x, types.GeneratorType):
        return Feed(lambda: tuple(next(x))[:2], batch_size)
    if hasattr(x, "take") and hasattr(x, "element_spec"):  # tf.data
        it = iter(x.repeat())
        return Feed(lambda: tuple(np.asarray(t) for t in next(it)[:2]), batch_size)
    if hasattr(x, "shape") and y is not None and hasattr(y, "shape") and len(x) == len(y) and len(x):
        start = itertools.count(skip * batch_size, batch_size)

        def sliced():
            idx = (next(start) + np.arange(batch_size)) % len(x)
            return np.asarray(x[idx]), np.asarray(y[idx])
        return Feed(sliced, batch_size)
    return None


def pack_feed(dataset, batch_size: int) -> Feed:
    """A PackDataset's batches (of `batch_size`), round and round."""
    index = itertools.count()
    return Feed(lambda: tuple(dataset[next(index) % len(dataset)])[:2], batch_size)


def _per_image(model, feed: Feed, images: int, setting: KerasSetting | None = None) -> Callable[[], float]:
    """A run of `images` through `model.fit` fed from `feed` (with the setting's threads): its
    seconds per image, the first execution (fit's own start) left out."""
    spe = setting.steps_per_execution if setting else int(getattr(model, "steps_per_execution", 1) or 1)
    executions = max(1, round(images / (spe * feed.batch_size)))

    def run() -> float:
        with backend_threads.using(setting.threads if setting else None):
            ends = batch_ends(model, lambda i: feed.next(), spe * (executions + 1), feed.workers)
        if len(ends) < 2:
            raise RuntimeError("fit ended before the timed steps")
        return (ends[-1] - ends[0]) / ((len(ends) - 1) * spe * feed.batch_size)

    return run


def felt_gains(model, source: Feed, pack: Callable[[int], Feed] | None, setting: KerasSetting | None,
               step_s: float, budget_s: float) -> dict[str, Felt]:
    """The script's model fed from `source` (the script's data) against the same model fed from
    a pack (`pack(batch_size)` gives its batches) and against a copy with `setting` (fed from the
    pack where there is one): {"pack": Felt, "settings": Felt} for those given. The script's step
    time `step_s` sizes the rounds to about `budget_s`."""
    steps = steps_per_round(budget_s, step_s, MAX_STEPS)
    images = steps * source.batch_size
    sides = {"current": _per_image(model, source, images)}
    if pack is not None:
        sides["pack"] = _per_image(model, pack(source.batch_size), images)
    if setting is not None:
        feed = pack(setting.batch_size) if pack is not None else source.rebatched(setting.batch_size)
        sides["settings"] = _per_image(copy_with(model, setting), feed, images, setting)
    felts = interleaved(*sides.values(), images=images)
    return dict(zip(list(sides)[1:], felts, strict=True))

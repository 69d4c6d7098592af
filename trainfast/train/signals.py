"""Ctrl-C and SIGTERM during a run: held until the step under way ends, and agreed across
torchrun's ranks so that every process stops at the same step."""

from __future__ import annotations

import contextlib
import signal
import threading

from trainfast.train import distributed


class Interrupts:
    """Ctrl-C and SIGTERM land between training steps, so that a checkpoint's weights and its
    count of steps agree (one landing mid-step used to save the next batch as done).

    Inside `step()` a first signal is held until the step ends; a second one raises at once
    (and `torn` tells the caller not to save). Anywhere else, e.g. during validation, they
    raise KeyboardInterrupt at once. Only the main thread of a process can take signals.

    Under torchrun every rank takes them (torchrun passes a SIGTERM on to all; rank 1 used to
    die at once and leave rank 0 in a broken collective): a first signal is always held, and the
    ranks agree after a step (every `agree_every` steps: an all-reduce of the flag) to stop at
    the same one, so that rank 0 saves one consistent checkpoint and all of them exit.
    """

    def __init__(self, active: bool, world=None, agree_every: int = 1):
        self.active = active and threading.current_thread() is threading.main_thread()
        self.world = world if world is not None and world.distributed else None
        self.agree_every, self.steps = agree_every, 0
        self.holding = self.pending = self.torn = False
        self.previous = {}

    def _handler(self, signum, frame):
        if (self.holding or self.world is not None) and not self.pending:
            self.pending = True  # distributed: held wherever it lands, until the ranks agree
            return
        self.torn = self.holding
        raise KeyboardInterrupt

    def __enter__(self):
        if self.active:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    @contextlib.contextmanager
    def step(self):
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.world is None:
            if self.pending:
                raise KeyboardInterrupt
            return
        self.steps += 1  # the ranks stop together, at a step where they agree: one rank's signal stops all
        if self.steps % self.agree_every == 0 and distributed.sum_all([float(self.pending)], self.world)[0] > 0:
            raise KeyboardInterrupt
        # `pending` is only ever set by the handler, never written here: a signal that lands while the
        # ranks agree (they wait for each other in the all-reduce) counts at the next agreement. Storing
        # the agreement's result in it used to lose such a signal, and an orphaned run trained on.

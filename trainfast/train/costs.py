"""Where a fit call's time goes: the seconds of each phase (setup, tune, training, validation,
checkpoints, ...), and the one line that says it when the run ends."""

from __future__ import annotations

import contextlib
import time


class Costs:
    """Seconds per phase of one call. Phases nest: a checkpoint written in the middle of an
    epoch counts as checkpoints, not also as training."""

    def __init__(self):
        self.began = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self._inner: list[float] = []  # per open phase: the seconds its nested phases took

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            took = time.perf_counter() - start
            nested = self._inner.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + took - nested
            if self._inner:
                self._inner[-1] += took

    def fold(self, name: str) -> None:
        """Everything so far as one phase, `name` (an attempt fit started over: its tune and
        training bought nothing the next attempt keeps)."""
        self.seconds = {name: self.total()}

    def total(self) -> float:
        return time.perf_counter() - self.began

    def as_dict(self) -> dict[str, float]:
        """The phases' seconds, and "other" (logging, the watchers' checks), "total" last."""
        total = self.total()
        return {**self.seconds, "other": max(total - sum(self.seconds.values()), 0.0), "total": total}

    def line(self) -> str:
        """e.g. 'the call took 105 s: training 87 s (83%), tune 12 s (11%), setup 3.9 s (4%), ...'"""
        d = self.as_dict()
        total = d.pop("total")
        parts = [f"{name} {_seconds(s)} ({s / total:.0%})" for name, s in sorted(d.items(), key=lambda kv: -kv[1])
                 if s >= 0.05]
        return f"the call took {_seconds(total)}: " + ", ".join(parts)


def _seconds(s: float) -> str:
    return f"{s:,.0f} s" if s >= 99.5 else f"{s:.1f} s" if s >= 0.95 else f"{s:.2f} s"

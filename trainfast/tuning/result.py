"""What a tune found: each timed setting (Trial), the choice and its table (TuneResult), and
the rules fit reads from them: the batch bound by the data, and a larger batch only where it is
BATCH_GAIN× faster."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, replace


from trainfast import hardware, units
from trainfast.config import Speed


MIN_STEPS_PER_EPOCH = 32
"""tune's batch is at most the largest power of two that leaves this many optimizer steps per
epoch (per process): a schedule needs steps to work with, not just images per second."""


def data_max_batch(images: int) -> int:
    """The largest batch tune may pick for `images` training images per process (≥ 8)."""
    return max(8, 2 ** int(math.log2(max(images // MIN_STEPS_PER_EPOCH, 1))))


@dataclass
class Trial:
    speed: Speed
    images_per_s: float | None  # None: failed or skipped
    loss: float | None = None
    compile_s: float = 0.0
    note: str = ""
    other_cores: float | None = None  # cores other processes kept busy while it was timed

    def to_dict(self) -> dict:
        return {"speed": asdict(self.speed), "label": self.speed.label(), "images_per_s": self.images_per_s,
                "loss": self.loss, "compile_s": self.compile_s, "note": self.note, "other_cores": self.other_cores}

    @classmethod
    def from_dict(cls, r: dict) -> "Trial":
        return cls(Speed(**r["speed"]), r["images_per_s"], r["loss"], r["compile_s"], r["note"], r.get("other_cores"))


@dataclass
class TuneResult:
    best: Speed
    rows: list[Trial] = field(default_factory=list)
    cached: bool = False
    seconds: float = 0.0
    not_timed: list[str] = field(default_factory=list)  # settings the time budget left out
    budget_s: float | None = None
    other_cores: float | None = None  # cores other processes kept busy on average while it measured
    key: str = ""  # its entry in the cache (forget drops it)
    short: str = ""  # why no search was made (a run too short for one to pay), in words; "" where one was
    candidate: Speed | None = None  # a short run's likeliest winner, left to the run's first steps (compare_in_run)

    @property
    def busy(self) -> bool:
        return hardware.is_busy(self.other_cores)

    def load_line(self) -> str:
        """What the load was, in words, where the machine was busy; else ''."""
        if not self.busy:
            return ""
        return (f"the machine was busy: other processes kept {self.other_cores:.1f} of its "
                f"{hardware.usable_cores()} cores busy on average while tune measured. The choice is not "
                "cached as this machine's: the next tune measures again")

    def __repr__(self) -> str:  # a notebook cell shows the table and the choice, not the dataclass
        return f"TuneResult ({len(self.rows)} timings):\n{self.table()}"

    def _repr_html_(self) -> str:
        import html
        # monospace and unwrapped, so the columns line up whatever the notebook's CSS; wide tables scroll
        return (f"<pre style='font-family:monospace;white-space:pre;overflow-x:auto'>"
                f"{html.escape(repr(self))}</pre>")

    def table(self) -> str:
        timed: dict[str, list[Trial]] = {}  # a setting timed several times shows once, at its median
        for r in (r for r in self.rows if r.images_per_s):
            timed.setdefault(r.speed.label(), []).append(r)
        merged = [replace(ts[0], images_per_s=median_rate(ts), note=ts[0].note if len(ts) == 1 else
                          "median of " + ", ".join(units.rate(t.images_per_s) for t in ts) + spread(ts))
                  for ts in timed.values()]
        for m, ts in zip(merged, timed.values()):  # a burst of load on a quiet tune: the rows it fell on
            loads = [t.other_cores for t in ts if t.other_cores is not None]
            if loads and hardware.is_busy(max(loads)) and not self.busy:
                m.note = "; ".join(n for n in (m.note, f"other processes held {max(loads):.1f} cores") if n)
        ok = sorted(merged, key=lambda r: -r.images_per_s)
        base = next((r.images_per_s for r in self.rows if r.images_per_s and r.speed.precision == "fp32"
                     and not r.speed.channels_last and not r.speed.compile), None)
        w = max([44] + [len(r.speed.label()) for r in self.rows])
        lines = [f"{'rank':>4s}  {'settings':{w}s} {'images/s':>9s} {'vs fp32':>8s}  note"]
        for i, r in enumerate(ok, 1):
            rel = f"{r.images_per_s / base:.2f}×" if base else ""
            note = "; ".join(n for n in (r.note, f"compile {r.compile_s:.0f} s" if r.compile_s else "") if n)
            lines.append(f"{i:>4d}  {r.speed.label():{w}s} {units.rate(r.images_per_s):>9s} {rel:>8s}  {note}")
        for r in self.rows:
            if not r.images_per_s:
                lines.append(f"{'—':>4s}  {r.speed.label():{w}s} {'—':>9s} {'':>8s}  {r.note}")
        if self.short:
            lines.append(self.short)
        untimed = [lbl for lbl in dict.fromkeys(self.not_timed) if lbl not in timed]
        if untimed:
            lines.append(f"not timed, the tune's budget of {self.budget_s:.1f} s spent: " + ", ".join(untimed))
        lines.append(f"chosen: {self.best.label()}" + (" (cached; --retune to measure again)" if self.cached else
                                                        f" ({units.rate(self.seconds)} s)"))
        if self.load_line():
            lines.append(self.load_line())
        return "\n".join(lines)


def median_rate(trials: list[Trial]) -> float:
    return statistics.median(t.images_per_s for t in trials)


def spread(trials: list[Trial]) -> str:
    """The range of several timings of one setting around their median, e.g. ' (±6%)'."""
    rates = [t.images_per_s for t in trials]
    return f" (±{(max(rates) - min(rates)) / 2 / statistics.median(rates):.0%})"


BATCH_GAIN = 1.3
"""A larger batch is taken over a smaller one only if tune measured it this much faster."""


def fastest_by_batch(result: TuneResult, floor: int = 1) -> dict[int, tuple[float, Speed]]:
    """{batch: (median images/s, setting)}: the fastest setting tune timed at each batch ≥ floor,
    with the chosen setting's compile choice, rejected settings left out; the chosen setting
    stands for its own batch."""
    best = result.best
    rates: dict[str, list[float]] = {}
    speeds: dict[str, Speed] = {}
    for r in result.rows:
        if r.images_per_s and not r.note.startswith("rejected") and r.speed.compile == best.compile:
            rates.setdefault(r.speed.label(), []).append(r.images_per_s)
            speeds[r.speed.label()] = r.speed
    fastest: dict[int, tuple[float, Speed]] = {}
    for label, rs in rates.items():
        b, rate = speeds[label].batch_size, statistics.median(rs)
        if b >= floor and (b not in fastest or rate > fastest[b][0]):
            fastest[b] = (rate, speeds[label])
    if best.label() in rates and best.batch_size >= floor:
        fastest[best.batch_size] = (statistics.median(rates[best.label()]), best)
    return fastest


def more_steps_unless_faster(result: TuneResult, floor: int, gain: float = BATCH_GAIN) -> tuple[Speed, str | None]:
    """The fastest setting tune timed at the smallest batch ≥ `floor` whose rate is within
    `gain`× of the chosen one's, in place of result.best (same compile choice; rejected
    settings left out); and why, in words (None if unchanged).

    Over a fixed number of epochs a larger batch means fewer optimizer steps: on 2 CPU cores
    plate_net at batch 256 ran 1.11× the images/s of 64 and ended at 94.5% / 66.7% held-out
    (characters / plates) against 95.1% / 69.6%. On a GPU a larger batch is several times faster."""
    best = result.best
    fastest = fastest_by_batch(result, floor)
    top = next((rate for rate, speed in fastest.values() if speed == best), None)
    if top is None:
        return best, None
    for b in sorted(fastest):
        rate, speed = fastest[b]
        if b < best.batch_size and top / rate < gain:
            return speed, (f"batch {best.batch_size} is only {top / rate:.2f}× batch {b}'s rate here: training at "
                           f"{b} with {speed.label()} (more optimizer steps per epoch; a larger batch must be "
                           f"{gain}× faster)")
    return best, None

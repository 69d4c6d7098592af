"""The tune's budget: the measuring core every search shares (Bench: times a setting within the
bound, records the load, judges soundness), and a short run's quick timing, which says whether
the run is long enough to search at all."""

from __future__ import annotations

import math
import time


from trainfast import hardware, units
from trainfast import step as _step
from trainfast.config import Speed
from trainfast.errors import TrainfastError
from trainfast.tuning.measure import MIN_SECONDS, loss_matches
from trainfast.tuning.result import Trial


SHORT_GAIN = 1.25  # a run too short to search takes the likeliest winner only this much faster (quick timings)


COMPILE_GUESS_S = 8.0  # a torch.compile before one is timed: 7.6 s for plate_net, 12 s for cifar_cnn on 2 cores


clock = time.perf_counter  # the tune's own elapsed time (tests replace it)


class Bench:
    """The measuring core every search shares: it times a setting within the tune's budget,
    records the load each timing ran under, and judges a timing sound against the reference's
    loss. The searches (CpuSearch, CudaSearch) only decide what to time next."""

    def __init__(self, model, input_shape, out_shape, dev, measure, log, *, max_seconds, planned_images,
                 budget_share, forward_s: float | None = None, together=None):
        self.model, self.input_shape, self.out_shape, self.dev = model, input_shape, out_shape, dev
        self.measure, self.log = measure, log
        self.together = together  # times several settings in turns (together.measure_together); None: one by one
        self.max_seconds, self.planned_images, self.budget_share = max_seconds, planned_images, budget_share
        self.rows: list[Trial] = []
        self.not_timed: list[str] = []
        self.took: list[tuple[float, Speed]] = []  # each measurement's seconds; the first also pays one-time set-up
        self.plan: dict = {}  # once the reference is timed: its time, and the fastest rate timed so far
        self.slowdown = 1.0  # how much longer than on the quiet machine a compile is expected to take
        self.ref: Trial | None = None
        self.beside_ref = (0.0, 0.0)  # the seconds and fastest rate of settings timed together with the reference
        self.forward_s = forward_s  # first_forward's time (start_batch_for)
        self.started = clock()

    def budget(self) -> float | None:
        """The tune's bound, from its start: max_seconds, and/or after the first measurement
        budget_share of the planned training at the fastest rate timed so far: the run the
        tune serves trains at the rate it finds, so a faster find tightens the bound."""
        bounds = [self.max_seconds] if self.max_seconds else []
        if self.plan and self.planned_images and self.budget_share:
            bounds.append(self.plan["first"] + self.budget_share * self.planned_images / self.plan["rate"])
        return min(bounds) if bounds else None

    def expected_s(self, speed: Speed) -> float:
        """How long measuring `speed` will take: the last measurement's time (not the first's),
        longer in proportion to a larger batch, plus a compile where none was timed yet."""
        seconds, last = self.took[-1]
        compiling = speed.compile and not any(s.compile for _, s in self.took)
        return seconds * max(1.0, speed.batch_size / last.batch_size) + (COMPILE_GUESS_S * self.slowdown
                                                                           if compiling else 0.0)

    def _spent(self, expected: float) -> bool:
        """Whether a measurement expected to take `expected` s is not to be begun: it would end
        past the bound (the reference is always timed, and the second measurement, the likely
        winner, always begun)."""
        if not any(r.images_per_s for r in self.rows) or self.budget() is None:
            return False
        left = self.budget() - (clock() - self.started)
        return left <= 0 or (len(self.took) >= 2 and left < expected)

    def _keep(self, trial: Trial) -> Trial:
        """Log a trial and keep its row."""
        self.rows.append(trial)
        if self.plan and trial.images_per_s:
            self.plan["rate"] = max(self.plan["rate"], trial.images_per_s)
        shown = f"{units.rate(trial.images_per_s)} images/s" if trial.images_per_s else trial.note
        busy = f"   (other processes: {trial.other_cores:.1f} cores)" if hardware.is_busy(trial.other_cores) else ""
        self.log(f"  {trial.speed.label():53s} {shown}{busy}")
        return trial

    def _not_timed(self, speed: Speed) -> Trial:
        self.not_timed.append(speed.label())
        return Trial(speed, None, note="not timed: the tune's budget is spent")

    def run(self, speed: Speed) -> Trial:
        """Time `speed` (or say why not), log it, and keep the row."""
        if self._spent(self.expected_s(speed) if self.took else 0.0):
            return self._not_timed(speed)
        reason = _step.check(speed, self.dev)
        if reason:
            return self._keep(Trial(speed, None, note=f"skipped: {reason}"))
        t = clock()
        with hardware.OtherLoad() as load:
            trial = self.measure(self.model, self.input_shape, self.out_shape, speed, self.dev)
        trial.other_cores = load.cores
        self.took.append((clock() - t, speed))
        return self._keep(trial)

    def run_many(self, speeds: list[Speed]) -> list[Trial]:
        """Time `speeds`, a Trial each in their order: together, their steps in turns, where this
        bench has such a timing (self.together) and two or more of them run here; else one by
        one (run). Those the budget has no room for are not timed, the last first; a compile is
        timed alone."""
        if self.together is None or any(s.compile for s in speeds):
            return [self.run(s) for s in speeds]
        runnable = [i for i, s in enumerate(speeds) if _step.check(s, self.dev) is None]
        out: dict[int, Trial] = {}
        while runnable and self.took and self._spent(sum(self.expected_s(speeds[i]) for i in runnable)):
            i = runnable.pop()
            out[i] = self._not_timed(speeds[i])
        if len(runnable) >= 2:
            out.update(zip(runnable, self._time_together([speeds[i] for i in runnable])))
        # in order: those timed together kept and logged; a skipped one, or the only one left, by run
        return [self._keep(out[i]) if i in out and i in runnable else out[i] if i in out else self.run(s)
                for i, s in enumerate(speeds)]

    def _time_together(self, speeds: list[Speed]) -> list[Trial]:
        self.log(f"  (the next {len(speeds)} timed together, their steps in turns)")
        t = clock()
        with hardware.OtherLoad() as load:
            trials = self.together(self.model, self.input_shape, self.out_shape, speeds, self.dev)
        each = (clock() - t) / len(speeds)
        for speed, trial in zip(speeds, trials):
            trial.other_cores = load.cores
            self.took.append((each, speed))
        if self.ref is None:  # timed beside the reference: its budget counts its own share as the first measurement
            self.beside_ref = (each * (len(speeds) - 1), max((r.images_per_s or 0.0) for r in trials))
        return trials

    def timed(self, speed: Speed) -> bool:
        """Whether `speed` has a row already (timed, skipped or failed)."""
        return self.row(speed) is not None

    def row(self, speed: Speed) -> Trial | None:
        """The last row of `speed`, or None."""
        return next((r for r in reversed(self.rows) if r.speed.label() == speed.label()), None)

    def set_reference(self, ref: Trial) -> None:
        """The first timing: fp32, plain layout; every other setting's loss is judged against its."""
        if ref.images_per_s is None:
            raise TrainfastError(f"the model does not train at all on {self.dev}: {ref.note}")
        self.ref = ref
        # The first measurement's time, set-up included; where the reference was timed together
        # with others, without their share (their time is spent all the same: it counts as spent).
        beside_s, beside_rate = self.beside_ref
        self.plan.update(first=clock() - self.started - beside_s, rate=max(ref.images_per_s, beside_rate))
        if self.planned_images and self.budget_share:
            self.log(f"  (tune budget: at most {self.budget():.1f} s in all: after this first measurement "
                     f"({self.plan['first']:.1f} s), {self.budget_share:.0%} of the planned training, "
                     f"~{self.planned_images / ref.images_per_s:.0f} s at this rate; less as faster settings are found)")
        elif self.max_seconds:
            self.log(f"  (tune budget: {self.max_seconds:.1f} s)")

    def sound(self, t: Trial) -> bool:
        """Timed, with a finite first-batch loss within LOSS_TOLERANCE of fp32's."""
        if t.images_per_s is None or t.loss is None or not math.isfinite(t.loss):
            return False
        ok = loss_matches(t.loss, self.ref.loss)
        if not ok and not t.note:
            t.note = f"rejected: first-batch loss {t.loss:.4f} vs fp32 {self.ref.loss:.4f}"
        return ok

    def better(self, t: Trial, best: Trial, margin: float = 1.03) -> bool:
        return self.sound(t) and t.images_per_s > best.images_per_s * margin


def short_run(probe, bench: Bench, search, in_run: bool = False
               ) -> tuple[list[Trial], Trial, str, Speed | None] | None:
    """(the quick timings, the faster, why no search, the setting left to the run to compare)
    where the run fit's tune serves is too short for a search to pay: budget_share of its
    planned training, at the rate a few steps of the search's first setting run, would not
    cover the search's first two measurements (each MIN_SECONDS plus four steps). Such a run is
    given one quick comparison instead: the first setting against the likeliest winner (the
    fastest precision the device runs, in channels_last), the latter taken only where it is
    SHORT_GAIN× faster with a sound loss; timed here on a copy, or, `in_run`, returned untimed
    for the run to time on its own first steps. None where the run is long enough, or the
    quick timing failed (the search then says why)."""
    def quick(speed: Speed) -> Trial:
        with hardware.OtherLoad() as load:
            trial = probe(bench.model, bench.input_shape, bench.out_shape, speed, bench.dev)
        trial.other_cores = load.cores
        if trial.images_per_s:
            first_step = trial.note == "a first step"
            trial.note = "a quick timing" + (": one first step, which already calls the run short" if first_step
                                             else "")
        return trial

    first = search.first_speed()
    ref = quick(first)
    if not ref.images_per_s:
        return None
    short, plan, search_s, share = too_short(bench, ref.images_per_s, first.batch_size)
    if not short:
        return None
    rows, best, candidate = [ref], ref, None
    likely = search.likely(first)
    if likely is not None and likely != first and in_run:
        candidate = likely
    elif likely is not None and likely != first:
        alt = quick(likely)
        rows.append(alt)
        if alt.images_per_s and loss_matches(alt.loss, ref.loss) and alt.images_per_s >= SHORT_GAIN * ref.images_per_s:
            best = alt
    how = (f"{likely.label()} is compared on the run's first steps" if candidate else
           "one quick comparison instead" if len(rows) > 1 else "a quick timing instead")
    return rows, best, (f"no search: ~{plan:.0f} s of training planned, and a search takes ~{search_s:.1f} s, more "
                        f"than the {bench.budget_share:.0%} of it ({share:.1f} s) a tune may take here; {how}. "
                        "A longer run (more epochs or images) searches"), candidate


def too_short(bench: Bench, rate: float, batch: int) -> tuple[bool, float, float, float]:
    """(too short to search, the planned training's seconds, a search's, the tune's share of the
    training) at `rate` images/s and `batch`: budget_share of the planned training would not
    cover the search's first two measurements (each MIN_SECONDS plus four steps). A lower rate
    makes both longer, the training more so (budget_share × planned images > 8 batches): a run
    too short at an understated rate is too short at the true one."""
    plan = bench.planned_images / rate
    search_s = 2 * (MIN_SECONDS + 4 * batch / rate)
    share = bench.budget_share * plan
    return share < search_s, plan, search_s, share

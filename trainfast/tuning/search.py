"""The search strategies, one per device over a shared one (Search): what to time next, in the
order the tuning package's docstring gives, and the round-robin final."""

from __future__ import annotations

from dataclasses import replace

import torch

from trainfast import hardware
from trainfast import step as _step
from trainfast.config import Speed
from trainfast.models import rewrite
from trainfast.tuning import measure
from trainfast.tuning.measure import START_STEP_S
from trainfast.tuning.budget import Bench
from trainfast.tuning.result import Trial, median_rate


FINAL_ROUNDS = 2  # extra round-robin timings of each finalist


MAX_BATCH = {"cpu": 512, "cuda": 8192}  # the largest batch tried unless the caller bounds it
FILL_GAIN = 1.10  # CUDA: a doubling of the batch that gains less than this has filled the device


def _final(rows: list[Trial], finalists: list[Speed], sound, run_many, rounds: int = FINAL_ROUNDS) -> Trial | None:
    """Time the finalists round-robin `rounds` times more (each round together where the bench
    times in turns), and once more any that then has fewer than rounds + 1 timings (one the
    search did not time); return the one whose timings have the highest median. On a shared
    machine one timing swings by 10-20%: the single fastest of many noisy timings is partly
    luck, and a slow spell timed one by one falls on whichever setting it happens to hit."""
    alive = list({s.label(): s for s in finalists}.values())  # each setting once, in order
    for i in range(rounds + 1):
        todo = [s for s in alive if i < rounds or sum(t.speed.label() == s.label() for t in rows) <= rounds]
        for s, t in zip(todo, run_many(todo)):
            if not sound(t) and not t.note.startswith("not timed"):
                alive.remove(s)  # out of memory, failed, or its loss is off: out of the final
    timed = {s.label(): [t for t in rows if t.speed.label() == s.label() and sound(t)] for s in alive}
    scored = [(median_rate(timed[s.label()]), s) for s in alive if timed[s.label()]]  # a budget can leave some untimed
    if not scored:
        return None
    best = max(scored, key=lambda m: m[0])[1]
    return next(t for t in reversed(rows) if t.speed.label() == best.label())


def _fill(run, batch: int, max_batch: int) -> Trial:
    """CUDA: fp32 at doubling batches from `batch` until a doubling gains less than FILL_GAIN;
    the trial of the last batch that gained. Below it every setting is bound by kernel launches,
    not by arithmetic, and precision and memory format cannot show what they are worth."""
    best = run(Speed("fp32", False, batch_size=batch))
    while best.images_per_s and best.speed.batch_size * 2 <= max_batch:
        t = run(Speed("fp32", False, batch_size=best.speed.batch_size * 2))
        if t.images_per_s is None or t.images_per_s < best.images_per_s * FILL_GAIN:
            break
        best = t
    return best


class Search:
    """The search both devices share (see the module's docstring): the reference, precision ×
    memory format, the rewrites, batch sizes, the device's own extra phase, a round-robin final,
    then torch.compile. A device's strategy says where to start and what it can run."""

    precisions: list[str]  # the likely winners first: under a tight budget they are the ones timed
    rewrites_first = False  # whether the rewrites are in every setting from the first, left out only as a neighbour

    def __init__(self, bench: Bench, *, batch_size, max_batch, try_rewrites, try_compile, other: float | None,
                 try_threads: bool = True):
        self.bench, self.pinned, self.max_batch = bench, batch_size, max_batch
        self.try_rewrites, self.try_compile, self.try_threads = try_rewrites, try_compile, try_threads
        self.base = rewrite.ALL if try_rewrites and self.rewrites_first else ()  # the rewrites every setting starts with
        self.other, self.busy = other, hardware.is_busy(other)  # cores other processes held when the tune began

    def first_speed(self) -> Speed:
        """The setting the search times first: fp32, plain layout, at its start batch."""
        raise NotImplementedError

    def reference(self) -> Trial:
        return self.bench.run(self.first_speed())

    def opening(self, first: Speed) -> list[Speed]:
        """Each precision in channels_last (the layout convolutions run fastest in, on CPUs and
        GPUs alike), at the first setting's batch and rewrites: the first rivals of `first`."""
        return [replace(first, precision=p, channels_last=True) for p in self.precisions]

    def likely(self, first: Speed) -> Speed | None:
        """The likeliest winner: the fastest precision this device runs, in channels_last."""
        return next((s for s in self.opening(first) if _step.check(s, self.bench.dev) is None), None)

    def extra(self, best: Trial) -> Trial:
        return best

    def run(self) -> Trial:
        bench, run, better = self.bench, self.bench.run, self.bench.better
        ref = self.reference()
        bench.set_reference(ref)
        start = self.start = ref.speed.batch_size
        # The opening (each precision in channels_last), then the best so far with the rewrites
        # toggled (added; on a CPU, where they are in from the first, left out) unless a CPU's
        # first group timed that, then the plain layout. A precision this device does not run
        # fast is skipped without timing.
        bench.run_many([s for s in self.opening(ref.speed) if not bench.timed(s)])
        best = max((t for t in bench.rows if bench.sound(t)), key=lambda t: t.images_per_s)
        toggled = replace(best.speed, rewrites=() if best.speed.rewrites else rewrite.ALL)
        if self.try_rewrites and not bench.timed(toggled):
            t = run(toggled)
            best = t if better(t, best) else best
        for p in self.precisions[:-1]:  # the plain layout (fp32's is the reference, timed first)
            t = run(Speed(p, False, batch_size=start, rewrites=best.speed.rewrites))
            best = t if better(t, best) else best
        if self.pinned is None:
            best = self.batches(best, start)
        if self.try_rewrites and not best.speed.rewrites and best.speed.batch_size != start:
            # Rewrites save memory-bound passes over activations; at a larger batch they can pay
            # where they did not at the first one (plate CNN: +5% at 128, +0% at 64 on 2 cores).
            t = run(replace(best.speed, rewrites=rewrite.ALL))
            best = t if better(t, best) else best
        best = self.extra(best)
        best = self.final(best)
        if self.try_compile:
            t = run(replace(best.speed, compile=True))
            best = t if better(t, best) else best
        return best

    def batches(self, best: Trial, start: int) -> Trial:
        """Powers of two up from `start` with the winner so far, until memory runs out or two
        doublings in a row are slower; then half of `start` if nothing larger won. Never
        stopped below the usual start (64) on slower timings alone, and a timing taken while
        other processes held cores does not count as slower: a slow spell is not a peak."""
        bench, b, slower = self.bench, start, 0
        while b * 2 <= self.max_batch:
            b *= 2
            t = bench.row(replace(best.speed, batch_size=b)) or bench.run(replace(best.speed, batch_size=b))
            if not bench.sound(t):
                break  # out of memory, or the loss went wrong: larger will not do better
            if bench.better(t, best):
                best, slower = t, 0
            elif t.images_per_s < best.images_per_s * 0.97 and not hardware.is_busy(t.other_cores):
                slower += 1
                if slower == 2 and b >= min(64, self.max_batch):
                    break  # two doublings in a row slower: past the peak, not one noisy timing
        b = start // 2
        if best.speed.batch_size == start and b >= 8:
            t = bench.run(replace(best.speed, batch_size=b))
            best = t if bench.better(t, best) else best
        return best

    def neighbours(self, speed: Speed) -> list[Speed]:
        """The settings one step away from `speed` in the choices the search prunes most."""
        near = []
        if self.pinned is None:
            near += [replace(speed, batch_size=b) for b in (speed.batch_size * 2, speed.batch_size // 2)
                     if 8 <= b <= self.max_batch]
        if self.try_rewrites:
            near.append(replace(speed, rewrites=() if speed.rewrites else rewrite.ALL))
        return near

    def final(self, best: Trial) -> Trial:
        """The fastest three so far (four on a busy machine) and the winner's neighbours, timed
        round-robin FINAL_ROUNDS times more, so that a slow spell of a shared machine falls on
        all of them; the best median of its timings wins, so that one lucky timing does not."""
        bench = self.bench
        leaders: dict[str, Speed] = {}
        for t in sorted((t for t in bench.rows if bench.sound(t)), key=lambda t: -t.images_per_s):
            leaders.setdefault(t.speed.label(), t.speed)
        known_bad = {t.speed.label() for t in bench.rows if not bench.sound(t)}
        near = self.neighbours(best.speed)
        if self.pinned is None and bench.together is not None and best.speed.batch_size != self.start:
            # the winner at the first batch too: fit's batch rule (result.more_steps_unless_faster)
            # weighs their ratio, which timings taken minutes apart moved from 1.21× to 1.40×
            near.append(replace(best.speed, batch_size=self.start))
        near = [s for s in near if s.label() not in known_bad]
        return _final(bench.rows, list(leaders.values())[:4 if self.busy else 3] + near, bench.sound,
                      bench.run_many) or best


class CpuSearch(Search):
    """CPU: start at a batch whose step takes about START_STEP_S at most (start_batch_for), with
    the rewrites where they change the model (on a CPU they save passes over memory and a slow
    random draw per dropped element: the 512² classifier's fp32 step 8.7 → 5.7 s at batch 32 on
    2 AVX2 cores, so a run too short to search has them too); bf16 only where the CPU has bf16
    instructions (step.check); then the threads: all the physical cores where torch uses fewer
    on a quiet machine; half of torch's where other programs hold cores (timed: whether they
    yield their cores is not in their CPU share)."""

    precisions = ["bf16", "fp32"]
    rewrites_first = True

    def first_speed(self) -> Speed:
        # A step's allowance in the cores other processes leave free: on a busy machine the start
        # is the batch the quiet machine would start at (the 512² CNN at 8, not 4, beside one
        # spinning process), not one shrunk by the load.
        bench, cores = self.bench, hardware.physical_cores()
        allowance = START_STEP_S * cores / max(cores - (self.other or 0.0), 0.5) if self.busy else START_STEP_S
        start = self.pinned or measure.start_batch_for(bench.model, bench.input_shape, bench.dev, self.max_batch, allowance,
                                               bench.forward_s)
        return Speed("fp32", False, batch_size=start, rewrites=self.base)

    def reference(self) -> Trial:
        """The first setting, timed together with the opening, the likeliest winner with the
        rewrites toggled and that at twice the batch (on a CPU a single timing swings 10-30%:
        the first comparisons decide most of a short tune)."""
        first = self.first_speed()
        if self.bench.together is None:
            return self.bench.run(first)
        group, likely = [first] + self.opening(first), self.likely(first)
        if likely is not None and self.try_rewrites:  # the likeliest with the rewrites toggled
            group.append(replace(likely, rewrites=() if likely.rewrites else rewrite.ALL))
        if likely is not None and self.pinned is None and 2 * first.batch_size <= self.max_batch:
            # and its first doubling of the batch: whether a larger batch is "clearly faster" (result.BATCH_GAIN)
            # is a ratio of two timings, and one taken alone moved it from 1.06× to 1.43× between two runs
            group.append(replace(likely, batch_size=2 * first.batch_size))
        return self.bench.run_many(group)[0]

    def extra(self, best: Trial) -> Trial:
        cores, threads = hardware.physical_cores(), torch.get_num_threads()
        if not self.try_threads:
            return best
        if self.busy and threads >= 2:
            other = threads // 2
        elif not self.busy and threads < cores:
            other = cores
        else:
            return best
        t = self.bench.run(replace(best.speed, threads=other))
        return t if self.bench.better(t, best) else best


class CudaSearch(Search):
    """CUDA: fp32 at doubling batches until the time per image stops falling (FILL_GAIN): the
    batch that fills the device, where the next steps are judged; below it every setting is
    launch-bound and they all look alike. Precisions: bf16, fp16, tf32 where the GPU has them."""

    precisions = ["bf16", "fp16", "tf32", "fp32"]

    def first_speed(self) -> Speed:
        return Speed("fp32", False, batch_size=self.pinned or min(64, self.max_batch))

    def reference(self) -> Trial:
        if self.pinned:
            return self.bench.run(self.first_speed())
        return _fill(self.bench.run, self.first_speed().batch_size, self.max_batch)

"""What a run changes about itself as it goes: torch's threads under other programs' load, a
short run's comparison on its own first steps, a re-tune where a cached choice proves stale,
and the time budget (TrainConfig.minutes) that shortens the plan."""

from __future__ import annotations

import collections
import copy
import statistics
import time
from dataclasses import replace

import torch

from trainfast import hardware, tuning, units
from trainfast import step as _step
from trainfast.config import Speed, TrainConfig
from trainfast.data.format import Pack
from trainfast.errors import Detail, in_words
from trainfast.train import run as loop
from trainfast.train.optim import tail_scheduler
from trainfast.train.run import Run, Watcher, moments_like_weights
from trainfast.train.rundir import record_decision, record_speed
from trainfast.train.speed import pays, timed_rate

_now = time.perf_counter  # Threads' clock (tests give it one that knows the thread count)


class Threads:
    """torch's intra-op threads on a CPU run, chosen by timing the run's own steps: laps of LAP
    steps at the threads the run has and at the other candidate (half the threads the run
    began with, or those again), alternated ROUNDS times within an epoch, each lap's first
    SETTLE steps untimed (the thread pool settles; every step trains); fewer threads are kept
    only where GAIN× faster, and a first round ×CLEAR apart settles it. The first trial starts
    once the first steps' own comparison (FirstSteps) is done; later ones where other programs
    may have come or gone (_due).

    Other processes' CPU share does not say whether they would yield: a low-priority neighbour
    keeps a core busy and gives it up at once, and reading its share cost fit a thread and
    ×0.84 in images/s (issue 51). The share is still recorded each epoch (`other_cores`: the
    rate check's notes). Off where the threads are pinned (Speed.threads), on a GPU, under
    torchrun (each rank would time its peers' waits), and for a deterministic run (another
    count sums in another order). Never more than the threads torch had when the run began;
    fit puts those back at its end."""

    SETTLE, LAP, ROUNDS, GAIN, RECHECK = 1, 3, 2, 1.08, 4
    # A first round this far apart settles it: beyond what twice the threads can gain on a quiet
    # machine, so only a neighbour ends a trial early. (At 1.5 a quiet lcnet_050 run timed 1.52×
    # and stopped, a second timed 1.32× and went on: the two runs trained different steps at one
    # thread, which sums in another order, and parted ways from their first epoch; issue 51.4.)
    CLEAR = 2.2
    SLOWER, RECENT = 1.5, 7

    def __init__(self, active: bool, since: hardware.OtherLoad | None = None):
        self.cap = torch.get_num_threads()
        self.active = active and self.cap > 1
        self.load: hardware.OtherLoad | None = None
        # the load over the run's set-up where `since` began it: fit's tune times with it
        self.at_start = hardware.other_cores_now(since=since) if active else None
        self.laps: list[int] = []  # the thread count of each lap still to run in this trial
        self.times: dict[int, list[float]] = {}
        self.began_with, self.in_lap, self.last = self.cap, 0, None
        self.since_trial: int | None = None  # steps since the last trial began; None before the first
        self.pace = 0.0  # seconds a step at the kept count, as the last trial timed it
        self.recent: collections.deque = collections.deque(maxlen=self.RECENT)  # the last steps' seconds
        self.trials = 0  # trials made; the first says what it kept even where nothing changed
        self.line = ""  # what the last trial found, said after the epoch's progress bar
        self.decisions: list[dict] = []  # each trial's timings and choice, for speed.json (run.py writes them)

    @property
    def trial_steps(self) -> int:
        return 2 * self.ROUNDS * (self.SETTLE + self.LAP)

    def after_step(self, steps_left: int, ready: bool) -> None:
        """After each training step: the trial's clock and switches; a new trial where one is due
        and fits in the `steps_left` of this epoch (`ready`: the first steps' comparison is done)."""
        if not self.active:
            return
        t = _now()
        if self.laps:
            self._timed(t)
            return
        if self.last is not None:
            self.recent.append(t - self.last)
        self.last = t
        if self.since_trial is not None:
            self.since_trial += 1
        if ready and steps_left >= self.trial_steps and self._due():
            self._begin(t)

    def _due(self) -> bool:
        """The first trial; then, once RECHECK trials' worth of steps have gone by: always where
        fewer threads were kept (the neighbour may have left, which their pace would not show),
        and where all are kept, only where the steps' pace slowed SLOWER× from what the last
        trial timed (a neighbour came: one at equal priority slows torch's two threads on 2
        cores 2.4×). A quiet machine pays for one trial (on the CIFAR CNN here a trial every 64
        steps cost 7% of a quiet run). A trial's laps at fewer threads sum in another order, so
        a trial changes the run's numbers: a shared machine's own drift (~20-30% here) or a
        faster pace is not a reason, else two runs of the same call part ways (issue 51.4: the
        same lcnet_050 call re-checked at a 1.27× slower pace in one run, not in the other, and
        ended 63.5% against 65.1% after identical first epochs)."""
        if self.since_trial is None:
            return True
        if self.since_trial < self.RECHECK * self.trial_steps:
            return False
        if torch.get_num_threads() < self.cap:
            return True
        if len(self.recent) < self.RECENT:
            return False
        pace = statistics.median(self.recent)
        return pace > self.pace * self.SLOWER

    def _begin(self, t: float) -> None:
        now = torch.get_num_threads()
        other = max(1, self.cap // 2) if now == self.cap else self.cap
        self.laps, self.times = [now, other] * self.ROUNDS, {now: [], other: []}
        self.began_with, self.in_lap, self.since_trial, self.last = now, 0, 0, t

    def _timed(self, t: float) -> None:
        n = self.laps[0]
        self.since_trial += 1
        if self.in_lap >= self.SETTLE:
            self.times[n].append(t - self.last)
        self.last, self.in_lap = t, self.in_lap + 1
        if self.in_lap < self.SETTLE + self.LAP:
            return
        self.laps.pop(0)
        self.in_lap = 0
        med = self._medians()
        if len(med) == 2 and max(med.values()) > self.CLEAR * min(med.values()):
            self.laps = []  # one round tells where the difference is this large
        if self.laps:
            torch.set_num_threads(self.laps[0])
        else:
            self._keep(med)
            self.recent.clear()

    def _medians(self) -> dict[int, float]:
        return {n: statistics.median(ts) for n, ts in self.times.items() if ts}

    def _keep(self, med: dict[int, float]) -> None:
        fewer, more = min(med), max(med)
        keep = fewer if med[more] > self.GAIN * med[fewer] else more
        torch.set_num_threads(keep)
        self.pace = med[keep]
        timed = f"{units.ms(med[fewer])} ms a step with {fewer}, {units.ms(med[more])} ms with {more}"
        self.trials += 1
        self.decisions.append({"what": "threads", "chose": keep, "was": self.began_with,
                               "step_ms": {str(n): round(1000 * t, 3) for n, t in sorted(med.items())}})
        if keep != self.began_with:
            self.line = Detail(f"threads {self.began_with} → {keep}: timed on the run's own steps ({timed})")
        elif self.trials == 1:
            self.line = Detail(f"threads: {keep}, timed on the run's own steps ({timed})")

    def __enter__(self):
        self.load = hardware.OtherLoad().__enter__()
        return self

    def __exit__(self, *exc):
        self.load.__exit__(*exc)
        return False


RATE_OFF = 0.6
"""A run whose epoch trains below this share of the rate tune timed for its setting says so
(tune times in-memory batches; on 2 cores the plate demo's epochs run at about 0.8× of it)."""


def check_tuned_rate(tuned, tried: list[dict], speed: Speed, row: dict, say) -> bool:
    """Compare an epoch's images/s with what tune timed for the run's setting; where it is far
    below, say why it may be: other processes' load during the epoch, the data path (the row's
    `waited`: seconds spent waiting for batches; without them the steps kept up), or a stale
    cached choice (then dropped from the cache, so that no run uses it again). True for a
    stale cached choice."""
    rate = timed_rate(tried, speed.label())
    if rate is None or row["images_per_s"] >= RATE_OFF * rate:
        return False
    said = (f"epoch {row['epoch'] + 1} trained at {units.rate(row['images_per_s'])} images/s, "
            f"{row['images_per_s'] / rate:.2f}× the {units.rate(rate)} tune timed for {speed.label()}")
    waited = row.get("waited", 0.0)
    stepping = row["images_per_s"] * row["seconds"] / max(row["seconds"] - waited, 1e-9)  # the rate without waits
    if hardware.is_busy(row.get("other_cores")):
        say(f"note: {said}: other processes kept {row['other_cores']:.1f} cores busy during it")
    elif stepping >= RATE_OFF * rate:
        say(f"note: {said}: its steps waited {waited:.1f} s of {row['seconds']:.1f} s for batches (without the waits: "
            f"{units.rate(stepping)} images/s); `trainfast doctor` shows where the data path's time goes")
    elif tuned.cached:
        tuning.forget(tuned)
        say(f"note: {said} on a quiet machine: the cached choice looks stale; dropped from the cache")
        return True
    else:
        say(f"note: {said}: the data path or the model's own work outside tune's in-memory timing costs that much "
            "more; `trainfast doctor` shows where the time goes")
    return False


def retune(run: "Run", given: torch.nn.Module, pk: Pack, pin: dict, images: int, budget_share: float, say) -> None:
    """A stale cached choice, found by the run that uses it: tune measures again now, at the
    run's batch (its schedule, loader position and learning rate are made for it), within
    budget_share of the `images` left to train, and the run goes on with what it finds from
    the next epoch: precision, memory format, rewrites, compile. Rewrites already applied stay
    (they are exact, and cannot be taken out); config.json records the new setting, so a resume
    goes on with it. The run's random streams are left as they were."""
    old = run.speed
    if run.world.distributed:
        say("the next run measures again (under torchrun every rank would have to switch at once)")
        return
    if run.cfg.deterministic:
        say("the next run measures again (a --deterministic run keeps its settings)")
        return
    h, w, c = pk.shape
    probe = copy.deepcopy(given).to(memory_format=torch.contiguous_format)  # the model as the first tune saw it
    t = time.perf_counter()
    gpus = [] if run.dev.type != "cuda" else [run.dev.index if run.dev.index is not None else
                                               torch.cuda.current_device()]
    with torch.random.fork_rng(devices=gpus):  # NOTE: the CUDA branch has not run on a GPU
        result = tuning.tune(probe, (c, h, w), device=run.dev, batch_size=old.batch_size, planned_images=images,
                       budget_share=budget_share, try_compile=pin.get("compile", True),
                       try_rewrites="rewrites" not in pin, optimizer=run.cfg.optimizer, retune=True,
                       try_threads=not (run.threads is not None and run.threads.active),
                       log=lambda m: None)
    rows = [r.to_dict() for r in result.rows]
    new = replace(result.best if "compile" in pin else pays(result.best, rows, images, say), **pin)
    new = replace(new, rewrites=new.rewrites or old.rewrites)
    took = time.perf_counter() - t
    if run.world.is_main:
        record_decision(run.run_dir, {"what": "re-tune", "epoch": run.state["epoch"] + 1, "chose": new.label(),
                                      "was": old.label(), "images_per_s": timed_rate(rows, new.label())})
    if new.label() == old.label():
        say(f"re-tuned at batch {old.batch_size} in {took:.1f} s: {old.label()} is still the fastest setting here")
        return
    use_speed(run, new)
    rate = timed_rate(rows, new.label())
    say(f"re-tuned at batch {old.batch_size} in {took:.1f} s: training on with {new.label()}"
        f"{f' ({units.rate(rate)} images/s as timed)' if rate else ''}, was {old.label()}")
    if run.world.is_main:
        record_speed(run.run_dir, run.speed)


def use_speed(run: "Run", new: Speed) -> None:
    """Train on with `new`'s precision, memory format, rewrites and compile from the next step
    (one process; the batch stays): the model and the optimizer's moments in its memory format."""
    old = run.speed
    _step.prepare(run.net, new, run.dev)  # the rewrites, the memory format
    if old.channels_last and not new.channels_last:
        run.net.to(memory_format=torch.contiguous_format)
    moments_like_weights(run.opt)
    run.trained = _step.compile_model(run.net, run.dev) if new.compile else run.net
    run.scaler = _step.make_scaler(new, run.dev)
    run.speed = new


class FirstSteps:
    """tune's quick comparison for a run too short to search, made on the run's own first
    steps rather than on a copy of the model. The candidate (tune's likeliest winner: the
    fastest precision the device runs, in channels_last) must first give the loss the first
    setting gives on the first batch from the initial weights (tuning.loss_matches; forward
    passes without a gradient, batch-norm statistics and random streams put back). Then WARM
    + TIMED steps train at the first setting and WARM + TIMED at the candidate, the last TIMED
    of each timed, and the run keeps the candidate where it ran tuning.SHORT_GAIN× faster, else goes
    back. Every step trains: the comparison costs two forward passes, the switches of memory
    format and the candidate's warm-up, where timing it on a copy cost the copy and WARM + 1
    steps that trained nothing. One process on a CPU only (a GPU's timing would need
    synchronising; under torchrun every rank would have to switch at once)."""

    WARM, TIMED = 1, 2

    def __init__(self, run: "Run", candidate: Speed, tried: list[dict]):
        self.first, self.candidate, self.tried = run.speed, candidate, tried
        self.began, self.load = 0.0, None
        self.timed: dict[str, dict] = {}
        self.line = ""  # what it found, said after the epoch's progress bar
        if len(run.loader) < 2 * (self.WARM + self.TIMED):  # both timings within the first epoch, none across its end
            self.line = (f"first steps: {candidate.label()} not compared: an epoch of {len(run.loader)} steps is too "
                         "few to time both settings")
        elif candidate.precision != self.first.precision:  # the same precision in another layout computes the same
            x, y = run.loader.batch(0, epoch=0)
            losses = []
            for speed in (self.first, candidate):
                try:
                    with _step.kept_state(run.net), torch.no_grad():
                        loss = _step.forward_loss(run.trained, x, y, speed, run.dev, run.cfg.label_smoothing)[0]
                except Exception as e:  # noqa: BLE001 - the first setting's failure is the run's to raise
                    if speed is self.first:
                        raise
                    self.line = f"first steps: {candidate.label()} left out: its forward pass failed ({in_words(e)})"
                    return
                losses.append(loss.item())
            if not tuning.loss_matches(losses[1], losses[0]):
                self.line = (f"first steps: {candidate.label()} left out: its loss on the first batch, "
                             f"{losses[1]:.4g}, is not {self.first.label()}'s {losses[0]:.4g}")

    def after_step(self, run: "Run") -> bool:
        """Called after each of the run's steps; True once the comparison is over."""
        if self.line:  # the candidate's loss was off: no comparison
            return self._done(run)
        n, per = run.state["step"], self.WARM + self.TIMED  # a new run's steps: the comparison is made at its start
        if n in (self.WARM, per + self.WARM):
            self.began, self.load = time.perf_counter(), hardware.OtherLoad().__enter__()
            return False
        if n not in (per, 2 * per):
            return False
        seconds = time.perf_counter() - self.began
        self.load.__exit__(None, None, None)
        rate = self.TIMED * run.loader.batch_size / seconds
        self.timed[run.speed.label()] = tuning.Trial(run.speed, rate, note="the run's first steps",
                                              other_cores=self.load.cores).to_dict()
        if n == per:
            use_speed(run, self.candidate)
            return False
        ref, alt = (self.timed[s.label()]["images_per_s"] for s in (self.first, self.candidate))
        keep = alt >= tuning.SHORT_GAIN * ref
        if not keep:
            use_speed(run, self.first)
        self.line = (f"first steps: {self.candidate.label()} ran {units.rate(alt)} images/s, {self.first.label()} "
                     f"{units.rate(ref)} ({alt / ref:.2f}×{'' if keep else f', under the {tuning.SHORT_GAIN}× a switch takes'}"
                     f"): training on with {run.speed.label()}")
        return self._done(run)

    def trying(self, run: "Run") -> bool:
        """The run trains at the candidate, and the comparison is not over."""
        return run.speed == self.candidate and not self.line

    def failed(self, run: "Run", e: Exception) -> None:
        """The candidate's step raised: back to the first setting, the step's gradients dropped."""
        use_speed(run, self.first)
        run.opt.zero_grad(set_to_none=True)
        self.line = f"first steps: {self.candidate.label()} left out: its training step failed ({in_words(e)})"

    def _done(self, run: "Run") -> bool:
        self.tried.extend(self.timed.values())
        if run.world.is_main:
            record_speed(run.run_dir, run.speed, self.tried)
            record_decision(run.run_dir, {"what": "first steps", "chose": run.speed.label(), "images_per_s": {
                label: t["images_per_s"] for label, t in self.timed.items()}})
        return True


def shorten(run: "Run", cfg: TrainConfig, more: int, epoch_s: float, epoch: int) -> TrainConfig:
    """The run's plan cut to `more` epochs after this one (TrainConfig.minutes), its learning
    rate annealed over them (tail_scheduler); kept in the checkpoint, so a resume goes on with it."""
    steps = more * len(run.loader)
    lrs = [g["lr"] for g in run.opt.param_groups]
    run.sched = tail_scheduler(run.opt, lrs, steps)
    new = replace(cfg, epochs=run.state["epoch"] + more)
    run.state["shortened"] = {"epochs": new.epochs, "steps": steps, "lrs": lrs}
    run.cfg = new
    run.save(epoch)
    run.say(f"time budget: epoch {epoch + 1} took {epoch_s:.1f} s, so {more} more fit the "
            f"{units.minutes(cfg.minutes)}: "
            f"{new.epochs} epochs instead of {cfg.epochs}, the learning rate annealed over them")
    return new


class RateCheck(Watcher):
    """After the first epoch's warm-up (the second epoch's end, or the last's), once: an epoch far
    below the rate tune timed is said with its likely cause, and a stale cached choice is
    measured again (retune) for the epochs left."""

    def __init__(self, tuned, tried: list[dict], given: torch.nn.Module, pk: Pack, pin: dict, n_train: int):
        self.tuned, self.tried, self.given, self.pk, self.pin, self.n_train = tuned, tried, given, pk, pin, n_train
        self.done = False

    def after_epoch(self, run: Run, epoch: int, row: dict) -> str | None:
        state, cfg = run.state, run.cfg
        if self.done or not (epoch >= 1 or state["epoch"] >= cfg.epochs):  # past the first epoch's warm-up
            return None
        self.done = True
        if check_tuned_rate(self.tuned, self.tried, run.speed, row, run.say) and state["epoch"] < cfg.epochs:
            t = loop.clock()
            with run.costs.phase("re-tune"):
                retune(run, self.given, self.pk, self.pin, self.n_train * (cfg.epochs - state["epoch"]),
                       cfg.tune_share, run.say)
            run.began += loop.clock() - t  # the time budget's epoch time is the epoch's, not the re-tune's
        return None


class TimeBudget(Watcher):
    """TrainConfig.minutes: after each epoch, as many more as fit in what is left at this
    epoch's pace (the plan shortened, see shorten), or "out-of-time" where not one more fits."""

    def __init__(self, minutes: float):
        self.minutes, self.deadline = minutes, loop.clock() + 60 * minutes

    def after_epoch(self, run: Run, epoch: int, row: dict) -> str | None:
        if run.state["epoch"] >= run.cfg.epochs:
            return None
        now = loop.clock()
        more = int((self.deadline - now) // max(now - run.began, 1e-9))
        if more <= 0:
            run.say(f"time budget: {units.minutes(self.minutes)} spent; stopping after epoch {epoch + 1} of "
                    f"{run.cfg.epochs}")
            return "out-of-time"
        if run.state["epoch"] + more < run.cfg.epochs:
            shorten(run, run.cfg, more, now - run.began, epoch)
        return None

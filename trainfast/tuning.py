"""`trainfast tune`: time the candidate speed settings on this machine, keep the fastest
sound one, and cache the choice with the load it was measured under.

A measuring core (_Bench) times a setting within the tune's budget and records how many cores
other processes kept busy meanwhile; a strategy per device (_CpuSearch, _CudaSearch over the
shared _Search) decides what to time next. The search is pruned, not exhaustive. (0) The
reference, fp32 in the plain layout: on a CPU at a batch whose step stays short
(start_batch_for), on CUDA at the batch that fills the device (_fill: below it every setting is
launch-bound and they all look alike). (1) precision (fp32, bf16; on CUDA also tf32 and fp16)
in channels_last; (2) the exact rewrite passes (trainfast.models.rewrite) on the winner, then
each precision in the plain layout; (3) batch sizes, powers of two, with the winner so far,
until memory runs out or two doublings in a row are slower, then the rewrites once more at
the new batch; (4) CPU threads, if torch uses fewer than the physical cores; (5) a final: the
fastest few and the winner's neighbours timed round-robin twice more, so that a slow spell of a
shared machine falls on all of them; the best median wins, so that one lucky timing does not;
(6) torch.compile of the winner (its compile time reported apart; on CUDA with CUDA graphs).

A candidate counts only if its loss on the same first batch, from the same weights, is finite
and within 5% of fp32's. Each timing runs at least `steps` steps and at least `min_seconds` of
them, issued back to back and synchronised once, as training issues them. On CUDA the trials
use cudnn.benchmark and a fused SGD, as fit does. Where other processes hold a CPU's cores,
the tune times with the threads left free, says so, and does not cache its choice as the
machine's (a busy tune once chose batch 4 and a quiet run reused it at a quarter of the speed).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from trainfast import hardware, units
from trainfast import step as _step
from trainfast.config import Speed, check_optimizer
from trainfast.diagnose.timing import step_breakdown, synthetic_batches, throughput
from trainfast.errors import TrainfastError, in_words
from trainfast.models import rewrite

LOSS_TOLERANCE = 0.05  # relative to the fp32 loss on the same batch
LOSS_BATCH = 8  # the images of that batch: the same for every candidate, whatever its batch size
STANDALONE_S = 60.0  # a tune with no budget given (not fit's): its default bound, in seconds
FINAL_ROUNDS = 2  # extra round-robin timings of each finalist
MIN_SECONDS = 0.8  # the least time one timing spans
QUICK_STEPS = 1  # the least timed steps of fit's quick timing (after one warm-up): is its run long enough to search?
QUICK_SPAN_S = 0.1  # ... and as many more as the warm-up step's time says span this (1 for ResNet-18, 4 for SqueezeNet)
SHORT_GAIN = 1.25  # a run too short to search takes the likeliest winner only this much faster (quick timings)
MAX_STEPS = 60
COMPILE_GUESS_S = 8.0  # a torch.compile before one is timed: 7.6 s for plate_net, 12 s for cifar_cnn on 2 cores
MAX_BATCH = {"cpu": 512, "cuda": 8192}  # the largest batch tried unless the caller bounds it
FILL_GAIN = 1.10  # CUDA: a doubling of the batch that gains less than this has filled the device
START_STEP_S = 0.5  # CPU: the first batch tried is sized so that one step takes about this long
START_PROBE = 4  # ... timed at this batch (smaller batches overstate the cost per image 2-3x)
_clock = time.perf_counter  # the tune's own elapsed time (tests replace it)


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
    threads: int | None = None  # the CPU threads it timed with, where the load made it fewer than the default
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
        fewer = f"; timed with {self.threads} thread{'s' * (self.threads != 1)}, the cores left free" \
            if self.threads else ""
        return (f"the machine was busy: other processes kept {self.other_cores:.1f} of its "
                f"{hardware.usable_cores()} cores busy on average while tune measured{fewer}. The choice is not "
                "cached as this machine's: the next tune measures again")

    def __repr__(self) -> str:  # a notebook cell shows the table and the choice, not the dataclass
        return f"TuneResult ({len(self.rows)} timings):\n{self.table()}"

    def _repr_html_(self) -> str:
        import html
        return f"<pre style='white-space:pre-wrap'>{html.escape(repr(self))}</pre>"

    def table(self) -> str:
        timed: dict[str, list[Trial]] = {}  # a setting timed several times shows once, at its median
        for r in (r for r in self.rows if r.images_per_s):
            timed.setdefault(r.speed.label(), []).append(r)
        merged = [replace(ts[0], images_per_s=_median(ts), note=ts[0].note if len(ts) == 1 else
                          "median of " + ", ".join(units.rate(t.images_per_s) for t in ts) + _spread(ts))
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


def _key(model: torch.nn.Module, shape, device: torch.device, pinned_batch, compile_: bool) -> str:
    structure = hardware.model_key(model)
    h = hashlib.sha1(f"{structure}|{tuple(shape)}|{hardware.machine_key(device)}|{pinned_batch}|{compile_}".encode())
    return h.hexdigest()


def _median(trials: list[Trial]) -> float:
    return statistics.median(t.images_per_s for t in trials)


def _spread(trials: list[Trial]) -> str:
    """The range of several timings of one setting around their median, e.g. ' (±6%)'."""
    rates = [t.images_per_s for t in trials]
    return f" (±{(max(rates) - min(rates)) / 2 / statistics.median(rates):.0%})"


def measure_trial(model, shape, out_shape, speed: Speed, device, steps: int = 5, warmup: int = 2,
                  min_seconds: float = MIN_SECONDS, optimizer: str = "adamw",
                  settled: Callable[[float, int], bool] | None = None) -> Trial:
    """Time training steps at `speed` on in-memory batches, after `warmup` of them: `steps`
    steps (fewer, but at least two, where those span 2 × min_seconds already), or more where
    those would span less than `min_seconds` (at most MAX_STEPS); where min_seconds is 0, a
    quick timing: `steps`, or as many as span QUICK_SPAN_S by the warm-up's time, issued
    back to back as training issues them (timing.throughput), each with an update by the
    `optimizer` the run uses (its cost per step is part of what a batch size buys). Also the
    first batch's loss, from the model's own weights. A quick timing stops after its warm-up
    where `settled(rate, batch)` says the warm-up's rate (a first step's, which understates
    the rate) is all its caller needs to know."""
    net = copy.deepcopy(model)
    data = synthetic_batches(shape, out_shape, speed.batch_size, device, n=2)
    compile_s, threads = 0.0, torch.get_num_threads()
    try:
        net = _step.prepare(net, speed, device)
        # the soundness check's loss: the same images and labels for every setting and batch size
        x, y = _step.to_device(*synthetic_batches(shape, out_shape, LOSS_BATCH, device, n=1)[0], speed, device)
        with torch.no_grad():
            loss, _ = _step.forward_loss(net.eval(), x, y, speed, device)
        net.train()
        if speed.compile:
            t = time.perf_counter()
            net = _step.compile_model(net, device)
            step_breakdown(net, data, device=device, speed=speed, steps=1, warmup=0)
            compile_s = time.perf_counter() - t
        opt = _step.make_optimizer(optimizer, net.parameters(), 1e-4, device)
        if min_seconds > 0:
            probe = step_breakdown(net, data, device=device, speed=speed, steps=1, warmup=warmup, optimizer=opt)
            # At least min_seconds of steps, and `steps` of them unless two already span twice that (a
            # 512² CNN's 1-2 s steps: five of them made each candidate cost ~8 s of a tune's budget).
            per = max(probe.step, 1e-9)
            n = min(MAX_STEPS, max(min(steps, max(2, math.ceil(2 * min_seconds / per))), math.ceil(min_seconds / per),
                                   1))
            rate = throughput(net, data, device=device, speed=speed, steps=n, warmup=1, optimizer=opt)
        else:  # a quick timing: the warm-up steps, timed, size what follows (a first step overstates a step's time)
            warm = throughput(net, data, device=device, speed=speed, steps=max(warmup, 1), warmup=0, optimizer=opt)
            if settled is not None and settled(warm, speed.batch_size):
                return Trial(speed, warm, float(loss), note="a first step")
            per_step = len(data[0][0]) / warm
            n = min(MAX_STEPS, max(steps, math.ceil(QUICK_SPAN_S / max(per_step, 1e-9))))
            rate = throughput(net, data, device=device, speed=speed, steps=n, warmup=0, optimizer=opt)
    except torch.cuda.OutOfMemoryError:
        return Trial(speed, None, note="out of memory")
    except Exception as e:  # noqa: BLE001 - a candidate that fails is skipped, with the reason
        return Trial(speed, None, note=f"failed: {in_words(e, 80)}")
    finally:
        torch.set_num_threads(threads)  # a trial that pins threads leaves them as it found them
    return Trial(speed, rate, float(loss), compile_s)



def _final(rows: list[Trial], finalists: list[Speed], sound, run, rounds: int = FINAL_ROUNDS) -> Trial | None:
    """Time the finalists round-robin `rounds` times more, and once more any that then has
    fewer than rounds + 1 timings (one the search did not time); return the one whose timings
    have the highest median. On a shared machine one timing swings by 10-20%: the single
    fastest of many noisy timings is partly luck, and a slow spell timed one by one falls on
    whichever setting it happens to hit."""
    alive = list({s.label(): s for s in finalists}.values())  # each setting once, in order
    for i in range(rounds + 1):
        for s in list(alive):
            if i == rounds and sum(t.speed.label() == s.label() for t in rows) > rounds:
                continue
            t = run(s)
            if not sound(t) and not t.note.startswith("not timed"):
                alive.remove(s)  # out of memory, failed, or its loss is off: out of the final
    timed = {s.label(): [t for t in rows if t.speed.label() == s.label() and sound(t)] for s in alive}
    scored = [(_median(timed[s.label()]), s) for s in alive if timed[s.label()]]  # a budget can leave some untimed
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


def start_batch_for(model: torch.nn.Module, input_shape, device: torch.device, max_batch: int,
                    step_s: float = START_STEP_S, forward_s: float | None = None) -> int:
    """The first batch to try: 64, or on the CPU less where a training step at 64 would take
    more than step_s (the 512² story's CNN: 13 s per step at 64 on 2 cores; a tune of
    several steps per candidate outlasted a one-epoch run).

    A first guess from the cost per image at batch START_PROBE (one fp32 training step of a
    copy, the faster of two after a warm-up; FLOPs instead took 3 s of a 4.8 s tune), then,
    where that guess is below 64, confirmed upward: the batch doubles while one step at the
    doubled batch, timed, stays within step_s. A small batch overstates the cost per
    image 2-3×, and one busy moment of a shared machine many times more: a guess from one
    probe alone started a CIFAR CNN's tune at batch 4 beside other programs.

    `forward_s`, the seconds first_forward took (two forward passes of two images, no
    gradient), skips the probe where a step at 64 (or max_batch) is surely short: three times
    that cost per image (a backward costs about two forwards) over the batch, within step_s.
    A batch of 2 overstates the cost per image 1.4-9× (the 512² CNN, compute-bound: 1.4×;
    ResNet-18 at 32²: 7×), so that estimate does not fall short of a step's time."""
    b = min(64, max_batch)
    if device.type != "cpu" or b <= START_PROBE:
        return b
    if forward_s is not None and 3 * b * forward_s / 4 <= step_s:
        return b
    net = copy.deepcopy(model).eval()  # no dropout: the global random state stays as it was
    gen = torch.Generator().manual_seed(0)

    def timed(batch: int, tries: int) -> float:
        """The fastest of `tries` steps after a warm-up; a step past step_s ends them."""
        x = torch.randn(batch, *input_shape, generator=gen)
        times = []
        for _ in range(tries + 1):
            t = time.perf_counter()
            _step.logits_of(net(x)).float().square().mean().backward()
            times.append(time.perf_counter() - t)
            if times[-1] > step_s:
                break
        return min(times[1:] or times)

    try:
        per_image = timed(START_PROBE, 2) / START_PROBE
        guess = b
        while guess > START_PROBE and guess * per_image > step_s:
            guess //= 2
        while guess < b and timed(guess * 2, 1) <= step_s:
            guess *= 2
    except Exception:  # noqa: BLE001 - a model that will not run on random input here: the usual start
        return b
    return guess


def _warm_forward_s(model: torch.nn.Module, input_shape) -> float:
    """Twice the seconds of one more forward pass of two images in eval mode, without a gradient
    (start_batch_for's estimate of a step, made for first_forward's two passes). Timed with a
    real clock, not the tests' fake one: it sizes the first batch. first_forward's own time
    held its first-call costs and a training-mode pass with its statistics put back: 15-35 ms
    for MobileNetV3-small at 32², where this pass takes 6, so a step at 32 read as surely more
    than START_STEP_S and a probe (a copy and three steps, 0.14 s) ran before a 5-epoch run."""
    was_training = model.training
    x = torch.zeros(2, *input_shape, device=next((p.device for p in model.parameters()), torch.device("cpu")))
    try:
        with torch.no_grad():
            t = time.perf_counter()
            model.eval()(x)
            return 2 * (time.perf_counter() - t)
    finally:
        model.train(was_training)


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


def _input_of(data) -> tuple[tuple[int, int, int], int | None]:
    """tune's input: ((C, H, W), the pack's image count or None) from a shape, a Pack or a pack's path."""
    from trainfast.data.format import Pack, as_pack

    if isinstance(data, (Pack, str)) or hasattr(data, "__fspath__"):
        pk = as_pack(data, "tune's input")
        h, w, c = pk.shape
        return (c, h, w), len(pk)
    try:
        shape = tuple(int(v) for v in data)
    except (TypeError, ValueError):
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise TrainfastError(f"tune's input must be (C, H, W), e.g. (3, 32, 32), or a pack; got {data!r}")
    c, h, w = shape
    if c not in (1, 3, 4) and w in (1, 3, 4):
        raise TrainfastError(f"tune's input shape is (C, H, W), channels first; {shape} looks like a pack's "
                             f"(H, W, C): give ({w}, {c}, {h})")
    return shape, None


def loss_matches(loss: float | None, ref: float | None) -> bool:
    """A setting's first-batch loss is finite and fp32's on the same batch, within LOSS_TOLERANCE."""
    return loss is not None and ref is not None and math.isfinite(loss) and \
        abs(loss - ref) <= LOSS_TOLERANCE * max(1.0, abs(ref))


class _Bench:
    """The measuring core every search shares: it times a setting within the tune's budget,
    records the load each timing ran under, and judges a timing sound against the reference's
    loss. The searches (_CpuSearch, _CudaSearch) only decide what to time next."""

    def __init__(self, model, input_shape, out_shape, dev, measure, log, *, max_seconds, planned_images,
                 budget_share, forward_s: float | None = None):
        self.model, self.input_shape, self.out_shape, self.dev = model, input_shape, out_shape, dev
        self.measure, self.log = measure, log
        self.max_seconds, self.planned_images, self.budget_share = max_seconds, planned_images, budget_share
        self.rows: list[Trial] = []
        self.not_timed: list[str] = []
        self.took: list[tuple[float, Speed]] = []  # each measurement's seconds; the first also pays one-time set-up
        self.plan: dict = {}  # once the reference is timed: its time, and the fastest rate timed so far
        self.slowdown = 1.0  # how much longer than on the quiet machine a compile is expected to take
        self.ref: Trial | None = None
        self.forward_s = forward_s  # first_forward's time (start_batch_for)
        self.started = _clock()

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

    def run(self, speed: Speed) -> Trial:
        """Time `speed` (or say why not), log it, and keep the row."""
        if any(r.images_per_s for r in self.rows) and self.budget() is not None:  # the reference is always timed
            left = self.budget() - (_clock() - self.started)
            # One that would end past the bound is not begun; the second always is: the likely winner.
            if left <= 0 or (len(self.took) >= 2 and left < self.expected_s(speed)):
                self.not_timed.append(speed.label())
                return Trial(speed, None, note="not timed: the tune's budget is spent")
        reason = _step.check(speed, self.dev)
        if reason:
            trial = Trial(speed, None, note=f"skipped: {reason}")
        else:
            t = _clock()
            with hardware.OtherLoad() as load:
                trial = self.measure(self.model, self.input_shape, self.out_shape, speed, self.dev)
            trial.other_cores = load.cores
            self.took.append((_clock() - t, speed))
        self.rows.append(trial)
        if self.plan and trial.images_per_s:
            self.plan["rate"] = max(self.plan["rate"], trial.images_per_s)
        shown = f"{units.rate(trial.images_per_s)} images/s" if trial.images_per_s else trial.note
        busy = f"   (other processes: {trial.other_cores:.1f} cores)" if hardware.is_busy(trial.other_cores) else ""
        self.log(f"  {speed.label():53s} {shown}{busy}")
        return trial

    def set_reference(self, ref: Trial) -> None:
        """The first timing: fp32, plain layout; every other setting's loss is judged against its."""
        if ref.images_per_s is None:
            raise TrainfastError(f"the model does not train at all on {self.dev}: {ref.note}")
        self.ref = ref
        self.plan.update(first=_clock() - self.started, rate=ref.images_per_s)
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


class _Search:
    """The search both devices share (see the module's docstring): the reference, precision ×
    memory format, the rewrites, batch sizes, the device's own extra phase, a round-robin final,
    then torch.compile. A device's strategy says where to start and what it can run."""

    precisions: list[str]  # the likely winners first: under a tight budget they are the ones timed

    def __init__(self, bench: _Bench, *, batch_size, max_batch, try_rewrites, try_compile, other: float | None):
        self.bench, self.pinned, self.max_batch = bench, batch_size, max_batch
        self.try_rewrites, self.try_compile = try_rewrites, try_compile
        self.other, self.busy = other, hardware.is_busy(other)  # cores other processes held when the tune began

    def first_speed(self) -> Speed:
        """The setting the search times first: fp32, plain layout, at its start batch."""
        raise NotImplementedError

    def reference(self) -> Trial:
        return self.bench.run(self.first_speed())

    def extra(self, best: Trial) -> Trial:
        return best

    def run(self) -> Trial:
        bench, run, better = self.bench, self.bench.run, self.bench.better
        ref = self.reference()
        bench.set_reference(ref)
        start = ref.speed.batch_size
        # Each precision in channels_last (the layout convolutions run fastest in, on CPUs and
        # GPUs alike), then the rewrites on the best of those, then the plain layout. A precision
        # this device does not run fast is skipped without timing.
        for p in self.precisions:
            run(Speed(p, True, batch_size=start))
        best = max((t for t in bench.rows if bench.sound(t)), key=lambda t: t.images_per_s)
        if self.try_rewrites:
            t = run(replace(best.speed, rewrites=rewrite.ALL))
            best = t if better(t, best) else best
        for p in self.precisions[:-1]:  # the plain layout (fp32's is the reference, timed first)
            t = run(Speed(p, False, batch_size=start))
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
            t = bench.run(replace(best.speed, batch_size=b))
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
        near = [s for s in self.neighbours(best.speed) if s.label() not in known_bad]
        return _final(bench.rows, list(leaders.values())[:4 if self.busy else 3] + near, bench.sound,
                      bench.run) or best


class _CpuSearch(_Search):
    """CPU: start at a batch whose step takes about START_STEP_S at most (start_batch_for); bf16
    only where the CPU has bf16 instructions (step.check); then the threads, where torch uses
    fewer than the physical cores and no other program holds the rest."""

    precisions = ["bf16", "fp32"]

    def first_speed(self) -> Speed:
        # A step's allowance in the cores other processes leave free: on a busy machine the start
        # is the batch the quiet machine would start at (the 512² CNN at 8, not 4, beside one
        # spinning process), not one shrunk by the load.
        bench, cores = self.bench, hardware.physical_cores()
        allowance = START_STEP_S * cores / max(cores - (self.other or 0.0), 0.5) if self.busy else START_STEP_S
        start = self.pinned or start_batch_for(bench.model, bench.input_shape, bench.dev, self.max_batch, allowance,
                                               bench.forward_s)
        return Speed("fp32", False, batch_size=start)

    def extra(self, best: Trial) -> Trial:
        cores = hardware.physical_cores()
        if self.busy or torch.get_num_threads() == cores:
            return best
        t = self.bench.run(replace(best.speed, threads=cores))
        return t if self.bench.better(t, best) else best


class _CudaSearch(_Search):
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


def tune(model: torch.nn.Module, input_shape, *, device=None, batch_size: int | None = None,
         max_batch: int | None = None, images: int | None = None, planned_images: int | None = None,
         budget_share: float = 0.0, max_seconds: float | None = None, try_compile: bool = True,
         try_rewrites: bool = True, optimizer: str = "adamw", retune: bool = False,
         measure: Callable[..., Trial] | None = None, probe: Callable[..., Trial] | None = None,
         other_cores: float | None = None, compare_in_run: bool = False, log=print) -> TuneResult:
    """Find the fastest sound speed settings for training `model` on inputs (C, H, W).

        trainfast.tune(model, "cifar.pack")     # the pack's shape; the batch bounded by its images, as fit bounds it
        trainfast.tune(model, (3, 32, 32), images=50_000)   # inputs of this shape, 50,000 per epoch

    Args:
        input_shape: (C, H, W), or a Pack (or a pack's path).
        images: training images per epoch (per process), where input_shape is not a pack: the
            batch is bounded as fit bounds it (data_max_batch). Without it and without a pack,
            batches up to max_batch are tried, which a small dataset could not use.
        batch_size: pin the batch size (else start at 64, or less than max_batch, and search
            powers of two).
        max_batch: the largest batch tried (default MAX_BATCH[device type]).
        planned_images, budget_share: bound the search to budget_share of the training it
            serves, planned_images at the fastest rate timed so far, counted after the first
            measurement (its one-time warm-ups are not the search's); what the bound leaves
            out is reported. A search cut short is cached with its budget: a later tune whose
            budget is not larger (within 25%) reuses it, a larger one measures again.
        max_seconds: a bound on the tune's own time, from its start (the tighter of the two
            bounds holds when both are given). A tune not given planned_images (not fit's) is
            bounded by STANDALONE_S unless this says otherwise (a torch.compile alone can take
            minutes on a laptop CPU); what it leaves out is listed.
        try_compile: include torch.compile of the winner (slow to compile on CPU).
        try_rewrites: include the exact rewrite passes of trainfast.models.rewrite.
        optimizer: the one the training will use (fit's default, "adamw"; "sgd", "rmsprop"):
            each timed step includes its update, whose cost per image falls as the batch grows.
        measure: replaces measure_trial (tests inject a fake clock here).
        probe: replaces the quick timing (a few steps) with which fit's tune judges whether its
            run is long enough for a search to pay (below); with `measure` given and no probe,
            that judgement is not made.
        other_cores: the cores other processes kept busy, sampled by the caller just before
            (fit samples them once for its threads and its tune); None: sampled here.
        compare_in_run: a short run's comparison (below) is the run's to make: the result's
            `candidate` is the likeliest winner, untimed, and fit times it on its first steps
            (one process on a CPU: train.adapt.FirstSteps) instead of on a copy of the model here.

    A short run gets no search: given planned_images and budget_share (fit's tune), a quick
    timing of the first setting says how long the training will take; where budget_share of
    that would not pay for the search's first two measurements (on 2 CPU cores, 5 epochs of
    1,400 small images: ~13 s of training against ~2.5 s of tuning), the run trains at that
    setting, or at the likeliest winner where one quick comparison (here, or on the run's first
    steps: compare_in_run) finds it SHORT_GAIN× faster, and the table says why. Such a choice
    is not cached: a longer run searches.

    The load of other processes is measured before and during the search. On a CPU where they
    hold cores, the search times with the threads left free (hardware.free_threads: a thread
    sharing its core with another program holds up the rest), says so, and its choice is not
    cached as this machine's: the next tune measures again.
    """
    try:
        dev = hardware.resolve_device(device)
    except ValueError as e:
        raise TrainfastError(str(e)) from None
    if not isinstance(model, torch.nn.Module):
        raise TrainfastError(f"tune takes an nn.Module, not a {type(model).__name__}")
    input_shape, pack_images = _input_of(input_shape)
    images = images or pack_images
    if images is not None:  # the data's images bound the batch as fit bounds it, unless the caller did
        max_batch = max_batch or min(MAX_BATCH.get(dev.type, MAX_BATCH["cpu"]), data_max_batch(images))
    if max_seconds is None and planned_images is None:  # not fit's tune (fit plans its images; tune_share 0: no bound)
        max_seconds = STANDALONE_S
    max_batch = max_batch or MAX_BATCH.get(dev.type, MAX_BATCH["cpu"])
    check_optimizer(optimizer)  # the arguments before any forward
    first = _step.first_forward(model, torch.zeros(2, *input_shape), f"inputs of shape {input_shape}")  # lazy too
    forward_s = _warm_forward_s(model, input_shape) if dev.type == "cpu" else None
    if try_rewrites and not rewrite.applies(model):
        try_rewrites = False  # nothing here they apply to: a timing "with rewrites" would time the same model
    key = _key(model, input_shape, dev, batch_size, (try_compile, try_rewrites, max_batch, optimizer))
    cache = hardware.read_cache("tune.json")
    if not retune and key in cache and _reusable(cache[key], planned_images, budget_share, max_seconds):
        c = cache[key]
        return TuneResult(Speed(**c["best"]), [Trial.from_dict(r) for r in c["rows"]], cached=True,
                          not_timed=c.get("not_timed", []), budget_s=c.get("budget_s"), key=key)

    out_shape = getattr(model, "output_shape", None) or tuple(first.shape[1:])
    own_timing = measure is None
    measure = measure or functools.partial(measure_trial, optimizer=optimizer)
    bench = _Bench(model, input_shape, out_shape, dev, measure, log, max_seconds=max_seconds,
                   planned_images=planned_images, budget_share=budget_share, forward_s=forward_s)
    if probe is None and own_timing:
        # Where the run compares on its own first steps, a first step slow enough to call the run too
        # short to search settles it: the rest of the quick timing could only find it shorter still.
        settled = (lambda rate, batch: _too_short(bench, rate, batch)[0]) if compare_in_run else None
        probe = functools.partial(measure_trial, optimizer=optimizer, steps=QUICK_STEPS, warmup=1, min_seconds=0.0,
                                  settled=settled)
    threads = torch.get_num_threads()
    other = (other_cores if other_cores is not None else hardware.other_cores_now()) if dev.type == "cpu" else None
    fewer = hardware.free_threads(other, threads) if dev.type == "cpu" else threads
    fewer = fewer if fewer < threads else None
    cuda = dev.type == "cuda"
    if fewer:
        log(f"  other processes keep {other:.1f} of {hardware.usable_cores()} cores busy: timing with {fewer} "
            f"thread{'s' * (fewer != 1)} (the cores left free), not {threads}")
    if hardware.is_busy(other):  # a compile's workers share the cores too (a bounded tune ran 71 s against 60)
        cores = hardware.usable_cores()
        bench.slowdown = cores / max(cores - other, 1.0)
    search = (_CudaSearch if cuda else _CpuSearch)(bench, batch_size=batch_size, max_batch=max_batch,
                                                     try_rewrites=try_rewrites, try_compile=try_compile, other=other)
    try:
        if fewer:
            torch.set_num_threads(fewer)
        short = _short_run(probe, bench, search, compare_in_run) if probe and planned_images and budget_share \
            else None
        if short:
            rows, trial, why, candidate = short  # no progress lines: the result's table, said next, has them
            loads = [r.other_cores for r in rows if r.other_cores is not None]
            return TuneResult(trial.speed, rows, seconds=_clock() - bench.started, threads=fewer, key=key, short=why,
                              other_cores=max(loads) if loads else None, candidate=candidate)
        log(f"tuning on {dev}: {'the batch that fills the GPU, then ' if cuda and not batch_size else ''}"
            f"precision × memory format{', rewrites' if try_rewrites else ''}, then batch size (up to {max_batch}), "
            f"{'' if cuda else 'threads, '}a round-robin final{', compile' if try_compile else ''}")
        bench.started = _clock()  # the quick timing is not the search's: its budget counts from here
        with hardware.OtherLoad() as load:
            best = search.run()
    finally:
        torch.set_num_threads(threads)
    not_timed = list(dict.fromkeys(bench.not_timed))  # a setting the budget skipped in several phases, once
    # A GPU's speed does not hang on other processes' CPU time as a CPU's does: its choice stands (the rows keep the load)
    result = TuneResult(best.speed, bench.rows, seconds=_clock() - bench.started, not_timed=not_timed,
                        budget_s=bench.budget(), other_cores=None if cuda else load.cores, threads=fewer, key=key)
    entry = {"best": asdict(best.speed), "rows": [r.to_dict() for r in bench.rows], "other_cores": result.other_cores,
             "busy": result.busy}
    if not_timed:
        log(f"  the tune's budget ({bench.budget():.1f} s) left {len(not_timed)} settings untimed; cached with that "
            "budget (a tune with a larger one measures again)")
        entry.update(budget_s=bench.budget(), first_s=bench.plan["first"], plan_rate=bench.plan["rate"],
                     not_timed=not_timed)
    cache[key] = entry
    hardware.write_cache("tune.json", cache)
    return result


def _short_run(probe, bench: _Bench, search: "_Search", in_run: bool = False
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
    short, plan, search_s, share = _too_short(bench, ref.images_per_s, first.batch_size)
    if not short:
        return None
    rows, best, candidate = [ref], ref, None
    likely = next((Speed(p, True, batch_size=first.batch_size) for p in search.precisions
                   if _step.check(Speed(p, True, batch_size=first.batch_size), bench.dev) is None), None)
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


def _too_short(bench: _Bench, rate: float, batch: int) -> tuple[bool, float, float, float]:
    """(too short to search, the planned training's seconds, a search's, the tune's share of the
    training) at `rate` images/s and `batch`: budget_share of the planned training would not
    cover the search's first two measurements (each MIN_SECONDS plus four steps). A lower rate
    makes both longer, the training more so (budget_share × planned images > 8 batches): a run
    too short at an understated rate is too short at the true one."""
    plan = bench.planned_images / rate
    search_s = 2 * (MIN_SECONDS + 4 * batch / rate)
    share = bench.budget_share * plan
    return share < search_s, plan, search_s, share


def forget(result: TuneResult) -> None:
    """Drop a cached choice (one that a run found far slower than tune timed it): the next tune measures again."""
    cache = hardware.read_cache("tune.json")
    if cache.pop(result.key, None) is not None:
        hardware.write_cache("tune.json", cache)


def _reusable(entry: dict, planned_images, budget_share: float, max_seconds) -> bool:
    """A choice measured on a quiet machine is, if its search was complete; one a budget cut
    short is, for a tune whose own budget (estimated at the cached search's fastest rate) is at
    most 25% larger. A choice measured while other processes held cores never is."""
    if entry.get("busy"):
        return False
    if "budget_s" not in entry:
        return True
    bounds = [max_seconds] if max_seconds else []
    if planned_images and budget_share:
        rate = entry.get("plan_rate") or entry["ref_rate"]  # ref_rate: entries from before plan_rate
        bounds.append(entry["first_s"] + budget_share * planned_images / rate)
    return bool(bounds) and min(bounds) <= 1.25 * entry["budget_s"]

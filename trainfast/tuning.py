"""`trainfast tune`: time the candidate speed settings on this machine, keep the fastest
sound one, and cache the choice.

The search is pruned, not exhaustive. (0) On CUDA, fp32 at doubling batches until the time
per image stops falling (FILL_GAIN): the batch that fills the device, where the next steps
are judged; below it every setting is launch-bound and they all look alike. (1) precision
(fp32, bf16; on CUDA also tf32 and fp16) in channels_last at the starting batch; (2) the
exact rewrite passes (trainfast.models.rewrite) on the winner, all together, then each
precision in the plain layout (the likely winners first, for a tight budget);
(3) batch sizes, powers of two, with the winner so far, until memory runs out or two
doublings in a row are slower, then the rewrites once more at the new batch if they lost at
the first; (4) CPU threads, if torch uses fewer than the physical cores; (5) a final:
the three fastest so far and the winner's neighbours (batch ×2 and ÷2, rewrites on/off),
timed round-robin twice more, so that a slow spell of a shared machine falls on all of them;
the best median of its timings wins, so that one lucky timing does not; (6) torch.compile
of the winner (its compile time reported apart; on CUDA with CUDA graphs). A candidate
counts only if its loss on the same first batch, from the same weights, is finite and
within 5% of fp32's. Each timing runs at least `steps` steps and at least `min_seconds` of
them, issued back to back and synchronised once, as training issues them, so that small,
fast steps are not timed over a few milliseconds. On CUDA the trials use cudnn.benchmark and a fused SGD, as fit does.
"""

from __future__ import annotations

import copy
import hashlib
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from trainfast import hardware, units
from trainfast import step as _step
from trainfast.config import Speed
from trainfast.diagnose.timing import step_breakdown, synthetic_batches, throughput
from trainfast.errors import TrainfastError
from trainfast.models import rewrite

LOSS_TOLERANCE = 0.05  # relative to the fp32 loss on the same batch
LOSS_BATCH = 8  # the images of that batch: the same for every candidate, whatever its batch size
STANDALONE_S = 60.0  # a tune with no budget given (not fit's): its default bound, in seconds
FINAL_ROUNDS = 2  # extra round-robin timings of each finalist
MIN_SECONDS = 0.8  # the least time one timing spans
MAX_STEPS = 60
COMPILE_GUESS_S = 8.0  # a torch.compile before one is timed: 7.6 s for plate_net, 12 s for cifar_cnn on 2 cores
MAX_BATCH = {"cpu": 512, "cuda": 8192}  # the largest batch tried unless the caller bounds it
FILL_GAIN = 1.10  # CUDA: a doubling of the batch that gains less than this has filled the device
START_STEP_S = 0.5  # CPU: the first batch tried is sized so that one step takes about this long
START_PROBE = 4  # ... timed at this batch (smaller batches overstate the cost per image 2-3x)
_DEFAULT_THREADS = torch.get_num_threads()  # restored after a trial that pins threads
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

    def to_dict(self) -> dict:
        return {"speed": asdict(self.speed), "label": self.speed.label(), "images_per_s": self.images_per_s,
                "loss": self.loss, "compile_s": self.compile_s, "note": self.note}


@dataclass
class TuneResult:
    best: Speed
    rows: list[Trial] = field(default_factory=list)
    cached: bool = False
    seconds: float = 0.0
    not_timed: list[str] = field(default_factory=list)  # settings the time budget left out
    budget_s: float | None = None

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
                          "median of " + ", ".join(units.rate(t.images_per_s) for t in ts)) for ts in timed.values()]
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
        untimed = [lbl for lbl in dict.fromkeys(self.not_timed) if lbl not in timed]
        if untimed:
            lines.append(f"not timed, the tune's budget of {self.budget_s:.1f} s spent: " + ", ".join(untimed))
        lines.append(f"chosen: {self.best.label()}" + (" (cached; --retune to measure again)" if self.cached else
                                                        f" ({self.seconds:.0f} s)"))
        return "\n".join(lines)


def _key(model: torch.nn.Module, shape, device: torch.device, pinned_batch, compile_: bool) -> str:
    structure = hardware.model_key(model)
    h = hashlib.sha1(f"{structure}|{tuple(shape)}|{hardware.machine_key(device)}|{pinned_batch}|{compile_}".encode())
    return h.hexdigest()


def _median(trials: list[Trial]) -> float:
    return statistics.median(t.images_per_s for t in trials)


def measure_trial(model, shape, out_shape, speed: Speed, device, steps: int = 5, warmup: int = 2,
                  min_seconds: float = MIN_SECONDS) -> Trial:
    """Time training steps at `speed` on in-memory batches, after `warmup` of them: `steps`
    steps, or more where those would span less than `min_seconds` (at most MAX_STEPS), issued
    back to back as training issues them (timing.throughput). Also the first batch's loss,
    from the model's own weights."""
    net = copy.deepcopy(model)
    data = synthetic_batches(shape, out_shape, speed.batch_size, device, n=2)
    compile_s = 0.0
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
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, fused=device.type == "cuda" or None)
        probe = step_breakdown(net, data, device=device, speed=speed, steps=1, warmup=warmup, optimizer=opt)
        n = max(steps, min(MAX_STEPS, math.ceil(min_seconds / max(probe.step, 1e-9))))
        rate = throughput(net, data, device=device, speed=speed, steps=n, warmup=1, optimizer=opt)
    except torch.cuda.OutOfMemoryError:
        return Trial(speed, None, note="out of memory")
    except Exception as e:  # noqa: BLE001 - a candidate that fails is skipped, with the reason
        return Trial(speed, None, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
    finally:
        if speed.threads and device.type == "cpu":
            torch.set_num_threads(_DEFAULT_THREADS)
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


def _neighbours(speed: Speed, *, pinned_batch, max_batch: int, try_rewrites: bool) -> list[Speed]:
    """The settings one step away from `speed` in the choices the search prunes most."""
    near = []
    if pinned_batch is None:
        near += [replace(speed, batch_size=b) for b in (speed.batch_size * 2, speed.batch_size // 2)
                 if 8 <= b <= max_batch]
    if try_rewrites:
        near.append(replace(speed, rewrites=() if speed.rewrites else rewrite.ALL))
    return near


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


def start_batch_for(model: torch.nn.Module, input_shape, device: torch.device, max_batch: int) -> int:
    """The first batch to try: 64, or on the CPU less where a training step at 64 would take
    more than START_STEP_S (the 512² story's CNN: 13 s per step at 64 on 2 cores; a tune of
    several steps per candidate outlasted a one-epoch run). The cost per image is timed: one
    fp32 training step of a copy at batch START_PROBE, the faster of two after a warm-up (a
    step that alone exceeds START_STEP_S ends it). Counting FLOPs instead took 3 s of a first
    cifar_resnet tune's 4.8 s: the FLOP counter's import and the machine's peak measurement."""
    b = min(64, max_batch)
    if device.type != "cpu" or b <= START_PROBE:
        return b
    try:
        net = copy.deepcopy(model).eval()  # no dropout: the global random state stays as it was
        x = torch.randn(START_PROBE, *input_shape, generator=torch.Generator().manual_seed(0))
        times = []
        for _ in range(3):
            t = time.perf_counter()
            _step.logits_of(net(x)).float().square().mean().backward()
            times.append(time.perf_counter() - t)
            if times[-1] > START_STEP_S:
                break
        per_image = min(times[1:] or times) / START_PROBE
    except Exception:  # noqa: BLE001 - a model that will not run on random input here: the usual start
        return b
    while b > START_PROBE and b * per_image > START_STEP_S:
        b //= 2
    return b


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


def tune(model: torch.nn.Module, input_shape, *, device=None, batch_size: int | None = None,
         max_batch: int | None = None, images: int | None = None, planned_images: int | None = None,
         budget_share: float = 0.0, max_seconds: float | None = None, try_compile: bool = True,
         try_rewrites: bool = True, retune: bool = False, measure: Callable[..., Trial] | None = None,
         log=print) -> TuneResult:
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
        measure: replaces measure_trial (tests inject a fake clock here).
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
    first = _step.first_forward(model, torch.zeros(2, *input_shape), f"inputs of shape {input_shape}")  # lazy too
    if try_rewrites and not any(rewrite.apply(copy.deepcopy(model), rewrite.ALL).values()):
        try_rewrites = False  # nothing here they apply to: a timing "with rewrites" would time the same model
    started = _clock()
    key = _key(model, input_shape, dev, batch_size, (try_compile, try_rewrites, max_batch))
    cache = hardware.read_cache("tune.json")
    if not retune and key in cache and _reusable(cache[key], planned_images, budget_share, max_seconds):
        c = cache[key]
        rows = [Trial(Speed(**r["speed"]), r["images_per_s"], r["loss"], r["compile_s"], r["note"]) for r in c["rows"]]
        return TuneResult(Speed(**c["best"]), rows, cached=True, not_timed=c.get("not_timed", []),
                          budget_s=c.get("budget_s"))

    measure = measure or measure_trial
    out_shape = getattr(model, "output_shape", None) or tuple(first.shape[1:])
    rows: list[Trial] = []
    not_timed: list[str] = []
    plan: dict = {}  # once the first setting is timed: its time, and the fastest rate timed so far

    def budget() -> float | None:
        """The tune's bound, from its start: max_seconds, and/or after the first measurement
        budget_share of the planned training at the fastest rate timed so far: the run the
        tune serves trains at the rate it finds, so a faster find tightens the bound."""
        bounds = [max_seconds] if max_seconds else []
        if plan and planned_images and budget_share:
            bounds.append(plan["first"] + budget_share * planned_images / plan["rate"])
        return min(bounds) if bounds else None

    took: list[tuple[float, Speed]] = []  # each measurement's seconds; the first also pays one-time set-up

    def expected_s(speed: Speed) -> float:
        """How long measuring `speed` will take: the last measurement's time (not the first's),
        longer in proportion to a larger batch, plus a compile where none was timed yet."""
        seconds, last = took[-1]
        compiling = speed.compile and not any(s.compile for _, s in took)
        return seconds * max(1.0, speed.batch_size / last.batch_size) + (COMPILE_GUESS_S if compiling else 0.0)

    def run(speed: Speed) -> Trial:
        timed_one = any(r.images_per_s for r in rows)  # the first setting is always timed: the reference
        if timed_one and budget() is not None:
            left = budget() - (_clock() - started)
            # One that would end past the bound is not begun; the second always is: the likely winner.
            if left <= 0 or (len(took) >= 2 and left < expected_s(speed)):
                not_timed.append(speed.label())
                return Trial(speed, None, note="not timed: the tune's budget is spent")
        reason = _step.check(speed, dev)
        if reason:
            trial = Trial(speed, None, note=f"skipped: {reason}")
        else:
            t = _clock()
            trial = measure(model, input_shape, out_shape, speed, dev)
            took.append((_clock() - t, speed))
        rows.append(trial)
        if plan and trial.images_per_s:
            plan["rate"] = max(plan["rate"], trial.images_per_s)
        shown = f"{units.rate(trial.images_per_s)} images/s" if trial.images_per_s else trial.note
        log(f"  {speed.label():53s} {shown}")
        return trial

    cuda = dev.type == "cuda"
    log(f"tuning on {dev}: {'the batch that fills the GPU, then ' if cuda and not batch_size else ''}"
        f"precision × memory format{', rewrites' if try_rewrites else ''}, then batch size (up to {max_batch}), "
        f"threads{', compile' if try_compile else ''}")
    start_batch = batch_size or start_batch_for(model, input_shape, dev, max_batch)
    if cuda and not batch_size:
        ref = _fill(run, start_batch, max_batch)
        start_batch = ref.speed.batch_size
    else:
        ref = run(Speed("fp32", False, batch_size=start_batch))
    if ref.images_per_s is None:
        raise TrainfastError(f"the model does not train at all on {dev}: {ref.note}")
    first = _clock() - started
    plan.update(first=first, rate=ref.images_per_s)
    if planned_images and budget_share:
        log(f"  (tune budget: at most {budget():.1f} s in all: after this first measurement ({first:.1f} s), "
            f"{budget_share:.0%} of the planned training, ~{planned_images / ref.images_per_s:.0f} s at this rate; "
            "less as faster settings are found)")
    elif max_seconds:
        log(f"  (tune budget: {max_seconds:.1f} s)")
    # The likely winners first: each precision in channels_last (the layout convolutions run
    # fastest in, on CPUs and GPUs alike), reduced precision first, then the rewrites on the
    # best of those, then the other layout: under a tight budget the likely winners are the
    # ones timed. A precision this device does not run fast is skipped without timing.
    precisions = ["bf16", "fp16", "tf32", "fp32"] if cuda else ["bf16", "fp32"]
    for p in precisions:
        run(Speed(p, True, batch_size=start_batch))

    def sound(t: Trial) -> bool:
        if t.images_per_s is None or t.loss is None or not torch.isfinite(torch.tensor(t.loss)):
            return False
        ok = abs(t.loss - ref.loss) <= LOSS_TOLERANCE * max(1.0, abs(ref.loss))
        if not ok and not t.note:
            t.note = f"rejected: first-batch loss {t.loss:.4f} vs fp32 {ref.loss:.4f}"
        return ok

    best = max((t for t in rows if sound(t)), key=lambda t: t.images_per_s)
    if try_rewrites:
        t = run(replace(best.speed, rewrites=rewrite.ALL))
        if sound(t) and t.images_per_s > best.images_per_s * 1.03:
            best = t
    for p in precisions[:-1]:  # the plain layout (fp32's is the reference, timed first)
        t = run(Speed(p, False, batch_size=start_batch))
        if sound(t) and t.images_per_s > best.images_per_s * 1.03:
            best = t
    if batch_size is None:
        b, slower = start_batch, 0
        while b * 2 <= max_batch:
            b *= 2
            t = run(replace(best.speed, batch_size=b))
            if not sound(t):
                break  # out of memory, or the loss went wrong: larger will not do better
            if t.images_per_s > best.images_per_s * 1.03:
                best, slower = t, 0
            elif t.images_per_s < best.images_per_s * 0.97:
                slower += 1
                if slower == 2:
                    break  # two doublings in a row slower: past the peak, not one noisy timing
        b = start_batch // 2
        if best.speed.batch_size == start_batch and b >= 8:
            t = run(replace(best.speed, batch_size=b))
            if sound(t) and t.images_per_s > best.images_per_s * 1.03:
                best = t
    if try_rewrites and not best.speed.rewrites and best.speed.batch_size != start_batch:
        # Rewrites save memory-bound passes over activations; at a larger batch they can pay
        # where they did not at the first one (plate CNN: +5% at 128, +0% at 64 on 2 cores).
        t = run(replace(best.speed, rewrites=rewrite.ALL))
        if sound(t) and t.images_per_s > best.images_per_s * 1.03:
            best = t
    cores = hardware.physical_cores()
    if dev.type == "cpu" and _DEFAULT_THREADS != cores:
        t = run(replace(best.speed, threads=cores))
        if sound(t) and t.images_per_s > best.images_per_s * 1.03:
            best = t
    leaders: dict[str, Speed] = {}
    for t in sorted((t for t in rows if sound(t)), key=lambda t: -t.images_per_s):
        leaders.setdefault(t.speed.label(), t.speed)
    known_bad = {t.speed.label() for t in rows if not sound(t)}
    near = [s for s in _neighbours(best.speed, pinned_batch=batch_size, max_batch=max_batch, try_rewrites=try_rewrites)
            if s.label() not in known_bad]
    best = _final(rows, list(leaders.values())[:3] + near, sound, run) or best
    if try_compile:
        t = run(replace(best.speed, compile=True))
        if sound(t) and t.images_per_s > best.images_per_s * 1.03:
            best = t
    not_timed = list(dict.fromkeys(not_timed))  # a setting the budget skipped in several phases, once
    result = TuneResult(best.speed, rows, seconds=_clock() - started, not_timed=not_timed, budget_s=budget())
    cache[key] = {"best": asdict(best.speed), "rows": [r.to_dict() for r in rows]}
    if not_timed:
        log(f"  the tune's budget ({budget():.1f} s) left {len(set(not_timed))} settings untimed; cached with that "
            "budget (a tune with a larger one measures again)")
        cache[key].update(budget_s=budget(), first_s=first, plan_rate=plan["rate"], not_timed=not_timed)
    hardware.write_cache("tune.json", cache)
    return result


def _reusable(entry: dict, planned_images, budget_share: float, max_seconds) -> bool:
    """A complete cached search always is; one a budget cut short is, for a tune whose own
    budget (estimated at the cached search's fastest rate) is at most 25% larger."""
    if "budget_s" not in entry:
        return True
    bounds = [max_seconds] if max_seconds else []
    if planned_images and budget_share:
        rate = entry.get("plan_rate") or entry["ref_rate"]  # ref_rate: entries from before plan_rate
        bounds.append(entry["first_s"] + budget_share * planned_images / rate)
    return bool(bounds) and min(bounds) <= 1.25 * entry["budget_s"]

"""`trainfast.tune`: the entry point that puts the pieces together (measure, budget, search,
result), and the cache of its choices with the load they were measured under."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import asdict
from typing import Callable

import torch

from trainfast import hardware
from trainfast import step as _step
from trainfast.config import Speed, check_optimizer
from trainfast.errors import TrainfastError
from trainfast.models import rewrite
from trainfast.tuning import budget
from trainfast.tuning.budget import Bench
from trainfast.tuning.measure import QUICK_STEPS, measure_trial, warm_forward_s
from trainfast.tuning.together import measure_together
from trainfast.tuning.result import Trial, TuneResult, data_max_batch
from trainfast.tuning.search import MAX_BATCH, CpuSearch, CudaSearch

STANDALONE_S = 60.0  # a tune with no budget given (not fit's): its default bound, in seconds


def _key(model: torch.nn.Module, shape, device: torch.device, pinned_batch, compile_: bool) -> str:
    structure = hardware.model_key(model)
    h = hashlib.sha1(f"{structure}|{tuple(shape)}|{hardware.machine_key(device)}|{pinned_batch}|{compile_}".encode())
    return h.hexdigest()


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
         try_rewrites: bool = True, try_threads: bool = True, optimizer: str = "adamw", retune: bool = False,
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
        try_threads: on a CPU, time another thread count (fit leaves it out where the run times
            its threads on its own steps, adapt.Threads).
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
    hold cores, the search also times half the threads (a thread sharing its core with a program
    at equal priority holds up the rest; one at low priority yields its core, so the load alone
    cannot say), says so, and its choice is not cached as this machine's: the next tune
    measures again.
    """
    try:
        dev = hardware.resolve_device(device)
    except ValueError as e:
        raise TrainfastError(str(e)) from None
    if not isinstance(model, torch.nn.Module):
        raise TrainfastError(f"tune takes an nn.Module, not a {type(model).__name__}")
    input_shape, pack_images = _input_of(input_shape)
    max_batch, max_seconds = _bounds(dev, images or pack_images, max_batch, max_seconds, planned_images)
    check_optimizer(optimizer)  # the arguments before any forward
    first = _step.first_forward(model, torch.zeros(2, *input_shape), f"inputs of shape {input_shape}")  # lazy too
    forward_s = warm_forward_s(model, input_shape) if dev.type == "cpu" else None
    if try_rewrites and not rewrite.applies(model):
        try_rewrites = False  # nothing here they apply to: a timing "with rewrites" would time the same model
    key = _key(model, input_shape, dev, batch_size, (try_compile, try_rewrites, max_batch, optimizer, try_threads))
    kept = None if retune else hardware.cached_entry(
        "tune.json", key, lambda e: _cached(e, key, dev, max_batch, planned_images, budget_share, max_seconds),
        "choice", log)
    if kept is not None:
        return kept

    bench, probe = _bench(model, input_shape, tuple(first.shape[1:]), dev, measure, probe, optimizer, forward_s,
                          max_seconds, planned_images, budget_share, compare_in_run, log)
    threads = torch.get_num_threads()
    other = (other_cores if other_cores is not None else hardware.other_cores_now()) if dev.type == "cpu" else None
    cuda = dev.type == "cuda"
    if hardware.is_busy(other) and threads >= 2 and try_threads:  # timed, not assumed: a low-priority program yields
        log(f"  other processes keep {other:.1f} of {hardware.usable_cores()} cores busy: {threads // 2} "
            f"thread{'s' * (threads // 2 != 1)} will be timed beside {threads}")
    if hardware.is_busy(other):  # a compile's workers share the cores too (a bounded tune ran 71 s against 60)
        cores = hardware.usable_cores()
        bench.slowdown = cores / max(cores - other, 1.0)
    search = (CudaSearch if cuda else CpuSearch)(bench, batch_size=batch_size, max_batch=max_batch,
                                                     try_rewrites=try_rewrites, try_compile=try_compile, try_threads=try_threads, other=other)
    try:
        short = budget.short_run(probe, bench, search, compare_in_run) if probe and planned_images and budget_share \
            else None
        if short:
            rows, trial, why, candidate = short  # no progress lines: the result's table, said next, has them
            loads = [r.other_cores for r in rows if r.other_cores is not None]
            return TuneResult(trial.speed, rows, seconds=budget.clock() - bench.started, key=key, short=why,
                              other_cores=max(loads) if loads else None, candidate=candidate)
        log(f"tuning on {dev}: {'the batch that fills the GPU, then ' if cuda and not batch_size else ''}"
            f"precision × memory format{', rewrites' if try_rewrites else ''}, then batch size (up to {max_batch}), "
            f"{'' if cuda else 'threads, '}a round-robin final{', compile' if try_compile else ''}")
        bench.started = budget.clock()  # the quick timing is not the search's: its budget counts from here
        with hardware.OtherLoad() as load:
            best = search.run()
    finally:
        torch.set_num_threads(threads)
    not_timed = list(dict.fromkeys(bench.not_timed))  # a setting the budget skipped in several phases, once
    # A GPU's speed does not hang on other processes' CPU time as a CPU's does: its choice stands (the rows keep the load)
    result = TuneResult(best.speed, bench.rows, seconds=budget.clock() - bench.started, not_timed=not_timed,
                        budget_s=bench.budget(), other_cores=None if cuda else load.cores, key=key)
    _store(key, result, bench, log)
    return result


def _bounds(dev, images: int | None, max_batch: int | None, max_seconds: float | None,
            planned_images: int | None) -> tuple[int, float | None]:
    """The largest batch tried (bounded by the data's images as fit bounds it, unless the caller
    did) and the tune's own time bound (STANDALONE_S where not fit's tune)."""
    largest = MAX_BATCH.get(dev.type, MAX_BATCH["cpu"])
    if images is not None:
        max_batch = max_batch or min(largest, data_max_batch(images))
    if max_seconds is None and planned_images is None:  # not fit's tune (fit plans its images; tune_share 0: no bound)
        max_seconds = STANDALONE_S
    return max_batch or largest, max_seconds


def _bench(model, input_shape, first_out, dev, measure, probe, optimizer: str, forward_s, max_seconds,
           planned_images, budget_share: float, compare_in_run: bool, log):
    """The search's bench (its timings, budget and rows), and the quick timing fit's tune
    judges a short run with (None where a test's `measure` stands in and gives none)."""
    out_shape = getattr(model, "output_shape", None) or first_out
    own_timing = measure is None
    measure = measure or functools.partial(measure_trial, optimizer=optimizer)
    # NOTE: settings are timed together, in turns, on a CPU only: there one timing swings 10-30%; a
    # GPU's steps are steadier, and a turn's synchronisation would cost a launch-bound step its overlap.
    # (A test's `measure` may carry its own `together`.)
    together = (functools.partial(measure_together, optimizer=optimizer) if own_timing and dev.type == "cpu"
                else getattr(measure, "together", None))
    bench = Bench(model, input_shape, out_shape, dev, measure, log, max_seconds=max_seconds,
                  planned_images=planned_images, budget_share=budget_share, forward_s=forward_s, together=together)
    if probe is None and own_timing:
        # Where the run compares on its own first steps, a first step slow enough to call the run too
        # short to search settles it: the rest of the quick timing could only find it shorter still.
        settled = (lambda rate, batch: budget.too_short(bench, rate, batch)[0]) if compare_in_run else None
        probe = functools.partial(measure_trial, optimizer=optimizer, steps=QUICK_STEPS, warmup=1, min_seconds=0.0,
                                  settled=settled)
    return bench, probe


def _store(key: str, result: TuneResult, bench, log):
    """The search's choice and rows into tune.json; a search its budget cut short keeps that
    budget with it (a tune with a larger one measures again)."""
    entry = {"best": asdict(result.best), "rows": [r.to_dict() for r in bench.rows],
             "other_cores": result.other_cores, "busy": result.busy}
    if result.not_timed:
        log(f"  the tune's budget ({bench.budget():.1f} s) left {len(result.not_timed)} settings untimed; cached "
            "with that budget (a tune with a larger one measures again)")
        entry.update(budget_s=bench.budget(), first_s=bench.plan["first"], plan_rate=bench.plan["rate"],
                     not_timed=result.not_timed)
    cache = hardware.read_cache("tune.json")  # as it is now: another process may have added to it meanwhile
    cache[key] = entry
    hardware.write_cache("tune.json", cache)


def forget(result: TuneResult) -> None:
    """Drop a cached choice (one that a run found far slower than tune timed it): the next tune measures again."""
    cache = hardware.read_cache("tune.json")
    if cache.pop(result.key, None) is not None:
        hardware.write_cache("tune.json", cache)


def _cached(entry, key: str, dev, max_batch: int, planned_images, budget_share: float,
            max_seconds) -> TuneResult | None:
    """The cached choice for `key` where it is reusable (_reusable); it must be valid: a setting
    this device runs, a batch within `max_batch`, timed rows (else an exception that
    hardware.cached_entry says, naming the file)."""
    if not _reusable(entry, planned_images, budget_share, max_seconds):
        return None
    best = Speed(**entry["best"])
    reason = _step.check(best, dev) or (f"batch {best.batch_size} is over the {max_batch} allowed here"
                                        if best.batch_size > max_batch else None)
    if reason:
        raise ValueError(reason)
    rows = [Trial.from_dict(r) for r in entry["rows"]]
    return TuneResult(best, rows, cached=True, not_timed=list(entry.get("not_timed", [])),
                      budget_s=entry.get("budget_s"), key=key)


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

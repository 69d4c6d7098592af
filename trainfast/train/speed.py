"""The run's speed settings: tune's measured choice within what the data allows, a race of the
batches tune found fastest, torch.compile only where it pays, and a resumed run's settings on
another device or number of processes."""

from __future__ import annotations

import statistics
from dataclasses import replace

import numpy as np
import torch

from trainfast import step as _step
from trainfast import tuning
from trainfast.config import Augment, Speed, TrainConfig, default_lr, scale_lr
from trainfast.data.format import Pack
from trainfast.data.loader import Loader
from trainfast.errors import TrainfastError
from trainfast.train import race
from trainfast.train.optim import optimizer_for
from trainfast.train.rundir import pack_record


def timed_rate(rows: list[dict], label: str) -> float | None:
    """The median images/s tune timed for the setting `label` (a setting timed several times
    counts at its median, as tune's table shows it); None if it was not timed."""
    rates = [r["images_per_s"] for r in rows if r["label"] == label and r["images_per_s"]]
    return statistics.median(rates) if rates else None


def pays(best: Speed, rows: list, planned_images: int, say) -> Speed:
    """`best` if it is not compiled, or if its compile time is won back over the planned
    images; else the same settings uncompiled."""
    if not best.compile:
        return best
    plain = replace(best, compile=False)
    fast, slow = timed_rate(rows, best.label()), timed_rate(rows, plain.label())
    if fast is None or slow is None:
        return best
    compile_s = max(r["compile_s"] for r in rows if r["label"] == best.label())
    saved = planned_images / slow - planned_images / fast
    if saved > compile_s:
        return best
    say(f"torch.compile left out: it would save {saved:.1f} s over this run's {planned_images:,} images "
        f"and takes {compile_s:.1f} s to compile")
    return plain


def tuned_speed(net, pk: Pack, dev, pin: dict, progress_log, say, *, images: int, epochs: int,
           world_size: int = 1, budget_share: float = 0.0, optimizer: str = "adamw",
           other_cores: float | None = None, compare_in_run: bool = False,
           try_threads: bool = True) -> tuple[Speed, list[dict], list, object]:
    """The fastest settings tune measures for `net` on `pk`'s images, keeping what the user
    pinned: the batch bounded by the data (tuning.data_max_batch of this process's share of `images`),
    the tune's time by budget_share of the planned training, a larger batch only where it is
    BATCH_GAIN× faster than a smaller one (more steps per epoch), torch.compile only where it
    pays for itself over `epochs`. Also the settings worth racing to a loss (race.contenders;
    [] where the batch is pinned), and the TuneResult."""
    h, w, c = pk.shape
    per_process = images // world_size
    limit = min(tuning.MAX_BATCH.get(dev.type, tuning.MAX_BATCH["cpu"]), tuning.data_max_batch(per_process))
    result = tuning.tune(net, (c, h, w), device=dev, batch_size=pin.get("batch_size"), max_batch=limit,
                   planned_images=per_process * epochs, budget_share=budget_share,
                   try_compile=pin.get("compile", True), try_rewrites="rewrites" not in pin, optimizer=optimizer,
                   try_threads=try_threads, other_cores=other_cores, compare_in_run=compare_in_run, log=progress_log)
    say(result.table())
    best, front = result.best, []
    if "batch_size" not in pin:
        say(f"batch bound by the data: at most {limit} ({per_process:,} images per process, "
            f"≥ {tuning.MIN_STEPS_PER_EPOCH} steps per epoch)")
        timed = [r.speed.batch_size for r in result.rows if r.images_per_s]
        floor = timed[0] if timed else 1  # never below where tune started
        best, why = tuning.more_steps_unless_faster(result, floor=floor)
        front = [(rate, replace(s, **pin)) for rate, s in race.contenders(tuning.fastest_by_batch(result, floor=floor))]
        if why and not front:
            say(why)
    rows = [r.to_dict() for r in result.rows]
    best = best if "compile" in pin else pays(best, rows, per_process * epochs, say)
    return replace(best, **pin), rows, front, result


def raced_batch(net, pk: Pack, subset, front: list, rule: Speed, cfg: TrainConfig, dev, augment: Augment, user_batch: int,
           planned_images: int, say) -> tuple[Speed, dict]:
    """The batch whose copy of `net` reaches the lowest loss in equal wall time (race.py), among
    the `front` tune found, each at the learning rate the run would give it before the range
    test (the user's, scaled with the batch, or the optimizer's default for the batch); the
    `rule`'s choice (BATCH_GAIN) where the run is too short to afford the laps."""
    seconds = race.lap_seconds(front, planned_images)
    if seconds is None:
        say(f"batch: the rule's {rule.batch_size} (tune timed batch {front[-1][1].batch_size} "
            f"{front[-1][0] / front[0][0]:.2f}× batch {front[0][1].batch_size}'s rate, but this run is too short to "
            f"race them to a loss: {race.RACE_SHARE:.0%} of it would not fit {race.MIN_LAP_STEPS} steps of each)"
            f"{_at_that_batch(rule, front)}")
        return rule, {}
    def lr_for(batch: int) -> float:
        return scale_lr(cfg.optimizer, cfg.lr, user_batch, batch) if cfg.lr else default_lr(cfg.optimizer, batch)
    laps = [race.Lap(replace(s, compile=False), rate, lr_for(s.batch_size)) for rate, s in front]  # compile: rule's
    pool = np.arange(len(pk)) if subset is None else subset  # a seeded sample: packs are often in class order
    probe_idx = np.sort(np.random.default_rng([cfg.seed, 104729]).permutation(pool)[:race.PROBE_IMAGES])
    probe = Loader(pk, min(256, len(probe_idx)), shuffle=False, drop_last=False, device=dev, subset=probe_idx)
    laps, cached = race.race(
        net, laps, lambda b: Loader(pk, b, shuffle=True, seed=cfg.seed, device=dev, augment=augment, subset=subset),
        probe, lambda p, lr: optimizer_for(p, cfg, lr, dev), dev, seconds,
        f"{pack_record(pk)['id']}|{len(probe_idx)}|{None if subset is None else len(subset)}|{augment}|{cfg.seed}|"
        f"{cfg.weight_decay}|{cfg.label_smoothing}", cfg.optimizer,
        cfg.label_smoothing, cfg.seed, say)
    won = race.choose(laps, replace(rule, compile=False))
    say(race.table(laps, won, seconds, len(probe_idx), cached))
    return replace(won, compile=rule.compile), {"lap_s": seconds, "laps": [lap.to_dict() for lap in laps], "cached": cached}


def _at_that_batch(rule: Speed, front: list) -> str:
    """Where the rule's setting is not tune's "chosen:" at a smaller batch: that it is the fastest
    tune timed at this batch, so a change of layout or rewrites is said, not silent."""
    return f"; training with {rule.label()}, the fastest tune timed at batch {rule.batch_size}" \
        if any(s.batch_size > rule.batch_size for _, s in front) else ""


def runnable(speed: Speed, dev: torch.device, say) -> Speed:
    """A resumed run's settings on `dev`: a precision this device cannot run (fp16 saved on a
    GPU, resumed on a CPU) becomes the next one it can, and says so."""
    if _step.check(speed, dev) is None:
        return speed
    for p in ("fp32",) if speed.precision == "tf32" else ("bf16", "fp32"):
        alt = replace(speed, precision=p)
        if _step.check(alt, dev) is None:
            say(f"{speed.precision} cannot run on {dev}: resuming in {p}")
            return alt
    return speed


def elastic(speed: Speed, saved_world: int, world, say) -> Speed:
    """A run saved by N processes resumes with M: the same global batch, split M ways. The k-th
    global batch holds the same images for any number of processes (rank r takes every M-th of
    the epoch's order), and the steps per epoch are the same, so the run goes on at the same
    step with the same data, the interrupted epoch's rest neither repeated nor skipped."""
    if world.size == saved_world:
        return speed
    total = speed.batch_size * saved_world
    if total % world.size:
        fits = ", ".join(str(m) for m in range(1, min(total, 64) + 1) if total % m == 0)
        raise TrainfastError(f"this run trained with {saved_world} process{'es' * (saved_world > 1)} and a global "
                             f"batch of {total}, which {world.size} processes cannot split evenly; resume with a "
                             f"number of processes that divides it ({fits})")
    say(f"resuming a run of {saved_world} process{'es' * (saved_world > 1)} with {world.size}: batch "
        f"{total // world.size} per process keeps the global batch of {total}")
    return replace(speed, batch_size=total // world.size)

"""The optimizer, its peak learning rate (the user's scaled to the batch, or the default checked
by a range test), and the learning-rate schedules."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from trainfast import step as _step
from trainfast.config import Speed, TrainConfig, default_lr, scale_lr
from trainfast.data.format import Pack
from trainfast.data.loader import Loader
from trainfast.train import distributed, lr_range
from trainfast.train.rundir import pack_record


def optimizer_for(params, cfg: TrainConfig, lr: float, device: torch.device):
    return _step.make_optimizer(cfg.optimizer, params, lr, device, cfg.momentum, cfg.weight_decay)


def lr_factor(cfg: TrainConfig, step: int, total: int) -> float:
    """The share of the peak learning rate at `step` of `total` for the constant and cosine
    schedules (cosine: a linear warm-up over cfg.warmup of the steps, then a half cosine to 0)."""
    if cfg.schedule == "constant":
        return 1.0
    warm = max(1, int(cfg.warmup * total))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


def scheduler_for(opt, cfg: TrainConfig, total: int, lr: float):
    """The schedule of a run of `total` optimizer steps at peak rate `lr`."""
    if cfg.schedule == "onecycle":
        # NOTE: one step more than the run takes: the scheduler also steps after the last update,
        # and at total_steps OneCycleLR extrapolates its last line below zero (a negative rate
        # logged for the last epoch). Each of its two phases must span a step or more: a rise
        # over warmup × steps that rounds to one step ended a 4-step run in ZeroDivisionError
        # (0.2 × 5 = 1), so a short run rises over two steps at least, and falls over one.
        steps = max(total + 1, 3)
        rise = min(max(cfg.warmup, 2 / steps), 1 - 1 / steps)
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=rise,
                                                   anneal_strategy="linear", div_factor=10, final_div_factor=100)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(cfg, step, total))


def tail_scheduler(opt, lrs: list[float], steps: int):
    """The learning rate of a shortened run (TrainConfig.minutes): from `lrs`, where the run
    stands, linearly down to a thousandth of them over the `steps` left, whatever the schedule
    was: a run cut short still ends annealed rather than at its peak."""
    for g, lr in zip(opt.param_groups, lrs):
        g["initial_lr"] = lr
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 - 0.999 * min(1.0, k / max(1, steps)))


def learning_rate(net, loader: Loader, cfg: TrainConfig, speed: Speed, dev, world, train_pk: Pack, saved, user_batch,
                   say) -> float:
    """The run's peak learning rate: the saved one on resume; the user's, scaled from their batch
    to the tuned one (scale_lr); else the optimizer's default for the batch (default_lr),
    checked by a range test on this data (10% of the planned steps, 20 to 100), which lowers it
    where a tenth of the rate at the test's lowest loss is lower (RangeTest.peak)."""
    if saved is not None and saved.get("lr"):
        return float(saved["lr"])
    if cfg.lr:
        lr = scale_lr(cfg.optimizer, cfg.lr, user_batch, speed.batch_size)
        if speed.batch_size != user_batch:
            say(f"batch size {user_batch} → {speed.batch_size} (tuned): learning rate scaled {cfg.lr:g} → {lr:g}")
        return lr
    default = default_lr(cfg.optimizer, speed.batch_size * world.size)
    if not cfg.lr_test:
        return default
    steps = min(lr_range.STEPS, max(20, int(cfg.tune_share * cfg.epochs * len(loader))))
    found = None
    if world.is_main:  # on the global batch, as one process would: torchrun and one process agree
        probe = loader if world.size == 1 else Loader(
            train_pk, speed.batch_size * world.size, seed=cfg.seed, device=dev, augment=loader.augment,
            subset=loader.subset)
        found = lr_range.cached_range_test(
            net, lambda i: probe.batch(i % len(probe), epoch=0), lambda p, lr: optimizer_for(p, cfg, lr, dev),
            replace(speed, batch_size=probe.batch_size), dev, f"{pack_record(train_pk)['id']}|{probe.samples}",
            cfg.optimizer, steps, cfg.label_smoothing, say)
        say(found.sentence(default, cfg.optimizer))
    # every process takes rank 0's answer
    return distributed.sum_all([found.peak(default) if world.is_main else 0.0], world)[0]

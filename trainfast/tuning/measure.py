"""Timing one candidate: a few training steps of a copy of the model at a setting, its loss on
a fixed first batch (loss_matches: the soundness check every setting passes), and the first
batch a CPU search starts at."""

from __future__ import annotations

import copy
import math
import time
from typing import Callable

import torch

from trainfast import step as _step
from trainfast.config import Speed
from trainfast.diagnose.timing import step_breakdown, synthetic_batches, throughput
from trainfast.errors import in_words
from trainfast.tuning.result import Trial


QUICK_STEPS = 1  # the least timed steps of fit's quick timing (after one warm-up): is its run long enough to search?
QUICK_SPAN_S = 0.1  # ... and as many more as the warm-up step's time says span this (1 for ResNet-18, 4 for SqueezeNet)
LOSS_TOLERANCE = 0.05  # relative to the fp32 loss on the same batch
LOSS_BATCH = 8  # the images of that batch: the same for every candidate, whatever its batch size


MIN_SECONDS = 0.8  # the least time one timing spans


MAX_STEPS = 60


START_STEP_S = 0.5  # CPU: the first batch tried is sized so that one step takes about this long
START_PROBE = 4  # ... timed at this batch (smaller batches overstate the cost per image 2-3x)


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
    data = synthetic_batches(shape, out_shape, speed.batch_size, device, n=2)
    compile_s, threads = 0.0, torch.get_num_threads()
    try:
        net, loss = prepared(model, shape, out_shape, speed, device)
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
                return Trial(speed, warm, loss, note="a first step")
            per_step = len(data[0][0]) / warm
            n = min(MAX_STEPS, max(steps, math.ceil(QUICK_SPAN_S / max(per_step, 1e-9))))
            rate = throughput(net, data, device=device, speed=speed, steps=n, warmup=0, optimizer=opt)
    except torch.cuda.OutOfMemoryError:
        return Trial(speed, None, note="out of memory")
    except Exception as e:  # noqa: BLE001 - a candidate that fails is skipped, with the reason
        return Trial(speed, None, note=f"failed: {in_words(e, 80)}")
    finally:
        torch.set_num_threads(threads)  # a trial that pins threads leaves them as it found them
    return Trial(speed, rate, loss, compile_s)


def prepared(model, shape, out_shape, speed: Speed, device) -> tuple[torch.nn.Module, float]:
    """A copy of `model` prepared at `speed` (rewrites, layout, device; in training mode), and
    its loss on the soundness check's batch: the same images and labels for every setting and
    batch size, from the model's own weights, without dropout."""
    net = _step.prepare(copy.deepcopy(model), speed, device)
    x, y = _step.to_device(*synthetic_batches(shape, out_shape, LOSS_BATCH, device, n=1)[0], speed, device)
    with torch.no_grad():
        loss, _ = _step.forward_loss(net.eval(), x, y, speed, device)
    return net.train(), float(loss)


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


def warm_forward_s(model: torch.nn.Module, input_shape) -> float:
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


def loss_matches(loss: float | None, ref: float | None) -> bool:
    """A setting's first-batch loss is finite and fp32's on the same batch, within LOSS_TOLERANCE."""
    return loss is not None and ref is not None and math.isfinite(loss) and \
        abs(loss - ref) <= LOSS_TOLERANCE * max(1.0, abs(ref))

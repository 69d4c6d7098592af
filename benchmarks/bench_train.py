"""Training-step throughput of the users' three CNNs: PyTorch eager fp32 defaults (what a
plain loop gets) vs the settings `trainfast tune` picks, with the share of the measured
peak each reaches (MFU = training FLOPs per second ÷ peak matmul FLOP/s at that precision).

The eager fp32 step is timed twice: with PyTorch's defaults, in a child process that keeps
glibc's malloc as it is (what a user's script gets), and in this process, after trainfast's
malloc setting (trainfast.step.keep_freed_memory), which is part of what trainfast changes
but not a setting tune searches. "ceiling" is the most any setting could gain over the
second: the tuned precision's peak ÷ the eager step's FLOP/s, i.e. the ratio of a step at
100% of that peak.

    python benchmarks/bench_train.py [--models cifar_cnn plate_cnn classifier512] [--runs 3]
    python benchmarks/bench_train.py --sweep --models cifar_cnn plate_cnn

--sweep also times every combination of precision × memory format × rewrites × batch size
(powers of two from 32 to the cap; no torch.compile) and checks tune's pruned choice against
the best of the exhaustive sweep: the sweep's --top fastest are timed again --runs times
beside tune's choice, round-robin, so that neither the winner of many noisy single runs nor
a setting timed during a quiet spell is favoured.

Each figure is the median of --runs timings of --steps steps after warm-up, on in-memory
batches (the input side is benchmarked in bench_loader.py). Also: the epoch time for
50,000 CIFAR-sized images from a raw pack with the tuned settings.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import trainfast
from trainfast import hardware, models
from trainfast.config import Speed
from trainfast.diagnose.cost import layer_costs
from trainfast.models import rewrite
from trainfast.tuning import measure_trial, tune

USER_BATCH = {"cifar_cnn": 256, "plate_cnn": 128, "classifier512": 5}
MAX_BATCH = {"cifar_cnn": 512, "plate_cnn": 512, "classifier512": 32}


def rate(net, shape, out, speed, dev, runs, steps):
    return statistics.median(measure_trial(net, shape, out, speed, dev, steps=steps, warmup=2).images_per_s
                             for _ in range(runs))


def plain_rate(name: str, runs: int, steps: int) -> float:
    """Eager fp32 at the users' batch in a fresh process with glibc's malloc left as it is."""
    env = {**os.environ, "TRAINFAST_KEEP_MEMORY": "0"}
    out = subprocess.run([sys.executable, __file__, "--plain", name, "--runs", str(runs), "--steps", str(steps)],
                         env=env, capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def sweep(name: str, chosen: Speed, dev, runs: int, steps: int, top_n: int = 3) -> None:
    """tune's choice vs the best of every combination it prunes away."""
    net = models.create(name)
    shape, out = net.input_shape, net.output_shape
    batches = [b for b in (32, 64, 128, 256, 512) if b <= MAX_BATCH[name]]
    grid = [Speed(p, cl, batch_size=b, rewrites=rw) for p in ("fp32", "bf16") for cl in (False, True)
            for rw in ((), rewrite.ALL) for b in batches]
    t = time.perf_counter()
    once = sorted(((measure_trial(net, shape, out, s, dev, steps=steps, warmup=2).images_per_s or 0.0, s)
                   for s in grid), key=lambda r: -r[0])
    top = [s for _, s in once[:top_n]]
    # Timed again round-robin (one timing of each, `runs` times over), so that a slow spell of
    # the shared machine falls on every candidate rather than on whichever it happens to hit.
    candidates = {s.label(): s for s in top + [chosen]}
    timings: dict[str, list[float]] = {label: [] for label in candidates}
    for _ in range(runs):
        for label, s in candidates.items():
            timings[label].append(measure_trial(net, shape, out, s, dev, steps=steps, warmup=2).images_per_s or 0.0)
    again = {label: statistics.median(t) for label, t in timings.items()}
    best_label = max((s.label() for s in top), key=again.get)
    share = again[chosen.label()] / again[best_label]
    print(f"{name}: exhaustive sweep of {len(grid)} settings in {time.perf_counter() - t:.0f} s; best "
          f"{best_label} {again[best_label]:,.0f} img/s; tune's {chosen.label()} {again[chosen.label()]:,.0f} "
          f"img/s = {share:.1%} of it (target ≥ 95%)")
    for r, s in once[:8]:
        print(f"    {s.label():44s} {r:8,.0f} (single run)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(USER_BATCH))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--compile", action="store_true", help="let tune try torch.compile (slow to compile on CPU)")
    p.add_argument("--sweep", action="store_true", help="also check tune's choice against an exhaustive sweep")
    p.add_argument("--top", type=int, default=3, help="how many of the sweep's fastest to time again beside tune's")
    p.add_argument("--plain", metavar="MODEL", help=argparse.SUPPRESS)  # the child process of plain_rate
    a = p.parse_args()
    dev = torch.device("cpu")
    if a.plain:
        net = models.create(a.plain)
        print(rate(net, net.input_shape, net.output_shape, Speed(batch_size=USER_BATCH[a.plain]), dev, a.runs, a.steps))
        return
    peaks = hardware.peaks(dev)["matmul_flops"]
    print(f"{hardware.cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"peaks {peaks['float32'] / 1e9:.0f} GFLOP/s fp32, {peaks.get('bfloat16', 0) / 1e9:.0f} bf16")
    print(f"{'model':14s} {'batch':>5s} {'eager fp32: defaults':>20s} {'+ malloc':>9s} {'tuned':>44s} "
          f"{'vs defaults':>11s} {'vs +malloc':>10s} {'MFU eager':>9s} {'MFU tuned':>9s} {'ceiling':>7s}")
    for name in a.models:
        plain = plain_rate(name, a.runs, a.steps)
        net = models.create(name)
        shape, out = net.input_shape, net.output_shape
        flops = layer_costs(models.create(name), shape, batch=1).train_flops
        base_speed = Speed(batch_size=USER_BATCH[name])
        base = rate(net, shape, out, base_speed, dev, a.runs, a.steps)
        chosen = tune(net, shape, device=dev, max_batch=MAX_BATCH[name], try_compile=a.compile, retune=True,
                      log=lambda m: None).best
        best = rate(net, shape, out, chosen, dev, a.runs, a.steps)
        peak_b = peaks["float32"]
        peak_t = peaks.get({"bf16": "bfloat16", "fp16": "float16"}.get(chosen.precision, "float32"), peak_b)
        print(f"{name:14s} {USER_BATCH[name]:5d} {plain:14.1f} img/s {base:9.1f} {chosen.label():>44s} {best:8.1f} "
              f"{best / plain:10.2f}× {best / base:9.2f}× {base * flops / peak_b:9.1%} {best * flops / peak_t:9.1%} "
              f"{peak_t / (base * flops):6.2f}×", flush=True)
        if a.sweep:
            sweep(name, chosen, dev, a.runs, a.steps, a.top)
    if "cifar_cnn" in a.models:
        tmp = Path(tempfile.mkdtemp())
        images = np.random.default_rng(0).integers(0, 255, (50_000, 32, 32, 3), dtype=np.uint8)
        pk = trainfast.pack((images, np.arange(50_000) % 10), tmp / "c", size=(32, 32), progress=False)
        chosen = tune(models.create("cifar_cnn"), (3, 32, 32), device=dev, try_compile=False, log=lambda m: None).best
        from trainfast.diagnose.timing import step_breakdown
        loader = trainfast.Loader(pk, chosen.batch_size, device=dev)
        t = time.perf_counter()
        step_breakdown(models.create("cifar_cnn"), loader, device=dev, speed=chosen, steps=len(loader) - 1, warmup=1)
        print(f"cifar_cnn: one epoch of 50,000 32×32 images from a raw pack, {chosen.label()}: "
              f"{time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    import sys

    from trainfast.hardware import OtherLoad

    with OtherLoad() as load:  # a busy neighbour makes every figure here low
        main()
    print(load.summary(), file=sys.stderr)  # stderr: a parent benchmark parses this one's stdout

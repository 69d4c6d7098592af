"""fit's thread count, timed on its own steps (adapt.Threads), against the count pinned, as a
user's loop runs: on a quiet machine (what the trials cost) and beside a neighbour spinning on
one core at low priority (`nice 19`) and at equal priority (what they win).

    python benchmarks/bench_threads.py [--images 10000] [--epochs 3] [--reps 3] [--model cifar_cnn]

Each rep runs both sides back to back in alternating order (the timed side first in even reps),
on random 32×32 images (the speed does not depend on what they show), batch 128, no tune. Reported
per condition: each side's training seconds over all epochs (median, spread), the threads each
epoch trained with, and the ratio pinned / timed (above 1: timing the threads was faster).
Nothing else may run while it measures: the neighbours are the benchmark's own.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import trainfast
from trainfast.data.held import from_arrays


def _neighbour(nice: int | None):
    if nice is None:
        return None
    p = subprocess.Popen([sys.executable, "-c", f"import os; os.nice({nice})\nwhile 1: pass"])
    time.sleep(0.3)
    return p


def _run(model: str, pk, epochs: int, pin: dict | None, run_dir: Path) -> tuple[float, list[int]]:
    shutil.rmtree(run_dir, ignore_errors=True)
    r = trainfast.fit(model, pk, epochs=epochs, tune=False, batch_size=128, device="cpu", pin=pin, run_dir=run_dir,
                      progress=False, log=lambda m: None)
    return sum(h["seconds"] for h in r.history), [h["threads"] for h in r.history]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=10000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="cifar_cnn")
    a = ap.parse_args()
    cores = torch.get_num_threads()
    tmp = Path(tempfile.mkdtemp(prefix="bench-threads-"))
    try:
        rng = np.random.default_rng(0)
        x = rng.integers(0, 256, (a.images, 32, 32, 3), dtype=np.uint8)
        pk = trainfast.pack(from_arrays(x, rng.integers(0, 10, a.images)), tmp / "p", size=(32, 32), progress=False)
        print(f"{a.model}, {a.images:,} images, {a.epochs} epochs, batch 128, torch {torch.__version__}, "
              f"{cores} threads at the start")
        for label, nice in (("quiet", None), ("nice-19 neighbour", 19), ("equal-priority neighbour", 0)):
            secs = {"timed": [], "pinned": []}
            for rep in range(a.reps):
                sides = [("timed", None), ("pinned", {"threads": cores})]
                for side, pin in (sides if rep % 2 == 0 else sides[::-1]):
                    spinner = _neighbour(nice)
                    try:
                        s, threads = _run(a.model, pk, a.epochs, pin, tmp / side)
                    finally:
                        if spinner is not None:
                            spinner.kill()
                            spinner.wait()
                    secs[side].append(s)
                    print(f"  {label:25s} rep {rep} {side:6s} {s:6.1f} s, threads per epoch {threads}", flush=True)
            med = {k: statistics.median(v) for k, v in secs.items()}
            print(f"{label:25s} timed {med['timed']:.1f} s ({min(secs['timed']):.1f}–{max(secs['timed']):.1f}), "
                  f"pinned {med['pinned']:.1f} s ({min(secs['pinned']):.1f}–{max(secs['pinned']):.1f}): "
                  f"pinned / timed {med['pinned'] / med['timed']:.2f}×")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Does the race pick the batch that reaches an accuracy first? The batches `fit` races, each
then trained to the end, side by side in one run.

    python benchmarks/bench_race.py [--model cifar_cnn] [--repeat 10] [--epochs 10] [--device cpu]

1. tune, as `fit` runs it (an empty trainfast cache, the data bound, a budget of 10% of a
   run of --race-epochs): the fastest setting at each batch;
2. the race among the batches that are faster than every smaller one (train/race.py), as
   `fit` runs it for a run of --race-epochs (long enough that the laps fit);
3. each raced batch, pinned, trained for --epochs with the range test at it: wall time to
   98% and 99% held-out, and the accuracy at the end.

Data: scikit-learn's digits at 32×32 (80/20 split), the training part repeated --repeat
times (±2-pixel shifts make the repeats differ), so that there are enough images for batches
from 64 to 512.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

TARGETS = (0.98, 0.99)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="cifar_cnn")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--epochs", type=int, default=10, help="epochs of each full run")
    p.add_argument("--race-epochs", type=int, default=40, help="the run length tune and the race are sized for")
    p.add_argument("--device", default="cpu")
    a = p.parse_args()

    import platform

    import numpy as np
    import torch

    import trainfast
    from trainfast import hardware, models
    from trainfast.config import Augment, TrainConfig
    from trainfast.datasets.digits import load_digits, split
    from trainfast.train import race
    from trainfast.train.speed import raced_batch as _raced
    from trainfast.tuning import data_max_batch
    from trainfast.tuning import MAX_BATCH, fastest_by_batch, more_steps_unless_faster, tune

    dev = hardware.resolve_device(a.device)
    print(f"# {hardware.cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch "
          f"{torch.__version__}, device {dev}; {a.model}, digits ×{a.repeat}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["TRAINFAST_CACHE"] = str(tmp / "cache")
        x, y, _ = load_digits(32)
        xtr, ytr, xte, yte = split(x, y, 0.2, seed=0)
        train = trainfast.pack((np.concatenate([xtr] * a.repeat), np.concatenate([ytr] * a.repeat)), tmp / "train",
                               size=(32, 32), progress=False)
        test = trainfast.pack((xte, yte), tmp / "test", size=(32, 32), progress=False)
        augment, cfg = Augment(translate=2), TrainConfig(epochs=a.race_epochs)
        net = models.create(a.model)
        planned = len(train) * a.race_epochs
        limit = min(MAX_BATCH.get(dev.type, MAX_BATCH["cpu"]), data_max_batch(len(train)))
        tuned = tune(net, (3, 32, 32), device=dev, max_batch=limit, planned_images=planned, budget_share=0.1,
                     try_compile=False, log=lambda m: None)
        print(tuned.table())
        floor = next(r.speed.batch_size for r in tuned.rows if r.images_per_s)
        rule, _ = more_steps_unless_faster(tuned, floor=floor)
        front = race.contenders(fastest_by_batch(tuned, floor=floor))
        if not front:
            print("no race: the batches tune timed run within "
                  f"{race.RACE_GAIN}× of each other (the rule picks {rule.label()})")
            return
        won, raced = _raced(net, train, None, front, rule, cfg, dev, augment, 256, planned, print)
        if not raced:
            return
        fastest = max(front, key=lambda f: f[0])[1].batch_size
        print(f"\n{'settings':46s} {'tune images/s':>13s} {'lap loss':>9s} " +
              " ".join(f"{'to ' + format(t, '.0%'):>7s}" for t in TARGETS) + f" {'at the end':>10s}")
        for lap in (race.Lap.from_dict(d) for d in raced["laps"]):
            ends: list[float] = []
            started = time.perf_counter()

            def log(msg, *args, ends=ends, started=started, **kw):
                if msg.startswith("epoch "):
                    ends.append(time.perf_counter() - started)
            r = trainfast.fit(a.model, train, test, speed=lap.speed, config=TrainConfig(epochs=a.epochs), device=dev,
                              augment=augment, run_dir=tmp / f"run-{lap.speed.batch_size}", progress=False, log=log)
            accs = [h["val_acc"] for h in r.history]
            to = [next((f"{ends[i]:6.1f}s" for i, acc in enumerate(accs) if acc >= t), f"{'—':>7s}") for t in TARGETS]
            mark = ("  ← the race's pick" if lap.speed.batch_size == won.batch_size else "") + (
                "  ← tune's fastest" if lap.speed.batch_size == fastest else "")
            print(f"{lap.speed.label():46s} {lap.images_per_s:13,.0f} {lap.loss:9.4f} {' '.join(to)} "
                  f"{accs[-1]:10.1%}{mark}", flush=True)


if __name__ == "__main__":
    import sys

    from trainfast.hardware import OtherLoad

    with OtherLoad() as load:  # a busy neighbour makes every figure here low
        main()
    print(load.summary(), file=sys.stderr)

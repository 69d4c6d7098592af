"""Time to a held-out accuracy: `fit` with its defaults against the hand-tuned recipe documented
for the same model and data, side by side in one run.

    python benchmarks/bench_defaults.py [--only cifar_resnet plate_net] [--plates PATH] [--seeds 0 1 2 3 4]

  defaults  trainfast.fit(model, train, val, epochs=N) and nothing else (augmentation aside,
            the same on both sides): tune within its budget, the batch rule, the optimizer's
            default rate checked by the learning-rate range test; run with an empty trainfast
            cache, so that the tune and the range test are paid as a first run pays them
  again     the same a second time, with what the first run cached (its tune, whole or cut
            short by its budget, and the range test's answer), as a user's next run on this
            machine and data
  recipe    the recipe docs/MODELS.md documents: AdamW 3e-3, weight decay 5e-4, one-cycle,
            batch 64, bf16 + channels_last + the exact rewrites, pinned (nothing tuned)

"to X" is the wall time from calling fit to the end of the first epoch whose held-out
accuracy (per character for the plates) reaches X: setup, tuning, range test, training and
each epoch's validation, on both sides. Data: scikit-learn's digits at 32×32 (80/20 split)
for cifar_resnet and cifar_cnn; generated plates for plate_net (made here if --plates is
missing, as the demo makes them: 20,000 to train on, 1,000 held out).

The epoch at which 99% of 360 digits is crossed moves by one or two with the seed, on every
side, and a seed's luck is not shared between batch sizes (the same seed at batch 32 and 64
takes different steps). With several --seeds, each side's mean time to the target over the
seeds is compared, as well as each seed's.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

CASES = {  # model: (epochs, target, translate)
    "cifar_resnet": (6, 0.99, 0),
    "cifar_cnn": (15, 0.97, 0),
    "plate_net": (10, 0.95, 2),
}


def _packs(model: str, a, tmp: Path):
    import trainfast

    if model.startswith("cifar"):
        from trainfast.datasets.digits import load_digits, split

        x, y, _ = load_digits(32)
        xtr, ytr, xte, yte = split(x, y, 0.2, seed=0)
        return (trainfast.pack((xtr, ytr), tmp / "digits-train", size=(32, 32), progress=False, overwrite=True),
                trainfast.pack((xte, yte), tmp / "digits-test", size=(32, 32), progress=False, overwrite=True))
    from trainfast.datasets.plates import is_current, make_plates

    packs = []
    for split_name, count, seed in (("train", 20000, 0), ("test", 1000, 1)):
        root = a.plates / f"plates-{split_name}"
        if not is_current(root, count, seed):
            make_plates(root, count, seed, progress=True)
        packs.append(trainfast.pack(root / "labels.csv", a.plates / f"{split_name}.pack", size=(64, 128),
                                    label_column="plate", label_kind="sequence", progress=False, overwrite=True))
    return tuple(packs)


def _run(model: str, side: str, train, test, tmp: Path, device: str = "cpu", seed: int = 0) -> dict:
    import trainfast
    from trainfast.config import Augment, Speed, TrainConfig
    from trainfast.models import rewrite

    epochs, target, translate = CASES[model]
    ends = []
    started = time.perf_counter()

    def log(msg, *args, **kw):
        if msg.lstrip().startswith("epoch "):
            ends.append(time.perf_counter() - started)
    kw = dict(device=device, run_dir=tmp / f"{model}-{side}-{seed}", augment=Augment(translate=translate), progress=False,
              log=log)
    if side in ("defaults", "again"):
        os.environ["TRAINFAST_CACHE"] = str(tmp / f"cache-{model}-{seed}")  # empty for "defaults": a first run
        r = trainfast.fit(model, train, test, config=TrainConfig(epochs=epochs, seed=seed), **kw)
        os.environ.pop("TRAINFAST_CACHE")
    else:
        cfg = TrainConfig(epochs=epochs, optimizer="adamw", lr=3e-3, weight_decay=5e-4, seed=seed)
        r = trainfast.fit(model, train, test, config=cfg, speed=Speed("bf16", True, batch_size=64,
                                                                       rewrites=rewrite.ALL), **kw)
    accs = [row["val_acc"] for row in r.history]
    reached = next((i for i, acc in enumerate(accs) if acc >= target), None)
    return {"settings": f"{r.speed.label()}", "accs": accs, "ends": ends, "epoch_to": reached,
            "to_target": ends[reached] if reached is not None and reached < len(ends) else None}


def _side(model: str, side: str, tmp: Path, device: str, seed: int) -> dict:
    """One side in a fresh Python process, as a user's run is: each pays the same one-time costs
    (imports, the first kernels' set-up), and none runs warm on another's."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, __file__, "--child", model, side, str(tmp), "--device", device,
                          "--seeds", str(seed)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--plates", type=Path, default=Path("bench-data/plates-defaults"),
                   help="folder for the generated plates and their packs (made if missing)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: where every side trains")
    p.add_argument("--seeds", type=int, nargs="+", default=[0],
                   help="training seeds (weights, order, augmentation), each run on every side; with several, "
                        "the means over them are compared")
    p.add_argument("--child", nargs=3, metavar=("MODEL", "SIDE", "TMP"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        import json
        model, side, tmp = a.child
        tmp = Path(tmp)
        print(json.dumps(_run(model, side, tmp / f"{model}-train", tmp / f"{model}-test", tmp, a.device, a.seeds[0])))
        return
    import platform

    import torch

    from trainfast import hardware
    print(f"# {hardware.cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"torch {torch.__version__}; device {a.device}; seeds {' '.join(map(str, a.seeds))}; "
          f"each side in a fresh process")
    print(f"{'model':14s} {'seed':>4s} {'side':9s} {'target':>6s} {'epochs to':>9s} {'to target s':>11s} "
          f"{'in all s':>9s} {'final':>6s}  settings")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for model in a.only:
            for which, pk in zip(("train", "test"), _packs(model, a, tmp)):
                (tmp / f"{model}-{which}").symlink_to(Path(pk.path).resolve())
            times = {}
            for seed in a.seeds:
                for side in ("recipe", "defaults", "again"):
                    r = _side(model, side, tmp, a.device, seed)
                    times.setdefault(side, []).append(r["to_target"])
                    to = f"{r['to_target']:11.1f}" if r["to_target"] is not None else f"{'not reached':>11s}"
                    epoch_to = f"{r['epoch_to'] + 1:9d}" if r["epoch_to"] is not None else f"{'—':>9s}"
                    print(f"{model:14s} {seed:4d} {side:9s} {CASES[model][1]:6.0%} {epoch_to} {to} "
                          f"{r['ends'][-1]:9.1f} {r['accs'][-1]:6.1%}  {r['settings']}", flush=True)
                    print(f"#   held-out by epoch: {', '.join(f'{x:.1%}' for x in r['accs'])}", flush=True)
            if len(a.seeds) > 1:
                print(_means(model, times), flush=True)


def _means(model: str, times: dict) -> str:
    """Each side's mean time to the target over the seeds, and again's ÷ the recipe's."""
    if any(t is None for ts in times.values() for t in ts):
        return f"# {model}: a side did not reach the target at every seed; no mean"
    mean = {side: sum(ts) / len(ts) for side, ts in times.items()}
    return (f"# {model}, mean to target over {len(times['recipe'])} seeds: " +
            ", ".join(f"{side} {m:.1f} s" for side, m in mean.items()) +
            f"; again ÷ recipe {mean['again'] / mean['recipe']:.2f}")


if __name__ == "__main__":
    import sys

    from trainfast.hardware import OtherLoad

    with OtherLoad() as load:  # a busy neighbour makes every figure here low
        main()
    print(load.summary(), file=sys.stderr)

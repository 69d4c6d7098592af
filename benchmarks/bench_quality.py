"""Does speed cost accuracy? The same training run at fp32 and at trainfast's fast settings
(bf16 autocast + channels_last + the exact rewrites), same seed, data and order, side by side.

    python benchmarks/bench_quality.py [--models cifar_cnn plate_net...] [--epochs 6]

Data: scikit-learn's bundled handwritten digits upscaled to 32×32 RGB (no download), 80/20
split; cifar_cnn and cifar_resnet take 32×32 inputs. Prints each epoch's training loss for
both runs, the largest relative difference, and the held-out accuracy of each.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import trainfast
from trainfast.config import Speed, TrainConfig
from trainfast.datasets.digits import load_digits, split
from trainfast.models import rewrite


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["cifar_cnn", "cifar_resnet"])
    p.add_argument("--epochs", type=int, default=6)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    x, y, _ = load_digits(32)
    xtr, ytr, xte, yte = split(x, y, 0.2, seed=0)
    train = trainfast.pack((xtr, ytr), tmp / "train", size=(32, 32), progress=False)
    test = trainfast.pack((xte, yte), tmp / "test", size=(32, 32), progress=False)
    cfg = TrainConfig(epochs=a.epochs, optimizer="adamw", lr=3e-3, weight_decay=5e-4, seed=0)
    settings = {"fp32": Speed("fp32", False, batch_size=64),
                "fast": Speed("bf16", True, batch_size=64, rewrites=rewrite.ALL)}
    for name in a.models:
        runs = {}
        for label, speed in settings.items():
            r = trainfast.fit(name, train, test, config=cfg, speed=speed, run_dir=tmp / f"{name}-{label}",
                              progress=False, log=lambda *args, **kw: None)
            runs[label] = r.history
        worst = max(abs(f["train_loss"] - q["train_loss"]) / f["train_loss"]
                    for f, q in zip(runs["fp32"], runs["fast"]))
        print(f"\n{name}: fp32 vs {settings['fast'].label()}, {len(xtr)} train / {len(xte)} held-out digits")
        print(f"  {'epoch':>5s} {'loss fp32':>10s} {'loss fast':>10s} {'acc fp32':>9s} {'acc fast':>9s}")
        for f, q in zip(runs["fp32"], runs["fast"]):
            print(f"  {f['epoch'] + 1:5d} {f['train_loss']:10.4f} {q['train_loss']:10.4f} "
                  f"{f['val_acc']:9.2%} {q['val_acc']:9.2%}")
        print(f"  largest relative training-loss difference: {worst:.1%}")


if __name__ == "__main__":
    main()

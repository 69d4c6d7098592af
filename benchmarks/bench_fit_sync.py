"""What `fit` loses to host-device synchronisation: a plain loop of the same step on the same
Loader batches, beside `fit` reading the loss off the device every step (what its NaN guard
and progress numbers did before) and every READ_EVERY steps (what they do now).

A GPU runs ahead of the host only while the host never waits for it; each `float(loss)`
empties that queue, and a small CNN, launch-bound on a big GPU, then waits for every kernel
launch. On a CPU the reads cost nothing, and the three should tie.

    python benchmarks/bench_fit_sync.py [--device cuda] [--model cifar_cnn] [--batch-size 256]

Each figure is the median images/s of the epochs after the first (50,000 random 32×32 images
from a raw pack, no validation), one process, the settings fixed (no tuning).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import trainfast
from trainfast import hardware, models
from trainfast import step as _step
from trainfast.config import Speed, TrainConfig
from trainfast.data.held import from_arrays
from trainfast.train import run as trainer


def plain_loop(model_name: str, pk, speed: Speed, dev, epochs: int) -> float:
    """The step fit runs, with nothing read back: the rate these settings allow on this data path."""
    torch.manual_seed(0)
    net = _step.prepare(models.create(model_name), speed, dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    scaler = _step.make_scaler(speed, dev)
    loader = trainfast.Loader(pk, speed.batch_size, device=dev)
    rates = []
    for _ in range(epochs):
        start, n = time.perf_counter(), 0
        for x, y in loader:
            loss, _ = _step.forward_loss(net, x, y, speed, dev)
            _step.backward(loss, scaler)
            _step.optimizer_step(opt, scaler)
            n += len(x)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        rates.append(n / (time.perf_counter() - start))
    return statistics.median(rates[1:])


def fit_rate(model_name: str, pk, speed: Speed, dev, epochs: int, every: int, out: Path) -> float:
    trainer.READ_EVERY[dev.type] = every
    r = trainfast.fit(model_name, pk, config=TrainConfig(epochs=epochs, val_fraction=0.0), speed=speed, device=dev,
                      run_dir=out, progress=False, log=lambda *a: None)
    return statistics.median(h["images_per_s"] for h in r.history[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None)
    ap.add_argument("--model", default="cifar_cnn")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--images", type=int, default=50_000)
    ap.add_argument("--epochs", type=int, default=4)
    a = ap.parse_args()
    dev = hardware.resolve_device(a.device)
    net = models.create(a.model)
    (c, h, w), out = net.input_shape, net.output_shape
    speed = Speed("bf16" if _step.supports_bf16(dev) else "fp32", True, batch_size=a.batch_size)
    read_every = trainer.READ_EVERY.get(dev.type, trainer.READ_EVERY["cuda"])
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, (a.images, h, w, c), dtype=np.uint8)
        if len(out) == 2:  # sequences, e.g. plates: (positions, alphabet)
            alphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:out[1]]
            data = from_arrays(images, rng.integers(0, len(alphabet), (a.images, out[0])), alphabet=alphabet)
        else:
            data = (images, np.arange(a.images) % out[0])
        pk = trainfast.pack(data, Path(tmp) / "p", size=(h, w), progress=False)
        rows = [("plain loop, nothing read back", plain_loop(a.model, pk, speed, dev, a.epochs))]
        for every in (1, max(read_every, 2)):
            rows.append((f"fit, loss read every {every} step{'s' if every > 1 else ''}",
                         fit_rate(a.model, pk, speed, dev, a.epochs, every, Path(tmp) / f"run{every}")))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else hardware.cpu_model()
    print(f"{a.model}, {speed.label()}, {a.images:,} images × {a.epochs} epochs on {dev} ({name}), torch {torch.__version__}")
    base = rows[0][1]
    for label, rate in rows:
        print(f"  {label:38s} {rate:10,.0f} images/s  {rate / base:5.2f}× the plain loop")


if __name__ == "__main__":
    import sys

    from trainfast.hardware import OtherLoad

    with OtherLoad() as load:  # a busy neighbour makes every figure here low
        main()
    print(load.summary(), file=sys.stderr)  # stderr: a parent benchmark parses this one's stdout

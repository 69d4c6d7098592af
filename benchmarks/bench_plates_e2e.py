"""End-to-end epochs of the license-plate story, from a folder of JPEG photos to the optimizer
step, side by side in one run: the same plate CNN, data, batch (64), optimizer (Adam 1e-3)
and epochs, fed four ways:

  keras-sequence    Keras 3 fit on the story's Sequence: skimage imread + resize per image,
                    every batch of every epoch (float32, as the user wrote it)
  keras-tfdata      Keras done well: tf.data with a parallel decode + resize map, cache,
                    shuffle and prefetch; mixed_bfloat16
  torch-dataloader  a plain PyTorch loop (eager fp32) on a DataLoader with 2 worker
                    processes decoding + resizing with Pillow per item
  trainfast         trainfast.pack once (timed, and amortised over the epochs), then
                    trainfast.fit with the settings tune measured on this machine

    python benchmarks/bench_plates_e2e.py [--count 4000] [--epochs 3] [--runs 3]

Each contender runs in a fresh process; the runs are interleaved so that a slow spell of the
machine hits them all. The first epoch is reported apart (it warms caches, traces graphs and,
for tf.data, fills the cache); "epoch" is the median of the later ones, then of the runs.
Held-out per-character accuracy after the last epoch is printed so that the speed is seen at
equal quality. Needs the benchmark extra: pip install -e ".[bench]".
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
SIZE = (64, 128)
BATCH = 64
KINDS = ("keras-sequence", "keras-tfdata", "torch-dataloader", "trainfast")


def _rows(root: Path) -> tuple[list[str], list[list[int]]]:
    with open(root / "labels.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return [str(root / r["path"]) for r in rows], [[ALPHABET.index(c) for c in r["plate"]] for r in rows]


def _keras_fit(model, train, val, epochs: int) -> dict:
    """fit with per-epoch times, then the held-out per-character accuracy."""
    import keras
    import numpy as np

    times = []

    class Times(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.t)

    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(train, epochs=epochs, verbose=0, callbacks=[Times()])
    right = total = 0
    batches = (val[i] for i in range(len(val))) if isinstance(val, keras.utils.PyDataset) else val
    for x, y in batches:
        pred = np.argmax(np.asarray(model.predict_on_batch(x)), -1)
        right += int((pred == np.asarray(y)).sum())
        total += int(np.asarray(y).size)
    return {"epochs_s": times, "val_char_acc": right / total}


def keras_sequence(train: Path, val: Path, epochs: int) -> dict:
    from keras_models import build_plain  # puts examples/ on sys.path
    from keras_plates import PlateSequence

    return _keras_fit(build_plain("plate_cnn", "float32"), PlateSequence(str(train), BATCH),
                      PlateSequence(str(val), BATCH), epochs)


def keras_tfdata(train: Path, val: Path, epochs: int) -> dict:
    import tensorflow as tf
    from keras_models import build_plain

    def dataset(root: Path, training: bool):
        paths, labels = _rows(root)

        def load(path, label):
            img = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
            return tf.image.resize(img, SIZE) / 255.0, label

        ds = tf.data.Dataset.from_tensor_slices((paths, labels)).map(load, num_parallel_calls=tf.data.AUTOTUNE).cache()
        if training:
            ds = ds.shuffle(len(paths), seed=0)
        return ds.batch(BATCH).prefetch(tf.data.AUTOTUNE)

    return _keras_fit(build_plain("plate_cnn", "mixed_bfloat16"), dataset(train, True), dataset(val, False), epochs)


def torch_dataloader(train: Path, val: Path, epochs: int) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from PIL import Image

    from trainfast import models

    class Photos(torch.utils.data.Dataset):
        def __init__(self, root):
            self.paths, self.labels = _rows(root)

        def __len__(self):
            return len(self.paths)

        def __getitem__(self, i):
            img = Image.open(self.paths[i]).convert("RGB").resize(SIZE[::-1], Image.BILINEAR)
            x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
            return x, torch.tensor(self.labels[i])

    def loader(root, shuffle):
        return torch.utils.data.DataLoader(Photos(root), batch_size=BATCH, shuffle=shuffle, num_workers=2,
                                           persistent_workers=True)

    torch.manual_seed(0)
    net = models.create("plate_cnn")
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    times = []
    train_dl = loader(train, True)
    for _ in range(epochs):
        t = time.perf_counter()
        net.train()
        for x, y in train_dl:
            out = net(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - t)
    right = total = 0
    net.eval()
    with torch.no_grad():
        for x, y in loader(val, False):
            right += int((net(x).argmax(-1) == y).sum())
            total += y.numel()
    return {"epochs_s": times, "val_char_acc": right / total}


def trainfast_run(train: Path, val: Path, epochs: int, work: Path) -> dict:
    import tempfile

    import trainfast
    from trainfast.config import TrainConfig
    from trainfast.tune import tune

    t = time.perf_counter()
    packs = [trainfast.pack(root / "labels.csv", work / f"{root.name}.pack", size=SIZE, label_column="plate",
                            alphabet=ALPHABET, progress=False, overwrite=True) for root in (train, val)]
    pack_s = time.perf_counter() - t
    t = time.perf_counter()
    speed = tune(trainfast.models.create("plate_cnn"), (3, *SIZE), batch_size=BATCH, try_compile=False,
                 log=lambda m: None).best
    tune_s = time.perf_counter() - t  # once per machine and model: cached after the first run
    cfg = TrainConfig(epochs=epochs, optimizer="adamw", lr=1e-3, weight_decay=0.0, schedule="constant")
    with tempfile.TemporaryDirectory() as run_dir:
        r = trainfast.fit("plate_cnn", packs[0], packs[1], config=cfg, speed=speed, run_dir=run_dir,
                          progress=False, log=lambda *a, **k: None)
    return {"epochs_s": [row["seconds"] for row in r.history], "val_char_acc": r.history[-1]["val_acc"],
            "pack_s": pack_s, "tune_s": tune_s, "settings": r.speed.label()}


def _worker(kind: str, train: Path, val: Path, epochs: int, work: Path) -> dict:
    if kind == "keras-sequence":
        return keras_sequence(train, val, epochs)
    if kind == "keras-tfdata":
        return keras_tfdata(train, val, epochs)
    if kind == "torch-dataloader":
        return torch_dataloader(train, val, epochs)
    return trainfast_run(train, val, epochs, work)


def _child(kind: str, a) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--data", str(a.data), "--epochs", str(a.epochs)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if p.returncode:
        sys.exit(f"{kind} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _data(a) -> tuple[Path, Path]:
    from trainfast.datasets.plates import make_plates

    train, val = a.data / "train", a.data / "heldout"
    for root, count, seed in ((train, a.count, 1), (val, max(a.count // 5, BATCH), 2)):
        if not (root / "labels.csv").exists():
            make_plates(root, count=count, seed=seed)
    return train, val


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=Path("bench-data/plates-e2e"), help="made here if missing")
    p.add_argument("--count", type=int, default=4000, help="training photos (held out: a fifth as many)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.epochs < 2:
        p.error("--epochs must be at least 2: the first epoch is reported apart")
    sys.path.insert(0, str(HERE))
    if a.worker:
        train, val = a.data / "train", a.data / "heldout"
        print(json.dumps(_worker(a.worker, train, val, a.epochs, a.data)))
        return

    import platform

    import torch

    from trainfast import hardware
    train, val = _data(a)
    print(f"# {hardware.cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"torch {torch.__version__}; {a.count} training photos, {a.epochs} epochs, batch {BATCH}, {a.runs} runs")
    results = {k: [] for k in a.kinds}
    for run in range(a.runs):
        for kind in a.kinds:
            r = _child(kind, a)
            results[kind].append(r)
            print(f"# run {run + 1} {kind}: epochs {', '.join(f'{s:.1f}' for s in r['epochs_s'])} s"
                  + (f"; pack {r['pack_s']:.1f} s, tune {r['tune_s']:.1f} s" if "pack_s" in r else "")
                  + f"; held-out char acc {r['val_char_acc']:.1%}", flush=True)

    def med(kind, f):
        return statistics.median(f(r) for r in results[kind])

    rows = {}
    for kind in a.kinds:
        first = med(kind, lambda r: r["epochs_s"][0])
        epoch = med(kind, lambda r: statistics.median(r["epochs_s"][1:]))
        setup = med(kind, lambda r: r.get("pack_s", 0.0))
        rows[kind] = {"first": first, "epoch": epoch, "setup": setup, "total": setup + first + epoch * (a.epochs - 1),
                      "acc": med(kind, lambda r: r["val_char_acc"])}
    base = rows.get("keras-sequence") or next(iter(rows.values()))
    print(f"\n{'pipeline':18s} {'setup s':>8s} {'epoch 1 s':>9s} {'epoch s':>8s} {'img/s':>7s} "
          f"{f'{a.epochs} epochs s':>11s} {'vs Sequence':>11s} {'held-out acc':>12s}")
    for kind, r in rows.items():
        print(f"{kind:18s} {r['setup']:8.1f} {r['first']:9.1f} {r['epoch']:8.1f} {a.count / r['epoch']:7,.0f} "
              f"{r['total']:11.1f} {base['total'] / r['total']:10.2f}× {r['acc']:12.1%}")
    if "trainfast" in results:
        print(f"# trainfast settings: {results['trainfast'][0]['settings']}; tune took "
              f"{results['trainfast'][0]['tune_s']:.1f} s in the first run (near 0 when this machine's choice "
              "was already cached), not counted in setup: it is once per machine and model")
    out = os.environ.get("TRAINFAST_BENCH_JSON")
    if out:
        Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

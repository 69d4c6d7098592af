"""End-to-end epochs of the license-plate story, from a folder of JPEG photos to the optimizer
step, side by side in one run: the same plate model, data, batch (64), recipe and epochs, fed
four (or five) ways:

  keras-sequence    Keras 3 fit on the story's Sequence: skimage imread + resize per image,
                    every batch of every epoch (float32, as the user wrote it)
  keras-tfdata      Keras done well: tf.data with a parallel decode + resize map, cache,
                    shuffle and prefetch; mixed_bfloat16
  keras-tfdata-fp32 the same at float32: Keras's best on a CPU without bf16 instructions
                    (AVX2 only), where TensorFlow's bf16 is slower than its fp32; the
                    default --kinds run one of the two, by the CPU's flags
  torch-dataloader  a plain PyTorch loop (eager fp32) on a DataLoader with 2 worker
                    processes decoding + resizing with Pillow per item
  trainfast         trainfast.pack once (timed, and amortised over the epochs), then
                    trainfast.fit with the settings tune measured on this machine

    python benchmarks/bench_plates_e2e.py [--count 4000] [--epochs 3] [--runs 3]
    python benchmarks/bench_plates_e2e.py --model plate_net --count 8000 --epochs 8 --target 0.85
    python benchmarks/bench_plates_e2e.py --model plate_net --count 20000 --heldout 1000 --epochs 30 \
        --translate 2 --plate-target 0.95 --max-minutes 15 --runs 1

--model plate_cnn (default) is the story's CNN with the story's recipe (Adam 1e-3); it does
not learn in a few epochs on any pipeline, so it measures speed only. --model plate_net is
trainfast's better plate reader, written the same way in Keras (keras_models.plate_net), with
the demo's recipe (AdamW 3e-3, weight decay 5e-4, cosine with 20% warm-up) on every
pipeline; with --target (--plate-target) it also reports the time to that held-out
accuracy of characters (of whole plates): setup plus the training epochs up to the first
whose held-out accuracy reaches it (the held-out evaluation after each epoch is not timed, on
any pipeline). --max-minutes stops a contender's training after that much training time (at
an epoch's end; trainfast, the fastest here, runs its epochs out), and a target first reached
after it counts as not reached.

Each contender runs in a fresh process; the runs are interleaved so that a slow spell of the
machine hits them all, and run i seeds every contender with i. The first epoch is reported
apart (it warms caches, traces graphs and, for tf.data, fills the cache); "epoch" is the
median of the later ones, then of the runs. Needs the benchmark extra: pip install torch==2.13.0 -e ".[bench]".
"""

from __future__ import annotations

import argparse
import csv
import json
import math
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
KINDS = ("keras-sequence", "keras-tfdata", "keras-tfdata-fp32", "torch-dataloader", "trainfast")


def default_kinds() -> list[str]:
    """Keras done well is mixed_bfloat16 on a CPU with bf16 instructions, float32 on one without
    (there TensorFlow's bf16 is emulated, and slower than the per-image Sequence at float32)."""
    from trainfast import hardware

    bf16 = {"AVX512-BF16", "AMX-BF16"} & set(hardware.isa_features())
    return ["keras-sequence", "keras-tfdata" if bf16 else "keras-tfdata-fp32", "torch-dataloader", "trainfast"]
# The recipe of each model, the same on every pipeline (AdamW; with no weight decay, Adam).
# plate_cnn: the story's (Adam 1e-3); plate_net: trainfast demo's.
RECIPES = {
    "plate_cnn": {"lr": 1e-3, "weight_decay": 0.0, "schedule": "constant", "warmup": 0.0},
    "plate_net": {"lr": 3e-3, "weight_decay": 5e-4, "schedule": "cosine", "warmup": 0.2},
}


def _rows(root: Path) -> tuple[list[str], list[list[int]]]:
    with open(root / "labels.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return [str(root / r["path"]) for r in rows], [[ALPHABET.index(c) for c in r["plate"]] for r in rows]


def _accuracies(hits) -> tuple[float, float]:
    """Held-out accuracy of characters and of whole plates, from (plates, 8) booleans."""
    return float(hits.mean()), float(hits.all(1).mean())


def _result(times: list[float], accs: list[tuple[float, float]]) -> dict:
    return {"epochs_s": times, "val_char_acc": [c for c, _ in accs], "val_plate_acc": [p for _, p in accs]}


def _keras_fit(model, train, val, epochs: int, recipe: dict, steps_per_epoch: int, max_s: float) -> dict:
    """fit with per-epoch times and, after each epoch (untimed), the held-out per-character accuracy."""
    import keras
    import numpy as np

    def accuracy() -> tuple[float, float]:
        hits = []
        batches = (val[i] for i in range(len(val))) if isinstance(val, keras.utils.PyDataset) else val
        for x, y in batches:
            hits.append(np.argmax(np.asarray(model.predict_on_batch(x)), -1) == np.asarray(y))
        return _accuracies(np.concatenate(hits))

    times, accs = [], []

    class PerEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.t)
            accs.append(accuracy())
            if sum(times) > max_s:
                self.model.stop_training = True

    lr = recipe["lr"]
    if recipe["schedule"] == "cosine":
        total = epochs * steps_per_epoch
        warm = max(1, int(recipe["warmup"] * total))
        lr = keras.optimizers.schedules.CosineDecay(lr / warm, total - warm, warmup_target=lr, warmup_steps=warm)
    opt = (keras.optimizers.AdamW(lr, weight_decay=recipe["weight_decay"]) if recipe["weight_decay"]
           else keras.optimizers.Adam(lr))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(train, epochs=epochs, verbose=0, callbacks=[PerEpoch()])
    return _result(times, accs)


def _steps(root: Path) -> int:
    return math.ceil(len(_rows(root)[0]) / BATCH)


def _shift_numpy(x, t: int, rng):
    """Each image of the NHWC batch `x` moved by up to ±t pixels each way, edges reflected (as
    trainfast's translate)."""
    import numpy as np

    pad = np.pad(x, ((0, 0), (t, t), (t, t), (0, 0)), mode="reflect")
    h, w = x.shape[1:3]
    dy, dx = rng.integers(0, 2 * t + 1, (2, len(x)))
    return np.stack([p[a:a + h, b:b + w] for p, a, b in zip(pad, dy, dx)])


def keras_sequence(train: Path, val: Path, epochs: int, model: str, seed: int, max_s: float,
                   translate: int = 0) -> dict:
    import keras
    import numpy as np
    from keras_models import build_plain  # puts examples/ on sys.path
    from keras_plates import PlateSequence

    class Shifted(PlateSequence):  # the story's Sequence, plus the recipe's translation
        rng = np.random.default_rng(seed)

        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return _shift_numpy(x, translate, self.rng), y

    keras.utils.set_random_seed(seed)
    return _keras_fit(build_plain(model, "float32"), (Shifted if translate else PlateSequence)(str(train), BATCH),
                      PlateSequence(str(val), BATCH), epochs, RECIPES[model], _steps(train), max_s)


def keras_tfdata(train: Path, val: Path, epochs: int, model: str, seed: int, max_s: float,
                 policy: str = "mixed_bfloat16", translate: int = 0) -> dict:
    import keras
    import tensorflow as tf
    from keras_models import build_plain

    keras.utils.set_random_seed(seed)

    def dataset(root: Path, training: bool):
        paths, labels = _rows(root)

        def load(path, label):
            img = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
            return tf.image.resize(img, SIZE) / 255.0, label

        def shift(img, label):  # ±translate pixels each way, edges reflected (as trainfast's)
            t = translate
            img = tf.pad(img, [[t, t], [t, t], [0, 0]], mode="REFLECT")
            return tf.image.random_crop(img, (*SIZE, 3)), label

        ds = tf.data.Dataset.from_tensor_slices((paths, labels)).map(load, num_parallel_calls=tf.data.AUTOTUNE).cache()
        if training:
            ds = ds.shuffle(len(paths), seed=seed)
            if translate:
                ds = ds.map(shift, num_parallel_calls=tf.data.AUTOTUNE)
        return ds.batch(BATCH).prefetch(tf.data.AUTOTUNE)

    return _keras_fit(build_plain(model, policy), dataset(train, True), dataset(val, False), epochs,
                      RECIPES[model], _steps(train), max_s)


def torch_dataloader(train: Path, val: Path, epochs: int, model: str, seed: int, max_s: float) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from PIL import Image

    from trainfast import models
    from trainfast.config import TrainConfig
    from trainfast.train.optim import lr_factor

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

    def accuracy() -> tuple[float, float]:
        net.eval()
        with torch.no_grad():
            return _accuracies(torch.cat([net(x).argmax(-1) == y for x, y in val_dl]).numpy())

    torch.manual_seed(seed)
    recipe = RECIPES[model]
    net = models.create(model)
    opt = torch.optim.AdamW(net.parameters(), lr=recipe["lr"], weight_decay=recipe["weight_decay"])
    train_dl, val_dl = loader(train, True), loader(val, False)
    total = epochs * len(train_dl)
    schedule = TrainConfig(schedule=recipe["schedule"], warmup=recipe["warmup"])  # the shape only, not trainfast's speed
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(schedule, step, total))
    times, accs = [], []
    for _ in range(epochs):
        t = time.perf_counter()
        net.train()
        for x, y in train_dl:
            out = net(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        times.append(time.perf_counter() - t)
        accs.append(accuracy())
        if sum(times) > max_s:
            break
    return _result(times, accs)


def trainfast_run(train: Path, val: Path, epochs: int, model: str, seed: int, work: Path, translate: int = 0) -> dict:
    import tempfile

    import trainfast
    from trainfast.config import Augment, TrainConfig
    from trainfast.tuning import tune

    t = time.perf_counter()
    packs = [trainfast.pack(root / "labels.csv", work / f"{root.name}.pack", size=SIZE, label_column="plate",
                            alphabet=ALPHABET, progress=False, overwrite=True) for root in (train, val)]
    pack_s = time.perf_counter() - t
    t = time.perf_counter()
    speed = tune(trainfast.models.create(model), (3, *SIZE), batch_size=BATCH, try_compile=False,
                 log=lambda m: None).best
    tune_s = time.perf_counter() - t  # once per machine and model: cached after the first run
    recipe = RECIPES[model]
    cfg = TrainConfig(epochs=epochs, optimizer="adamw", lr=recipe["lr"], weight_decay=recipe["weight_decay"],
                      schedule=recipe["schedule"], warmup=recipe["warmup"], seed=seed)
    with tempfile.TemporaryDirectory() as run_dir:
        r = trainfast.fit(model, packs[0], packs[1], config=cfg, speed=speed, run_dir=run_dir,
                          augment=Augment(translate=translate), progress=False, log=lambda *a, **k: None)
    return {**_result([row["seconds"] for row in r.history],
                      [(row["val_acc"], row["val_seq_acc"]) for row in r.history]),
            "pack_s": pack_s, "tune_s": tune_s, "settings": r.speed.label()}


def _worker(kind: str, a) -> dict:
    train, val = a.data / "train", a.data / "heldout"
    if kind == "trainfast":
        return trainfast_run(train, val, a.epochs, a.model, a.seed, a.data, a.translate)
    max_s = a.max_minutes * 60 if a.max_minutes else math.inf
    shift = {"translate": a.translate} if a.translate else {}
    if kind == "keras-tfdata-fp32":
        return keras_tfdata(train, val, a.epochs, a.model, a.seed, max_s, policy="float32", **shift)
    run = {"keras-sequence": keras_sequence, "keras-tfdata": keras_tfdata, "torch-dataloader": torch_dataloader}[kind]
    return run(train, val, a.epochs, a.model, a.seed, max_s, **shift)


def _child(kind: str, a, seed: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--data", str(a.data), "--epochs", str(a.epochs),
           "--model", a.model, "--seed", str(seed), "--max-minutes", str(a.max_minutes or 0),
           "--translate", str(a.translate)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if p.returncode:
        sys.exit(f"{kind} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _to_target(r: dict, target: float, key: str = "val_char_acc", max_s: float = math.inf) -> float | None:
    """Setup plus the training epochs up to the first that reaches `target` held-out accuracy
    (r[key]) within max_s of training; None if none does."""
    for i, acc in enumerate(r[key]):
        trained = sum(r["epochs_s"][:i + 1])
        if trained > max_s:
            return None
        if acc >= target:
            return r.get("pack_s", 0.0) + trained
    return None


def _data(a) -> tuple[Path, Path]:
    from trainfast.datasets.plates import is_current, make_plates

    train, val = a.data / "train", a.data / "heldout"
    for root, count, seed in ((train, a.count, 1), (val, a.heldout or max(a.count // 5, BATCH), 2)):
        if not is_current(root, count, seed):
            make_plates(root, count=count, seed=seed, progress=True)
    return train, val


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=Path("bench-data/plates-e2e"), help="made here if missing")
    p.add_argument("--count", type=int, default=4000, help="training photos")
    p.add_argument("--heldout", type=int, help="held-out photos (default: a fifth of --count)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--model", choices=list(RECIPES), default="plate_cnn",
                   help="plate_cnn: the story's model and recipe; plate_net: trainfast's, which learns")
    p.add_argument("--target", type=float, help="also report the time to this held-out per-character accuracy")
    p.add_argument("--plate-target", type=float, help="also report the time to this held-out whole-plate accuracy")
    p.add_argument("--translate", type=int, default=0,
                   help="move each training image by up to ±N pixels each way (edges reflected), on every side: "
                        "trainfast's Augment, a tf.data map, a wrapper of the Sequence (not torch-dataloader)")
    p.add_argument("--max-minutes", type=float, help="stop each contender's training after this many minutes "
                   "(at an epoch's end); a target reached later counts as not reached")
    p.add_argument("--kinds", nargs="+", choices=KINDS,
                   help="default: the Sequence, one Keras tf.data (mixed_bfloat16 where the CPU has bf16 "
                        "instructions, else fp32), the DataLoader and trainfast")
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.epochs < 2:
        p.error("--epochs must be at least 2: the first epoch is reported apart")
    for name, value in (("--target", a.target), ("--plate-target", a.plate_target)):
        if value is not None and not 0 < value < 1:
            p.error(f"{name} is a held-out accuracy between 0 and 1, not {value}")
    sys.path.insert(0, str(HERE))
    if a.worker:
        print(json.dumps(_worker(a.worker, a)))
        return
    a.kinds = a.kinds or default_kinds()
    if a.translate and "torch-dataloader" in a.kinds:
        p.error("--translate is not written for torch-dataloader; leave it out of --kinds")

    import platform

    import torch

    from trainfast import hardware
    _data(a)
    print(f"# {hardware.cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"torch {torch.__version__}; {a.model}, {a.count} training photos, {a.epochs} epochs, batch {BATCH}, "
          f"{a.runs} runs")
    results = {k: [] for k in a.kinds}
    for run in range(a.runs):
        for kind in a.kinds:
            r = _child(kind, a, seed=run)
            results[kind].append(r)
            print(f"# run {run + 1} {kind}: epochs {', '.join(f'{s:.1f}' for s in r['epochs_s'])} s"
                  + (f"; pack {r['pack_s']:.1f} s, tune {r['tune_s']:.1f} s" if "pack_s" in r else "")
                  + f"; held-out char acc {', '.join(f'{x:.1%}' for x in r['val_char_acc'])}"
                  + f"; plates {', '.join(f'{x:.1%}' for x in r['val_plate_acc'])}", flush=True)

    def med(kind, f):
        return statistics.median(f(r) for r in results[kind])

    max_s = a.max_minutes * 60 if a.max_minutes else math.inf
    targets = [(f"to {t:.0%} {what}", t, key) for t, what, key in
               ((a.target, "chars", "val_char_acc"), (a.plate_target, "plates", "val_plate_acc")) if t is not None]
    rows = {}
    for kind in a.kinds:
        rows[kind] = {"setup": med(kind, lambda r: r.get("pack_s", 0.0)),
                      "first": med(kind, lambda r: r["epochs_s"][0]),
                      "epoch": med(kind, lambda r: statistics.median(r["epochs_s"][1:])),
                      "epochs": med(kind, lambda r: len(r["epochs_s"])),
                      "total": med(kind, lambda r: r.get("pack_s", 0.0) + sum(r["epochs_s"])),
                      "acc": med(kind, lambda r: r["val_char_acc"][-1]),
                      "plates": med(kind, lambda r: r["val_plate_acc"][-1])}
        for name, t, key in targets:
            reached = [x for x in (_to_target(r, t, key, max_s) for r in results[kind]) if x is not None]
            # the median over the runs, counting a run that never got there as slower than any that did
            rows[kind][name] = (statistics.median(reached + [math.inf] * (len(results[kind]) - len(reached)))
                                if reached else math.inf, f"{len(reached)}/{len(results[kind])}")
    base = rows.get("keras-sequence") or next(iter(rows.values()))
    head = (f"\n{'pipeline':18s} {'setup s':>8s} {'epoch 1 s':>9s} {'epoch s':>8s} {'img/s':>7s} {'epochs':>6s} "
            f"{'in all s':>9s} {'vs Sequence':>11s} {'chars':>6s} {'plates':>6s}")
    for name, _, _ in targets:
        head += f" {name + ' s':>16s} {'runs':>4s} {'vs Sequence':>11s}"
    print(head)
    for kind, r in rows.items():
        line = (f"{kind:18s} {r['setup']:8.1f} {r['first']:9.1f} {r['epoch']:8.1f} {a.count / r['epoch']:7,.0f} "
                f"{r['epochs']:6g} {r['total']:9.1f} {base['total'] / r['total']:10.2f}× {r['acc']:6.1%} "
                f"{r['plates']:6.1%}")
        for name, _, _ in targets:
            (when, runs), (base_when, _) = r[name], base[name]
            shown = f"{when:16.1f}" if math.isfinite(when) else f"{'not reached':>16s}"
            ratio = f"{base_when / when:10.2f}×" if math.isfinite(when) and math.isfinite(base_when) else f"{'—':>11s}"
            line += f" {shown} {runs:>4s} {ratio}"
        print(line)
    if a.max_minutes:
        print(f"# --max-minutes {a.max_minutes:g}: each contender but trainfast stopped training at the end of the "
              f"first epoch past {a.max_minutes:g} minutes; \"not reached\" means not within them")
    if "trainfast" in results:
        print(f"# trainfast settings: {results['trainfast'][0]['settings']}; tune took "
              f"{results['trainfast'][0]['tune_s']:.1f} s in the first run (near 0 when this machine's choice "
              "was already cached), not counted in setup: it is once per machine and model")
    out = os.environ.get("TRAINFAST_BENCH_JSON")
    if out:
        Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    import sys

    from trainfast.hardware import OtherLoad

    with OtherLoad() as load:  # a busy neighbour makes every figure here low
        main()
    print(load.summary(), file=sys.stderr)  # stderr: a parent benchmark parses this one's stdout

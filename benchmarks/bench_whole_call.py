"""The whole call a user makes, side by side (issue 48): `trainfast.fit(model, pack, val,
batch_size=B, epochs=E)` against Keras 3's `model.fit(x, y, batch_size=B, epochs=E,
validation_data=...)` on the same learnable images, for the users' three CNNs.

    python benchmarks/bench_whole_call.py [--models cifar_cnn plate_cnn classifier512] [--rounds 2]

Each side runs in a fresh process of its own, the sides alternating round by round (Keras first
in odd rounds). The images are made the same way on both sides (seeded): for the plates, rendered plate
photos (trainfast.datasets.plates), else dim noise with each label drawn into its image (a
bright square at the class's place), so both sides can learn them; 10% more are the held-out
set both validate on after every epoch. Keras gets the arrays in memory as float32 in [0, 1], its
best policy on this CPU (mixed_bfloat16 where the CPU has bf16 instructions, else float32; both
with --keras-policies) and a warm-up fit of two batches first (tracing), which is not timed.
trainfast gets a pack of the same images (made before the clock starts) and an empty cache, so
its tune runs as on a first call; its own account of the call (tune, first steps, training,
validation, saves) is printed beside the wall time. Needs the benchmark extra (TensorFlow):
pip install torch==2.13.0 -e ".[bench]".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# model: (training images, the users' batch, epochs): the issue's table
SETTINGS = {"cifar_cnn": (10_000, 256, 5), "plate_cnn": (4_000, 128, 5), "classifier512": (400, 32, 2)}
ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
SHAPES = {"cifar_cnn": ((32, 32), (10,)), "plate_cnn": ((64, 128), (8, 36)), "classifier512": ((512, 512), (10,))}


def learnable(name: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n images (N, H, W, 3) uint8 and their labels: for the plates, rendered plate photos
    (trainfast.datasets.plates: a glyph per character, in several fonts, with perspective, blur and
    noise; ~7 ms each), resized to the model's input; else dim noise with the label drawn in."""
    (h, w), out = SHAPES[name]
    rng = np.random.default_rng(seed)
    if len(out) == 2:  # L characters of K symbols
        return _plates(n, seed, (h, w))
    x = rng.integers(0, 96, (n, h, w, 3), dtype=np.uint8)
    k = out[0]
    y = rng.integers(0, k, n)
    s = h // 4
    for c in range(k):  # class c: a bright square in cell c of a 4x4 grid, jittered a little
        r, col = divmod(c, 4)
        for i in np.flatnonzero(y == c):
            dy, dx = rng.integers(0, max(s // 4, 1), 2)
            x[i, r * s + dy:(r + 1) * s + dy - s // 4, col * s + dx:(col + 1) * s + dx - s // 4, c % 3] += 150
    return x, y


def _plates(n: int, seed: int, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    import io

    from PIL import Image

    from trainfast.datasets.plates import font_paths, render

    fonts, (h, w) = font_paths(), size
    x, y = np.empty((n, h, w, 3), np.uint8), np.empty((n, 8), np.int64)
    for i in range(n):
        jpeg, text, _ = render(seed, i, fonts)
        x[i] = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB").resize((w, h), Image.BILINEAR))
        y[i] = [ALPHABET.index(ch) for ch in text]
    return x, y


def _data(name: str):
    n, _, _ = SETTINGS[name]
    return learnable(name, n, 0), learnable(name, n // 10, 1)


def run_trainfast(name: str) -> dict:
    import torch

    import trainfast
    from trainfast import models

    (x, y), (xv, yv) = _data(name)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRAINFAST_CACHE"] = str(Path(tmp) / "cache")  # a first call: nothing tuned yet
        chars = {"alphabet": ALPHABET} if y.ndim == 2 else {}  # the plates' 36 symbols
        train = trainfast.pack((x, y), Path(tmp) / "train.pack", progress=False, **chars)
        val = trainfast.pack((xv, yv), Path(tmp) / "val.pack", progress=False, **chars)
        net = models.create(name)
        _, batch, epochs = SETTINGS[name]
        lines: list[tuple[float, str]] = []
        t = time.perf_counter()
        r = trainfast.fit(net, train, val, batch_size=batch, epochs=epochs, device="cpu", run_dir=Path(tmp) / "run",
                          progress=False, log=lambda m: lines.append((time.perf_counter() - t, str(m))))
        wall = time.perf_counter() - t
    return {"side": "trainfast", "model": name, "wall_s": wall, "images": len(x) * epochs,
            "acc": r.history[-1].get("val_acc"), "settings": r.speed.label(),
            "costs": {k: round(v, 2) for k, v in r.costs.items()}, "epochs_s": [h["seconds"] for h in r.history],
            "log": [f"{s:6.1f}s {m}" for s, m in lines], "versions": {"torch": torch.__version__}}


def run_keras(name: str, policy: str) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, str(HERE))
    import keras
    from keras_models import build_plain

    (x, y), (xv, yv) = _data(name)
    x, xv = x.astype(np.float32) / 255, xv.astype(np.float32) / 255
    _, batch, epochs = SETTINGS[name]
    model = build_plain(name, policy)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[:2 * batch], y[:2 * batch], batch_size=batch, epochs=1, verbose=0,
              validation_data=(xv[:batch], yv[:batch]))  # warm-up: tracing, not timed
    t = time.perf_counter()
    h = model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, validation_data=(xv, yv))
    wall = time.perf_counter() - t
    return {"side": f"keras {policy}", "model": name, "wall_s": wall, "images": len(x) * epochs,
            "acc": h.history["val_accuracy"][-1],
            "versions": {"keras": keras.__version__, "backend": keras.backend.backend()}}


def _child(args: list[str]) -> dict:
    p = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _policies(asked: list[str] | None) -> list[str]:
    if asked:
        return asked
    from trainfast import hardware
    return ["mixed_bfloat16", "float32"] if hardware.cpu_has_bf16() else ["float32"]


def _say(name: str, runs: dict[str, list[dict]]) -> None:
    ours = runs["trainfast"]
    rate = {side: statistics.median(r["images"] / r["wall_s"] for r in rs) for side, rs in runs.items()}
    keras_best = max((s for s in rate if s != "trainfast"), key=rate.get)
    acc = {side: statistics.median(r["acc"] for r in rs) for side, rs in runs.items()}
    print(f"{name:14s} " + "  ".join(f"{side} {rate[side]:7.1f} img/s ({acc[side]:.1%})" for side in rate)
          + f"   trainfast / {keras_best}: {rate['trainfast'] / rate[keras_best]:.2f}×", flush=True)
    for r in ours:
        print(f"    trainfast {r['wall_s']:.1f} s, {r['settings']}; epochs " +
              ", ".join(f"{s:.1f}" for s in r["epochs_s"]) + " s" +
              (f"; {r['costs']}" if r.get("costs") else ""))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--keras-policies", nargs="+", choices=["float32", "mixed_bfloat16"],
                   help="default: mixed_bfloat16 and float32 where the CPU has bf16 instructions, else float32")
    p.add_argument("--show-log", action="store_true", help="print trainfast's log of each run")
    p.add_argument("--worker", nargs=2, metavar=("SIDE", "MODEL"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        side, name = a.worker
        print(json.dumps(run_trainfast(name) if side == "trainfast" else run_keras(name, side)))
        return
    import platform

    import torch

    from trainfast import hardware
    print(f"# {hardware.cpu_model()}, {os.cpu_count()} CPUs, {' '.join(hardware.isa_features())}; Python "
          f"{platform.python_version()}, torch {torch.__version__}")
    sides = ["trainfast", *_policies(a.keras_policies)]
    out = []
    for name in a.models:
        n, batch, epochs = SETTINGS[name]
        print(f"# {name}: {n:,} training images, {n // 10:,} held out, batch {batch}, {epochs} epochs", flush=True)
        runs: dict[str, list[dict]] = {}
        for i in range(a.rounds):
            for side in (sides if i % 2 else sides[::-1]):
                r = _child(["--worker", side, name])
                runs.setdefault("trainfast" if side == "trainfast" else r["side"], []).append(r)
                if a.show_log and side == "trainfast":
                    print("\n".join(r["log"]))
        _say(name, runs)
        out.append(runs)
    if os.environ.get("TRAINFAST_BENCH_JSON"):
        Path(os.environ["TRAINFAST_BENCH_JSON"]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    from trainfast.hardware import OtherLoad

    with OtherLoad() as load:  # a busy neighbour makes every figure here low
        main()
    print(load.summary(), file=sys.stderr)

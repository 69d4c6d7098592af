"""Which feed keeps a Keras `model.fit` busiest, per backend: the users' own feeds against a
trainfast pack, on the stories' models.

    python benchmarks/bench_keras_feed.py [--backends tensorflow torch jax] [--models plate_cnn cifar_cnn]
                                          [--images 1000] [--runs 3]

Each backend runs in a fresh process (KERAS_BACKEND is fixed at Keras's import). There, for one
model, every feed trains the same compiled model one epoch after another in turn (round-robin,
so a burst of load on this shared machine hits all feeds alike), after one warm-up epoch each;
a figure is the median images/s of --runs epochs. The feeds:

  files (the plate story: a CSV of photos, resized to 64×128 per batch)
    sequence      the story's keras.utils.Sequence: skimage imread + resize per image, one worker
    sequence_mp   the same Sequence with workers=4, use_multiprocessing=True
    tfdata        the best tf.data pipeline from the files: parallel read/decode/resize (AUTOTUNE),
                  cache, shuffle, batch, prefetch (every backend can iterate tf.data)
  folders (the 512² story: JPEG photos in class folders, 512×512 after resizing, batch 5)
    from_directory  keras.utils.image_dataset_from_directory(...), Keras 3's flow_from_directory
    tfdata        the same with .cache().prefetch(AUTOTUNE)
  arrays (the CIFAR story: uint8 images in memory)
    arrays        model.fit(x / 255.0, y, batch_size=...) as the story wrote it
    tfdata        from_tensor_slices(uint8), shuffle, batch, map(cast / 255, AUTOTUNE), prefetch
  a trainfast pack of the same images, for both
    packdataset   trainfast.keras.PackDataset (numpy batches)
    tf_pack       a tf.data pipeline over the pack's uint8 batches, cast to float in TensorFlow's
                  threads (Keras on torch and JAX iterate tf.data too): the candidate for a
                  TensorFlow fast path

Needs TensorFlow, JAX and Keras (`pip install tensorflow-cpu jax keras scikit-image`) beside
trainfast; writes nothing outside a temporary folder. Prints one JSON line per (backend, model,
feed) and a table; docs/BENCHMARKS.md keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BATCH = {"plate_cnn": 128, "cifar_cnn": 256, "classifier512": 5}
ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _data(model: str, images: int, tmp: Path) -> dict:
    """The model's data as its story has it (files or arrays), and a pack of the same images."""
    import numpy as np

    import trainfast
    if model == "plate_cnn":
        from trainfast.datasets.plates import make_plates
        make_plates(tmp / "plates", count=images, seed=1)
        pk = trainfast.pack(tmp / "plates" / "labels.csv", tmp / "plates.pack", size=(64, 128), label_column="plate",
                            progress=False)
        return {"csv": str(tmp / "plates" / "labels.csv"), "pack": str(pk.path)}
    rng = np.random.default_rng(0)
    if model == "classifier512":  # the 512² story: JPEG photos in class folders, larger than 512²
        from PIL import Image
        for i in range(images):
            folder = tmp / "photos" / f"class{i % 10}"
            folder.mkdir(parents=True, exist_ok=True)
            small = rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)  # smooth, photo-like after upscaling
            Image.fromarray(small).resize((800, 600), Image.BILINEAR).save(folder / f"{i:05d}.jpg", quality=90)
        pk = trainfast.pack(tmp / "photos", tmp / "photos.pack", size=(512, 512), progress=False)
        return {"folder": str(tmp / "photos"), "pack": str(pk.path)}
    side = 32
    x = rng.integers(0, 256, (images, side, side, 3), dtype=np.uint8)
    y = rng.integers(0, 10, images)
    np.savez(tmp / "arrays.npz", x=x, y=y)
    pk = trainfast.pack((x, y), tmp / "arrays.pack", progress=False)
    return {"npz": str(tmp / "arrays.npz"), "pack": str(pk.path)}


def _feeds(model: str, data: dict, batch: int) -> dict:
    """name → a function returning (x, kwargs) for model.fit, built fresh for each epoch where needed."""
    import csv

    import keras
    import numpy as np
    import tensorflow as tf

    from trainfast.keras import PackDataset

    feeds = {}
    if "csv" in data:
        from skimage.io import imread
        from skimage.transform import resize
        root = os.path.dirname(data["csv"])
        with open(data["csv"], newline="") as f:
            rows = [(os.path.join(root, r["path"]), r["plate"]) for r in csv.DictReader(f)]

        class PlateSequence(keras.utils.PyDataset):  # the story's generator
            def __init__(self, **kwargs):
                super().__init__(**kwargs)

            def __len__(self):
                return math.ceil(len(rows) / batch)

            def __getitem__(self, i):
                chunk = rows[i * batch:(i + 1) * batch]
                x = np.stack([resize(imread(p), (64, 128)) for p, _ in chunk]).astype("float32")
                return x, np.array([[ALPHABET.index(c) for c in plate] for _, plate in chunk])

        feeds["sequence"] = lambda: (PlateSequence(), {})
        feeds["sequence_mp"] = lambda: (PlateSequence(workers=4, use_multiprocessing=True), {})
        paths = [p for p, _ in rows]
        labels = np.array([[ALPHABET.index(c) for c in plate] for _, plate in rows])

        def load(path, label):
            img = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
            return tf.image.resize(img, (64, 128)) / 255.0, label
        files_ds = (tf.data.Dataset.from_tensor_slices((paths, labels)).map(load, num_parallel_calls=tf.data.AUTOTUNE)
                    .cache().shuffle(len(paths)).batch(batch).prefetch(tf.data.AUTOTUNE))
        feeds["tfdata"] = lambda: (files_ds, {})
    elif "folder" in data:  # Keras 3's form of the story's flow_from_directory
        def from_directory():
            return keras.utils.image_dataset_from_directory(data["folder"], image_size=(512, 512), batch_size=batch,
                                                            verbose=False)
        scaled = lambda ds: ds.map(lambda a, b: (a / 255.0, b))  # noqa: E731 - the story's rescale=1/255
        plain = scaled(from_directory())
        best = scaled(from_directory()).cache().prefetch(tf.data.AUTOTUNE)
        feeds["from_directory"] = lambda: (plain, {})
        feeds["tfdata"] = lambda: (best, {})
    else:
        z = np.load(data["npz"])
        x8, y = z["x"], z["y"]
        xf = x8 / 255.0  # as the story wrote it (float64 → Keras converts per batch)
        feeds["arrays"] = lambda: (xf, {"y": y, "batch_size": batch})
        arr_ds = (tf.data.Dataset.from_tensor_slices((x8, y)).shuffle(len(y)).batch(batch)
                  .map(lambda a, b: (tf.cast(a, tf.float32) / 255.0, b), num_parallel_calls=tf.data.AUTOTUNE)
                  .prefetch(tf.data.AUTOTUNE))
        feeds["tfdata"] = lambda: (arr_ds, {})
    pds = PackDataset(data["pack"], batch_size=batch, drop_last=False)
    tfpack = tf_pack(data["pack"], batch)
    feeds["packdataset"] = lambda: (pds, {})
    feeds["tf_pack"] = lambda: (tfpack, {})
    return feeds


def tf_pack(pack, batch_size: int):
    """A tf.data pipeline over a pack's uint8 batches (the Loader's order), cast to float32 by a
    TensorFlow map on its own threads and prefetched: a quarter of the bytes through Python."""
    import tensorflow as tf
    import torch

    from trainfast import Loader

    loader = Loader(pack, batch_size, drop_last=False, device="cpu", dtype=torch.uint8, workers=1)
    h, w, c = loader.pack.shape
    epochs = iter(range(1 << 62))  # each pass over the dataset is the Loader's next epoch

    def batches():
        epoch = next(epochs)
        for k in range(len(loader)):
            x, y = loader.batch(k, epoch)
            yield x.permute(0, 2, 3, 1).numpy(), y.numpy()  # NHWC uint8 as stored: no copy

    ds = tf.data.Dataset.from_generator(batches, output_signature=(
        tf.TensorSpec(shape=(None, h, w, c), dtype=tf.uint8),
        tf.TensorSpec(shape=(None, *loader.pack.labels.shape[1:]), dtype=tf.int64)))
    ds = ds.map(lambda x, y: (tf.cast(x, tf.float32) * (1 / 255), y), num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE).apply(tf.data.experimental.assert_cardinality(len(loader)))


def child(model: str, images: int, runs: int, feeds_wanted: list[str] | None):
    """One backend, one model: every feed trains the same model, epochs round-robin."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import warnings
    warnings.filterwarnings("ignore")  # Keras's "shuffle ignored for tf.data" on every fit
    sys.path.insert(0, str(HERE))
    import keras
    import keras_models

    from trainfast import hardware

    batch = BATCH[model]
    with tempfile.TemporaryDirectory(prefix="bench-keras-feed-") as tmp:
        data = _data(model, images, Path(tmp))
        feeds = _feeds(model, data, batch)
        if feeds_wanted:
            feeds = {k: v for k, v in feeds.items() if k in feeds_wanted}
        net = keras_models.build(model, "float32")
        rates: dict[str, list[float]] = {k: [] for k in feeds}
        loads: dict[str, list[float]] = {k: [] for k in feeds}
        for epoch in range(runs + 1):  # epoch 0: warm-up (tracing, tf.data's cache, worker start)
            for name, make in feeds.items():
                x, kw = make()
                with hardware.OtherLoad() as load:
                    t = time.perf_counter()
                    net.fit(x, epochs=1, verbose=0, **kw)
                    seconds = time.perf_counter() - t
                if epoch:
                    rates[name].append(images / seconds)
                    loads[name].append(load.cores if load.cores is not None else float("nan"))
        for name in feeds:
            print(json.dumps({"backend": keras.backend.backend(), "model": model, "feed": name, "batch": batch,
                              "images": images, "images_per_s": statistics.median(rates[name]),
                              "runs": [round(r, 1) for r in rates[name]],
                              "other_cores": max(loads[name]) if loads[name] else None,
                              "versions": {"keras": keras.__version__}}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=["tensorflow", "torch", "jax"])
    p.add_argument("--models", nargs="+", default=["plate_cnn", "cifar_cnn"], choices=list(BATCH))
    p.add_argument("--images", type=int, default=0, help="images per epoch (default: 1000 plates, 3000 arrays, "
                                                         "40 at 512²)")
    p.add_argument("--runs", type=int, default=3, help="timed epochs per feed")
    p.add_argument("--feeds", nargs="+", help="only these feeds")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "IMAGES"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child[0], int(a.child[1]), a.runs, a.feeds)
    results = []
    for backend in a.backends:
        for model in a.models:
            images = a.images or {"plate_cnn": 1000, "cifar_cnn": 3000, "classifier512": 40}[model]
            cmd = [sys.executable, __file__, "--child", model, str(images), "--runs", str(a.runs)]
            cmd += ["--feeds", *a.feeds] if a.feeds else []
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "KERAS_BACKEND": backend})
            if proc.returncode:
                print(f"{backend} {model} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            for line in proc.stdout.splitlines():
                if line.startswith("{"):
                    print(line, flush=True)
                    results.append(json.loads(line))
    print(f"\n{'backend':11s} {'model':10s} {'feed':12s} {'images/s':>9s} {'× story':>8s} {'× best user':>11s}")
    for backend in a.backends:
        for model in a.models:
            rows = [r for r in results if r["backend"] == backend and r["model"] == model]
            if not rows:
                continue
            story = next((r for r in rows if r["feed"] in ("sequence", "arrays", "from_directory")), rows[0])["images_per_s"]
            best_user = max(r["images_per_s"] for r in rows if r["feed"] not in ("packdataset", "tf_pack"))
            for r in rows:
                print(f"{backend:11s} {model:10s} {r['feed']:12s} {r['images_per_s']:9,.0f} "
                      f"{r['images_per_s'] / story:8.2f} {r['images_per_s'] / best_user:11.2f}")


if __name__ == "__main__":
    main()

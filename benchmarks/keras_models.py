"""The users' three CNNs as they wrote them in Keras 3, and a training-step timer for them.

Run on its own, it prints one JSON line of images/s per (model, policy), so that
bench_vs_keras.py can run Keras in a fresh process, apart from PyTorch:

    python benchmarks/keras_models.py --models cifar_cnn --policies float32 mixed_bfloat16

Benchmark-only: needs `pip install tensorflow-cpu keras` (the `bench` extra); the package never does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from keras_plates import plate_cnn as _story_plate_cnn  # noqa: E402

INPUT = {"plate_cnn": (64, 128, 3), "classifier512": (512, 512, 3), "cifar_cnn": (32, 32, 3), "plate_net": (64, 128, 3)}
OUTPUT = {"plate_cnn": (8, 36), "classifier512": (10,), "cifar_cnn": (10,), "plate_net": (8, 36)}
# trainable parameters, equal to the PyTorch ports' (trainfast.models); batch-norm statistics are not counted
PARAMS = {"plate_cnn": 264_560, "classifier512": 32_641_130, "cifar_cnn": 276_138, "plate_net": 295_476}


def plate_cnn() -> keras.Model:
    return _story_plate_cnn(logits=True)  # the one definition, in the Keras walk-through's example


def classifier512() -> keras.Model:
    return keras.Sequential([
        keras.Input((512, 512, 3)),
        layers.Conv2D(64, 3, strides=2, padding="same", activation="relu"), layers.Dropout(0.25),
        layers.Conv2D(64, 3, strides=2, padding="same", activation="relu"), layers.Dropout(0.25),
        layers.Conv2D(32, 3, activation="relu"), layers.MaxPooling2D(3, 2),
        layers.Flatten(), layers.Dense(256, activation="relu"), layers.Dense(4096, activation="relu"),
        layers.Dense(10, dtype="float32"),
    ])


def cifar_cnn() -> keras.Model:
    def block(n):
        return [layers.Conv2D(n, 3, padding="same", activation="relu"), layers.Conv2D(n, 3, activation="relu"),
                layers.MaxPooling2D(2), layers.Dropout(0.25)]
    return keras.Sequential([keras.Input((32, 32, 3)), *block(32), *block(64), *block(64), layers.Flatten(),
                             layers.Dense(512, activation="relu"), layers.Dropout(0.25),
                             layers.Dense(10, dtype="float32")])


def plate_net() -> keras.Model:
    """trainfast's better plate reader (trainfast/models/better.py: PlateNet) written in Keras:
    a model that learns, so that time to an accuracy can be compared."""
    def bn_relu():
        return [layers.BatchNormalization(momentum=0.9, epsilon=1e-5), layers.ReLU()]  # PyTorch's BN defaults

    def conv_bn(n, stride=1):
        return [layers.Conv2D(n, 3, strides=stride, padding="same", use_bias=False), *bn_relu()]
    return keras.Sequential([
        keras.Input((64, 128, 3)),
        *conv_bn(16, 2), *conv_bn(32), layers.MaxPooling2D(2), *conv_bn(64), layers.MaxPooling2D(2), *conv_bn(64),
        layers.Conv2D(128, (8, 1), use_bias=False), *bn_relu(),          # the 8 rows folded: (1, 16, 128)
        layers.Reshape((16, 128)),
        layers.Conv1D(128, 5, padding="same", use_bias=False), *bn_relu(),
        layers.Conv1D(128, 5, padding="same", use_bias=False), *bn_relu(),  # 9 columns per position
        layers.AveragePooling1D(2), layers.Dropout(0.1),                 # 16 columns → 8 positions
        layers.Conv1D(36, 1, dtype="float32"),                           # (8, 36) logits
    ])


MODELS = {"plate_cnn": plate_cnn, "classifier512": classifier512, "cifar_cnn": cifar_cnn, "plate_net": plate_net}


def build_plain(name: str, policy: str) -> keras.Model:
    """The model under a precision policy ("float32", "mixed_bfloat16"), not compiled."""
    keras.mixed_precision.set_global_policy(policy)
    model = MODELS[name]()
    trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    assert trainable == PARAMS[name], (name, trainable)
    return model


def build(name: str, policy: str) -> keras.Model:
    model = build_plain(name, policy)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9, nesterov=True),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def step_rate(name: str, policy: str, batch: int, steps: int, runs: int) -> list[float]:
    """images/s of `fit` on in-memory random batches: `runs` timed epochs of `steps` steps after a warm-up epoch."""
    model = build(name, policy)
    rng = np.random.default_rng(0)
    n = batch * 2
    x = rng.random((n, *INPUT[name]), dtype=np.float32)
    y = rng.integers(0, OUTPUT[name][-1], (n, *OUTPUT[name][:-1]))
    import tensorflow as tf
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).cache().repeat().prefetch(2)
    model.fit(ds, steps_per_epoch=3, epochs=1, verbose=0)  # warm-up: tracing, XLA
    rates = []
    for _ in range(runs):
        t = time.perf_counter()
        model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0)
        rates.append(steps * batch / (time.perf_counter() - t))
    return rates


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--policies", nargs="+", default=["float32", "mixed_bfloat16"])
    p.add_argument("--batch", type=int, nargs="+", help="one batch per model (default: the users' batches)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    default = {"plate_cnn": 128, "classifier512": 32, "cifar_cnn": 256}
    for i, name in enumerate(a.models):
        batch = a.batch[i] if a.batch else default[name]
        for policy in a.policies:
            r = step_rate(name, policy, batch, a.steps, a.runs)
            print(json.dumps({"framework": "keras", "model": name, "policy": policy, "batch": batch,
                              "images_per_s": statistics.median(r), "runs": r,
                              "versions": {"keras": keras.__version__, "backend": keras.backend.backend()}}),
                  flush=True)


if __name__ == "__main__":
    main()

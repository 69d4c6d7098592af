"""The license-plate story's Keras training, as its user wrote it, and the same with a pack.

    python examples/keras_plates.py plates/                     # the user's Sequence: imread + resize per image
    python examples/keras_plates.py plates/ --pack plates.pack  # the same model on a trainfast pack

plates/ is what `trainfast make-plates plates --count 4000` writes (images/ and labels.csv
of path,plate); plates.pack is what `trainfast pack plates/labels.csv plates.pack --size 64x128
--label-column plate` writes. Prints each epoch's time. See docs/KERAS.md.

Needs Keras 3, a backend and scikit-image: `pip install torch==2.13.0 -e ".[keras,demo]" tensorflow-cpu`
(or KERAS_BACKEND=torch with the torch you have).
"""

import argparse
import csv
import math
import os
import time

import keras
import numpy as np
from keras import layers
from skimage.io import imread
from skimage.transform import resize

ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class PlateSequence(keras.utils.Sequence):
    """The user's generator: every batch of every epoch decodes and resizes its photos again."""

    def __init__(self, root, batch_size=64):
        super().__init__()
        with open(os.path.join(root, "labels.csv"), newline="") as f:
            self.rows = [(os.path.join(root, r["path"]), r["plate"]) for r in csv.DictReader(f)]
        self.batch_size = batch_size

    def __len__(self):
        return math.ceil(len(self.rows) / self.batch_size)

    def __getitem__(self, i):
        rows = self.rows[i * self.batch_size:(i + 1) * self.batch_size]
        x = np.stack([resize(imread(path), (64, 128)) for path, _ in rows]).astype("float32")
        y = np.array([[ALPHABET.index(c) for c in plate] for _, plate in rows])
        return x, y


def plate_cnn(logits=False):
    """The story's model: 264,560 parameters, (8, 36) out: probabilities (the story's softmax),
    or with logits=True raw scores in float32 under any precision policy (for a from_logits loss)."""
    return keras.Sequential([
        keras.Input((64, 128, 3)),
        layers.Conv2D(32, 3, activation="relu"), layers.MaxPooling2D(2),
        layers.Conv2D(32, 3, activation="relu"), layers.MaxPooling2D(2),
        layers.Conv2D(64, 3, activation="relu"), layers.MaxPooling2D(2),
        layers.Conv2D(64, 3, activation="relu"), layers.MaxPooling2D(2),
        layers.Flatten(), layers.Dropout(0.25), layers.Reshape((1, 768)),
        layers.Dense(256, activation="relu"), layers.Dense(8, activation="relu"),
        layers.Permute((2, 1)), layers.Dense(36, activation=None if logits else "softmax", dtype="float32"),
    ])


class EpochTimes(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.t = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch {epoch + 1}: {time.perf_counter() - self.t:.1f} s, loss {logs['loss']:.3f}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", help="folder with images/ and labels.csv")
    p.add_argument("--pack", help="train from this trainfast pack instead of the per-image Sequence")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    a = p.parse_args()
    if a.pack:
        from trainfast.keras import PackDataset
        data = PackDataset(a.pack, batch_size=a.batch_size)  # the only line that changes
    else:
        data = PlateSequence(a.root, batch_size=a.batch_size)
    model = plate_cnn()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(data, epochs=a.epochs, verbose=0, callbacks=[EpochTimes()])


if __name__ == "__main__":
    main()

"""Benchmark data: real photos as JPEGs of varied size, made from scikit-image's samples.

Random crops and rescales of the colour photos that scikit-image ships (no download), saved
as JPEGs in a Keras-style folder (two classes) with a CSV beside it. Deterministic for a seed.

    python benchmarks/photos.py bench-data/photos --count 2000
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
from PIL import Image

SAMPLES = ["astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry",
           "retina", "colorwheel", "stereo_motorcycle"]


def _samples() -> list[np.ndarray]:
    import skimage.data

    out = []
    for name in SAMPLES:
        im = getattr(skimage.data, name)()
        out.append(im[0] if isinstance(im, tuple) else im)
    return [np.ascontiguousarray(im[..., :3]) for im in out]


def make_photos(root, count: int = 2000, seed: int = 0) -> Path:
    """Write `count` JPEGs under root/{a,b}/ and root/labels.csv; reuse them if already there."""
    root = Path(root)
    done = root / ".complete"
    if done.exists() and int(done.read_text()) == count:
        return root
    rng = np.random.default_rng(seed)
    photos = _samples()
    rows = ["path,label"]
    for i in range(count):
        src = photos[int(rng.integers(len(photos)))]
        h, w = src.shape[:2]
        ch, cw = int(rng.integers(h // 3, h + 1)), int(rng.integers(w // 3, w + 1))
        y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        scale = float(rng.uniform(0.6, 1.6))
        im = Image.fromarray(src[y: y + ch, x: x + cw]).resize((max(32, int(cw * scale)), max(32, int(ch * scale))))
        label = "ab"[i % 2]
        os.makedirs(root / label, exist_ok=True)
        rel = f"{label}/{i:05d}.jpg"
        im.save(root / rel, quality=int(rng.integers(80, 96)))
        rows.append(f"{rel},{label}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    done.write_text(str(count))
    return root


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root")
    p.add_argument("--count", type=int, default=2000)
    a = p.parse_args()
    print(make_photos(a.root, a.count))


PATCH_SOURCES = ["astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry",
                 "stereo_motorcycle", "brick", "grass", "gravel"]
"""The ten photographs of natural_patches: one class each (the last three grey, made RGB)."""


def natural_patches(train: int = 10_000, test: int = 2_500, size: int = 32, seed: int = 0, held_out: float = 0.25):
    """Square patches of ten of scikit-image's photographs, the class being the photograph:
    ((x_train, y_train), (x_test, y_test)), x uint8 (N, size, size, 3), y int64, classes balanced.

    Each patch is a crop of 24–96 pixels (at most the region's width) resized to `size`. The
    held-out patches come from the right `held_out` of each photograph's width, the training
    patches from the rest: no held-out pixel was ever seen in training."""
    import skimage.data

    rng = np.random.default_rng(seed)
    photos = []
    for name in PATCH_SOURCES:
        im = getattr(skimage.data, name)()
        im = im[0] if isinstance(im, tuple) else im
        photos.append(np.ascontiguousarray(np.stack([im] * 3, -1) if im.ndim == 2 else im[..., :3]))

    def cut(count: int, right: bool):
        x = np.empty((count, size, size, 3), np.uint8)
        y = np.arange(count, dtype=np.int64) % len(photos)
        for i, label in enumerate(y):
            src = photos[label]
            h, w = src.shape[:2]
            split = int(w * (1 - held_out))
            lo, hi = (split, w) if right else (0, split)
            side = int(rng.integers(24, min(96, hi - lo, h) + 1))
            top, left = int(rng.integers(0, h - side + 1)), int(rng.integers(lo, hi - side + 1))
            crop = Image.fromarray(src[top:top + side, left:left + side])
            x[i] = np.asarray(crop.resize((size, size), Image.BILINEAR))
        order = rng.permutation(count)
        return x[order], y[order]

    return cut(train, False), cut(test, True)

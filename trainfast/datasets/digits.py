"""scikit-learn's bundled handwritten digits (1,797 images, 8×8, 10 classes) as a tiny real
dataset, upscaled for CNNs. Needs scikit-learn (`pip install scikit-learn`); nothing is
downloaded: the data ships inside scikit-learn.
"""

from __future__ import annotations

import numpy as np
from PIL import Image


def load_digits(size: int = 32) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(images (N, size, size) uint8, labels (N,) int64, class names '0'…'9')."""
    try:
        from sklearn.datasets import load_digits as _load
    except ImportError:
        raise ImportError("the digits dataset needs scikit-learn: pip install scikit-learn") from None
    d = _load()
    small = (d.images * (255 / 16)).round().astype(np.uint8)  # 0..16 → 0..255
    images = np.stack([np.asarray(Image.fromarray(im).resize((size, size), Image.BILINEAR)) for im in small])
    return images, d.target.astype(np.int64), [str(i) for i in range(10)]


def split(images, labels, test_fraction: float = 0.2, seed: int = 0):
    """A seeded, stratified-enough shuffle split: (train_images, train_labels, test_images, test_labels)."""
    order = np.random.default_rng(seed).permutation(len(images))
    n_test = int(len(images) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return images[train], labels[train], images[test], labels[test]

"""Shared fixtures: small image datasets made on the spot (no downloads, nothing in git)."""

import os
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("KERAS_BACKEND", "torch")  # Keras tests run without TensorFlow


def write_images(root, classes=("cat", "dog"), per_class=12, seed=0, ext=".jpg"):
    """A Keras-style folder: root/<class>/<i><ext>, photos of random size and content."""
    rng = np.random.default_rng(seed)
    for c, name in enumerate(classes):
        os.makedirs(root / name, exist_ok=True)
        for i in range(per_class):
            h, w = int(rng.integers(40, 120)), int(rng.integers(40, 160))
            base = np.full((h, w, 3), 60 + 120 * c, np.uint8)  # the class is visible in the colour
            img = np.clip(base + rng.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(root / name / f"{i:03d}{ext}")
    return root


def png_bomb(path, width=40000, height=40000):
    """A tiny PNG whose header claims a huge image: Pillow must refuse it before decoding."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b"")
    path.write_bytes(data)


@pytest.fixture
def image_folder(tmp_path):
    return write_images(tmp_path / "photos")


@pytest.fixture(autouse=True, scope="session")
def _cache_in_tmp(tmp_path_factory):
    """Measured peaks and tune choices go to a per-session cache, not the user's home."""
    os.environ["TRAINFAST_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield


@pytest.fixture(scope="session")
def digits_packs(tmp_path_factory):
    """scikit-learn's digits at 32×32 RGB: (train pack, test pack)."""
    import trainfast
    from trainfast.datasets.digits import load_digits, split

    tmp = tmp_path_factory.mktemp("digits")
    x, y, classes = load_digits(32)
    xtr, ytr, xte, yte = split(x, y, 0.2, seed=0)
    train = trainfast.pack((xtr, ytr), tmp / "train", size=(32, 32), progress=False)
    test = trainfast.pack((xte, yte), tmp / "test", size=(32, 32), progress=False)
    return train, test


SMALL_NET = '''
import torch.nn as nn


def small():
    """No batch-norm, no dropout: deterministic across DDP and single-process runs."""
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
    net.input_shape, net.output_shape = (3, 32, 32), (10,)
    return net
'''


@pytest.fixture(scope="session")
def small_net_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "small_net.py"
    path.write_text(SMALL_NET)
    return path

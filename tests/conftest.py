"""Shared fixtures: small image datasets made on the spot (no downloads, nothing in git)."""

import os
import signal
import struct
import zlib

import numpy as np
import pytest
import torch
import torch.nn as nn
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


def step_clock(monkeypatch, seconds):
    """fit's thread trials (adapt.Threads) read a clock that advances, at each reading, by
    seconds(threads) (a dict or a function of torch's thread count now, i.e. the count the
    step just ended ran with): a step's time at each count, as a neighbour would make it."""
    import torch

    from trainfast.train import adapt
    t = [0.0]

    def now():
        n = torch.get_num_threads()
        t[0] += seconds(n) if callable(seconds) else seconds[n]
        return t[0]
    monkeypatch.setattr(adapt, "_now", now)


def other_load(monkeypatch, cores, machine_cores: int | None = 2):
    """Pretend other processes keep `cores` (a number, or a function called per measurement)
    busy during every hardware.OtherLoad measurement, on a machine of `machine_cores` cores
    whose torch starts with as many threads (None: this machine's)."""
    from trainfast import hardware

    def so_far(self):
        return cores() if callable(cores) else cores
    monkeypatch.setattr(hardware.OtherLoad, "so_far", so_far)
    if machine_cores:
        for name in ("usable_cores", "physical_cores", "default_threads"):
            monkeypatch.setattr(hardware, name, lambda: machine_cores)


def png_bomb(path, width=40000, height=40000):
    """A tiny PNG whose header claims a huge image: Pillow must refuse it before decoding."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b"")
    path.write_bytes(data)


HAVE_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])])
def device(request):
    """Each device this machine has, for behaviour that must hold on all of them.

    NOTE: trainfast picks CUDA when there is one, so a test that means the CPU says
    device="cpu"; a test that leaves the device out would mean different things on different
    machines."""
    return request.param


@pytest.fixture
def image_folder(tmp_path):
    return write_images(tmp_path / "photos")


@pytest.fixture(autouse=True)
def _torch_threads_back():
    """A test that sets torch's threads (the busy-machine tests pretend a 2-core machine) leaves
    the next test the threads it found: on a 16-core GPU machine the rest of the suite would
    otherwise run on 2."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


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
def noise_pack16(tmp_path_factory):
    """128 noise images of 16×16 RGB in 4 classes, packed: enough for a doctor's few steps."""
    import trainfast
    images = np.random.default_rng(0).integers(0, 255, (128, 16, 16, 3), dtype=np.uint8)
    return trainfast.pack((images, np.arange(128) % 4), tmp_path_factory.mktemp("noise16") / "p", size=(16, 16),
                          progress=False)


@pytest.fixture(scope="session")
def small_net_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "small_net.py"
    path.write_text(SMALL_NET)
    return path


class Signals(nn.Module):
    """Sends this process `sig` from inside its `at`-th forward pass in training (or evaluation) mode."""

    input_shape, output_shape = (3, 32, 32), (10,)

    def __init__(self, at=None, sig=signal.SIGINT, when="train"):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                                 nn.Dropout(0.2), nn.Linear(128, 10))
        self.at, self.sig, self.when, self.calls = at, sig, when, 0

    def forward(self, x):
        # NOTE: fit's first forward (2 of the pack's images, to check the model takes them) is not counted
        if self.training == (self.when == "train") and len(x) > 2:
            self.calls += 1
            if self.calls == self.at:
                os.kill(os.getpid(), self.sig)
        return self.net(x)

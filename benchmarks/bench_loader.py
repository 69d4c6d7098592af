"""Loader throughput vs a plain memory copy, FFCV (if installed) and torch's DataLoader.

1. raw pack, 64×128×3, batch 256: trainfast.Loader with uint8 output (and float beside it)
   vs a memcpy of the same bytes (the physical limit) and vs FFCV's Loader on the same images;
2. trainfast.Loader from a pack of the benchmark photos vs torch.utils.data.DataLoader over
   the JPEG folder with PIL decode + resize per item and num_workers = cores;
3. a JPEG pack at 512×512: decode throughput with one thread and with all cores.

Medians of --runs epochs, after one warm-up epoch. Run from the repository root:

    python benchmarks/bench_loader.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from photos import make_photos  # noqa: E402

import trainfast  # noqa: E402
from trainfast.hardware import usable_cores  # noqa: E402


def _median_rate(fn, runs: int) -> float:
    fn()  # warm-up: page cache, thread pools, allocator
    return statistics.median(fn() for _ in range(runs))


def memcpy_rate(images: np.ndarray, dst: np.ndarray) -> float:
    """images/s of one streaming copy of all the pack's bytes into a warm buffer."""
    t = time.perf_counter()
    np.copyto(dst, images)
    return len(images) / (time.perf_counter() - t)


def loader_rate(loader) -> float:
    t = time.perf_counter()
    n = 0
    for x, _ in loader:
        n += len(x)
    return n / (time.perf_counter() - t)


def ffcv_rate(images: np.ndarray, labels: np.ndarray, batch: int, workers: int, tmp: Path, runs: int):
    try:
        from ffcv.fields import IntField, NDArrayField
        from ffcv.fields.decoders import IntDecoder, NDArrayDecoder
        from ffcv.loader import Loader, OrderOption
        from ffcv.writer import DatasetWriter
    except ImportError:
        return None

    class _Data:
        def __len__(self):
            return len(images)

        def __getitem__(self, i):
            return images[i], int(labels[i])

    path = str(tmp / "ffcv.beton")
    DatasetWriter(path, {"image": NDArrayField(np.dtype("uint8"), images.shape[1:]), "label": IntField()},
                  num_workers=workers).from_indexed_dataset(_Data())
    loader = Loader(path, batch_size=batch, num_workers=workers, order=OrderOption.RANDOM, drop_last=True,
                    pipelines={"image": [NDArrayDecoder()], "label": [IntDecoder()]}, os_cache=True)

    def epoch():
        t = time.perf_counter()
        n = sum(len(x) for x, _ in loader)
        return n / (time.perf_counter() - t)
    return _median_rate(epoch, runs)


def dataloader_rate(files: list[str], size, batch: int, workers: int) -> float:
    from PIL import Image

    class Folder(torch.utils.data.Dataset):  # what a user writes: decode + resize per item
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            im = Image.open(files[i]).convert("RGB").resize((size[1], size[0]), Image.BILINEAR)
            x = torch.from_numpy(np.array(im)).permute(2, 0, 1).float().div_(255)
            return x, i % 2

    dl = torch.utils.data.DataLoader(Folder(), batch_size=batch, shuffle=True, num_workers=workers,
                                     drop_last=True, persistent_workers=True)
    return _median_rate(lambda: loader_rate(dl), 2)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=20000, help="images in the raw pack")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--photos", default="bench-data/photos")
    a = p.parse_args()
    cores = usable_cores()
    tmp = Path(tempfile.mkdtemp(prefix="tf-bench-"))
    h, w = 64, 128
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (a.count, h, w, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, a.count)
    pk = trainfast.pack((images, labels), tmp / "raw", size=(h, w), progress=False)
    mb = h * w * 3 / 1e9

    rows = []
    dst = np.empty(pk.images.shape, np.uint8)
    mem = _median_rate(lambda: memcpy_rate(pk.images, dst), a.runs)
    rows.append(("memcpy of the same bytes (limit)", mem))
    u8 = _median_rate(lambda: loader_rate(trainfast.Loader(pk, a.batch, dtype=torch.uint8, device="cpu")), a.runs)
    rows.append(("trainfast.Loader, uint8", u8))
    f32 = _median_rate(lambda: loader_rate(trainfast.Loader(pk, a.batch, device="cpu")), a.runs)
    rows.append(("trainfast.Loader, float32 normalised", f32))
    ff = ffcv_rate(images, labels, a.batch, cores, tmp, a.runs)
    if ff is not None:
        rows.append((f"FFCV Loader, {cores} workers", ff))
    print(f"raw pack {a.count} × {h}×{w}×3, batch {a.batch}, medians of {a.runs} epochs")
    print(f"{'':40s} {'images/s':>10s} {'GB/s':>6s} {'of memcpy':>9s}")
    for name, r in rows:
        print(f"{name:40s} {r:10.0f} {r * mb:6.2f} {r / mem:9.0%}")
    if ff is None:
        print("(FFCV not installed: see docs/BENCHMARKS.md for how to build it)")

    root = make_photos(a.photos)
    files = sorted(str(f) for f in root.glob("*/*.jpg"))
    photo_pack = trainfast.pack(root, tmp / "photos", size=(h, w), progress=False)
    dl = dataloader_rate(files, (h, w), a.batch, cores)
    ours = _median_rate(lambda: loader_rate(trainfast.Loader(photo_pack, a.batch, device="cpu")), a.runs)
    print(f"\n{len(files)} JPEG photos → 64×128 float batches of {a.batch}")
    print(f"{'torch DataLoader, PIL decode+resize, ' + str(cores) + ' workers':48s} {dl:9.0f} images/s")
    print(f"{'trainfast.Loader from a pack':48s} {ours:9.0f} images/s  ({ours / dl:.0f}×)")

    big = trainfast.pack(root, tmp / "big", size=(512, 512), encoding="jpeg", quality=90, progress=False)
    one = _median_rate(lambda: loader_rate(trainfast.Loader(big, 32, dtype=torch.uint8, device="cpu", workers=1)), 3)
    allc = _median_rate(lambda: loader_rate(trainfast.Loader(big, 32, dtype=torch.uint8, device="cpu",
                                                            workers=cores)), 3)
    size_mb = sum(f.stat().st_size for f in big.path.iterdir()) / 1e6
    print(f"\nJPEG pack, {len(big)} images at 512×512 (q 90, {size_mb / len(big) * 1000:.0f} kB each)")
    print(f"decode, 1 thread: {one:.0f} images/s; {cores} threads: {allc:.0f} images/s ({allc / one:.2f}×)")
    import shutil
    shutil.rmtree(tmp)


if __name__ == "__main__":
    import sys

    from trainfast.hardware import OtherLoad

    with OtherLoad() as load:  # a busy neighbour makes every figure here low
        main()
    print(load.summary(), file=sys.stderr)  # stderr: a parent benchmark parses this one's stdout

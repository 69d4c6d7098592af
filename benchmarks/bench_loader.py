"""Loader throughput vs a plain memory copy, FFCV (if installed) and torch's DataLoader.

1. raw pack, 64×128×3, batch 256: trainfast.Loader with uint8 output (and float beside it)
   vs a memcpy of the same bytes (the physical limit) and vs FFCV's Loader on the same images;
2. trainfast.Loader from a pack of the benchmark photos vs torch.utils.data.DataLoader over
   the JPEG folder with PIL decode + resize per item and num_workers = cores;
3. a JPEG pack at 512×512: decode throughput by thread count, with simplejpeg (the default:
   the GIL released for the whole call) and with Pillow (the fallback), and on CUDA the
   batched GPU decode (torchvision's nvJPEG) of the same pack;
4. on CUDA (--device cuda): the raw pack to the GPU, kept there (resident) and by the host
   path, against the pinned and pageable copy of the same bytes and a DataLoader over a
   TensorDataset with pinned memory.

Medians of --runs epochs, after one warm-up epoch. Run from the repository root:

    python benchmarks/bench_loader.py
    python benchmarks/bench_loader.py --device cuda --sections cuda,jpeg
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
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


def loader_rate(loader, sync=lambda: None) -> float:
    t = time.perf_counter()
    n = 0
    for x, _ in loader:
        n += len(x)
    sync()  # CUDA: until the last batch has arrived
    return n / (time.perf_counter() - t)


def cuda_rows(pk, batch: int, runs: int, dev: torch.device) -> list[tuple[str, float]]:
    """images/s of the raw pack delivered to `dev` as batches, beside copies of the same bytes."""
    sync = torch.cuda.synchronize
    rows = []
    x = torch.from_numpy(np.array(pk.images[:batch]))

    def copies(src, n=200):
        sync()
        t = time.perf_counter()
        for _ in range(n):
            src.to(dev, non_blocking=True)
        sync()
        return n * batch / (time.perf_counter() - t)
    limit = _median_rate(lambda: copies(x.pin_memory()), runs)
    rows.append(("pinned host→device copy (the limit)", limit))
    rows.append(("pageable host→device copy", _median_rate(lambda: copies(x), runs)))
    for resident in (True, False):
        for dt in (torch.uint8, torch.float32, torch.bfloat16):
            ld = trainfast.Loader(pk, batch, dtype=dt, device=dev, resident=resident)
            name = f"Loader {'resident' if resident else f'host path, {ld.workers} workers'}, {str(dt)[6:]}"
            rows.append((name, _median_rate(lambda ld=ld: loader_rate(ld, sync), runs)))
    images, labels = torch.from_numpy(np.array(pk.images)), torch.from_numpy(np.array(pk.labels))
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch, shuffle=True,
                                     num_workers=min(8, usable_cores()), pin_memory=True, drop_last=True,
                                     persistent_workers=True)

    def users():  # what a user writes: float on the device, NCHW
        for a, b in dl:
            yield a.to(dev, non_blocking=True).permute(0, 3, 1, 2).float().div_(255), b.to(dev, non_blocking=True)
    rows.append((f"DataLoader(TensorDataset, {dl.num_workers} workers, pinned), float",
                 _median_rate(lambda: loader_rate(users(), sync), max(2, runs // 2))))
    return rows


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
    p.add_argument("--device", default="cpu", help="cuda adds section 4 and the GPU decode")
    p.add_argument("--sections", default="raw,photos,jpeg,cuda", help="which sections to run (comma-separated)")
    p.add_argument("--jpeg-count", type=int, default=400, help="photos in the 512² JPEG pack")
    a = p.parse_args()
    sections = set(a.sections.split(","))
    cores = usable_cores()
    tmp = Path(tempfile.mkdtemp(prefix="tf-bench-"))
    h, w = 64, 128
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (a.count, h, w, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, a.count)
    pk = trainfast.pack((images, labels), tmp / "raw", size=(h, w), progress=False)
    mb = h * w * 3 / 1e9
    if a.device.startswith("cuda") and "cuda" in sections:
        rows = cuda_rows(pk, a.batch, a.runs, torch.device(a.device))
        print(f"raw pack {a.count} × {h}×{w}×3 → {torch.cuda.get_device_name(a.device)}, batch {a.batch}, "
              f"medians of {a.runs} epochs")
        for name, r in rows:
            print(f"{name:52s} {r:12,.0f} images/s {r * mb:7.2f} GB/s {r / rows[0][1]:6.0%} of pinned", flush=True)
    if "raw" in sections:
        raw_rows(pk, images, labels, a, cores, tmp, mb)
    if sections & {"photos", "jpeg"}:
        root = make_photos(a.photos if "photos" in sections else tmp / "photos", 2000 if "photos" in sections
                           else a.jpeg_count)
    if "photos" in sections:
        photo_rows(root, a, cores, tmp, h, w)
    if "jpeg" in sections:
        jpeg_rows(root, tmp, cores, torch.device(a.device))
    import shutil
    shutil.rmtree(tmp)


def raw_rows(pk, images, labels, a, cores, tmp, mb):
    h, w, _ = pk.shape
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


def photo_rows(root, a, cores, tmp, h, w):
    files = sorted(str(f) for f in root.glob("*/*.jpg"))
    photo_pack = trainfast.pack(root, tmp / "photos", size=(h, w), progress=False)
    dl = dataloader_rate(files, (h, w), a.batch, cores)
    ours = _median_rate(lambda: loader_rate(trainfast.Loader(photo_pack, a.batch, device="cpu")), a.runs)
    print(f"\n{len(files)} JPEG photos → 64×128 float batches of {a.batch}")
    print(f"{'torch DataLoader, PIL decode+resize, ' + str(cores) + ' workers':48s} {dl:9.0f} images/s")
    print(f"{'trainfast.Loader from a pack':48s} {ours:9.0f} images/s  ({ours / dl:.0f}×)")


@contextmanager
def _pillow_decode():
    """JPEG packs decoded by Pillow, as when simplejpeg is not installed."""
    from trainfast.data import decode
    kept, decode._simplejpeg = decode._simplejpeg, None
    try:
        yield
    finally:
        decode._simplejpeg = kept


def jpeg_rows(root, tmp, cores, dev):
    """512² JPEG pack → uint8 batches of 32: threads × decoder, and the batched GPU decode on CUDA."""
    big = trainfast.pack(root, tmp / "big", size=(512, 512), encoding="jpeg", quality=90, progress=False)
    size_mb = sum(f.stat().st_size for f in big.path.iterdir()) / 1e6
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"\nJPEG pack, {len(big)} images at 512×512 (q 90, {size_mb / len(big) * 1000:.0f} kB each) → {dev}, "
          f"batch 32, images/s (medians of 3 epochs)")
    threads = sorted({1, 2, 4, 8, 16, cores} & set(range(1, max(cores, 8) + 1)))
    print(f"{'threads':>8s} " + " ".join(f"{t:>8d}" for t in threads))
    for name in ("simplejpeg", "Pillow"):
        with _pillow_decode() if name == "Pillow" else nullcontext():
            rates = [_median_rate(lambda t=t: loader_rate(trainfast.Loader(big, 32, dtype=torch.uint8, device=dev,
                                                                           workers=t, decode="cpu"), sync), 3)
                     for t in threads]
        print(f"{name:>8s} " + " ".join(f"{r:8.0f}" for r in rates) +
              f"   ({rates[-1] / rates[0]:.1f}× one thread; {rates[-1] / (rates[0] * min(threads[-1], cores)):.0%} "
              f"of linear in cores)",
              flush=True)
    if dev.type == "cuda":
        try:
            gpu = trainfast.Loader(big, 32, dtype=torch.uint8, device=dev, decode="gpu")
        except trainfast.TrainfastError as e:
            print(f"GPU decode: {e}")
            return
        print(f"{'nvJPEG':>8s} {_median_rate(lambda: loader_rate(gpu, sync), 3):8.0f}   ({gpu.describe()})")


if __name__ == "__main__":
    import sys

    from trainfast.hardware import OtherLoad

    with OtherLoad() as load:  # a busy neighbour makes every figure here low
        main()
    print(load.summary(), file=sys.stderr)  # stderr: a parent benchmark parses this one's stdout

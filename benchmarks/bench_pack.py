"""Pack build rate vs the per-image generator users write, on the same JPEG files.

The users' pattern (a keras.utils.Sequence): for every image of every batch, every epoch,
skimage.io.imread + skimage.transform.resize. trainfast pack decodes each image once, at
reduced size when JPEG DCT scaling allows, in parallel processes. Medians of --runs runs.

    python benchmarks/bench_pack.py            # makes bench-data/photos on first use
    python benchmarks/bench_pack.py --same-size 300   # + 512² JPEGs into a 512² JPEG pack: bytes kept vs re-encoded
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from photos import make_photos  # noqa: E402

import trainfast  # noqa: E402


def sequence_style(files: list[str], size) -> float:
    """images/s of imread + resize per image, the way the users' Sequence does it."""
    import numpy as np
    from skimage.io import imread
    from skimage.transform import resize

    t = time.perf_counter()
    batch = [resize(imread(f), size) for f in files]
    np.array(batch)
    return len(files) / (time.perf_counter() - t)


def pack_rate(root: Path, size, workers: int) -> float:
    out = Path(tempfile.mkdtemp(prefix="tf-bench-")) / "p"
    t = time.perf_counter()
    pk = trainfast.pack(root, out, size=size, workers=workers, progress=False)
    rate = len(pk) / (time.perf_counter() - t)
    shutil.rmtree(out.parent)
    return rate


def same_size_jpegs(photos: Path, root: Path, count: int) -> Path:
    """`count` 512×512 JPEGs (quality 85) cut from the photos: the 512² story's files, already at the pack's size."""
    from PIL import Image
    if (root / ".complete").exists():
        return root
    files = sorted(photos.glob("*/*.jpg"))
    (root / "a").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.open(files[i % len(files)]).convert("RGB").resize((512, 512)).save(root / "a" / f"{i:05d}.jpg", quality=85)
    (root / ".complete").write_text(str(count))
    return root


def keep_vs_reencode(root: Path, runs: int, workers: int) -> tuple[float, float]:
    """images/s packing 512² JPEGs into a 512² JPEG pack (quality 90) with the bytes kept, and with
    every file decoded and re-encoded as before (keeps_bytes off); alternating runs, medians."""
    from trainfast.data import decode
    kept, again = [], []
    original = decode.keeps_bytes
    for _ in range(runs):
        for side, on in ((kept, True), (again, False)):
            decode.keeps_bytes = original if on else (lambda *a, **k: False)  # NOTE: fork workers inherit it
            out = Path(tempfile.mkdtemp(prefix="tf-bench-")) / "p"
            t = time.perf_counter()
            pk = trainfast.pack(root, out, size=(512, 512), encoding="jpeg", quality=90, workers=workers,
                                progress=False)
            side.append(len(pk) / (time.perf_counter() - t))
            assert (pk.meta["jpeg_kept"] == len(pk)) == on
            shutil.rmtree(out.parent)
    decode.keeps_bytes = original
    return statistics.median(kept), statistics.median(again)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="bench-data/photos")
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--sequence-images", type=int, default=300, help="images timed for the slow generator")
    p.add_argument("--same-size", type=int, default=0, metavar="N",
                   help="also pack N 512x512 JPEGs into a 512x512 JPEG pack, bytes kept vs re-encoded")
    a = p.parse_args()
    root = make_photos(a.data, a.count)
    size = (64, 128)
    files = sorted(str(f) for f in root.glob("*/*.jpg"))
    seq = statistics.median(sequence_style(files[: a.sequence_images], size) for _ in range(a.runs))
    one = statistics.median(pack_rate(root, size, 1) for _ in range(a.runs))
    from trainfast.hardware import usable_cores
    cores = usable_cores()
    allc = statistics.median(pack_rate(root, size, cores) for _ in range(a.runs))
    print(f"{len(files)} JPEGs → 64×128, medians of {a.runs} runs")
    print(f"{'method':48s} {'images/s':>9s} {'ratio':>7s}")
    print(f"{'Sequence-style skimage imread + resize (1 core)':48s} {seq:9.0f} {1:7.2f}")
    print(f"{'trainfast pack, 1 worker':48s} {one:9.0f} {one / seq:7.2f}")
    print(f"{f'trainfast pack, {cores} workers':48s} {allc:9.0f} {allc / seq:7.2f}")
    print(f"scaling {cores} workers vs 1: {allc / one:.2f}×")
    if a.same_size:
        kept, again = keep_vs_reencode(same_size_jpegs(root, Path(a.data + "-512"), a.same_size), a.runs, cores)
        print(f"{a.same_size} JPEGs at 512×512 (q85) → a 512×512 JPEG pack (q90), {cores} workers, medians of {a.runs}")
        print(f"{'re-encoded (decode + encode each file)':48s} {again:9.0f} {1:7.2f}")
        print(f"{'bytes kept (trainfast pack now)':48s} {kept:9.0f} {kept / again:7.2f}")


if __name__ == "__main__":
    import sys

    from trainfast.hardware import OtherLoad

    with OtherLoad() as load:  # a busy neighbour makes every figure here low
        main()
    print(load.summary(), file=sys.stderr)  # stderr: a parent benchmark parses this one's stdout

"""Where the files live: the doctor on the plate story's per-image pipeline with the images on a
local disk and on a slow drive, side by side in one run.

The plate story's 105k images sat on a network drive. There is no network drive here, so one
is made: a read-only FUSE file system over the same folder that waits --latency-ms before
each file opens (the round trips of a network file system's lookup and open) and reads at
most --mb-per-s. FUSE drops its page cache on each open, so every read is cold.

For each location the doctor times the users' pipeline (`--no-fixes`) and measures the
storage apart from decoding; the table shows the files/s and MB/s it read, the storage's
share of the data time per image, and whether it called the storage the bottleneck. Then the
same images packed once onto the local disk, for the data time that is left.

    python benchmarks/bench_storage.py [--plates bench-data/plates-defaults] [--latency-ms 10]

Needs FUSE: Linux, /dev/fuse, libfuse2 (`apt install libfuse2`), `pip install fusepy`, and
root or the fuse group. Without them it says what is missing and exits with 2.
"""

from __future__ import annotations

import argparse
import errno
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _slow_fs(root: str, latency_s: float, bytes_per_s: float):
    """A fusepy Operations object: `root` read-only, each open delayed by latency_s, each read
    paced to bytes_per_s (shared by all readers, as one link is)."""
    from fuse import FuseOSError, Operations

    class SlowDrive(Operations):
        def __init__(self):
            self.link = threading.Lock()  # one link: reads queue for it

        def _real(self, path):
            return os.path.join(root, path.lstrip("/"))

        def getattr(self, path, fh=None):
            try:
                st = os.lstat(self._real(path))
            except OSError as e:
                raise FuseOSError(e.errno) from None
            return {k: getattr(st, k) for k in ("st_mode", "st_size", "st_nlink", "st_uid", "st_gid",
                                                "st_atime", "st_mtime", "st_ctime")}

        def readdir(self, path, fh):
            return [".", "..", *os.listdir(self._real(path))]

        def open(self, path, flags):
            if flags & (os.O_WRONLY | os.O_RDWR):
                raise FuseOSError(errno.EROFS)
            time.sleep(latency_s)
            return os.open(self._real(path), os.O_RDONLY)

        def read(self, path, size, offset, fh):
            data = os.pread(fh, size, offset)
            with self.link:
                time.sleep(len(data) / bytes_per_s)
            return data

        def release(self, path, fh):
            os.close(fh)
            return 0

    return SlowDrive()


def _serve(root: str, mountpoint: str, latency_s: float, bytes_per_s: float) -> None:
    from fuse import FUSE
    FUSE(_slow_fs(root, latency_s, bytes_per_s), mountpoint, foreground=True, ro=True, nothreads=False)


def _missing() -> str | None:
    if not sys.platform.startswith("linux") or not os.path.exists("/dev/fuse"):
        return "FUSE needs Linux with /dev/fuse"
    try:
        import fuse  # noqa: F401
    except (ImportError, OSError) as e:  # fusepy raises OSError where libfuse is missing
        return f"fusepy and libfuse2 are needed (pip install fusepy; apt install libfuse2): {e}"
    return None


def _doctor(data: Path, batch: int, steps: int, device: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "trainfast", "doctor", "--model", "plate_cnn", "--data", str(data),
           "--batch-size", str(batch), "--steps", str(steps), "--device", device, "--no-fixes", "--json", str(out),
           "--label-column", "plate"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"doctor failed on {data}:\n{run.stdout}\n{run.stderr}")
    return json.loads(out.read_text())


def _row(where: str, r: dict) -> str:
    t, s = r["steps"], r.get("storage") or {}
    data_ms = t["data"] / t["batch_size"] * 1e3
    share = (1e3 / s["files_per_s"]) / data_ms if s else 0.0
    return (f"{where:22s} {s.get('files_per_s', 0):9,.0f} {s.get('mb_per_s', 0):8.1f} "
            f"{data_ms:10.2f} {min(share, 1):7.0%}  {'yes' if s.get('storage_bound') else 'no':5s} {t['images_per_s']:7,.0f}  "
            f"{r['verdict']['degree']} {r['verdict']['kind']}".strip())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plates", type=Path, default=Path("bench-data/plates-defaults"),
                   help="a folder with plates-train/labels.csv (made here if missing: 20,000 plates)")
    p.add_argument("--images", type=int, default=1000, help="how many of the plates to use (default 1000)")
    p.add_argument("--latency-ms", type=float, default=10.0, help="wait before each file opens (default 10)")
    p.add_argument("--mb-per-s", type=float, default=40.0, help="read bandwidth of the slow drive (default 40)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    why = _missing()
    if why:
        print(f"bench_storage: {why}", file=sys.stderr)
        raise SystemExit(2)
    import torch

    import trainfast
    from trainfast import hardware

    src = a.plates / "plates-train"
    if not (src / "labels.csv").is_file():
        subprocess.run([sys.executable, "-m", "trainfast", "make-plates", str(src), "--count", "20000"], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        local = tmp / "local"  # the sample the doctor reads, on this machine's disk
        (local / "images").mkdir(parents=True)
        lines = (src / "labels.csv").read_text().splitlines()
        head, rows = lines[0], lines[1:a.images + 1]
        for row in rows:
            name = row.split(",", 1)[0]
            shutil.copyfile(src / name, local / name)
        (local / "labels.csv").write_text("\n".join([head, *rows]) + "\n")
        os.sync()  # written back, so that the doctor's cold read can drop them from the page cache
        mnt = tmp / "drive"
        mnt.mkdir()
        server = mp.get_context("fork").Process(
            target=_serve, args=(str(local), str(mnt), a.latency_ms / 1e3, a.mb_per_s * 1e6), daemon=True)
        server.start()
        try:
            for _ in range(100):
                if (mnt / "labels.csv").exists():
                    break
                time.sleep(0.1)
            else:
                raise SystemExit("the slow drive did not mount")
            print(f"# {hardware.cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__}, device {a.device}; "
                  f"{len(rows):,} plates at 64×128; slow drive: {a.latency_ms:g} ms per open, {a.mb_per_s:g} MB/s; "
                  f"batch {a.batch_size}, {a.steps} steps")
            print(f"{'where':22s} {'files/s':>9s} {'MB/s':>8s} {'data ms/img':>10s} {'storage':>7s}  "
                  f"{'bound':5s} {'img/s':>7s}  verdict")
            for where, root in (("local disk", local), ("slow drive", mnt)):
                r = _doctor(root / "labels.csv", a.batch_size, a.steps, a.device, tmp / f"{where[0]}.json")
                print(_row(where, r))
                if where == "slow drive":
                    print("# " + r["storage"]["sentence"])
            trainfast.pack(mnt / "labels.csv", tmp / "plates.pack", size=(64, 128), label_column="plate",
                           label_kind="sequence", progress=False)
            r = _doctor(tmp / "plates.pack", a.batch_size, a.steps, a.device, tmp / "p.json")
            print(_row("pack on local disk", r))
        finally:
            subprocess.run(["umount", str(mnt)], capture_output=True)
            server.join(5)
            if server.is_alive():
                server.kill()


if __name__ == "__main__":
    main()

"""Where the files live: how fast the source's storage reads them, apart from decoding.

The plate story's images sat on a network drive: a per-image pipeline there waits on the
storage as much as on the decoder, and packing onto a local disk removes both. Each file of
the sample is first dropped from the page cache (posix_fadvise DONTNEED; a hint that local
file systems follow and some network ones ignore), then read whole, so that the figure is a
cold read, as an epoch over a dataset larger than memory sees it.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import asdict, dataclass

from trainfast import units

STORAGE_BOUND = 0.5  # the storage is "the bottleneck" when reading takes this share of the data time
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "glusterfs", "lustre", "beegfs", "gpfs",
              "davfs", "fuse.sshfs", "fuse.rclone", "fuse.s3fs", "fuse.gcsfuse", "fuse.blobfuse", "fuse.goofys",
              "fuse.juicefs", "fuse.davfs"}  # file systems whose reads cross a network


@dataclass
class StorageRead:
    files: int  # files read
    bytes: int
    seconds: float
    cold: bool  # the page cache could be told to drop the files first
    fs: str = ""  # the file system type the first file lives on ("ext4", "nfs4", …), where the OS says
    mount: str = ""  # … and where it is mounted

    @property
    def files_per_s(self) -> float:
        return self.files / max(self.seconds, 1e-9)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)

    def to_dict(self) -> dict:
        return {**asdict(self), "files_per_s": self.files_per_s, "mb_per_s": self.mb_per_s}


def _drop_cached(path: str) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        # Pages written but not yet on disk (files made just now: the demo's plates) cannot be
        # dropped; writing them back first changes nothing in the file and is a no-op for the rest.
        with contextlib.suppress(OSError):
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def file_system(path: str, mounts: str = "/proc/mounts") -> tuple[str, str] | None:
    """(file system type, mount point) of `path`, from the mount table (Linux); None elsewhere."""
    try:
        with open(mounts, encoding="utf-8", errors="replace") as f:
            table = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = None
    for point, kind in table:
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)  # a space is written \040
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[1])):  # the last mount over a path wins
            best = (kind, point)
    return best


def read_throughput(files: list[str], max_files: int = 256, max_seconds: float = 2.0,
                    clock=time.perf_counter) -> StorageRead | None:
    """Read up to `max_files` of `files` whole (spread over the list), cold where the OS allows,
    for at most about `max_seconds`; None if none could be read."""
    if not files:
        return None
    step = max(1, len(files) // max_files)
    sample = files[::step][:max_files]
    cold = all([_drop_cached(f) for f in sample])
    n = size = 0
    start = clock()
    for f in sample:
        try:
            with open(f, "rb", buffering=0) as fh:
                while chunk := fh.read(1 << 20):
                    size += len(chunk)
        except OSError:
            continue
        n += 1
        if clock() - start > max_seconds:
            break
    seconds = clock() - start
    fs, mount = file_system(sample[0]) or ("", "")
    return StorageRead(n, size, seconds, cold, fs, mount) if n else None


def storage_sentence(read: StorageRead, data_s_per_image: float) -> tuple[str, bool]:
    """(a sentence for the report, whether the storage is the bottleneck of the data time)."""
    per_file = 1 / read.files_per_s
    share = per_file / max(data_s_per_image, 1e-12)
    bound = share >= STORAGE_BOUND
    how = "cold" if read.cold else "possibly cached"
    if read.fs:
        how += f"; {read.fs} at {read.mount}" + (", a network file system" if read.fs in NETWORK_FS else "")
    text = (f"reading the files alone ({how}): {units.rate(read.files_per_s)} files/s, {read.mb_per_s:,.1f} MB/s, "
            f"{units.ms(per_file)} ms per file = {min(share, 1):.0%} of the data time per image")
    if bound:
        text += "; the storage is the bottleneck: write the pack to a local disk"
    return text, bound

"""Arrays users hold, given to fit or the doctor as (images, labels): packed once into trainfast's
cache under their fingerprint, reused while they are the same, and the cache kept to the packs
used last."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from pathlib import Path

from trainfast import files
from trainfast.data.format import Pack
from trainfast.data.held import from_arrays
from trainfast.data.pack import pack
from trainfast.errors import TrainfastError
from trainfast.hardware import cache_dir

ARRAYS_WAIT_S = 600.0  # how long pack_arrays waits for another process packing the same arrays


ARRAYS_KEEP = 8  # packs of arrays kept in the cache (the most recently used); older ones go ...
ARRAYS_IDLE_S = 3600.0  # ... once unused this long (another process may still be reading one)


def pack_arrays(images, labels, name: str = "arrays") -> tuple[Pack, list[str]]:
    """(images, labels) arrays as a pack in trainfast's cache, at their own size, made once and
    reused while the arrays are the same (the folder is named by their fingerprint, and the pack
    records it); and the notes on how they were read (channels-first, class names). The cache
    keeps the ARRAYS_KEEP packs used last."""
    src = from_arrays(images, labels, name=name)
    fingerprint = src.fingerprint()
    out = cache_dir() / "packs" / f"{fingerprint[:16]}.pack"
    kept = _cached_arrays(out, fingerprint)
    if kept is not None:
        return kept, src.notes
    deadline = time.monotonic() + ARRAYS_WAIT_S
    while True:
        try:
            pk = pack(src, out, progress=False, overwrite=True)
            break
        except files.Busy:  # another process packs the same arrays (each torchrun rank calls fit((x, y))): wait,
            if time.monotonic() > deadline:  # then take the pack it made
                raise
            time.sleep(0.2)
            kept = _cached_arrays(out, fingerprint)
            if kept is not None:
                return kept, src.notes
    _prune_arrays(out.parent)
    return pk, src.notes


def _cached_arrays(out: Path, fingerprint: str) -> Pack | None:
    """The pack of these arrays made before, marked as used now; None where there is none (or it
    is of other arrays, or unreadable: it is made again)."""
    try:
        pk = Pack(out)
    except (TrainfastError, OSError, ValueError):
        return None
    if (pk.meta.get("build") or {}).get("fingerprint") != fingerprint:
        return None
    with contextlib.suppress(OSError):
        os.utime(out / "meta.json")
    return pk


def _prune_arrays(folder: Path) -> None:
    """Keep the cache of array packs to the ARRAYS_KEEP used last; an older one goes once idle
    ARRAYS_IDLE_S. Only folders named as pack_arrays names them, holding a pack, are touched."""
    made = []
    for p in folder.glob("*.pack"):
        if re.fullmatch(r"[0-9a-f]{16}\.pack", p.name) and p.is_dir() and not p.is_symlink():
            with contextlib.suppress(OSError):
                made.append(((p / "meta.json").stat().st_mtime, p))
    made.sort(reverse=True)
    for used, p in made[ARRAYS_KEEP:]:
        if time.time() - used > ARRAYS_IDLE_S:
            shutil.rmtree(p, ignore_errors=True)

"""The parallel part of a pack's build: the input order cut into chunks, each decoded and
written by a worker process (numpy and Pillow only) into the build folder, where a chunk's
.json marks it done (a rerun skips it). pack.py plans the chunks and assembles the pack.

Workers end with the process that started them, however it ended (`_worker_start`); an input
file is read only if it is a regular file of a size an image could have (`read_input`).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import stat
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from trainfast.config import PackConfig
from trainfast.data import decode as _decode
from trainfast.data.sources import Source
from trainfast.errors import TrainfastError


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def run_chunks(src: Source, chunks: list[np.ndarray], cfg: PackConfig, build: Path, progress: bool) -> None:
    from tqdm import std

    from trainfast.progress import tqdm

    chunk_dir = build / "chunks"
    todo = [i for i in range(len(chunks)) if not (chunk_dir / f"{i:06d}.json").exists()]
    total = sum(len(c) for c in chunks)
    left = sum(len(chunks[i]) for i in todo)
    std.tqdm.monitor_interval = 0  # no monitor thread alive when the pool forks (the notebook bars' base too)
    bar = tqdm(total=total, initial=total - left, unit="img", desc="packing", disable=not progress,
               dynamic_ncols=True, smoothing=0.1)
    tasks = (chunk_task(src, i, chunks[i], cfg, chunk_dir) for i in todo)
    try:
        if cfg.workers == 1 or len(todo) <= 1:
            for task in tasks:
                _after_chunk(build_chunk(task), cfg, bar)
            return
        context = _mp_context()
        try:
            with ProcessPoolExecutor(max_workers=min(cfg.workers, len(todo)), mp_context=context,
                                     initializer=_worker_start, initargs=(os.getpid(),)) as pool:
                pending = set()
                for task in tasks:  # keep a bounded number in flight: array chunks carry their pixels
                    pending.add(pool.submit(build_chunk, task))
                    if len(pending) >= 2 * cfg.workers:
                        done, pending = wait(pending, return_when=FIRST_COMPLETED)
                        for f in done:
                            _after_chunk(f.result(), cfg, bar, pool)
                for f in pending:
                    _after_chunk(f.result(), cfg, bar, pool)
        except BrokenProcessPool:
            why = ("with the 'spawn' start method (macOS, Windows) each worker imports your script again: if it "
                   "calls trainfast at its top level, put that under `if __name__ == \"__main__\":`"
                   if context.get_start_method() == "spawn" else "out of memory, or killed")
            raise TrainfastError(f"a pack worker process died ({why}); the chunks already packed are kept: "
                                 "rerun the same command to go on") from None
    finally:
        bar.close()


def _worker_start(parent: int) -> None:
    """Pool initializer: a worker ends when the process that started it does, however that one
    ended. NOTE: killed with SIGKILL (as the OOM killer does), the parent used to leave its
    workers waiting on their queue for ever, holding the caller's pipes open."""
    if sys.platform.startswith("linux"):
        try:  # the kernel signals us when the parent dies
            ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it died before we asked
        os._exit(1)

    def watch():  # elsewhere (and as a second line): look once a second
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="trainfast-parent-watch", daemon=True).start()


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def not_while_a_worker_starts(what: str) -> None:
    """A process that 'spawn' started runs the parent's script again as it starts (`__mp_main__`);
    a script without an `if __name__ == "__main__":` guard would call trainfast again there (and
    meet its own parent's pack lock). Said in one line, in the worker, where it happens."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise TrainfastError(f"{what} was called while a worker process started (the 'spawn' start method, as on "
                             "macOS and Windows, imports your script again in each worker): put the code that calls "
                             "trainfast under `if __name__ == \"__main__\":`")


def _mp_context():
    """fork on Linux, spawn elsewhere (TRAINFAST_START_METHOD=spawn tries the other platforms' way here).

    NOTE: spawn re-imports the caller's __main__ in every worker, which re-runs a user's
    script that lacks an `if __name__ == "__main__"` guard. Our workers use only numpy and
    Pillow, so fork is safe for them where it exists.
    """
    return get_context(os.environ.get("TRAINFAST_START_METHOD") or ("fork" if sys.platform == "linux" else "spawn"))


def _after_chunk(result: dict, cfg: PackConfig, bar, pool=None) -> None:
    if result["errors"] and cfg.on_error == "fail":
        if pool is not None:  # drop the queued chunks; wait for the running ones, which still write into the
            pool.shutdown(wait=True, cancel_futures=True)  # build folder that is removed next
        key, reason = result["errors"][0]
        raise TrainfastError(f"{key}: {reason} (--on-error fail: nothing was written)")
    bar.update(result["n"])


def chunk_task(src: Source, index: int, positions: np.ndarray, cfg: PackConfig, chunk_dir: Path) -> dict:
    task = {"index": index, "positions": positions, "keys": [src.keys[p] for p in positions],
            "cfg": cfg, "dir": str(chunk_dir)}
    if src.files is not None:
        task["files"] = [src.files[p] for p in positions]
    else:
        task["array"] = src.array[positions]
    return task


# The largest file a valid input can be: Pillow refuses images over twice MAX_IMAGE_PIXELS as
# decompression bombs, and the widest uncompressed pixel it reads is 8 bytes (16-bit RGBA); 1 MiB
# more for headers. A larger file is refused before it is read (a 2 GB sparse file was read whole).
MAX_INPUT_BYTES = 2 * 89_478_485 * 8 + 2**20


def read_input(path: str) -> bytes:
    """An input file's bytes; a DecodeError with the reason for anything that is not a regular
    file of a size an image could have. A FIFO, device or socket is refused before a byte is
    read (opening a FIFO for reading blocks until a writer comes: it is opened non-blocking)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise _decode.DecodeError("file not found") from None
    except IsADirectoryError:
        raise _decode.DecodeError("unreadable: it is a folder, not a file") from None
    except PermissionError:
        raise _decode.DecodeError("unreadable: permission denied") from None
    except OSError as e:
        raise _decode.DecodeError(f"unreadable ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise _decode.DecodeError("unreadable: it is a folder, not a file")
        if not stat.S_ISREG(st.st_mode):
            mode = st.st_mode
            kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or
                    stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
            raise _decode.DecodeError(f"not read: it is {kind}, not an image file")
        if st.st_size > MAX_INPUT_BYTES:
            raise _decode.DecodeError(f"not read: {st.st_size:,} bytes, more than any image trainfast decodes "
                                      f"({MAX_INPUT_BYTES:,})")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_INPUT_BYTES + 1)
    except OSError as e:
        raise _decode.DecodeError(f"unreadable ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_INPUT_BYTES:  # it grew while being read
        raise _decode.DecodeError(f"not read: more than {MAX_INPUT_BYTES:,} bytes")
    return data


def build_chunk(task: dict) -> dict:
    """Decode one chunk and write it (runs in a worker process; numpy and Pillow only)."""
    cfg: PackConfig = task["cfg"]
    h, w = cfg.size
    c = cfg.channels
    n = len(task["positions"])
    images = np.empty((n, h, w, c), np.uint8) if cfg.encoding == "raw" else None  # jpeg keeps only bytes
    hist = np.zeros(256 * c, np.int64)  # per channel, how many pixels have each value: exact sums, no float copy
    channel = np.arange(c, dtype=np.uint16) * 256
    ok, errors, blobs = [], [], []
    kept = 0  # JPEG files stored with their own bytes (see decode.keeps_bytes)
    for j in range(n):
        try:
            raw = None
            if "files" in task:
                data = read_input(task["files"][j])
                if images is None and _decode.keeps_bytes(data, cfg.size, c, cfg.quality):
                    raw, img = _decode.kept_jpeg(data, c)  # pixels as the Loader will see them
                if raw is None:
                    img = _decode.decode_file(data, cfg.size, cfg.resize, c)
            else:
                img = _decode.decode_array(task["array"][j], cfg.size, cfg.resize, c)
        except _decode.DecodeError as e:
            errors.append((task["keys"][j], str(e)))
            if cfg.on_error == "fail":
                break
            continue
        hist += np.bincount((img.reshape(-1, c) + channel).ravel(), minlength=256 * c)
        if images is not None:
            images[len(ok)] = img
        else:
            blobs.append(raw if raw is not None else _decode.encode_jpeg(img, cfg.quality))
            kept += raw is not None
        ok.append(int(task["positions"][j]))
    hist = hist.reshape(c, 256)
    values = np.arange(256, dtype=np.int64)
    result = {"n": n, "ok": ok, "errors": errors, "kept": kept,
              "sum": (hist @ values).tolist(), "sumsq": (hist @ values ** 2).tolist()}
    if errors and cfg.on_error == "fail":
        return result  # nothing is written: the build stops
    base = Path(task["dir"]) / f"{task['index']:06d}"
    if cfg.encoding == "raw":
        save_npy_atomic(base.with_suffix(".images.npy"), images[: len(ok)])
    else:
        save_npy_atomic(base.with_suffix(".jpeg.npy"), np.frombuffer(b"".join(blobs), np.uint8))
        result["lengths"] = [len(b) for b in blobs]
    write_atomic(base.with_suffix(".json"), json.dumps(result).encode())  # marks the chunk done
    return result

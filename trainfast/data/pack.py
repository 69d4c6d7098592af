"""Build a pack: decode and resize every input once, in parallel, resumably, atomically.

The work is cut into deterministic chunks of the (seeded) input order. Each worker process
writes its chunk's arrays into a build folder beside OUT and a small JSON that marks the
chunk done; a rerun after a kill (SIGKILL included) keeps the finished chunks. When all are
done the chunks are assembled into the pack's arrays in a temporary sibling folder, which
is renamed to OUT in one step. A reader never sees a half-written pack.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np

from trainfast import files, units
from trainfast.config import PackConfig
from trainfast.data import chunks as _chunks
from trainfast.data import decode as _decode
from trainfast.data.format import ENCODINGS, SCHEMA_VERSION, Pack, is_pack, read_meta
from trainfast.data.held import from_arrays
from trainfast.data.sources import Source, open_source
from trainfast.errors import TrainfastError
from trainfast.hardware import usable_cores

_JPEG_AUTO_PIXELS = 256 * 256  # auto encoding: raw up to this many pixels per image, jpeg above


def pack(source, out, config: PackConfig | None = None, *, overwrite: bool = False,
         progress: bool = True, log=None, **options) -> Pack:
    """Decode and resize every image of `source` once into a pack at `out`.

    Args:
        source: an image folder, a .csv, a .npz, a CIFAR tarball, a `Source`, or a tuple
            (images, labels) of arrays.
        out: the pack's directory. An existing pack is kept if it is up to date, and
            replaced only with overwrite=True; anything else there is refused.
        config: a PackConfig; keyword options (size=(64, 128), encoding="jpeg", ...) override it.
        progress: show a progress bar and a summary (on `log`, default print; silent with progress=False).
        path_column, label_column, label_kind, alphabet, split: how to read CSV and CIFAR sources;
            alphabet also for (images, labels) arrays with sequence labels (N, L).

    Returns:
        the finished Pack.

    Example:
        trainfast.pack("photos/", "photos.pack", size=(64, 128), resize="crop")
    """
    _chunks.not_while_a_worker_starts("trainfast.pack")
    source_options = {k: options.pop(k) for k in ("path_column", "label_column", "label_kind", "alphabet", "split")
                      if k in options}
    log = log or (print if progress else (lambda msg: None))
    src = _source(source, source_options)
    cfg = replace(config or PackConfig(), **options)
    cfg = _checked(cfg, src)
    for note in src.notes:
        log(f"{src.origin}: {note}")

    if src.skipped and cfg.on_error == "fail":
        key, reason = src.skipped[0]
        raise TrainfastError(f"{key}: {reason} (--on-error fail: nothing was written)")
    out = Path(out)
    order = np.random.default_rng(cfg.seed).permutation(len(src))
    if cfg.limit:
        order = order[: cfg.limit]
    identity = {"fingerprint": src.fingerprint(), "options": _options_record(cfg), "count_in": len(order)}

    _check_out(out, src)
    with _only_writer(out):
        return _build(src, out, order, cfg, identity, overwrite, progress, log)


def is_arrays(data) -> bool:
    """True for (images, labels) given as a pair of arrays rather than paths."""
    return isinstance(data, (tuple, list)) and len(data) == 2 and not isinstance(data[0], (str, os.PathLike))


def _source(source, options: dict) -> Source:
    """What `pack` was given, as a Source; anything else is named with what pack takes."""
    if isinstance(source, Source):
        return source
    if is_arrays(source):
        return from_arrays(*source, alphabet=options.get("alphabet"))  # (images, labels); sequences name their alphabet
    if isinstance(source, dict):
        ik = next((k for k in ("images", "x") if k in source), None)
        lk = next((k for k in ("labels", "y") if k in source), None)
        if ik is None or lk is None:
            raise TrainfastError(f"pack: a dict source needs 'images' (or 'x') and 'labels' (or 'y'); it has "
                                 f"{', '.join(map(repr, source)) or 'nothing'}")
        return from_arrays(source[ik], source[lk], classes=source.get("classes"), alphabet=options.get("alphabet"))
    if isinstance(source, (str, os.PathLike)):
        return open_source(source, **options)
    raise TrainfastError(f"pack: cannot pack a {type(source).__name__}; give an image folder, a .csv, a .npz or a "
                         "CIFAR tarball path, or arrays as (images, labels)")


def _build(src: Source, out: Path, order: np.ndarray, cfg: PackConfig, identity: dict, overwrite: bool,
           progress: bool, log) -> Pack:
    """Everything from here to the installed pack, by the one process that holds OUT's lock."""
    if out.exists() or out.is_symlink():
        meta = _pack_meta(out)
        if meta is None:
            raise TrainfastError(f"{out}: exists and is not a trainfast pack; trainfast replaces only packs it made "
                                 "(remove it yourself, or choose another OUT)")
        if meta.get("build") == identity and not overwrite:
            log(f"{out}: up to date ({meta['count']} images); nothing to do")
            _remove(_build_dir(out))
            return Pack(out)
        if not overwrite:
            raise TrainfastError(f"{out}: a different pack is already there; pass --overwrite to replace it")

    build = _build_dir(out)
    per_chunk = chunk_images(cfg)
    _prepare_build_dir(build, {**identity, "chunk": per_chunk}, log)  # other chunking: other chunk files
    started = time.perf_counter()
    chunks = [order[i: i + per_chunk] for i in range(0, len(order), per_chunk)]
    try:
        _chunks.run_chunks(src, chunks, cfg, build, progress)
        pack_dir = _assemble(src, chunks, cfg, build, identity)
        _install(pack_dir, out)
    except TrainfastError:
        if cfg.on_error == "fail":
            _remove(build)
        raise
    except OSError as e:
        if not _disk_full(e):
            raise
        need = len(order) * cfg.size[0] * cfg.size[1] * cfg.channels * (2 if cfg.encoding == "raw" else 0.25)
        free = shutil.disk_usage(build).free
        raise TrainfastError(f"{e.filename or build}: no space left on the device ({free / 1e9:.2f} GB free there; "
                             f"this build needs about {need / 1e9:.2f} GB). Free some and rerun the same command: "
                             "the finished chunks are kept") from None
    _remove(build)
    pk = Pack(out)
    _summarise(pk, src, time.perf_counter() - started, log)
    return pk


def _only_writer(out: Path):
    """One trainfast process builds OUT at a time; a second one says so at once (the lock is a
    file beside OUT, `.OUT.trainfast-lock`)."""
    return files.only_one(out.parent / f".{out.name}.trainfast-lock",
                          f"{out}: another trainfast process is building this pack now; wait for it to finish "
                          "(then rerun: an up-to-date pack is kept) or choose another OUT")


def _check_out(out: Path, src: Source) -> None:
    """OUT must not be where the user's data is: not the working directory, not the source or
    a folder above it or above any of its files, and not inside a source folder (whose next
    pack would read the pack as one more class)."""
    here = out.resolve()
    if here == Path.cwd().resolve():
        raise TrainfastError(f"{out}: is the working directory; the pack needs a folder of its own, e.g. data.pack")
    from_disk = src.kind != "arrays" or Path(src.origin).is_file()  # a .npz is "arrays" from a file
    origin = Path(src.origin).resolve() if from_disk else None
    if origin is not None and (here == origin or here in origin.parents):
        raise TrainfastError(f"{out}: holds the source {src.origin}; choose an OUT outside it, e.g. beside it")
    if src.kind == "folder" and origin in here.parents:
        raise TrainfastError(f"{out}: is inside the source folder {src.origin}, where the next pack of that "
                             "folder would read it as a class; put OUT beside the folder")
    inside = str(here) + os.sep
    for f in (src.files or ()) if src.kind == "csv" else ():  # a folder's files are all inside it: checked above
        if os.path.abspath(f).startswith(inside):
            raise TrainfastError(f"{out}: holds {f}, an input of this pack; choose an OUT that holds no inputs")


def _pack_meta(out: Path) -> dict | None:
    """The metadata of the trainfast pack at `out`, or None if what is there is anything else."""
    if not is_pack(out):
        return None
    try:
        return read_meta(out)
    except TrainfastError:
        return None


def _checked(cfg: PackConfig, src: Source) -> PackConfig:
    if cfg.size is None:  # arrays keep their own size; files may each have another
        if src.array is None:
            raise TrainfastError(f"{src.origin}: image files can differ in size; say which size the pack holds, "
                                 "e.g. size=(64, 128) (--size 64x128)")
        cfg = replace(cfg, size=src.array.shape[1:3])
    try:
        h, w = (int(v) for v in cfg.size)
    except (TypeError, ValueError):
        raise TrainfastError(f"size must be (height, width), got {cfg.size!r}") from None
    if h < 1 or w < 1 or h > 8192 or w > 8192:
        raise TrainfastError(f"size {h}×{w} is out of range (1 to 8192 per side)")
    if cfg.resize not in _decode.RESIZE_MODES:
        raise TrainfastError(f"resize must be one of {', '.join(_decode.RESIZE_MODES)}, not {cfg.resize!r}")
    if cfg.channels not in (1, 3):
        raise TrainfastError(f"channels must be 1 or 3, not {cfg.channels}")
    encoding = cfg.encoding
    if encoding == "auto":
        encoding = "jpeg" if h * w > _JPEG_AUTO_PIXELS else "raw"
    if encoding not in ENCODINGS:
        raise TrainfastError(f"encoding must be raw, jpeg or auto, not {cfg.encoding!r}")
    if not 1 <= cfg.quality <= 100:
        raise TrainfastError(f"quality must be 1 to 100, not {cfg.quality}")
    if cfg.on_error not in ("skip", "fail"):
        raise TrainfastError(f"on_error must be skip or fail, not {cfg.on_error!r}")
    if cfg.workers < 0 or cfg.limit < 0 or cfg.chunk < 1:
        raise TrainfastError("workers and limit must be ≥ 0, chunk ≥ 1")
    return replace(cfg, size=(h, w), encoding=encoding, workers=cfg.workers or usable_cores())


CHUNK_BYTES = 64 << 20  # a worker holds at most this much of decoded images at once


def chunk_images(cfg: PackConfig) -> int:
    """Inputs per chunk: cfg.chunk, fewer for large images, so that a worker's decoded chunk
    stays within CHUNK_BYTES (512 images of 1024×1024 would be 1.6 GB per worker)."""
    h, w = cfg.size
    return max(1, min(cfg.chunk, CHUNK_BYTES // (h * w * cfg.channels)))


def _options_record(cfg: PackConfig) -> dict:
    """The options that change the pack's bytes (workers and chunking do not)."""
    d = cfg.to_dict()
    for k in ("workers", "on_error", "chunk"):
        d.pop(k)
    d["size"] = list(d["size"])
    if cfg.encoding == "raw":
        d.pop("quality")
    return d


def _build_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.trainfast-build"


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _prepare_build_dir(build: Path, identity: dict, log) -> None:
    """Reuse a build folder from an interrupted run of the same build, else start afresh."""
    marker = build / "build.json"
    if build.is_symlink():  # a planted link: a resumed build would write wherever it points
        raise TrainfastError(f"{build}: a link where trainfast keeps its build folder; trainfast builds nothing "
                             "through a link: remove it, then rerun")
    if build.exists():
        try:
            same = json.loads(marker.read_text(encoding="utf-8")) == identity
        except (OSError, ValueError):
            same = False
        if same:
            done = len(list((build / "chunks").glob("*.json")))
            log(f"resuming an interrupted build: {done} chunk(s) already done")
            return
        _remove(build)
    try:
        (build / "chunks").mkdir(parents=True)
    except OSError as e:
        raise TrainfastError(f"{build.parent}: cannot write here ({e.strerror or e})") from None
    _chunks.write_atomic(marker, json.dumps(identity, indent=1).encode())


def _disk_full(e: OSError) -> bool:
    """ENOSPC or a quota; or numpy's short write ("N requested and M written"), which has no errno."""
    return e.errno in (errno.ENOSPC, errno.EDQUOT) or (e.errno is None and " requested and " in str(e)
                                                        and str(e).rstrip().endswith("written"))


# --- assembly: chunks → one pack ----------------------------------------------------------

def _reserve(path: Path) -> None:
    """Allocate a memory-mapped file's blocks now. NOTE: the map is sparse, and a store into it
    on a full disk kills the process with SIGBUS and no message; allocated first, a full disk
    is an OSError (ENOSPC) here, which pack() turns into one line."""
    if not hasattr(os, "posix_fallocate"):  # macOS, Windows
        return
    with open(path, "r+b") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # file systems that cannot: write and hope
                return
            raise OSError(e.errno, e.strerror, str(path)) from None


def _assemble(src: Source, chunks: list[np.ndarray], cfg: PackConfig, build: Path, identity: dict) -> Path:
    chunk_dir = build / "chunks"
    results = [json.loads((chunk_dir / f"{i:06d}.json").read_text(encoding="utf-8")) for i in range(len(chunks))]
    positions = [p for r in results for p in r["ok"]]
    skipped = [{"input": k, "reason": why} for k, why in src.skipped]
    skipped += [{"input": k, "reason": why} for r in results for k, why in r["errors"]]
    if not positions:
        first = f" (first: {skipped[0]['input']}: {skipped[0]['reason']})" if skipped else ""
        raise TrainfastError(f"{src.origin}: none of the {len(src) + len(src.skipped)} inputs could be packed{first}")

    dest = build / "pack"
    _remove(dest)
    dest.mkdir()
    n = len(positions)
    h, w = cfg.size
    c = cfg.channels
    if cfg.encoding == "raw":
        images = np.lib.format.open_memmap(dest / "images.npy", mode="w+", dtype=np.uint8, shape=(n, h, w, c))
        _reserve(dest / "images.npy")
        at = 0
        for i, r in enumerate(results):
            part = np.load(chunk_dir / f"{i:06d}.images.npy", allow_pickle=False)
            images[at: at + len(part)] = part
            at += len(part)
        images.flush()
        del images
    else:
        lengths = np.asarray([x for r in results for x in r["lengths"]], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        blob = np.lib.format.open_memmap(dest / "jpeg.npy", mode="w+", dtype=np.uint8, shape=(int(offsets[-1]),))
        _reserve(dest / "jpeg.npy")
        at = 0
        for i in range(len(results)):
            part = np.load(chunk_dir / f"{i:06d}.jpeg.npy", allow_pickle=False)
            blob[at: at + len(part)] = part
            at += len(part)
        blob.flush()
        del blob
        np.save(dest / "offsets.npy", offsets, allow_pickle=False)
    np.save(dest / "labels.npy", np.ascontiguousarray(src.labels[positions]), allow_pickle=False)

    count = n * h * w
    mean = np.sum([r["sum"] for r in results], axis=0) / count
    var = np.sum([r["sumsq"] for r in results], axis=0) / count - mean ** 2
    std = np.sqrt(np.maximum(var, 1.0))  # at least one grey level: a constant channel is not scaled to infinity
    meta = {
        "format": "trainfast-pack",
        "schema": SCHEMA_VERSION,
        "count": n,
        "shape": [h, w, c],
        "layout": "NHWC",
        "encoding": cfg.encoding,
        "label_kind": "sequence" if src.labels.ndim == 2 else "class",
        "classes": src.classes,
        "alphabet": src.alphabet,
        "sequence_length": int(src.labels.shape[1]) if src.labels.ndim == 2 else None,
        "mean": [round(float(v) / 255, 6) for v in mean],
        "std": [round(float(v) / 255, 6) for v in std],
        "source": {"kind": src.kind, "path": src.origin, "inputs": len(src) + len(src.skipped)},
        "skipped": len(skipped),
        "build": identity,
    }
    if cfg.encoding == "jpeg":  # JPEG files already at the pack's size and quality keep their own bytes
        meta["jpeg_kept"] = sum(r.get("kept", 0) for r in results)
    _chunks.write_atomic(dest / "inputs.json", json.dumps([src.keys[p] for p in positions]).encode())
    _chunks.write_atomic(dest / "skipped.json", json.dumps(skipped, indent=1).encode())
    _chunks.write_atomic(dest / "meta.json", json.dumps(meta, indent=1).encode())  # last: it makes this a pack
    return dest


def _install(pack_dir: Path, out: Path) -> None:
    """Move the finished pack to `out`; an old pack there is removed only after the move."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.parent / f".{out.name}.trainfast-old"
        _remove(old)
        os.replace(out, old)
    os.replace(pack_dir, out)
    if old is not None:
        _remove(old)


def _summarise(pk: Pack, src: Source, seconds: float, log) -> None:
    h, w, c = pk.shape
    size = sum(f.stat().st_size for f in pk.path.iterdir())
    log(f"packed {len(pk)} images ({h}×{w}×{c} {pk.encoding}, {size / 1e6:.1f} MB) into {pk.path} "
        f"in {seconds:.1f} s ({units.rate(len(pk) / max(seconds, 1e-9))} images/s)")
    if pk.meta.get("jpeg_kept"):
        log(f"  {pk.meta['jpeg_kept']} JPEG files were already at {h}×{w} and quality ≤ the pack's: kept as they were "
            "(not re-encoded)")
    skipped = pk.skipped
    if skipped:
        reasons = Counter(s["reason"].split(" (")[0] for s in skipped)
        log(f"skipped {len(skipped)} input(s): " + "; ".join(f"{k}: {v}" for k, v in reasons.most_common(6)))
        log(f"  the list with each input and reason: {pk.path / 'skipped.json'}")

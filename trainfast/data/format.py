"""The pack on disk, and `Pack`, its reader. docs/FORMAT.md is the specification.

A pack is a directory of plain files that numpy alone can read:

    meta.json      schema version, count, shape, encoding, labels, mean/std, source, options
    images.npy     raw packs: (N, H, W, C) uint8, NHWC
    jpeg.npy       jpeg packs: every image's JPEG bytes, concatenated, uint8
    offsets.npy    jpeg packs: (N + 1,) int64; image i is jpeg[offsets[i]:offsets[i + 1]]
    labels.npy     (N,) int64 class indices, or (N, L) int64 indices into the alphabet
    inputs.json    for each image, the input it came from (a path, or arrays[i])
    skipped.json   inputs left out, with the reason: [{"input": ..., "reason": ...}]
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from trainfast.errors import TrainfastError
from trainfast.units import shell_arg

SCHEMA_VERSION = 1
META = "meta.json"
ENCODINGS = ("raw", "jpeg")


def is_pack(path) -> bool:
    """True when `path` is a directory holding a pack's meta.json."""
    return (Path(path) / META).is_file()


def read_meta(path) -> dict:
    p = Path(path)
    if not p.exists():
        raise TrainfastError(f"{p}: no such pack (no file or folder there)")
    if not p.is_dir():  # a CSV, an image, a tarball given where a pack belongs
        raise TrainfastError(f"{p}: not a pack but a file; make a pack from it first: "
                             f"trainfast pack {shell_arg(p, path=True)} OUT --size HxW")
    try:
        meta = json.loads((p / META).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TrainfastError(f"{p}: not a pack (no {META}; make one with `trainfast pack`)") from None
    except (OSError, ValueError) as e:
        raise TrainfastError(f"{p}: unreadable {META} ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != "trainfast-pack":
        raise TrainfastError(f"{p}: {META} is not a trainfast pack's")
    if meta.get("schema") != SCHEMA_VERSION:
        raise TrainfastError(f"{p}: pack schema {meta.get('schema')} is not {SCHEMA_VERSION}, which this "
                             "trainfast reads; rebuild it with `trainfast pack --overwrite`")
    return meta


def _damaged(path: Path, what: str) -> TrainfastError:
    return TrainfastError(f"{path}: damaged pack ({what})")


def _check_meta(path: Path, m: dict) -> None:
    """meta.json has what a reader needs, with sane values; checked before any array is opened."""
    missing = [k for k in ("count", "shape", "encoding", "mean", "std") if k not in m]
    if missing:
        raise _damaged(path, f"{META} has no {', '.join(missing)}")
    shape = m["shape"]
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) and v > 0 for v in shape)):
        raise _damaged(path, f"{META} shape {shape!r} is not [height, width, channels]")
    if not isinstance(m["count"], int) or m["count"] < 0:
        raise _damaged(path, f"{META} count {m['count']!r} is not a number of images")
    if m["encoding"] not in ENCODINGS:
        raise _damaged(path, f"{META} encoding {m['encoding']!r} is not raw or jpeg")
    for key in ("mean", "std"):
        v = m[key]
        if not (isinstance(v, list) and len(v) == shape[2] and all(isinstance(x, (int, float)) and np.isfinite(x)
                                                                  for x in v)):
            raise _damaged(path, f"{META} {key} {v!r} is not {shape[2]} finite numbers")
    if min(m["std"]) <= 0:
        raise _damaged(path, f"{META} std {m['std']!r} has a value ≤ 0 (normalising would divide by it)")
    classes, alphabet = m.get("classes"), m.get("alphabet")
    if not ((isinstance(classes, list) and classes) or (isinstance(alphabet, str) and alphabet)):
        raise _damaged(path, f"{META} has neither classes nor an alphabet")


def _check_arrays(pk: "Pack") -> None:
    """The arrays agree with the metadata: dtypes, shapes, label range, JPEG offsets."""
    path, (h, w, c), n = pk.path, pk.shape, len(pk)
    labels = pk.labels
    if labels.dtype.kind not in "iu" or labels.ndim not in (1, 2):
        raise _damaged(path, f"labels.npy is {labels.dtype} {labels.shape}, not integers (N,) or (N, L)")
    if labels.ndim == 2 and not pk.alphabet:
        raise _damaged(path, f"labels.npy holds sequences {labels.shape} but {META} has no alphabet (it has classes)")
    if labels.ndim == 1 and not pk.classes:
        raise _damaged(path, f"labels.npy holds one class per image but {META} has no classes (it has an alphabet)")
    limit = len(pk.alphabet) if labels.ndim == 2 else len(pk.classes)
    if n and (labels.min() < 0 or labels.max() >= limit):
        raise _damaged(path, f"labels.npy holds labels from {labels.min()} to {labels.max()}; "
                             f"{'the alphabet' if labels.ndim == 2 else 'the classes'} allow 0 to {limit - 1}")
    if pk.encoding == "raw":
        if pk.images.dtype != np.uint8 or pk.images.shape != (n, h, w, c):
            raise _damaged(path, f"images.npy is {pk.images.dtype} {pk.images.shape}, not uint8 {(n, h, w, c)}")
        return
    off = pk.offsets
    if pk.jpeg.dtype != np.uint8 or pk.jpeg.ndim != 1 or off.dtype.kind not in "iu" or off.ndim != 1:
        raise _damaged(path, f"jpeg.npy / offsets.npy are {pk.jpeg.dtype} {pk.jpeg.shape} / {off.dtype} {off.shape}, "
                             "not uint8 bytes and integer offsets")
    if off[0] != 0 or off[-1] != len(pk.jpeg) or (n and np.any(np.diff(off) <= 0)):
        raise _damaged(path, "offsets.npy is not increasing from 0 to the size of jpeg.npy")


def as_pack(obj, what: str = "data") -> "Pack":
    """`obj` as an open Pack: a Pack, or the path of one; anything else is named in one line."""
    if isinstance(obj, Pack):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        return Pack(obj)
    hint = ""
    if isinstance(obj, (tuple, list)) and len(obj) == 2:
        hint = "; pack arrays first: trainfast.pack((x, y), 'train.pack')"
    elif type(obj).__name__ in ("DataLoader", "Dataset", "Sequence", "PyDataset"):
        hint = "; pack the images first with trainfast.pack or `trainfast pack`"
    raise TrainfastError(f"{what} must be a trainfast Pack or a pack's path, not a {type(obj).__name__}{hint}")


class Pack:
    """A pack opened for reading; arrays are memory-mapped, never loaded whole.

    Example:
        pk = Pack("plates.pack")
        len(pk), pk.shape          # 20000, (64, 128, 3)
        pk.images[0]               # (64, 128, 3) uint8, read-only (raw packs)
        pk.image(0)                # the same, for raw and jpeg packs alike
    """

    def __init__(self, path):
        self.path = Path(path)
        self.meta = read_meta(self.path)
        m = self.meta
        _check_meta(self.path, m)
        self.shape: tuple[int, int, int] = tuple(m["shape"])  # (H, W, C)
        self.encoding: str = m["encoding"]
        self.classes: list[str] | None = m.get("classes")
        self.alphabet: str | None = m.get("alphabet")
        self.mean: list[float] = m["mean"]
        self.std: list[float] = m["std"]
        try:
            self.labels: np.ndarray = np.load(self.path / "labels.npy", mmap_mode="r", allow_pickle=False)
            if self.encoding == "raw":
                self.images = np.load(self.path / "images.npy", mmap_mode="r", allow_pickle=False)
                n = len(self.images)
            else:
                self.images = None
                self.jpeg = np.load(self.path / "jpeg.npy", mmap_mode="r", allow_pickle=False)
                self.offsets = np.load(self.path / "offsets.npy", allow_pickle=False)
                n = len(self.offsets) - 1
        except (OSError, ValueError) as e:
            raise TrainfastError(f"{self.path}: damaged pack ({e})") from None
        if n != m["count"]:
            raise TrainfastError(f"{self.path}: damaged pack (meta says {m['count']} images, "
                                 f"{'images.npy' if self.encoding == 'raw' else 'offsets.npy'} holds {n})")
        if len(self.labels) != n:
            raise TrainfastError(f"{self.path}: damaged pack (labels.npy holds {len(self.labels)} labels for {n} "
                                 "images)")
        _check_arrays(self)

    def __len__(self) -> int:
        return self.meta["count"]

    def __repr__(self) -> str:
        h, w, c = self.shape
        what = f"{len(self.classes)} classes" if self.classes else f"sequences of {self.sequence_length} over {self.alphabet!r}"
        return f"Pack({str(self.path)!r}: {len(self)} images {h}×{w}×{c} {self.encoding}, {what})"

    @property
    def sequence_length(self) -> int | None:
        """L for sequence labels (N, L); None for class labels."""
        return self.labels.shape[1] if self.labels.ndim == 2 else None

    @property
    def skipped(self) -> list[dict]:
        return json.loads((self.path / "skipped.json").read_text(encoding="utf-8"))

    @property
    def inputs(self) -> list[str]:
        return json.loads((self.path / "inputs.json").read_text(encoding="utf-8"))

    def image(self, i: int) -> np.ndarray:
        """Image i as (H, W, C) uint8, decoding it for jpeg packs."""
        if self.images is not None:
            return np.asarray(self.images[i])
        from trainfast.data.decode import decode_jpeg

        try:
            return decode_jpeg(memoryview(self.jpeg[self.offsets[i]: self.offsets[i + 1]]), self.shape[2])
        except (ValueError, OSError, RuntimeError) as e:  # bytes changed after the pack was built
            raise TrainfastError(f"{self.path}: image {i} in jpeg.npy cannot be decoded ({e}); the pack is "
                                 "damaged: build it again (trainfast pack ... --overwrite)") from None

    def label_text(self, label) -> str:
        """A label as a person reads it: the class name, or the plate string."""
        label = np.asarray(label)
        if label.ndim == 1:
            return "".join(self.alphabet[int(i)] for i in label)
        return self.classes[int(label)] if self.classes else str(int(label))

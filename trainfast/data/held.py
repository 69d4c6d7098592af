"""Images already held as arrays: numpy arrays in memory, a .npz, or a CIFAR "python version"
tarball. Arrays are taken as users hold them (channels-first, [-1, 1] floats, class names,
one-hot or (N, 1) labels), each conversion said in Source.notes; what cannot be read as
images and labels is refused in one line that says the fix."""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import numpy as np

from trainfast.data.sources import Source
from trainfast.errors import TrainfastError

SPARSE_CLASSES = 4096
"""Integer labels name classes 0..max; beyond this (and 16× the distinct values) they are ids,
not indices, and are refused rather than made into that many classes."""


def from_arrays(images, labels, classes=None, alphabet=None, name="arrays") -> Source:
    """In-memory images (N, H, W[, C]) uint8 (or float in [0, 1] or [-1, 1]) and labels (N,) or (N, L).

    Arrays as users already hold them are taken: channels-first images (N, C, H, W) are
    viewed channels-last, and string, boolean, whole-number float or one-hot labels become
    classes. `Source.notes` says which conversion was made.
    """
    images = np.asarray(images)
    labels = np.asarray(labels)
    notes = []
    if images.ndim not in (3, 4):
        raise TrainfastError(f"{name}: images must be (N, H, W) or (N, H, W, C), got shape {images.shape}")
    if len(images) == 0:
        raise TrainfastError(f"{name}: no images (empty array)")
    if 0 in images.shape:
        raise TrainfastError(f"{name}: images of shape {images.shape} hold no pixels")
    if labels.ndim == 0:
        raise TrainfastError(f"{name}: labels must be an array of one label per image, not {labels.item()!r}")
    if labels.ndim == 2 and labels.shape[1] == 1 and alphabet is None:  # (N, 1), as keras.datasets gives them
        labels = labels[:, 0]
    if images.ndim == 4 and images.shape[1] in (1, 3, 4) and images.shape[3] not in (1, 3, 4):
        # (N, C, H, W), as torch and CIFAR's raw rows hold them; the pack's decoder wants (H, W, C)
        notes.append(f"images {images.shape} read as channels-first (N, C, H, W) and stored channels-last")
        images = images.transpose(0, 2, 3, 1)
    elif images.ndim == 4 and images.shape[3] not in (1, 3, 4):
        raise TrainfastError(f"{name}: images of shape {images.shape} have {images.shape[3]} channels; trainfast "
                             "packs (N, H, W, C) images with 1, 3 or 4 channels (channels-first arrays: "
                             "x.transpose(0, 2, 3, 1))")
    if len(labels) != len(images):
        raise TrainfastError(f"{name}: {len(images)} images but {len(labels)} labels")
    labels, classes, note = _class_labels(labels, classes, alphabet, name)
    notes += [note] if note else []
    if images.dtype.kind == "f":
        finite = np.isfinite(images.reshape(len(images), -1)).all(axis=1)
        if not finite.all():  # NaN would become 0 (black) silently when converted to uint8
            bad = np.flatnonzero(~finite)
            raise TrainfastError(f"{name}: {len(bad)} image{'s hold' if len(bad) > 1 else ' holds'} NaN or infinite "
                                 f"values (first: image {bad[0]}); fix or drop {'them' if len(bad) > 1 else 'it'} "
                                 "before packing")
        low, top = float(np.min(images)), float(np.max(images))
        if top > 1.0 + 1e-3:  # clipped to [0, 1], 0–255 floats would come out almost all white
            raise TrainfastError(f"{name}: float images must be in [0, 1], and these reach {top:.4g}; for 0–255 "
                                 "values pass them as uint8 (images.astype(np.uint8)) or divide by 255")
        if low < -1.0 - 1e-3:  # standardised images: their scale is not known here
            raise TrainfastError(f"{name}: float images must be in [0, 1] (or [-1, 1]), and these reach {low:.4g}: "
                                 "pass them before normalisation (trainfast normalises each channel itself)")
        if low < 0:  # the usual [-1, 1] form; clipped to [0, 1] its negative half would become black
            images = (images.astype(np.float32) + 1) / 2
            notes.append(f"float images from {low:.3g} to {top:.3g} read as [-1, 1] and stored as (x + 1) / 2 in "
                         "0–255 (trainfast normalises each channel itself)")
    elif images.dtype.kind in "iu" and images.dtype != np.uint8:
        low, top = int(images.min()), int(images.max())
        if low < 0 or top > 255:
            wide = f" (for {images.dtype.itemsize * 8}-bit images, x / {np.iinfo(images.dtype).max} gives floats in [0, 1])" \
                if low >= 0 else ""
            raise TrainfastError(f"{name}: {images.dtype} images hold values from {low} to {top}; trainfast packs "
                                 f"0–255 (uint8) or floats in [0, 1]{wide}")
        images = images.astype(np.uint8)
    elif images.dtype == bool:  # masks and binarised digits: False black, True white
        images = images.astype(np.uint8) * 255
        notes.append("boolean images stored as 0 (False) and 255 (True)")
    elif images.dtype != np.uint8:
        raise TrainfastError(f"{name}: images must be uint8 (0–255) or floats in [0, 1], not {images.dtype}")
    if classes is None and labels.ndim == 1:
        classes = [str(i) for i in range(int(labels.max()) + 1)]
    keys = [f"{name}[{i}]" for i in range(len(images))]
    return Source("arrays", name, keys, labels.astype(np.int64), classes=list(classes) if classes else None,
                  alphabet=alphabet, array=images, notes=notes)


def _class_labels(labels: np.ndarray, classes, alphabet, name: str):
    """(int64 labels, classes, a note or None) from the labels arrays users hold."""
    if labels.dtype.kind == "O":  # a list or pandas column of Python objects: let numpy type it
        kinds = {isinstance(v, (str, bytes)) for v in labels.ravel()}
        if len(kinds) == 2:
            odd = next(v for v in labels.ravel() if not isinstance(v, (str, bytes)))
            raise TrainfastError(f"{name}: labels mix strings with {type(odd).__name__} ({odd!r}); give integers "
                                 "(N,) or class names (N,) as strings")
        labels = np.asarray(labels.tolist())
    if labels.dtype.kind in "USO":  # names: 'cat', b'dog'; sorted, as a folder's classes are
        if labels.ndim != 1:
            raise TrainfastError(f"{name}: string labels must be one per image, shape (N,), not {labels.shape}")
        text = np.array([v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in labels])
        found, index = np.unique(text, return_inverse=True)
        if classes is not None:
            missing = sorted(set(found) - set(map(str, classes)))
            if missing:
                raise TrainfastError(f"{name}: labels {missing[:5]} are not among the classes given")
            where = {c: i for i, c in enumerate(map(str, classes))}
            return np.array([where[t] for t in text], np.int64), list(map(str, classes)), None
        shown = ", ".join(f"{c}={i}" for i, c in enumerate(found[:6])) + (", …" if len(found) > 6 else "")
        note = f"{len(found)} classes from the label names, sorted: {shown}"
        return index.astype(np.int64), [str(c) for c in found], note
    if labels.dtype.kind == "b" and labels.ndim == 1:
        return labels.astype(np.int64), classes or ["False", "True"], None
    if labels.dtype.kind in "fiub" and labels.ndim == 2 and alphabet is None and labels.shape[1] > 1 \
            and np.all((labels == 0) | (labels == 1)) and np.all(labels.sum(1) == 1):
        # one-hot rows, as keras.utils.to_categorical (floats), np.eye(K, dtype=int) or pandas.get_dummies make them
        return labels.argmax(1).astype(np.int64), classes, \
            f"one-hot labels ({labels.shape[1]} columns) read as class indices"
    if labels.dtype.kind == "f":
        if np.all(np.isfinite(labels)) and np.all(labels == np.round(labels)):
            labels = labels.astype(np.int64)  # 3.0 is class 3
        else:
            bad = labels[~(np.isfinite(labels) & (labels == np.round(labels)))].ravel()[0]
            raise TrainfastError(f"{name}: labels must be class indices or names, and {bad!r} is neither; "
                                 "for class names, map them first: names, y = np.unique(labels, return_inverse=True)")
    if labels.dtype.kind not in "iu" or labels.ndim not in (1, 2):
        raise TrainfastError(f"{name}: labels must be integers (N,) or (N, L), or class names (N,), "
                             f"got {labels.dtype} {labels.shape}")
    if labels.ndim == 2 and alphabet is None:
        raise TrainfastError(f"{name}: labels of shape {labels.shape} are sequences (N, L) and need an alphabet "
                             "(alphabet=\"0123456789ABC…\"); one-hot labels: labels.argmax(1)")
    if labels.size and labels.min() < 0:
        raise TrainfastError(f"{name}: labels must be ≥ 0; the smallest is {int(labels.min())}")
    if labels.ndim == 2 and labels.size and labels.max() >= len(alphabet):
        raise TrainfastError(f"{name}: label {int(labels.max())} has no character in the alphabet of "
                             f"{len(alphabet)} ({alphabet!r})")
    if classes is not None and labels.ndim == 1 and labels.max() >= len(classes):
        raise TrainfastError(f"{name}: label {int(labels.max())} has no name among the {len(classes)} classes given")
    if classes is None and labels.ndim == 1 and labels.size:
        top, distinct = int(labels.max()), len(np.unique(labels))
        if top >= max(SPARSE_CLASSES, 16 * distinct):  # class names 0..top would be made, and a head that wide
            raise TrainfastError(f"{name}: class indices reach {top:,} with {distinct:,} distinct values, which would "
                                 f"make {top + 1:,} classes; number them 0..{distinct - 1} first: "
                                 "classes, y = np.unique(labels, return_inverse=True)")
    return labels, classes, None


def from_npz(path) -> Source:
    """A .npz holding `images` (or `x`) and `labels` (or `y`); optional `classes` (strings)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            names = set(z.files)
            ik = next((k for k in ("images", "x") if k in names), None)
            lk = next((k for k in ("labels", "y") if k in names), None)
            if ik is None or lk is None:
                raise TrainfastError(f"{path}: needs arrays named images (or x) and labels (or y); has {', '.join(sorted(names))}")
            classes = [str(c) for c in z["classes"]] if "classes" in names else None
            return from_arrays(z[ik], z[lk], classes=classes, name=str(path))
    except (OSError, ValueError) as e:
        raise TrainfastError(f"{path}: not a readable .npz ({e})") from None


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain data and numpy arrays, nothing else: no code runs from the file.

    NOTE: CIFAR's "python version" is pickle. These are the only globals its batches need.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    }

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only plain data and arrays are allowed")


def _load_batch(tar: tarfile.TarFile, member: tarfile.TarInfo) -> dict:
    data = tar.extractfile(member).read()
    obj = _ArraysOnlyUnpickler(io.BytesIO(data), encoding="latin1").load()
    if not isinstance(obj, dict):
        raise pickle.UnpicklingError("a CIFAR batch must be a dict")
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in obj.items()}


def from_cifar(path, split="train") -> Source:
    """CIFAR-10 or CIFAR-100 "python version" tarball, as its authors distribute it."""
    if split not in ("train", "test"):
        raise TrainfastError(f"--split must be train or test, not {split!r}")
    try:
        with tarfile.open(path) as tar:
            members = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}
            if "batches.meta" in members:  # CIFAR-10
                names = ["test_batch"] if split == "test" else [f"data_batch_{i}" for i in range(1, 6)]
                meta, label_key, names_key = "batches.meta", "labels", "label_names"
            elif "meta" in members and "train" in members:  # CIFAR-100, fine labels
                names, meta, label_key, names_key = [split], "meta", "fine_labels", "fine_label_names"
            else:
                raise TrainfastError(f"{path}: not a CIFAR-10/100 python tarball (no batches.meta or meta)")
            missing = [n for n in names if n not in members]
            if missing:
                raise TrainfastError(f"{path}: CIFAR tarball lacks {', '.join(missing)}")
            classes = [c.decode() if isinstance(c, bytes) else str(c) for c in _load_batch(tar, members[meta])[names_key]]
            images, labels = [], []
            for n in names:
                batch = _load_batch(tar, members[n])
                data = np.asarray(batch["data"], dtype=np.uint8)
                images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
                labels.append(np.asarray(batch[label_key], dtype=np.int64))
    except (tarfile.TarError, OSError, EOFError, pickle.UnpicklingError, KeyError, ValueError) as e:
        raise TrainfastError(f"{path}: cannot read the CIFAR tarball ({type(e).__name__}: {e})") from None
    src = from_arrays(np.concatenate(images), np.concatenate(labels), classes=classes, name=f"{Path(path).name}:{split}")
    src.kind, src.origin = "cifar", str(path)
    return src

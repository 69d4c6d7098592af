"""Where images come from: an image folder, a CSV, numpy arrays, or a CIFAR tarball.

A Source lists the inputs and their labels; it decodes nothing (the pack workers do). Inputs
whose row or label is already wrong here are recorded in `skipped` with the reason.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import pickle
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainfast.errors import TrainfastError
from trainfast.units import shell_arg

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
DEFAULT_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
LABEL_KINDS = ("auto", "class", "sequence")


@dataclass
class Source:
    """The inputs of a pack, before decoding.

    Exactly one of `files` (paths to read) and `array` (N, H, W[, C] images) is set.
    `labels` is int64 (N,) for classes or (N, L) for sequences over `alphabet`.
    """

    kind: str
    origin: str
    keys: list[str]
    labels: np.ndarray
    classes: list[str] | None = None
    alphabet: str | None = None
    files: list[str] | None = None
    array: np.ndarray | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    pack_flags: str = ""  # the `trainfast pack` options that read this source the same way (a CSV's columns)
    notes: list[str] = field(default_factory=list)  # how the inputs were read, for the log (channels-first, names)

    def fingerprint(self) -> str:
        """sha1 of what the pack is made from: the input names and labels (and array bytes).

        NOTE: a file rewritten in place under the same name is not noticed; use --overwrite.
        """
        h = hashlib.sha1()
        h.update(f"{self.kind}\0{len(self.keys)}\0".encode())
        h.update("\0".join(self.keys).encode("utf-8", "surrogateescape"))
        h.update(np.ascontiguousarray(self.labels).tobytes())
        h.update("\0".join(self.classes or []).encode("utf-8", "surrogateescape") + (self.alphabet or "").encode())
        if self.array is not None:
            h.update(memoryview(np.ascontiguousarray(self.array)).cast("B"))
        return h.hexdigest()

    def __len__(self) -> int:
        return len(self.keys)

    def pack_command(self, out: str, size: str) -> str:
        """The `trainfast pack` command that reads this source as it was read here, shell-quoted
        for pasting (a folder named `photos $(id)` stays one argument)."""
        return (f"trainfast pack {shell_arg(self.origin, path=True)} {shell_arg(out, path=True)} "
                f"--size {shell_arg(size)}" + (f" {self.pack_flags}" if self.pack_flags else ""))


def _flag(option: str, value: str) -> str:
    """`--option value` for a printed command; `--option=-value` where the value begins with `-`."""
    return f"{option}={shell_arg(value)}" if str(value).startswith("-") else f"{option} {shell_arg(value)}"


def open_source(path, *, path_column="path", label_column="label", label_kind="auto",
                alphabet=DEFAULT_ALPHABET, split="train") -> Source:
    """Pick the source type from what `path` is: folder, .csv, .npz or a CIFAR tarball."""
    p = Path(path)
    if not p.exists():
        raise TrainfastError(f"{path}: no such file or folder")
    if p.is_dir():
        return from_folder(p)
    name = p.name.lower()
    if name.endswith(".csv"):
        return from_csv(p, path_column=path_column, label_column=label_column,
                        label_kind=label_kind, alphabet=alphabet)
    if name.endswith(".npz"):
        return from_npz(p)
    if name.endswith((".tar.gz", ".tgz", ".tar")):
        return from_cifar(p, split=split)
    raise TrainfastError(f"{path}: not a source trainfast knows (an image folder, a .csv, a .npz, "
                         "or a CIFAR-10/100 python tarball)")


def _unreadable_folder(e: OSError):
    """os.walk skips a folder it cannot list; a class would silently lose its images."""
    raise TrainfastError(f"{e.filename}: cannot read this folder ({e.strerror or e}); fix its permissions or move "
                         "it out of the source")


def _real(path) -> Path:
    """Where `path` leads, links followed as far as they go. NOTE: Path.resolve() raises
    RuntimeError on a link loop (a.jpg -> a.jpg); realpath stops at the loop, and the file that
    cannot be opened is then skipped with its reason like any unreadable input."""
    return Path(os.path.realpath(path))


def from_folder(root) -> Source:
    """One subfolder per class, as Keras's image_dataset_from_directory reads it.

    Class names are the subfolder names, sorted; images are found recursively inside them.
    """
    root = Path(root)
    inside = _real(root)
    try:
        entries = sorted(root.iterdir())
        # A pack inside the folder (an older trainfast allowed OUT there) is not a class.
        classes = [d.name for d in entries if d.is_dir() and not d.name.startswith(".")
                   and not ((d / "meta.json").is_file() and (d / "labels.npy").is_file())]
    except OSError as e:  # a class folder this user may not read (is_file raises PermissionError there)
        _unreadable_folder(e)
    for name in classes:  # a class folder that links out of the source (loop -> ..) would pack what is not in it
        target = _real(root / name)
        if (root / name).is_symlink() and (target == inside or inside not in target.parents):
            raise TrainfastError(f"{root / name}: a class folder that is a link to {target}, outside {root}; "
                                 "trainfast does not follow links out of the source (copy or move the images in)")
    keys, labels, skipped = [], [], []
    for index, name in enumerate(classes):
        for dirpath, dirnames, filenames in os.walk(root / name, onerror=_unreadable_folder):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for fn in sorted(filenames):
                if fn.lower().endswith(IMAGE_EXTENSIONS) and not fn.startswith("."):
                    path = os.path.join(dirpath, fn)
                    key = os.path.relpath(path, root)
                    if os.path.islink(path) and inside not in _real(path).parents:
                        skipped.append((key, f"a link to {_real(path)}, outside the source: not followed"))
                        continue
                    keys.append(key)
                    labels.append(index)
            # A folder named like an image (x.jpg/) is an unreadable input, not a subfolder.
            for d in list(dirnames):
                if d.lower().endswith(IMAGE_EXTENSIONS):
                    keys.append(os.path.relpath(os.path.join(dirpath, d), root))
                    labels.append(index)
                    dirnames.remove(d)
    if not keys:
        loose = [f for f in os.listdir(root) if f.lower().endswith(IMAGE_EXTENSIONS)]
        hint = (" (images must sit in one subfolder per class, e.g. root/cat/1.jpg)" if loose else "")
        raise TrainfastError(f"{root}: no images found{hint}")
    csvs = sorted(f for f in os.listdir(root) if f.lower().endswith(".csv"))
    if len(classes) == 1 and csvs:  # make-plates' layout: images/ and labels.csv
        raise TrainfastError(f"{root}: one subfolder ({classes[0]}/), so every image would get the same class; "
                             f"its labels are likely in {csvs[0]}: give that CSV as the source "
                             f"(--label-column names its label column)")
    return Source("folder", str(root), keys, np.asarray(labels, np.int64), classes=classes,
                  files=[str(root / k) for k in keys], skipped=skipped)


def from_csv(csv_path, *, path_column="path", label_column="label", label_kind="auto",
             alphabet=DEFAULT_ALPHABET) -> Source:
    """A CSV with a path column and a label column; relative paths resolve against its folder.

    label_kind: 'class' (names, sorted), 'sequence' (fixed-length strings over `alphabet`,
    e.g. plates), or 'auto': sequence when ≥ 80% of labels are equal-length strings over the
    alphabet and most are unique, else class.
    """
    csv_path = Path(csv_path)
    if label_kind not in LABEL_KINDS:
        raise TrainfastError(f"label kind {label_kind!r} is not one of {', '.join(LABEL_KINDS)}")
    try:
        text = csv_path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise TrainfastError(f"{csv_path}: cannot read ({e})") from None
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if not header:
        raise TrainfastError(f"{csv_path}: empty CSV (no header row)")
    header = [h.strip() for h in header]
    pcol, lcol = path_column, label_column
    given = label_kind
    if (pcol not in header or lcol not in header) and len(header) == 2 \
            and (pcol, lcol) == ("path", "label"):
        pcol, lcol = header  # a two-column CSV with other names: path first, label second
    for col, what in ((pcol, "--path-column"), (lcol, "--label-column")):
        if col not in header:
            raise TrainfastError(f"{csv_path}: no column {col!r} ({what}); columns are {', '.join(header)}")
    pi, li = header.index(pcol), header.index(lcol)

    base = csv_path.parent
    rows, skipped = [], []
    for line_no, row in enumerate(reader, start=2):
        if not row or all(not c.strip() for c in row):
            continue
        where = f"{csv_path.name}:{line_no}"
        if len(row) != len(header):
            skipped.append((where, f"malformed row: {len(row)} fields, header has {len(header)}"))
            continue
        path, label = row[pi].strip(), row[li].strip()
        if not path or not label:
            skipped.append((where, "empty path" if not path else "empty label"))
            continue
        rows.append((path, label, where))
    first_row: dict[str, tuple[str, str]] = {}
    for path, label, where in rows:  # one image with two labels: both rows would be packed, maybe split apart
        key = os.path.normpath(path)
        if key in first_row and first_row[key][1] != label:
            raise TrainfastError(f"{csv_path}: {path} is listed twice with different labels "
                                 f"({first_row[key][0]}: {first_row[key][1]!r}, {where}: {label!r}); keep one row")
        first_row.setdefault(key, (where, label))
    if not rows:
        raise TrainfastError(f"{csv_path}: no usable rows" + (f" ({skipped[0][0]}: {skipped[0][1]})" if skipped else ""))

    texts = [r[1] for r in rows]
    if label_kind == "auto":
        label_kind = "sequence" if _looks_like_sequences(texts, alphabet) else "class"
    keys, files, labels = [], [], []
    classes = sorted(set(texts)) if label_kind == "class" else None
    if label_kind == "class":
        index = {c: i for i, c in enumerate(classes)}
        for path, label, _ in rows:
            keys.append(path)
            files.append(str(base / path))
            labels.append(index[label])
        label_array = np.asarray(labels, np.int64)
    else:
        length = Counter(len(t) for t in texts).most_common(1)[0][0]
        char_index = {c: i for i, c in enumerate(alphabet)}
        for path, label, where in rows:
            if len(label) != length:
                skipped.append((f"{where} {path}", f"label {label!r} has {len(label)} characters, expected {length}"))
                continue
            bad = sorted(set(label) - set(alphabet))
            if bad:
                skipped.append((f"{where} {path}", f"label {label!r} has {''.join(bad)!r}, not in the alphabet {alphabet!r}"))
                continue
            keys.append(path)
            files.append(str(base / path))
            labels.append([char_index[c] for c in label])
        label_array = np.asarray(labels, np.int64).reshape(len(labels), length)
    if not keys:
        raise TrainfastError(f"{csv_path}: every row was rejected (first: {skipped[0][0]}: {skipped[0][1]})")
    flags = [_flag("--path-column", path_column)] * (path_column != "path")
    flags += [_flag("--label-column", label_column)] * (label_column != "label")
    flags += [f"--labels {given}"] * (given != "auto")
    flags += [_flag("--alphabet", alphabet)] * (label_kind == "sequence" and alphabet != DEFAULT_ALPHABET)
    return Source("csv", str(csv_path), keys, label_array, classes=classes,
                  alphabet=alphabet if label_kind == "sequence" else None, files=files, skipped=skipped,
                  pack_flags=" ".join(flags))


def _looks_like_sequences(texts: list[str], alphabet: str) -> bool:
    length, count = Counter(len(t) for t in texts).most_common(1)[0]
    chars = set(alphabet)
    fitting = sum(1 for t in texts if len(t) == length and set(t) <= chars)
    return length >= 2 and fitting >= 0.8 * len(texts) and len(set(texts)) >= 0.5 * len(texts)


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

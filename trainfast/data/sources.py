"""Where images come from: an image folder or a CSV of paths (here), numpy arrays, a .npz or a
CIFAR tarball (data/held.py); open_source picks one from a path.

A Source lists the inputs and their labels; it decodes nothing (the pack workers do). Inputs
whose row or label is already wrong here are recorded in `skipped` with the reason.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
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
        from trainfast.data.held import from_npz  # held.py builds on Source, defined here

        return from_npz(p)
    if name.endswith((".tar.gz", ".tgz", ".tar")):
        from trainfast.data.held import from_cifar

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
    rows, skipped = _csv_rows(csv_path, path_column, label_column)
    given = label_kind
    if label_kind == "auto":
        label_kind = "sequence" if _looks_like_sequences([r[1] for r in rows], alphabet) else "class"
    if label_kind == "class":
        classes = sorted({label for _, label, _ in rows})
        index = {c: i for i, c in enumerate(classes)}
        keys, label_array = [r[0] for r in rows], np.asarray([index[r[1]] for r in rows], np.int64)
    else:
        classes = None
        keys, label_array = _sequence_labels(rows, alphabet, skipped)
    if not keys:
        raise TrainfastError(f"{csv_path}: every row was rejected (first: {skipped[0][0]}: {skipped[0][1]})")
    flags = [_flag("--path-column", path_column)] * (path_column != "path")
    flags += [_flag("--label-column", label_column)] * (label_column != "label")
    flags += [f"--labels {given}"] * (given != "auto")
    flags += [_flag("--alphabet", alphabet)] * (label_kind == "sequence" and alphabet != DEFAULT_ALPHABET)
    return Source("csv", str(csv_path), keys, label_array, classes=classes,
                  alphabet=alphabet if label_kind == "sequence" else None,
                  files=[str(csv_path.parent / k) for k in keys], skipped=skipped, pack_flags=" ".join(flags))


def _csv_rows(csv_path: Path, path_column: str, label_column: str) -> tuple[list, list]:
    """The CSV's usable rows as (path, label, 'file:line') and its skipped ones as ('file:line',
    reason). A two-column CSV with other names is path first, label second; an image listed
    twice with two labels is refused, naming both rows."""
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
    if (pcol not in header or lcol not in header) and len(header) == 2 and (pcol, lcol) == ("path", "label"):
        pcol, lcol = header
    for col, what in ((pcol, "--path-column"), (lcol, "--label-column")):
        if col not in header:
            raise TrainfastError(f"{csv_path}: no column {col!r} ({what}); columns are {', '.join(header)}")
    pi, li = header.index(pcol), header.index(lcol)
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
    return rows, skipped


def _sequence_labels(rows: list, alphabet: str, skipped: list) -> tuple[list[str], np.ndarray]:
    """The rows' labels as character indices (N, L), L the most common length; a row of another
    length or with a character outside `alphabet` is added to `skipped` with the reason."""
    length = Counter(len(label) for _, label, _ in rows).most_common(1)[0][0]
    char_index = {c: i for i, c in enumerate(alphabet)}
    keys, labels = [], []
    for path, label, where in rows:
        bad = sorted(set(label) - set(alphabet))
        if len(label) != length:
            skipped.append((f"{where} {path}", f"label {label!r} has {len(label)} characters, expected {length}"))
        elif bad:
            skipped.append((f"{where} {path}", f"label {label!r} has {''.join(bad)!r}, not in the alphabet {alphabet!r}"))
        else:
            keys.append(path)
            labels.append([char_index[c] for c in label])
    return keys, np.asarray(labels, np.int64).reshape(len(labels), length)


def _looks_like_sequences(texts: list[str], alphabet: str) -> bool:
    length, count = Counter(len(t) for t in texts).most_common(1)[0]
    chars = set(alphabet)
    fitting = sum(1 for t in texts if len(t) == length and set(t) <= chars)
    return length >= 2 and fitting >= 0.8 * len(texts) and len(set(texts)) >= 0.5 * len(texts)


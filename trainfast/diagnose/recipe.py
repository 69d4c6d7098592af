"""What a script reads, and the pack that replaces it: the script doctor's recipe.

The probes note each image and CSV file the script opens for reading (an audit hook), the
arguments of `keras.utils.image_dataset_from_directory`, and the first batch its data source
gives. From those this module finds the source to pack — the CSV whose rows name the images
read, the class folders they sit in, or image_dataset_from_directory's folder — and the size
(the batch's own), and writes the exact `trainfast pack` command and the line to change in the
script. The gain is measured on the spot: a pack of a sample of those files feeds the script's
own Keras model for a few steps; for PyTorch the Loader's time per batch on that sample stands
in for the data wait, as in the data doctor.
"""

from __future__ import annotations

import csv
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainfast import files, units
from trainfast.data.sources import IMAGE_EXTENSIONS, Source, from_csv, from_folder
from trainfast.diagnose.origin import Origin, rel_path
from trainfast.diagnose.verdict import Recommendation
from trainfast.errors import TrainfastError

COVERED = 0.8  # a source explains the script's reads when it lists this share of the images read
LABEL_NAMES = ("label", "labels", "class", "category", "target", "y", "plate", "text", "name")


@dataclass
class Labels:
    """The form of the script's labels, read off its first batch: class indices (B,), one-hot
    classes (B, K), sequences of indices (B, L) or one-hot sequences (B, L, K)."""

    kind: str  # "class" or "sequence"
    shape: tuple  # one example's
    length: int = 0  # symbols per sequence
    width: int = 0  # the one-hot width (classes, or the alphabet's size); 0 for indices
    top: int = 0  # the largest class index seen (indices only)

    def said(self) -> str:
        what = f"sequences of {self.length}" if self.kind == "sequence" else "one class per image"
        return f"{what}, " + (f"one-hot over {self.width} (shape {self.shape})" if self.width else "as indices")

    def fits(self, values: list[str]) -> bool:
        """Could a CSV column holding `values` be these labels?"""
        if self.kind == "sequence":
            right = [v for v in values if len(v) == self.length]
            return len(right) >= 0.9 * len(values) and (not self.width or len(set("".join(right))) <= self.width)
        distinct = len(set(values))
        if self.width:  # one-hot: the model's width is the number of classes
            return distinct == self.width
        return max(2, self.top + 1) <= distinct <= len(values) // 2  # class labels repeat


def labels_of(y) -> Labels | None:
    """The form of a batch's labels, or None where it is none of the four (a regression target)."""
    if y is None or y.ndim == 0 or y.shape[0] == 0 or y.dtype.kind not in "biuf":
        return None
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    whole = bool(np.all(np.mod(y, 1) == 0)) and float(np.min(y)) >= 0
    one_hot = y.ndim >= 2 and bool(np.isin(y, (0, 1)).all()) and bool(np.all(y.sum(-1) == 1))
    if y.ndim == 1 and whole:
        return Labels("class", (), top=int(np.max(y)))
    if y.ndim == 2 and one_hot:
        return Labels("class", y.shape[1:], width=int(y.shape[1]))
    if y.ndim == 2 and whole:
        return Labels("sequence", y.shape[1:], length=int(y.shape[1]))
    if y.ndim == 3 and one_hot:
        return Labels("sequence", y.shape[1:], length=int(y.shape[1]), width=int(y.shape[2]))
    return None


@dataclass
class Recipe:
    """The pack that replaces what the script reads, and how the script reads it instead."""

    source: Source
    size: tuple[int, int]  # (height, width) of the script's batches
    channels: int
    out: str  # the pack's suggested path
    reads: str  # what the script reads, in words ("the 120 images listed in plates/labels.csv")
    notes: list[str] = field(default_factory=list)
    labels: Labels | None = None  # the form of the script's labels
    scale: float = 1.0  # 255 where the script's pixels ran to 255
    origin: Origin | None = None  # where the script hands its data over

    @property
    def command(self) -> str:
        return self.source.pack_command(self.out, f"{self.size[0]}x{self.size[1]}") + \
            (" --channels 1" if self.channels == 1 else "")

    @property
    def one_hot(self) -> bool:
        return bool(self.labels and self.labels.width)

    def assign(self, call: str, data_name: str) -> str:
        """The line that makes `call` the script's data (with its own name, where it had one)."""
        if self.origin is None:
            return f"data = {call}   # was: {data_name}"
        return self.origin.assign(call, data_name)


def batch_images(batch, framework: str):
    """(images array, labels array or None, (H, W, C)) of a script's batch, or None: the first 4-D
    array is the images (NHWC for Keras unless it says channels_first, NCHW for PyTorch)."""
    parts = list(batch) if isinstance(batch, (list, tuple)) else [batch]
    arrays = [_numpy(p) for p in parts]
    x = next((a for a in arrays if a is not None and a.ndim == 4), None)
    if x is None:
        return None
    y = next((a for a in arrays if a is not None and a is not x), None)
    channels_last = framework == "keras" and _keras_channels_last()
    h, w, c = (x.shape[1], x.shape[2], x.shape[3]) if channels_last else (x.shape[2], x.shape[3], x.shape[1])
    return x, y, (int(h), int(w), int(c))


def _keras_channels_last() -> bool:
    import sys
    keras = sys.modules.get("keras")
    return keras is None or keras.config.image_data_format() == "channels_last"


def _numpy(a):
    if hasattr(a, "detach"):  # a torch tensor
        return a.detach().cpu().numpy()
    if hasattr(a, "numpy") and not isinstance(a, np.ndarray):  # a tf.Tensor
        try:
            return np.asarray(a.numpy())
        except Exception:  # noqa: BLE001 - not an eager tensor
            return None
    return np.asarray(a) if hasattr(a, "shape") else None


def find_recipe(probe, first) -> tuple[Recipe | None, str]:
    """The recipe for what the script read, or (None, why not, in words); `first` is
    batch_images() of its first batch (None where it had no image array)."""
    if first is None:
        return None, "its batches hold no 4-D image array"
    x, y, (h, w, c) = first
    if c not in (1, 3):
        return None, f"its images have {c} channels; a pack holds 1 (grayscale) or 3 (RGB)"
    labels = labels_of(y)
    src, reads, notes = _source(probe, labels)
    if src is None:
        return None, reads
    width = len(src.alphabet or src.classes or [])
    if labels is not None and labels.width and labels.width != width:
        notes.append(f"your labels were one-hot over {labels.width}; the pack's are over {width} "
                     f"({'symbols' if src.alphabet else 'classes'}): the model's last layer must match")
    scale = 255.0 if float(np.max(x)) > 1.5 else 1.0
    return Recipe(src, (h, w), c, _pack_name(src), reads, notes, labels, scale,
                  probe.data_origin), ""


def _source(probe, labels: Labels | None = None) -> tuple[Source | None, str, list[str]]:
    fd = probe.from_directory
    if fd.get("directory"):
        if fd.get("labels", "inferred") != "inferred":
            return None, "image_dataset_from_directory was given its labels as a list; pack from a CSV", []
        try:
            src = from_folder(rel_path(os.path.abspath(fd["directory"])))
        except TrainfastError as e:
            return None, str(e), []
        return src, f"the {len(src):,} images under {fd['directory']} (image_dataset_from_directory)", []
    read = [p for p, in_data in probe.files_read.items() if in_data] or list(probe.files_read)
    if not read:
        return None, ("it opened no image file that trainfast could see (a reader in C++, such as tf.data's, "
                      "is out of its sight)"), []
    for path in reversed(probe.csvs_read):  # the CSV read last is the likeliest list
        found = _csv_source(path, read, labels)
        if found is not None:
            return found
    return _folder_source(read)


def _csv_source(path: str, read: list[str], labels: Labels | None = None):
    """(source, what it reads, notes) from a CSV that lists the images read, with the label column
    that fits the script's labels; (None, why, []) where none fits; None where the CSV does not
    list the images."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error):
        return None
    if len(rows) < 2:
        return None
    header, body = [h.strip() for h in rows[0]], [r for r in rows[1:] if len(r) == len(rows[0])]
    base, wanted = os.path.dirname(path), set(read)
    hits = [sum(os.path.normpath(os.path.join(base, r[i].strip())) in wanted for r in body)
            for i in range(len(header))]
    best = max(range(len(header)), key=hits.__getitem__)
    if hits[best] < COVERED * len(wanted):
        return None
    others = [i for i in range(len(header)) if i != best]
    if not others:
        return None
    fits = [i for i in others if labels is not None and labels.fits([r[i].strip() for r in body])]
    if labels is not None and not fits:
        return None, (f"{rel_path(path)} lists the images the script read, but none of its other columns "
                      f"({', '.join(repr(header[i]) for i in others)}) holds labels like the script's "
                      f"({labels.said()}): pack it with --label-column naming the column that does"), []
    candidates = fits or others
    named = [i for i in candidates if header[i].lower() in LABEL_NAMES]
    label = header[(named or candidates)[0]]
    notes = [] if len(candidates) == 1 else \
        [f"label column {label!r} is a guess among {', '.join(repr(header[i]) for i in candidates)}: check it"]
    try:
        src = from_csv(rel_path(path), path_column=header[best], label_column=label)
        if labels is not None and (src.alphabet is not None) != (labels.kind == "sequence"):
            src = from_csv(rel_path(path), path_column=header[best], label_column=label, label_kind=labels.kind)
    except TrainfastError as e:
        return None, str(e), []
    return src, f"the {len(src):,} images listed in {rel_path(path)}", notes


def _folder_source(read: list[str]):
    root = os.path.commonpath(read)
    if os.path.isfile(root):
        root = os.path.dirname(root)
    if all(os.path.dirname(p) == root for p in read):  # all in one folder: its parent may hold the classes
        parent = os.path.dirname(root)
        if sum(_holds_images(os.path.join(parent, d)) for d in os.listdir(parent) if not d.startswith(".")) < 2:
            return None, (f"the images it reads sit in one folder ({rel_path(root)}) and no CSV it opened lists them: "
                          "trainfast cannot tell their labels"), []
        root = parent
    try:
        src = from_folder(rel_path(root))
    except TrainfastError as e:
        return None, str(e), []
    listed = {os.path.abspath(f) for f in src.files}
    if sum(p in listed for p in read) < COVERED * len(read):
        return None, f"{rel_path(root)} holds class folders, but not the images the script read", []
    return src, f"the {len(src):,} images in the class folders of {rel_path(root)}", []


def _holds_images(folder: str) -> bool:
    """A folder with image files right inside it, as a class folder has (a peek, not a walk)."""
    try:
        with os.scandir(folder) as it:
            return any(e.name.lower().endswith(IMAGE_EXTENSIONS) for e in it)
    except OSError:  # not a folder, or unreadable
        return False


def torch_notes(recipe: Recipe) -> list[str]:
    """What else changes when a PyTorch script reads the Loader instead: its labels' and pixels' form."""
    notes = list(recipe.notes)
    if recipe.one_hot:
        notes.append("your labels were one-hot; the Loader gives class indices: cross_entropy takes them as they are")
    if recipe.scale != 1.0:
        notes.append("your batches held pixel values up to 255; the Loader gives them normalised (or 0–1 with "
                     "normalize=False): drop your own scaling")
    return notes


def _pack_name(src: Source) -> str:
    p = Path(src.origin)
    stem = p.parent.name if src.kind == "csv" and p.parent.name else (p.stem if src.kind == "csv" else p.name)
    return f"{stem or 'data'}.pack"


def sample_pack(src: Source, size: tuple[int, int], channels: int, batch_size: int, where: Path):
    """A pack in `where` of the first inputs of `src`, enough for a few batches (at least 256):
    what the doctors time a pack's reader on."""
    from trainfast.data.pack import pack

    n = min(len(src), max(4 * batch_size, 256))
    sample = Source(src.kind, src.origin, src.keys[:n], src.labels[:n], src.classes, src.alphabet,
                    files=src.files[:n] if src.files else None,
                    array=src.array[:n] if src.array is not None else None)
    return pack(sample, where / "sample", size=tuple(size), channels=channels, progress=False)


def torch_recommendation(recipe: Recipe, step_s: float, data_s: float, batch_size: int,
                         data_name: str, device: str = "cpu", x=None, loader=None,
                         budget_s: float = 15.0) -> Recommendation:
    """The data wait with the Loader on a pack of a sample of the script's files in place of
    `loader` (the script's own DataLoader), the two drawn in interleaved rounds, added to the
    rest of the script's step (its time as the script ran). Without `loader`: the Loader's time
    per batch against the wait the script saw."""
    from trainfast.data.loader import Loader
    from trainfast.diagnose.remedies import seconds_per_batch
    from trainfast.diagnose.felt import drawing, interleaved, steps_per_round

    rest = max(step_s - data_s, 0.0)
    with files.scratch("doctor") as tmp:
        pk = sample_pack(recipe.source, recipe.size, recipe.channels, batch_size, tmp)
        n = len(pk)
        ours = Loader(pk, min(batch_size, len(pk)), device="cpu", drop_last=True)
        if loader is not None:
            k = steps_per_round(budget_s, data_s, 16)

            def per_image(draw):
                return lambda: (rest * k + draw(k)) / (k * batch_size)
            felt = interleaved(per_image(drawing(loader)), per_image(drawing(ours)), images=k * batch_size)[0]
            gain, spread = felt.gain, felt.spread
            per_batch = statistics.median(felt.new) * batch_size - rest
            was = statistics.median(felt.current) * batch_size - rest
            how = (f"a pack of {n} of your files loads a batch in {units.ms(per_batch)} ms; {data_name} took "
                   f"{units.ms(was)} ms per batch, drawn in turns ({felt.words()}), and the script waited "
                   f"{units.ms(data_s)} ms per step for it")
        else:
            per_batch = seconds_per_batch(ours)
            gain, spread = step_s / max(rest + per_batch, 1e-9), None
            how = (f"a pack of {n} of your files loads a batch in {units.ms(per_batch)} ms; the script waited "
                   f"{units.ms(data_s)} ms per step for {data_name}")
    unit = x is not None and float(np.min(x)) >= 0 and float(np.max(x)) <= 1.5  # the script fed [0, 1] images
    call = f"Loader({recipe.out!r}, batch_size={batch_size}, device={device!r}" + \
        (", normalize=False" if unit else "") + ")"
    code = (f"from trainfast import Loader\n{recipe.assign(call, data_name)}\n"
            f"# batches: (images N×C×H×W float32 on {device}, "
            + ("in [0, 1] as yours were" if unit else "normalised by the pack's mean and std") + "; labels int64)")
    return Recommendation(
        "Pack the images once, then stream the pack",
        f"{recipe.command}\n# then in the script:\n{code}" + "".join(f"\n# {n}" for n in torch_notes(recipe)),
        gain, True, f"{how}; it reads {recipe.reads}", spread=spread)

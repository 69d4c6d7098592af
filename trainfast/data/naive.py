"""The input pipeline users write, for measuring it: decode + resize every image of every
batch, one at a time, in Python (a keras.utils.Sequence or a map-style Dataset).

trainfast never trains from this; the doctor times it, and the demo shows what it costs.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from trainfast.data.decode import DecodeError
from trainfast.data.sources import Source
from trainfast.errors import TrainfastError


class PerImageBatches:
    """A Sequence-like object: `len()` batches, `[k]` decodes batch k from the files.

    Each item is read and decoded at full size — with Pillow (`Image.open(...).resize(...)`),
    or with reader="skimage" exactly as the plate story's Sequence does it
    (`skimage.io.imread` + `skimage.transform.resize`) — converted to float and stacked:
    per-sample Python in the hot path, by design. Bad files are skipped.
    """

    def __init__(self, source: Source, size: tuple[int, int], batch_size: int, seed: int = 0,
                 reader: str = "pil"):
        if source.files is None:
            raise ValueError("PerImageBatches reads files; this source holds arrays")
        if reader not in ("pil", "skimage"):
            raise ValueError(f"reader must be pil or skimage, not {reader!r}")
        self.source, self.size, self.batch_size, self.reader = source, tuple(size), batch_size, reader
        self.order = np.random.default_rng(seed).permutation(len(source))

    def __len__(self) -> int:
        return len(self.order) // self.batch_size

    def __getitem__(self, k: int):
        if not 0 <= k < len(self):
            raise IndexError(k)
        images, labels, failed = [], [], None
        for i in self.order[k * self.batch_size: (k + 1) * self.batch_size]:
            try:
                if self.reader == "skimage":
                    img = _skimage(self.source.files[i], self.size)
                else:
                    with open(self.source.files[i], "rb") as f:
                        img = torch.from_numpy(_decode_full(f.read(), self.size)).float().div(255)
            except (OSError, ValueError, DecodeError) as e:
                failed = failed or f"{self.source.files[i]}: {getattr(e, 'strerror', None) or e}"
                continue
            images.append(img.permute(2, 0, 1))
            labels.append(torch.as_tensor(self.source.labels[i]))
        if not images:  # a CSV of files that are not there: say so (torch.stack's own error named nothing)
            raise TrainfastError(f"{self.source.origin}: no file of batch {k} could be read (first: {failed})")
        return torch.stack(images), torch.stack(labels)

    def __iter__(self):
        for k in range(len(self)):
            yield self[k]


def _decode_full(data: bytes, size) -> np.ndarray:
    """Decode at full resolution, then resize: what users' code does (no JPEG draft mode)."""
    im = Image.open(io.BytesIO(data)).convert("RGB")
    im = im.resize((size[1], size[0]), Image.BILINEAR)
    return np.asarray(im, dtype=np.uint8).copy()


def _skimage(path: str, size) -> torch.Tensor:
    """The story's per-image code: imread, then resize to float64 in [0, 1]."""
    from skimage.io import imread
    from skimage.transform import resize

    return torch.from_numpy(resize(imread(path), size)).float()

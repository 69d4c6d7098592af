"""The input pipeline users write, for measuring it: decode + resize every image of every
batch, one at a time, in Python (a keras.utils.Sequence or a map-style Dataset).

trainfast never trains from this; the doctor times it, and the demo shows what it costs.
"""

from __future__ import annotations

import numpy as np
import torch

from trainfast.data.decode import DecodeError
from trainfast.data.sources import Source


class PerImageBatches:
    """A Sequence-like object: `len()` batches, `[k]` decodes batch k from the files.

    Each item is read and decoded with Pillow at full size (no DCT scaling, as a plain
    `Image.open(...).resize(...)` does), converted to float, and stacked: per-sample Python
    in the hot path, by design. Bad files are skipped.
    """

    def __init__(self, source: Source, size: tuple[int, int], batch_size: int, seed: int = 0):
        if source.files is None:
            raise ValueError("PerImageBatches reads files; this source holds arrays")
        self.source, self.size, self.batch_size = source, tuple(size), batch_size
        self.order = np.random.default_rng(seed).permutation(len(source))

    def __len__(self) -> int:
        return len(self.order) // self.batch_size

    def __getitem__(self, k: int):
        if not 0 <= k < len(self):
            raise IndexError(k)
        images, labels = [], []
        for i in self.order[k * self.batch_size: (k + 1) * self.batch_size]:
            try:
                with open(self.source.files[i], "rb") as f:
                    data = f.read()
                img = _decode_full(data, self.size)
            except (OSError, DecodeError):
                continue
            images.append(torch.from_numpy(img).permute(2, 0, 1).float().div(255))
            labels.append(torch.as_tensor(self.source.labels[i]))
        return torch.stack(images), torch.stack(labels)

    def __iter__(self):
        for k in range(len(self)):
            yield self[k]


def _decode_full(data: bytes, size) -> np.ndarray:
    """Decode at full resolution, then resize: what users' code does (no JPEG draft mode)."""
    import io

    from PIL import Image

    im = Image.open(io.BytesIO(data)).convert("RGB")
    im = im.resize((size[1], size[0]), Image.BILINEAR)
    return np.asarray(im, dtype=np.uint8).copy()

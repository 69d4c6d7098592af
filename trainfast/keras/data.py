"""PackDataset: a pack read by Keras at memory speed, in the order and with the augmentations
trainfast.Loader gives."""

from __future__ import annotations

import keras
import numpy as np

from trainfast.config import Augment
from trainfast.data.loader import Loader
from trainfast.errors import TrainfastError


class PackDataset(keras.utils.PyDataset):
    """A Keras PyDataset over a pack: batches of (images NHWC float32, labels int64) numpy arrays.

    Same order and augmentations as `trainfast.Loader` with the same arguments (a permutation
    of the pack per epoch from (seed, epoch); Keras's on_epoch_end moves to the next epoch).

    Args:
        pack: a Pack or its path.
        batch_size, shuffle, seed, augment: as for trainfast.Loader.
        drop_last: False (the default) ends each epoch with the smaller batch that is left, as a
            Keras Sequence or tf.data's batch() does: every image, every epoch; True drops it
            (trainfast.Loader's default when shuffling: every step the same shape).
        normalize: subtract the pack's mean and divide by its std; off by default, giving
            values in [0, 1], as the usual Keras `/ 255.0` does.
        scale: multiplies the images: 255.0 gives the 0–255 values of images read as bytes, for a
            model that divides by 255 itself.
        one_hot: labels as one-hot float32 rows (`keras.utils.to_categorical`'s form, for a
            categorical_crossentropy loss): (batch, classes), or (batch, length, alphabet) for
            sequences. Off by default: class indices, for the sparse_ losses.
        **kwargs: PyDataset's own (workers, use_multiprocessing, max_queue_size).
    """

    def __init__(self, pack, batch_size: int = 32, shuffle: bool = True, *, drop_last: bool = False,
                 seed: int = 0, augment: Augment | None = None, normalize: bool = False, scale: float = 1.0,
                 one_hot: bool = False, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
            raise TrainfastError(f"scale={scale!r}: give a positive number (255.0 for 0–255 images)")
        if not isinstance(one_hot, bool):
            raise TrainfastError(f"one_hot={one_hot!r}: give True or False")
        self.loader = Loader(pack, batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed, device="cpu",
                             augment=augment, normalize=normalize, workers=1)
        self.scale, self.one_hot = float(scale), one_hot
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __getitem__(self, k: int):
        x, y = self.loader.batch(int(k), self.epoch)
        images = x.permute(0, 2, 3, 1).numpy()  # NHWC memory already: no copy
        if self.scale != 1.0:
            images *= self.scale  # the batch is the Loader's own, made for this call
        labels = y.numpy()
        if self.one_hot:
            pk = self.loader.pack
            labels = np.eye(len(pk.alphabet or pk.classes), dtype=np.float32)[labels]
        return images, labels

    def on_epoch_end(self) -> None:
        self.epoch += 1

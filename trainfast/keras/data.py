"""PackDataset: a pack read by Keras at memory speed, in the order and with the augmentations
trainfast.Loader gives."""

from __future__ import annotations

import keras

from trainfast.config import Augment
from trainfast.data.loader import Loader


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
        **kwargs: PyDataset's own (workers, use_multiprocessing, max_queue_size).
    """

    def __init__(self, pack, batch_size: int = 32, shuffle: bool = True, *, drop_last: bool = False,
                 seed: int = 0, augment: Augment | None = None, normalize: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.loader = Loader(pack, batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed, device="cpu",
                             augment=augment, normalize=normalize, workers=1)
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __getitem__(self, k: int):
        x, y = self.loader.batch(int(k), self.epoch)
        return x.permute(0, 2, 3, 1).numpy(), y.numpy()  # NHWC memory already: no copy

    def on_epoch_end(self) -> None:
        self.epoch += 1

"""Keras 3 users keep Keras (any backend): read a pack at memory speed, and see where a fit's
time goes.

    from trainfast.keras import PackDataset, SpeedDoctor
    model.fit(PackDataset("plates.pack", batch_size=128), epochs=10, callbacks=[SpeedDoctor()])

Optional: needs `pip install keras` (Keras 3) and one of its backends (tensorflow, jax or torch).
"""

from __future__ import annotations

import time

try:
    import keras
except ImportError:  # pragma: no cover - depends on what is installed
    raise ImportError("trainfast.keras needs Keras 3 and a backend: pip install keras tensorflow "
                      "(or keras with jax or torch; set KERAS_BACKEND)") from None
if int(keras.__version__.split(".")[0]) < 3:  # pragma: no cover
    raise ImportError(f"trainfast.keras needs Keras 3, not {keras.__version__}: pip install -U keras")

import torch  # noqa: E402

from trainfast.config import Augment  # noqa: E402
from trainfast.data.loader import Loader  # noqa: E402


class PackDataset(keras.utils.PyDataset):
    """A Keras PyDataset over a pack: batches of (images NHWC float32, labels int64) numpy arrays.

    Same order and augmentations as `trainfast.Loader` with the same arguments (a permutation
    of the pack per epoch from (seed, epoch); Keras's on_epoch_end moves to the next epoch).

    Args:
        pack: a Pack or its path.
        batch_size, shuffle, drop_last, seed, augment: as for trainfast.Loader.
        normalize: subtract the pack's mean and divide by its std; off by default, giving
            values in [0, 1], as the usual Keras `/ 255.0` does.
        **kwargs: PyDataset's own (workers, use_multiprocessing, max_queue_size).
    """

    def __init__(self, pack, batch_size: int = 32, shuffle: bool = True, *, drop_last: bool | None = None,
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


class SpeedDoctor(keras.callbacks.Callback):
    """Print where the time of `fit` goes after `batches` training batches (default: at the end
    of the first epoch): the wait for the next batch vs the train step, the verdict, and the
    model's per-layer parameters and FLOPs.

    The wait is the time between one batch's end and the next one's start. Keras's torch and
    jax backends fetch the batch there; on TensorFlow the fetch runs inside the compiled step,
    so use `trainfast doctor -- python train.py` there to separate the two.
    """

    def __init__(self, batches: int | None = None, warmup: int = 2, print_fn=print):
        super().__init__()
        self.batches, self.warmup, self.print_fn = batches, warmup, print_fn
        self.report = None
        self._steps, self._end, self._begin, self._done = [], None, None, False

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        from trainfast.diagnose.script import Step
        now = time.perf_counter()
        if self._done or self._begin is None:
            return
        wait = self._begin - self._end if self._end is not None else 0.0
        self._steps.append(Step(seconds=now - (self._end if self._end is not None else self._begin), data=wait))
        self._end = now
        if self.batches and len(self._steps) >= self.batches + self.warmup:
            self._finish("after the requested batches")

    def on_epoch_end(self, epoch, logs=None):
        if not self._done and self._steps:
            self._finish("at the end of the first epoch")

    def _finish(self, when: str):
        from trainfast import hardware
        from trainfast.diagnose.script import ScriptReport, _keras_layers

        self._done = True
        layers, model = _keras_layers(self.model)
        system = {"device": keras.backend.backend(), "cpu": hardware.cpu_model(),
                  "physical_cores": hardware.physical_cores(), "usable_cores": hardware.usable_cores(),
                  "torch_threads": torch.get_num_threads(), "cuda_available": torch.cuda.is_available(),
                  "torch": torch.__version__}
        self.report = ScriptReport(command=["keras", "fit"], framework="keras", stopped=when, steps=self._steps,
                                   warmup=min(self.warmup, len(self._steps) - 1), system=system, layers=layers,
                                   model=model, devices={"model": [f"keras {keras.backend.backend()} backend"]})
        self.print_fn(self.report.text())

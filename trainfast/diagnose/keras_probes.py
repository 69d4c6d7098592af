"""The Keras probes of `trainfast doctor -- python train.py` (diagnose.probes has the rest):
`Model.fit` gets a callback that ends a step at each batch's end and marks each epoch, its data
is wrapped (a PyDataset's `__getitem__` and a generator's `next` timed), and
`image_dataset_from_directory`'s arguments say what it reads. They are installed once keras is
imported (`_KerasWatcher`), or at once where it already is. `keras_layers` reads a model's
per-layer parameters and FLOPs for the report."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types

from trainfast.diagnose.probes import _note_origin, _Probe


def _patch_keras(keras, probe: _Probe, undo: list):
    Model = keras.Model
    original_fit = Model.fit

    class _Doctor(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            probe.epoch_start(self.params.get("steps") if self.params else None)

        def on_train_batch_end(self, batch, logs=None):
            probe.boundary(probe.cur.batch_size)

    def fit(self, x=None, *args, **kwargs):
        probe.framework = "keras"
        probe.keras_model = self
        callbacks = list(kwargs.pop("callbacks", None) or [])
        kwargs["callbacks"] = callbacks + [_Doctor()]
        _note_origin(probe, x, sys._getframe(1))
        y = args[0] if args else kwargs.get("y")
        size = kwargs.get("batch_size") or (args[1] if len(args) > 1 and isinstance(args[1], int) else 32)
        probe.keras_fit = probe.keras_fit or (x, y, size)
        if probe.first_batch is None and hasattr(x, "shape") and hasattr(x, "__getitem__"):
            # arrays: the first batch is theirs to show
            probe.first_batch = (x[:size], y[:size] if y is not None and hasattr(y, "__getitem__") else None)
        return original_fit(self, _wrap_keras_data(keras, x, probe), *args, **kwargs)

    Model.fit = fit
    undo.append(lambda: setattr(Model, "fit", original_fit))

    # keras.utils.image_dataset_from_directory reads its files in TensorFlow's C++, out of the
    # audit hook's sight: its arguments say what the script reads.
    utils = keras.utils
    original_ifd = getattr(utils, "image_dataset_from_directory", None)
    if original_ifd is not None:
        def image_dataset_from_directory(directory, *args, **kwargs):
            import inspect
            try:
                bound = inspect.signature(original_ifd).bind(directory, *args, **kwargs)
                bound.apply_defaults()
                probe.from_directory = {k: bound.arguments.get(k) for k in
                                        ("directory", "labels", "label_mode", "color_mode", "batch_size",
                                         "image_size", "validation_split", "subset")}
            except TypeError:
                pass
            return original_ifd(directory, *args, **kwargs)

        utils.image_dataset_from_directory = image_dataset_from_directory
        undo.append(lambda: setattr(utils, "image_dataset_from_directory", original_ifd))


def _timed_getitem(cls, probe: _Probe):
    original = cls.__getitem__

    def __getitem__(self, i):
        t0 = probe.enter_data()
        try:
            batch = original(self, i)
        finally:
            probe.generator_times.append(probe.leave_data(t0))
        probe.note_batch(batch)
        return batch

    return type(cls.__name__, (cls,), {"__getitem__": __getitem__, "__module__": cls.__module__})


def _wrap_keras_data(keras, x, probe: _Probe):
    if isinstance(x, keras.utils.PyDataset):
        probe.data_source = {"kind": f"keras PyDataset ({type(x).__name__})",
                             "workers": getattr(x, "workers", 1),
                             "use_multiprocessing": getattr(x, "use_multiprocessing", False)}
        if type(x).__module__.startswith("trainfast."):
            probe.data_source["reads"] = "a trainfast pack"
        x.__class__ = _timed_getitem(type(x), probe)
        return x
    if isinstance(x, types.GeneratorType) or (hasattr(x, "__next__") and hasattr(x, "__iter__")):
        probe.data_source = {"kind": "Python generator"}

        def timed():
            while True:
                t0 = probe.enter_data()
                try:
                    batch = next(x)
                except StopIteration:
                    probe.leave_data(t0)
                    return
                except BaseException:
                    probe.leave_data(t0)
                    raise
                probe.generator_times.append(probe.leave_data(t0))
                probe.note_batch(batch)
                yield batch

        return timed()
    kind = type(x).__module__.split(".")[0]
    probe.data_source = {"kind": "in-memory arrays" if kind == "numpy" else f"{type(x).__name__} ({kind})"}
    if kind == "tensorflow" and hasattr(x, "take"):  # tf.data runs in C++ threads: timed alone after the run
        probe.data_source["kind"] = "tf.data Dataset"
        probe.tf_dataset = x
    return x


class _KerasWatcher(importlib.abc.MetaPathFinder):
    """Patch Keras as soon as the script imports it (importing it ourselves would cost seconds)."""

    def __init__(self, probe: _Probe, undo: list):
        self.probe, self.undo, self.done = probe, undo, False

    def find_spec(self, name, path=None, target=None):
        if name != "keras" or self.done:
            return None
        self.done = True
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return None
        loader, watcher = spec.loader, self

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                loader.exec_module(module)
                _patch_keras(module, watcher.probe, watcher.undo)

        spec.loader = _Loader()
        return spec


def keras_layers(model) -> tuple[list[dict], dict]:
    """Per-layer parameters and forward FLOPs per image, from each layer's config and output shape."""
    rows = []
    for layer in getattr(model, "layers", []):
        try:
            params = int(layer.count_params())
            out = tuple(d for d in layer.output.shape[1:])
        except Exception:  # noqa: BLE001 - an unbuilt or exotic layer: show what is known
            continue
        flops = 0
        kernel = getattr(layer, "kernel", None)
        if kernel is not None and None not in out:
            k = tuple(kernel.shape)
            positions = 1
            for d in out[:-1]:
                positions *= d
            fan_in = 1
            for d in k[:-1]:
                fan_in *= d
            flops = 2 * positions * fan_in * k[-1]
        rows.append({"name": layer.name, "kind": type(layer).__name__, "output": list(out), "params": params,
                     "flops": flops})
    total = {"params": sum(r["params"] for r in rows), "forward_flops": sum(r["flops"] for r in rows)}
    return rows, total

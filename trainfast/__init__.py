"""trainfast: fast image-CNN training, and numbers that say why yours was slow.

The public surface is small:

    import trainfast
    trainfast.pack("photos/", "photos.pack", size=(64, 128))   # decode + resize once
    pk = trainfast.Pack("photos.pack")
    for images, labels in trainfast.Loader(pk, batch_size=256):
        ...
    trainfast.doctor("plate_cnn", pk)                  # where a training step's time goes
    trainfast.tune(model, (3, 64, 128))                # the fastest settings here
    trainfast.fit(model, pk, epochs=10)                # train with them

The rooms behind the functions: trainfast.diagnose (doctor), trainfast.tuning (tune),
trainfast.train (fit), trainfast.data (pack, Pack, Loader).

NOTE: names are imported lazily, so that pack worker processes (which need only numpy and
Pillow) start without importing torch.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "Pack": "trainfast.data.format",
    "Loader": "trainfast.data.loader",
    "Augment": "trainfast.data.augment",
    "pack": "trainfast.data.pack",
    "doctor": "trainfast.diagnose",
    "tune": "trainfast.tuning",
    "fit": "trainfast.train.fit",
    "TrainfastError": "trainfast.errors",
    "models": "trainfast.models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainfast' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(_EXPORTS[name])
    value = module if module.__name__ == f"trainfast.{name}" else getattr(module, name)
    globals()[name] = value
    return value

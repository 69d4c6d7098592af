"""trainfast.keras on Keras's torch backend (no TensorFlow needed)."""

import importlib
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from trainfast import Loader  # noqa: E402
from trainfast.config import Augment  # noqa: E402


def test_pack_dataset_yields_the_loaders_batches_in_the_loaders_order(digits_packs):
    from trainfast.keras import PackDataset

    train, _ = digits_packs
    aug = Augment(translate=2)
    ds = PackDataset(train, batch_size=50, seed=3, augment=aug)
    loader = Loader(train, 50, seed=3, device="cpu", normalize=False, augment=aug)
    assert len(ds) == len(loader)
    for epoch in range(2):
        for k, (x, y) in enumerate(loader):
            kx, ky = ds[k]
            assert kx.shape == (50, 32, 32, 3) and kx.dtype == np.float32
            assert np.array_equal(kx, x.permute(0, 2, 3, 1).numpy()) and np.array_equal(ky, y.numpy())
        ds.on_epoch_end()
    assert not np.array_equal(ds[0][1], PackDataset(train, batch_size=50, seed=3)[0][1])  # epochs differ


def test_a_keras_model_trains_on_a_pack_and_the_speed_doctor_reports(digits_packs):
    from trainfast.keras import PackDataset, SpeedDoctor

    train, _ = digits_packs
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(16, 3, activation="relu"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    printed = []
    doc = SpeedDoctor(batches=4, print_fn=printed.append)
    hist = model.fit(PackDataset(train, batch_size=64), epochs=3, verbose=0, callbacks=[doc])
    assert hist.history["accuracy"][-1] > hist.history["accuracy"][0]
    assert len(printed) == 1 and "VERDICT" in printed[0] and "train step" in printed[0]
    assert len(doc.report.timed) == 4 and doc.report.model["params"] == model.count_params()


def test_missing_keras_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "trainfast.keras", raising=False)
    with pytest.raises(ImportError, match="pip install keras"):
        importlib.import_module("trainfast.keras")
    monkeypatch.delitem(sys.modules, "trainfast.keras", raising=False)

"""trainfast.keras on Keras's torch backend (no TensorFlow needed)."""

import importlib
import sys

import numpy as np
import pytest
import torch

keras = pytest.importorskip("keras")

from trainfast import Loader  # noqa: E402
from trainfast.config import Augment  # noqa: E402


def test_pack_dataset_yields_the_loaders_batches_in_the_loaders_order(digits_packs):
    from trainfast.keras import PackDataset

    train, _ = digits_packs
    aug = Augment(translate=2)
    ds = PackDataset(train, batch_size=50, seed=3, augment=aug)
    loader = Loader(train, 50, seed=3, device="cpu", normalize=False, augment=aug, drop_last=False)
    assert len(ds) == len(loader) == -(-len(train) // 50)  # every image, as a Keras Sequence (issue 49.6)
    for epoch in range(2):
        for k, (x, y) in enumerate(loader):
            kx, ky = ds[k]
            assert kx.shape == (50 if k < len(ds) - 1 else len(train) - 50 * k, 32, 32, 3) and kx.dtype == np.float32
            assert np.array_equal(kx, x.permute(0, 2, 3, 1).numpy()) and np.array_equal(ky, y.numpy())
        ds.on_epoch_end()
    assert not np.array_equal(ds[0][1], PackDataset(train, batch_size=50, seed=3)[0][1])  # epochs differ
    assert len(PackDataset(train, batch_size=50, drop_last=True)) == len(train) // 50


def test_pack_dataset_gives_one_hot_labels_and_0_to_255_pixels_on_request(digits_packs, tmp_path):
    """The forms a user's Sequence often gave (to_categorical labels, pixels as bytes), so that
    a script's loss and Rescaling stay as they are."""
    from trainfast.errors import TrainfastError
    from trainfast.keras import PackDataset

    train, _ = digits_packs
    x, y = PackDataset(train, batch_size=8)[0]
    hx, hy = PackDataset(train, batch_size=8, one_hot=True, scale=255)[0]
    assert hy.shape == (8, 10) and hy.dtype == np.float32 and np.array_equal(hy.argmax(1), y)
    assert np.allclose(hx, x * 255) and hx.max() > 1.5
    again = PackDataset(train, batch_size=8, one_hot=True, scale=255)
    assert np.array_equal(again[0][0], again[0][0])  # scaled once per call: the batch is not a shared buffer

    import trainfast
    from trainfast.datasets.plates import make_plates
    make_plates(tmp_path / "src", 20, 0, progress=False)
    plates = trainfast.pack(tmp_path / "src" / "labels.csv", tmp_path / "p", size=(16, 32), label_column="plate",
                            progress=False)
    _, seq = PackDataset(plates, batch_size=4, one_hot=True)[0]
    assert seq.shape == (4, 8, 36) and np.all(seq.sum(-1) == 1)
    for bad, message in (({"scale": 0}, "scale=0: give a positive number"),
                         ({"one_hot": "yes"}, "one_hot='yes': give True or False")):
        with pytest.raises(TrainfastError, match=message):
            PackDataset(train, **bad)


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
    # issue 49.5: the backend's device, not the backend's name, and where to go next
    device = "cpu" if not torch.cuda.is_available() else doc.report.system["device"]
    assert doc.report.system["device"] == device and "batches drawn on ?" not in printed[0]
    assert f"model on keras torch backend, {device}" in printed[0]
    assert "trainfast.keras.tune(model, data)" in printed[0] or "trainfast doctor -- python" in printed[0]


def test_missing_keras_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "trainfast.keras", raising=False)
    with pytest.raises(ImportError, match="pip install keras"):
        importlib.import_module("trainfast.keras")
    monkeypatch.delitem(sys.modules, "trainfast.keras", raising=False)


def _small_model(policy_last_float32=True):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_keras_tune_times_the_settings_on_a_copy_and_says_what_to_paste(digits_packs):
    """The model's own setting is timed first, then the alternatives this backend has; the user's
    model keeps its weights; the result prints its table and the lines that won."""
    from trainfast.keras import PackDataset, tune

    train, _ = digits_packs
    model = _small_model()
    before = [w.copy() for w in model.get_weights()]
    logged = []
    r = tune(model, PackDataset(train, batch_size=32), max_seconds=30, log=logged.append)
    import torch
    assert r.backend == "torch" and (r.device == "cpu") == (not torch.cuda.is_available())  # Keras's torch: CUDA if any
    assert r.trials[0] is r.base and r.base.setting.batch_size == 32 and r.base.images_per_s > 0
    assert r.base.setting.policy == "float32" and r.base.setting.jit_compile is False
    assert {t.setting.batch_size for t in r.trials} >= {32, 64}  # a larger batch was timed
    assert any("torch.compile" in n for n in r.not_tried)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))  # copies were trained
    assert r.best.images_per_s >= r.base.images_per_s
    text = repr(r)
    assert "trainfast.keras.tune" in text and ("keep what you have" in text or "batch_size=" in text
                                               or "set_dtype_policy" in text)
    assert any(line.startswith("best:") for line in logged)


def test_keras_tune_policies_follow_the_device(monkeypatch):
    from trainfast import hardware
    from trainfast.keras.settings import _policies

    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: False)
    assert _policies("cpu") == ["float32"]  # bf16 emulated: not worth timing
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: True)
    assert _policies("cpu") == ["float32", "mixed_bfloat16"]
    assert _policies("gpu sm61") == ["float32"]  # a GTX 1080: fp16 without tensor cores
    assert _policies("gpu sm75") == ["float32", "mixed_float16"]
    assert _policies("gpu sm90") == ["float32", "mixed_float16", "mixed_bfloat16"]


def test_keras_tune_says_what_it_needs():
    from trainfast.errors import TrainfastError
    from trainfast.keras import tune

    x, y = np.zeros((4, 32, 32, 3), np.float32), np.zeros(4, np.int64)
    bare = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Flatten(), keras.layers.Dense(10)])
    with pytest.raises(TrainfastError, match="compiled model"):
        tune(bare, (x, y))
    with pytest.raises(TrainfastError, match="as many labels as images"):
        tune(_small_model(), (x, y[:3]))
    with pytest.raises(TrainfastError, match="not dict"):
        tune(_small_model(), {"x": x})

    class Sub(keras.Model):  # a subclassed model: clone_model cannot copy it
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(10)

        def call(self, x):
            return self.d(keras.ops.mean(x, axis=(1, 2)))

    sub = Sub()
    sub.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(TrainfastError, match="clone_model"):
        tune(sub, (x, y), log=lambda m: None)


def test_the_threads_line_is_the_backends_own(monkeypatch):
    """The cores answer a script can use: torch.set_num_threads on the torch backend, TensorFlow's
    threading config on TensorFlow (set at the script's top: its pools are fixed at start)."""
    from trainfast.keras import threads

    assert threads.code(1).startswith("torch.set_num_threads(1)") and threads.can_time()
    monkeypatch.setattr(keras.backend, "backend", lambda: "tensorflow")
    assert "tf.config.threading.set_intra_op_parallelism_threads(3)" in threads.code(3)
    assert "set_inter_op_parallelism_threads(1)" in threads.code(3) and not threads.can_time()
    with threads.using(1):  # not the torch backend: nothing changes
        import torch
        assert torch.get_num_threads() >= 1

"""The benchmarks compare trainfast with Keras on the same architectures: each Keras port in
benchmarks/keras_models.py must have the PyTorch model's trainable parameters and output
shape (checked here on Keras's torch backend; the benchmarks themselves run TensorFlow)."""

import sys
from pathlib import Path

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytest.importorskip("skimage")  # the plate port lives in examples/keras_plates.py, which reads with skimage

from trainfast import models  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
keras_models = pytest.importorskip("keras_models")


@pytest.mark.parametrize("name", ["plate_cnn", "cifar_cnn", "plate_net"])
def test_each_keras_port_has_the_pytorch_models_parameters_and_output(name):
    net = models.create(name)
    model = keras_models.build_plain(name, "float32")
    trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    assert trainable == sum(p.numel() for p in net.parameters()) == keras_models.PARAMS[name]
    out = model(np.zeros((2, *keras_models.INPUT[name]), np.float32))
    assert tuple(out.shape) == (2, *net.output_shape)

import pytest
import torch
import torch.nn as nn

from trainfast import models
from trainfast.models.layers import KerasSamePad


def _params(m):
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("name,params,out", [
    ("plate_cnn", 264_560, (8, 36)),
    ("classifier512", 32_641_130, (10,)),
    ("cifar_cnn", 276_138, (10,)),
])
def test_ports_match_keras_parameter_counts(name, params, out):
    m = models.create(name)
    assert _params(m) == params
    assert models.entry(name).output_shape == out


def test_classifier512_dense_holds_most_parameters():
    m = models.create("classifier512")
    dense = m.classifier[1]
    assert isinstance(dense, nn.Linear) and dense.in_features == 123_008
    assert _params(dense) == 31_490_304


def test_plate_cnn_layer_shapes():
    m = models.create("plate_cnn").eval()
    shapes = []
    hooks = [layer.register_forward_hook(lambda mod, i, o: shapes.append(tuple(o.shape[1:])))
             for layer in m.features if isinstance(layer, (nn.Conv2d, nn.MaxPool2d))]
    y = m(torch.randn(1, 3, 64, 128))
    for h in hooks:
        h.remove()
    # (C, H, W): Keras reports these as 62×126×32, 31×63, 29×61, 14×30, 12×28×64, 6×14, 4×12, 2×6×64
    assert shapes == [(32, 62, 126), (32, 31, 63), (32, 29, 61), (32, 14, 30),
                      (64, 12, 28), (64, 6, 14), (64, 4, 12), (64, 2, 6)]
    assert y.shape == (1, 8, 36)
    per_layer = [_params(l) for l in m.modules() if isinstance(l, (nn.Conv2d, nn.Linear))]
    assert per_layer == [896, 9_248, 18_496, 36_928, 196_864, 2_056, 72]


def test_keras_same_padding_stride_2_is_asymmetric():
    pad = KerasSamePad(3, 2)
    x = torch.zeros(1, 1, 512, 512)
    assert pad(x).shape == (1, 1, 513, 513)  # one extra row/column, at the bottom/right
    assert pad(torch.ones(1, 1, 4, 4))[0, 0, -1].sum() == 0 and pad(torch.ones(1, 1, 4, 4))[0, 0, 0].sum() > 0


def test_keras_flatten_order_is_hwc():
    m = models.create("cifar_cnn").eval()
    x = torch.randn(1, 64, 2, 2)
    flat = m.classifier[0](x)
    assert torch.equal(flat[0, :64], x[0, :, 0, 0])  # first pixel's channels come first


def test_unknown_model_lists_known():
    with pytest.raises(ValueError, match="known models: .*cifar_cnn"):
        models.create("resnet9000")


@pytest.mark.parametrize("name", models.list())
def test_every_registered_model_forward_backward(name):
    m = models.create(name)
    c, h, w = m.input_shape
    x = torch.randn(2, c, h, w).contiguous(memory_format=torch.channels_last)
    y = m(x)
    assert tuple(y.shape[1:]) == m.output_shape
    y.float().square().mean().backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)

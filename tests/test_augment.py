import pytest
import torch

from trainfast.config import Augment
from trainfast.errors import TrainfastError
from trainfast.data.augment import geometric, photometric


def _batch(b=6, h=5, w=7, c=3):
    return torch.arange(b * h * w * c, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(b, h, w, c)


def _gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_flip_only_flips_or_keeps_each_image():
    x = _batch()
    out = geometric(x, Augment(flip=True), _gen())
    for i in range(len(x)):
        assert torch.equal(out[i], x[i]) or torch.equal(out[i], x[i].flip(1))
    assert any(torch.equal(out[i], x[i].flip(1)) for i in range(len(x)))


def test_translate_shifts_with_black_fill():
    x = torch.full((64, 4, 4, 1), 9, dtype=torch.uint8)
    out = geometric(x, Augment(translate=1), _gen())
    assert set(out.unique().tolist()) <= {0, 9}
    # Each image is the shifted original: its non-black area is a rectangle of side 3 or 4.
    for img in out[..., 0]:
        nz = (img == 9).nonzero()
        rows = nz[:, 0].unique().numel()
        cols = nz[:, 1].unique().numel()
        assert rows in (3, 4) and cols in (3, 4) and (img == 9).sum() == rows * cols


def test_crop_pad_uses_reflection_and_keeps_values():
    x = _batch()
    out = geometric(x, Augment(crop_pad=2), _gen(1))
    for i in range(len(x)):  # every output pixel comes from its own image
        assert set(map(tuple, out[i].reshape(-1, 3).tolist())) <= set(map(tuple, x[i].reshape(-1, 3).tolist()))


def test_photometric_stays_in_range_and_cutout_zeroes_squares():
    x = torch.full((8, 3, 10, 10), 0.5)
    out = photometric(x.clone(), Augment(brightness=0.5, contrast=0.5), _gen())
    assert out.min() >= 0 and out.max() <= 1 and not torch.allclose(out, x)
    cut = photometric(torch.ones(8, 3, 10, 10), Augment(cutout=4), _gen())
    zeros = (cut[:, 0] == 0).sum(dim=(1, 2))
    assert ((zeros > 0) & (zeros <= 16)).all()
    assert torch.equal(cut[:, 0] == 0, cut[:, 2] == 0)  # all channels of a pixel


@pytest.mark.parametrize("field,value", [("crop_pad", -1), ("translate", 1.5), ("cutout", "4"), ("brightness", -0.1),
                                         ("contrast", 2), ("flip", "yes"), ("crop_pad", True)])
def test_an_augmentation_out_of_range_is_refused_naming_it(field, value):
    with pytest.raises(TrainfastError, match=f"augment {field} must be .*not {value!r}"):
        Augment(**{field: value})

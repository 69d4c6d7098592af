import io

import numpy as np
import pytest
from PIL import Image

from trainfast.data.decode import DecodeError, decode_array, decode_file, encode_jpeg, decode_jpeg
from conftest import png_bomb


def _bytes(im, fmt, **kw):
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "CMYK", "I;16", "1", "LA"])
def test_every_mode_becomes_rgb_uint8(mode):
    im = Image.new("RGB", (50, 30), (200, 100, 50)).convert(mode)
    fmt = "TIFF" if mode in ("CMYK",) else "PNG"
    out = decode_file(_bytes(im, fmt), (16, 24), "stretch", 3)
    assert out.shape == (16, 24, 3) and out.dtype == np.uint8


def test_32bit_integer_grey_is_scaled_not_wrapped(tmp_path):
    """A 32-bit integer TIFF: values past 16 bits map over the int32 range; they used to wrap
    modulo 256 (a / 257, then uint8)."""
    from PIL import Image

    from trainfast.data.decode import decode_file
    a = np.array([[0, 2 ** 30, 2 ** 31 - 1, 70000]] * 4, np.int32)
    Image.fromarray(a, "I").save(tmp_path / "x.tif")
    out = decode_file((tmp_path / "x.tif").read_bytes(), (4, 4), "stretch", 1)
    assert out.shape[:2] == (4, 4) and list(out[0, :, 0]) == [0, 128, 255, 0]


@pytest.mark.parametrize("values,want", [
    ([0, 2 ** 19, 2 ** 20, 2 ** 18], [0, 128, 255, 64]),      # 32-bit up to 2²⁰: was all black (issue 50.10)
    ([-5.0, 0.0, 5.0, 2.5], [0, 128, 255, 191]),             # float with negatives: its own range
    ([0.0, 5e5, 1e6, 2.5e5], [0, 128, 255, 64]),             # float past 255
    ([0.0, 0.5, 1.0, 0.25], [0, 128, 255, 64]),              # float in [0, 1], as it is
])
def test_samples_with_no_fixed_range_map_the_image_own_range(tmp_path, values, want):
    a = np.array([values] * 4, np.int32 if isinstance(values[0], int) else np.float32)
    Image.fromarray(a).save(tmp_path / "x.tif")
    out = decode_file((tmp_path / "x.tif").read_bytes(), (4, 4), "stretch", 1)
    assert [abs(int(o) - w) <= 1 for o, w in zip(out[0, :, 0], want)] == [True] * 4, list(out[0, :, 0])


def test_16bit_grey_is_scaled_not_clipped():
    a = np.full((8, 8), 32768, np.uint16)  # half of the 16-bit range
    im = Image.fromarray(a)
    out = decode_file(_bytes(im, "PNG"), (8, 8), "stretch", 1)
    assert out.shape == (8, 8, 1)
    assert abs(int(out[0, 0, 0]) - 128) <= 1


def test_channels_1_gives_single_channel():
    im = Image.new("RGB", (20, 20), (255, 0, 0))
    out = decode_file(_bytes(im, "JPEG"), (10, 10), "stretch", 1)
    assert out.shape == (10, 10, 1)


def test_exif_orientation_is_applied():
    # A 40 wide × 20 tall image, stored with "rotate 90" (orientation 6): it shows as 20 × 40.
    a = np.zeros((20, 40, 3), np.uint8)
    a[:, :20] = 255  # left half white
    im = Image.fromarray(a)
    exif = Image.Exif()
    exif[0x0112] = 6
    out = decode_file(_bytes(im, "JPEG", exif=exif, quality=95), (40, 20), "stretch", 3)
    # Rotated 90° clockwise, the white left half becomes the top half.
    assert out[:20].mean() > 200 and out[20:].mean() < 50


def test_jpeg_draft_decodes_large_images_correctly():
    a = np.zeros((1200, 1600, 3), np.uint8)
    a[:, 800:] = 255
    out = decode_file(_bytes(Image.fromarray(a), "JPEG"), (60, 80), "stretch", 3)
    assert out.shape == (60, 80, 3)
    assert out[:, :38].mean() < 10 and out[:, 42:].mean() > 245


def test_fit_pads_and_crop_crops():
    im = Image.new("RGB", (100, 50), (255, 255, 255))  # 2:1 white
    fit = decode_file(_bytes(im, "PNG"), (40, 40), "fit", 3)
    assert fit[0].max() == 0 and fit[20].min() == 255  # black bars above and below
    crop = decode_file(_bytes(im, "PNG"), (40, 40), "crop", 3)
    assert crop.min() == 255


@pytest.mark.parametrize("data,reason", [
    (b"", "empty"),
    (b"this is not an image at all", "not an image"),
])
def test_bad_bytes_give_reasons(data, reason):
    with pytest.raises(DecodeError, match=reason):
        decode_file(data, (8, 8), "stretch", 3)


def test_truncated_jpeg_is_refused():
    data = _bytes(Image.new("RGB", (200, 200), (9, 9, 9)), "JPEG")
    with pytest.raises(DecodeError, match="corrupt or truncated"):
        decode_file(data[: len(data) // 3], (8, 8), "stretch", 3)


def test_decompression_bomb_is_refused(tmp_path):
    png_bomb(tmp_path / "bomb.png")
    with pytest.raises(DecodeError, match="decompression bomb"):
        decode_file((tmp_path / "bomb.png").read_bytes(), (8, 8), "stretch", 3)


def test_decode_array_float_and_shapes():
    a = np.full((10, 10), 0.5, np.float32)
    out = decode_array(a, (10, 10), "stretch", 3)
    assert out.shape == (10, 10, 3) and out[0, 0, 0] in (127, 128)
    with pytest.raises(DecodeError, match="shape"):
        decode_array(np.zeros((4, 4, 2), np.uint8), (4, 4), "stretch", 3)


def test_jpeg_round_trip_is_deterministic():
    img = np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)
    assert encode_jpeg(img, 90) == encode_jpeg(img, 90)
    back = decode_jpeg(encode_jpeg(img, 95), 3)
    assert back.shape == img.shape


@pytest.mark.parametrize("channels", [1, 3])
def test_pack_jpeg_decode_is_pillows_decode_with_or_without_simplejpeg(monkeypatch, channels):
    """simplejpeg (GIL released, threads scale) and the Pillow fallback give the same pixels."""
    from trainfast.data import decode as dec
    rng = np.random.default_rng(3)
    img = rng.integers(0, 255, (24, 40, channels), dtype=np.uint8)
    data = encode_jpeg(img, quality=90)
    fast = decode_jpeg(memoryview(data), channels)
    monkeypatch.setattr(dec, "_simplejpeg", None)
    slow = decode_jpeg(memoryview(data), channels)
    assert fast.shape == slow.shape == (24, 40, channels) and fast.dtype == slow.dtype == np.uint8
    assert np.abs(fast.astype(int) - slow.astype(int)).max() <= 1
    assert dec.jpeg_decoder_name() == "Pillow"

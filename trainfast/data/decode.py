"""Decode one image (a file or an array) to a fixed size, RGB or grayscale uint8.

This runs in pack worker processes: it imports numpy and Pillow only. Every failure a
user's file can cause becomes a DecodeError whose message is the reason, in words.
"""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

RESIZE_MODES = ("stretch", "fit", "crop")
_EXIF_ORIENTATION = 0x0112


class DecodeError(Exception):
    """An input that cannot become an image; str(e) is the reason."""


def _target_scale(w: int, h: int, tw: int, th: int, mode: str) -> tuple[float, float]:
    """Scale factors (x, y) from a w×h source to the resized image before any padding/crop."""
    if mode == "stretch":
        return tw / w, th / h
    s = min(tw / w, th / h) if mode == "fit" else max(tw / w, th / h)
    return s, s


def _wide_to_8bit(a: np.ndarray) -> np.ndarray:
    """One channel of 16-bit, 32-bit or float samples as uint8. 16-bit ones (and Pillow's "I"
    within 16 bits: it opens 16-bit PNGs so) map their full range, 0–65535, to 0–255; floats in
    [0, 1] or [0, 255] map as they are. Samples with no fixed range (32-bit beyond 16 bits,
    negative ones, floats past 255) map the image's own range: a 32-bit TIFF holding values up to
    2²⁰ came out black under the full 32-bit range."""
    floats = a.dtype.kind == "f"
    a = np.nan_to_num(a.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    lo, hi = float(a.min(initial=0)), float(a.max(initial=0))
    if lo < 0 or hi > (255.0 if floats else 65535.0):  # no fixed range: the image's own, 0 (or below) to its top
        lo = min(lo, 0.0)
        a = (a - lo) * (255.0 / max(hi - lo, 1e-12))
    elif floats:
        a = a * 255.0 if hi <= 1.0 else a
    else:
        a = a / 257.0
    return np.rint(np.clip(a, 0, 255)).astype(np.uint8)


def _to_8bit_mode(im: Image.Image, channels: int) -> Image.Image:
    """Any Pillow mode → 'RGB' or 'L' (alpha dropped, as Keras's load_img does)."""
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        im = Image.fromarray(_wide_to_8bit(np.asarray(im)), "L")
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    want = "L" if channels == 1 else "RGB"
    return im if im.mode == want else im.convert(want)


def resize(im: Image.Image, tw: int, th: int, mode: str) -> Image.Image:
    """Resize a Pillow image to tw×th: stretch, fit (letterbox with black) or centre crop."""
    w, h = im.size
    if (w, h) == (tw, th):
        return im
    if mode == "stretch":
        return im.resize((tw, th), Image.BILINEAR)
    if mode == "crop":
        # Crop the centred source box with the target's aspect ratio and resize it in one go.
        s = max(tw / w, th / h)
        bw, bh = tw / s, th / s
        box = ((w - bw) / 2, (h - bh) / 2, (w + bw) / 2, (h + bh) / 2)
        return im.resize((tw, th), Image.BILINEAR, box=box)
    s = min(tw / w, th / h)
    nw, nh = max(1, round(w * s)), max(1, round(h * s))
    canvas = Image.new(im.mode, (tw, th))
    canvas.paste(im.resize((nw, nh), Image.BILINEAR), ((tw - nw) // 2, (th - nh) // 2))
    return canvas


def decode_file(data: bytes, size: tuple[int, int], mode: str, channels: int) -> np.ndarray:
    """Bytes of an image file → (H, W, C) uint8 at `size` = (H, W).

    JPEGs are decoded at reduced size with DCT scaling when the target is much smaller; EXIF
    orientation is applied; decompression bombs (Pillow's limit) are refused.
    """
    if not data:
        raise DecodeError("empty file (0 bytes)")
    th, tw = size
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            if im.format == "JPEG":
                orientation = im.getexif().get(_EXIF_ORIENTATION, 1)
                rotated = orientation in (5, 6, 7, 8)  # stored image is transposed
                w, h = im.size
                sx, sy = _target_scale(h, w, tw, th, mode)[::-1] if rotated else _target_scale(w, h, tw, th, mode)
                im.draft("L" if channels == 1 else "RGB", (math.ceil(w * sx), math.ceil(h * sy)))
            im.load()
            im = ImageOps.exif_transpose(im)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise DecodeError(f"refused as a decompression bomb ({e})") from None
    except UnidentifiedImageError:
        raise DecodeError("not an image Pillow can read") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise DecodeError(f"corrupt or truncated image ({e})") from None
    im = _to_8bit_mode(im, channels)
    return _as_hwc(resize(im, tw, th, mode))


def decode_array(a: np.ndarray, size: tuple[int, int], mode: str, channels: int) -> np.ndarray:
    """One (H, W), (H, W, 1|3|4) uint8 or [0, 1] float array → (H, W, C) uint8 at `size`."""
    if a.dtype != np.uint8:
        if a.dtype.kind != "f":
            raise DecodeError(f"array images must be uint8 or float in [0, 1], not {a.dtype}")
        a = np.rint(np.clip(a, 0.0, 1.0) * 255.0).astype(np.uint8)
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if a.ndim == 3 and a.shape[2] == 4:
        a = a[:, :, :3]
    if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] != 3):
        raise DecodeError(f"array image of shape {a.shape} is not (H, W) or (H, W, 1|3|4)")
    th, tw = size
    if a.shape[:2] == (th, tw) and (a.ndim == 2) == (channels == 1):
        return a.reshape(th, tw, channels)
    im = Image.fromarray(np.ascontiguousarray(a), "L" if a.ndim == 2 else "RGB")
    return _as_hwc(resize(_to_8bit_mode(im, channels), tw, th, mode))


def encode_jpeg(image: np.ndarray, quality: int) -> bytes:
    """(H, W, C) uint8 → JPEG bytes (deterministic for the same input and quality)."""
    im = Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image)
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


try:
    import simplejpeg as _simplejpeg
except ImportError:  # a platform without its wheels: Pillow decodes
    _simplejpeg = None


# The IJG standard luminance table (quality 50); a file's table over it gives its quality.
_STD_LUMINANCE_SUM = sum((16, 11, 10, 16, 24, 40, 51, 61, 12, 12, 14, 19, 26, 58, 60, 55, 14, 13, 16, 24, 40, 57, 69, 56,
                          14, 17, 22, 29, 51, 87, 80, 62, 18, 22, 37, 56, 68, 109, 103, 77, 24, 35, 55, 64, 81, 104,
                          113, 92, 49, 64, 78, 87, 103, 121, 120, 101, 72, 92, 95, 98, 112, 100, 103, 99))
KEEP_QUALITY_MARGIN = 5  # a JPEG of at most the pack's quality + this is kept: re-encoding it only adds loss


def jpeg_quality(im: Image.Image) -> float | None:
    """A JPEG's IJG quality (1-100), estimated from its luminance table; None if it has none."""
    tables = getattr(im, "quantization", None) or {}
    if 0 not in tables:
        return None
    scale = 100.0 * sum(tables[0]) / _STD_LUMINANCE_SUM  # order-free: a sum, zigzag or not
    return max(1.0, min(100.0, (200.0 - scale) / 2 if scale <= 100 else 5000.0 / scale))


def keeps_bytes(data: bytes, size: tuple[int, int], channels: int, quality: int) -> bool:
    """True when a JPEG file can go into a JPEG pack as it is: already at the pack's size and
    colour mode, upright (no EXIF rotation), and of no better quality than the pack's (within
    KEEP_QUALITY_MARGIN). Its bytes are then kept, not decoded and re-encoded (a generation lost)."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format != "JPEG" or im.size != (size[1], size[0]) or im.mode != ("L" if channels == 1 else "RGB"):
                return False
            if im.getexif().get(_EXIF_ORIENTATION, 1) != 1 or im.info.get("progressive") or im.info.get("progression"):
                return False  # rotated on decode; progressive: not every GPU decoder reads it
            q = jpeg_quality(im)
            return q is not None and q <= quality + KEEP_QUALITY_MARGIN
    except Exception:  # noqa: BLE001 - anything unreadable takes the ordinary path, which says why
        return False


def kept_jpeg(data: bytes, channels: int) -> tuple[bytes | None, np.ndarray | None]:
    """A JPEG whose bytes keeps_bytes accepted, decoded as the Loader will decode it: (its bytes,
    its pixels), or (None, None) where that strict decoder refuses it (a truncated file, extraneous
    bytes), so that the ordinary path decodes it leniently and re-encodes it, or skips it with the
    reason. Kept as they were, such bytes failed the whole pack."""
    try:
        return data, decode_jpeg(data, channels)
    except Exception:  # noqa: BLE001 - simplejpeg raises ValueError, Pillow OSError; either: not kept
        return None, None


def jpeg_decoder_name() -> str:
    return "simplejpeg" if _simplejpeg is not None else "Pillow"


def decode_jpeg(data, channels: int) -> np.ndarray:
    """JPEG bytes from a pack → (H, W, C) uint8.

    simplejpeg (libjpeg-turbo) releases the GIL for the whole call, so decoding threads scale
    with cores. Pillow, the fallback, gives the GIL up and takes it back many times per image:
    on a 16-core host its threads stalled at 1,500 512² images/s, about 2.5× one thread.
    """
    if _simplejpeg is not None:
        return _simplejpeg.decode_jpeg(data, colorspace="GRAY" if channels == 1 else "RGB")
    im = Image.open(io.BytesIO(data))
    im = im.convert("L" if channels == 1 else "RGB")
    return _as_hwc(im)


def _as_hwc(im: Image.Image) -> np.ndarray:
    a = np.asarray(im, dtype=np.uint8)
    return a[:, :, None] if a.ndim == 2 else a

"""Synthetic license-plate photos: what a user of the plate story would have on disk.

`make_plates(out, count, seed)` writes out/images/*.jpg (photo-like sizes larger than
64×128) and out/labels.csv with columns path,plate,font (the font's file name). Each plate holds 8 characters from
0-9A-Z, rendered in one of several fonts that matplotlib ships, on a varied background,
with perspective, rotation, scale, brightness, blur, noise and JPEG artefacts. Image i
depends only on (seed, i), so the result is the same for any number of workers.

Plate fonts are designed so that no two characters look alike; the DejaVu fonts draw 0 and O
nearly alike at 64×128 (a trained reader swapped 6% of them against 0.7% of other characters),
so zero is drawn slashed, as many plate and terminal fonts draw it. VERSION counts changes to
what is drawn: out/plates.json records it with the count and seed, so that a set made by
an older generator is not mistaken for a current one.
"""

from __future__ import annotations

import csv
import io
import json
import os
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from PIL import Image, ImageChops, ImageDraw, ImageFilter, ImageFont

from trainfast import files
from trainfast.errors import TrainfastError

ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
LENGTH = 8
VERSION = 2  # 2: slashed zero
_FONTS = ("DejaVuSans-Bold.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSans.ttf", "DejaVuSerif-Bold.ttf",
          "DejaVuSansMono.ttf", "DejaVuSerif.ttf")
_PLATE_COLOURS = [((235, 235, 230), (20, 20, 20)), ((245, 200, 40), (15, 15, 15)),
                  ((250, 250, 250), (30, 40, 120)), ((40, 90, 40), (240, 240, 240)),
                  ((210, 215, 225), (120, 20, 20))]


def font_paths() -> list[str]:
    """The TrueType fonts used: those of _FONTS that matplotlib's installation ships."""
    import matplotlib

    root = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    found = [str(root / f) for f in _FONTS if (root / f).exists()]
    if not found:
        raise RuntimeError(f"no DejaVu fonts found under {root}")
    return found


@lru_cache(maxsize=64)
def _font(path: str, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(path, size)


@lru_cache(maxsize=64)
def _stem(path: str, size: int) -> int:
    """The font's vertical stroke width in pixels at `size`: the ink across the middle of "l"."""
    font = _font(path, size)
    im = Image.new("L", (size * 2, size * 2), 0)
    ImageDraw.Draw(im).text((size // 2, 0), "l", font=font, fill=255)
    ink = np.asarray(im) > 127
    rows = np.flatnonzero(ink.any(axis=1))
    return max(1, int(ink[(rows[0] + rows[-1]) // 2].sum()))


def _slash_zero(draw: ImageDraw.ImageDraw, font_path: str, font: ImageFont.FreeTypeFont, x: int, y: int,
                fill) -> None:
    """A diagonal stroke through the zero drawn at (x, y), inside its counter, as thick as the
    font's stems."""
    left, top, right, bottom = font.getbbox("0")
    w, h = right - left, bottom - top
    draw.line((x + left + 0.25 * w, y + bottom - 0.2 * h, x + left + 0.75 * w, y + top + 0.2 * h),
              fill=fill, width=_stem(font_path, font.size))


_NOISE_SIGMAS = (4, 8, 12)


@lru_cache(maxsize=len(_NOISE_SIGMAS))
def _noise_tile(level: int) -> Image.Image:
    """Gaussian noise around 128, fixed per level (so every image stays deterministic)."""
    a = np.random.default_rng(level).normal(128, _NOISE_SIGMAS[level], (600, 900, 3))
    return Image.fromarray(a.clip(0, 255).astype(np.uint8))


def _background(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    """A smooth colour gradient with a few blobs: road, wall or car body."""
    c0, c1 = rng.integers(0, 256, 3).astype(np.float32), rng.integers(0, 256, 3).astype(np.float32)
    tx = np.linspace(0, rng.uniform(0.3, 1), 16, dtype=np.float32)[None, :, None]
    ty = np.linspace(0, rng.uniform(0, 0.7), 8, dtype=np.float32)[:, None, None]
    t = np.minimum(tx + ty, 1)  # a 16×8 gradient, scaled up smoothly: cheap
    im = Image.fromarray((c0 + (c1 - c0) * t).astype(np.uint8)).resize((w, h), Image.BILINEAR)
    draw = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(0, 5))):
        x, y = int(rng.integers(0, w)), int(rng.integers(0, h))
        r = int(rng.integers(5, max(6, w // 4)))
        draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    return im


def _plate(rng: np.random.Generator, text: str, fonts: list[str]) -> tuple[Image.Image, str]:
    """The plate itself, flat and upright: text on a coloured board with a border; and the
    font's file name."""
    bg, fg = _PLATE_COLOURS[int(rng.integers(len(_PLATE_COLOURS)))]
    font_path = fonts[int(rng.integers(len(fonts)))]
    font = _font(font_path, int(rng.integers(28, 38)))
    gap = int(rng.integers(0, 5))
    widths = [font.getbbox(ch)[2] for ch in text]
    ascent, descent = font.getmetrics()
    tw, th = sum(widths) + gap * (len(text) - 1), ascent + descent
    pw, ph = tw + int(rng.integers(14, 30)), th + int(rng.integers(10, 22))
    plate = Image.new("RGB", (pw, ph), bg)
    draw = ImageDraw.Draw(plate)
    draw.rectangle((1, 1, pw - 2, ph - 2), outline=fg, width=int(rng.integers(1, 4)))
    x, y = (pw - tw) // 2, (ph - th) // 2
    for ch, cw in zip(text, widths):
        dy = int(rng.integers(-1, 2))
        draw.text((x, y + dy), ch, font=font, fill=fg)
        if ch == "0":
            _slash_zero(draw, font_path, font, x, y + dy, fg)
        x += cw + gap
    return plate, Path(font_path).name


def _perspective_coeffs(src, dst):
    """Coefficients for Image.transform(PERSPECTIVE) mapping output points dst → input src."""
    a = []
    for (x, y), (u, v) in zip(dst, src):
        a.append([x, y, 1, 0, 0, 0, -u * x, -u * y])
        a.append([0, 0, 0, x, y, 1, -v * x, -v * y])
    return np.linalg.solve(np.asarray(a, float), np.asarray(src, float).reshape(8))


def render(seed: int, index: int, fonts: list[str]) -> tuple[bytes, str, str]:
    """Image `index` of the set `seed`: (JPEG bytes, plate text, font file name)."""
    rng = np.random.default_rng([seed, index])
    text = "".join(ALPHABET[i] for i in rng.integers(0, len(ALPHABET), LENGTH))
    plate, font = _plate(rng, text, fonts)
    pw, ph = plate.size
    # Photo: the plate fills most of the frame, as a crop from a plate detector would.
    out_w = int(pw * rng.uniform(1.05, 1.3))
    out_h = int(out_w * rng.uniform(0.42, 0.6))
    photo = _background(rng, out_w, out_h)
    jitter = rng.uniform(-0.04, 0.04, (4, 2)) * [pw, ph]
    corners = np.array([[0, 0], [pw, 0], [pw, ph], [0, ph]], float)
    angle = np.deg2rad(rng.uniform(-5, 5))
    rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    placed = (corners - [pw / 2, ph / 2]) @ rot.T + [out_w / 2, out_h / 2] + jitter
    placed += rng.uniform(-0.04, 0.04, 2) * [out_w, out_h]
    coeffs = _perspective_coeffs(corners, placed)
    warped = plate.transform((out_w, out_h), Image.PERSPECTIVE, tuple(coeffs), Image.BILINEAR)
    mask = Image.new("L", (pw, ph), 255).transform((out_w, out_h), Image.PERSPECTIVE, tuple(coeffs), Image.BILINEAR)
    photo.paste(warped, (0, 0), mask)
    gain, offset = rng.uniform(0.55, 1.25), rng.uniform(-25, 25)  # exposure, as a lookup table
    photo = photo.point([int(min(255, max(0, v * gain + offset))) for v in range(256)] * 3)
    level = int(rng.integers(0, len(_NOISE_SIGMAS) + 1))
    if level:  # sensor noise: a random window of a fixed noise tile, added around 0
        tile = _noise_tile(level - 1)
        x0, y0 = int(rng.integers(0, tile.width - out_w + 1)), int(rng.integers(0, tile.height - out_h + 1))
        photo = ImageChops.add(photo, tile.crop((x0, y0, x0 + out_w, y0 + out_h)), 1.0, -128)
    if rng.random() < 0.7:
        photo = photo.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.2, 1.4))))
    buf = io.BytesIO()
    photo.save(buf, format="JPEG", quality=int(rng.integers(60, 95)))
    return buf.getvalue(), text, font


def _render_range(args) -> list[tuple[str, str]]:
    seed, start, stop, images_dir = args
    fonts = font_paths()
    rows = []
    for i in range(start, stop):
        data, text, font = render(seed, i, fonts)
        with open(os.path.join(images_dir, f"{i:06d}.jpg"), "wb") as f:
            f.write(data)
        rows.append((text, font))
    return rows


def _check_out(out: Path) -> None:
    """OUT must be new, empty, or plates made here before (a whole set, or the images/ of an
    interrupted one): the files written there replace any of the same names."""
    labels = out / "labels.csv"
    header = ("path,plate\n", "path,plate,font\n")  # (before fonts were recorded)
    names = {p.name for p in out.iterdir()} if out.is_dir() else set()
    ours = (labels.is_file() and labels.read_text(errors="replace").startswith(header)) or \
        ("images" in names and names <= {"images", "plates.json", "labels.csv.tmp"})
    if out.exists() and not ours and (not out.is_dir() or any(out.iterdir())):
        raise TrainfastError(f"{out}: exists and does not hold plates made by trainfast; it writes images/ and "
                             "labels.csv there, so give it a new or empty folder")


def is_current(out, count: int, seed: int) -> bool:
    """Whether OUT holds a complete set of `count` plates of `seed` from this generator."""
    out = Path(out)
    try:
        made = json.loads((out / "plates.json").read_text())
    except (OSError, ValueError):
        return False
    return (out / "labels.csv").is_file() and made == {"count": count, "seed": seed, "version": VERSION}


def make_plates(out, count: int = 1000, seed: int = 0, workers: int = 0, progress: bool = False) -> Path:
    """Write `count` plate photos to out/images/ and out/labels.csv (path,plate,font), and
    what made them (count, seed, generator version) to out/plates.json.

    The CSV is written last, under a temporary name, then renamed: a CSV that exists is
    complete.
    """
    from trainfast.hardware import usable_cores  # NOTE: datasets may ask how many cores there are

    out = Path(out)
    _check_out(out)
    try:
        return _make(out, count, seed, workers or usable_cores(), progress)
    except OSError as e:  # a read-only or full file system: one line, whatever was written stays visible as such
        raise TrainfastError(f"{e.filename or out}: cannot write the plates ({e.strerror or e}); labels.csv, written "
                             "last, is not there, so nothing here looks complete") from None


def _make(out: Path, count: int, seed: int, workers: int, progress: bool) -> Path:
    images_dir = out / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    step = max(50, -(-count // (workers * 8)))
    ranges = [(seed, s, min(s + step, count), str(images_dir)) for s in range(0, count, step)]
    from trainfast.progress import tqdm

    bar = tqdm(total=count, unit="img", desc="making plates", disable=not progress)
    texts: list[tuple[str, str]] = []
    if workers == 1 or len(ranges) == 1:
        for r in ranges:
            texts += _render_range(r)
            bar.update(r[2] - r[1])
    else:
        ctx = get_context("fork" if os.name == "posix" and os.uname().sysname == "Linux" else "spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            for r, t in zip(ranges, pool.map(_render_range, ranges)):
                texts += t
                bar.update(r[2] - r[1])
    bar.close()
    files.write_text(out / "plates.json", json.dumps({"count": count, "seed": seed, "version": VERSION}) + "\n")
    rows = io.StringIO(newline="")
    w = csv.writer(rows)
    w.writerow(["path", "plate", "font"])
    w.writerows((f"images/{i:06d}.jpg", t, font) for i, (t, font) in enumerate(texts))
    files.write_text(out / "labels.csv", rows.getvalue())
    return out

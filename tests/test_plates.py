import csv
import hashlib

from trainfast.data.sources import from_csv
from trainfast.datasets.plates import ALPHABET, make_plates


def _digest(folder):
    return {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted((folder / "images").iterdir())}


def test_deterministic_for_a_seed_whatever_the_workers(tmp_path):
    a = make_plates(tmp_path / "a", 30, seed=3, workers=1)
    b = make_plates(tmp_path / "b", 30, seed=3, workers=2)
    c = make_plates(tmp_path / "c", 30, seed=4, workers=1)
    assert _digest(a) == _digest(b) and _digest(a) != _digest(c)
    assert (a / "labels.csv").read_text() == (b / "labels.csv").read_text()


def test_csv_is_what_a_user_would_have(tmp_path):
    out = make_plates(tmp_path / "p", 25, seed=0, workers=1)
    rows = list(csv.DictReader(open(out / "labels.csv")))
    assert len(rows) == 25 and list(rows[0]) == ["path", "plate", "font"]
    from PIL import Image
    for r in rows:
        assert len(r["plate"]) == 8 and set(r["plate"]) <= set(ALPHABET)
        w, h = Image.open(out / r["path"]).size
        assert w > 128 and h > 64  # photo-like, larger than the 64×128 target
    assert len({r["plate"] for r in rows}) == 25
    src = from_csv(out / "labels.csv", label_column="plate")
    assert src.alphabet == ALPHABET and src.labels.shape == (25, 8)


def test_make_plates_writes_only_into_a_folder_of_its_own(tmp_path, capsys):
    from trainfast.cli import main

    (tmp_path / "labels.csv").write_text("mine,not yours\n")
    assert main(["make-plates", str(tmp_path), "--count", "2"]) == 1
    assert "does not hold plates made by trainfast" in capsys.readouterr().err
    assert (tmp_path / "labels.csv").read_text() == "mine,not yours\n"
    assert main(["make-plates", str(tmp_path / "new"), "--count", "2", "--workers", "1"]) == 0
    assert main(["make-plates", str(tmp_path / "new"), "--count", "3", "--workers", "1"]) == 0  # its own: again


def test_an_interrupted_make_plates_can_be_rerun(tmp_path):
    from trainfast.datasets.plates import make_plates

    (tmp_path / "p" / "images").mkdir(parents=True)  # killed before labels.csv was written
    (tmp_path / "p" / "images" / "000000.jpg").write_bytes(b"half")
    make_plates(tmp_path / "p", 2, workers=1)
    assert (tmp_path / "p" / "labels.csv").read_text().startswith("path,plate,font\n")


def test_zero_is_slashed_so_it_cannot_pass_for_o():
    """Plate fonts tell 0 from O; the DejaVu fonts nearly do not at 64×128, so the generator
    strikes zero through, in every font."""
    import numpy as np
    from PIL import Image, ImageDraw

    from trainfast.datasets.plates import _font, _slash_zero, font_paths

    for path in font_paths():
        font = _font(path, 32)
        left, top, right, bottom = font.getbbox("0")
        # a point on the slash, off the centre (DejaVu Sans Mono's own zero has a dot there,
        # which blurs away at 64×128)
        on_slash = (round(top + 0.62 * (bottom - top)) + 4, round(left + 0.4 * (right - left)) + 4)
        plain, slashed = Image.new("L", (64, 64)), Image.new("L", (64, 64))
        for im in (plain, slashed):
            ImageDraw.Draw(im).text((4, 4), "0", font=font, fill=255)
        _slash_zero(ImageDraw.Draw(slashed), path, font, 4, 4, 255)
        assert np.asarray(plain)[on_slash] == 0, path  # the counter of a plain zero is empty ...
        assert np.asarray(slashed)[on_slash] == 255, path  # ... and the slash crosses it


def test_a_set_knows_what_made_it(tmp_path):
    from trainfast.datasets.plates import is_current

    out = make_plates(tmp_path / "p", 3, seed=5, workers=1)
    assert is_current(out, 3, 5)
    assert not is_current(out, 3, 6) and not is_current(out, 4, 5) and not is_current(tmp_path / "none", 3, 5)
    (out / "labels.csv").unlink()  # the CSV is the mark of a complete set
    assert not is_current(out, 3, 5)


def test_make_plates_on_a_read_only_file_system_is_one_line(tmp_path, monkeypatch, capsys):
    import errno
    from pathlib import Path

    from trainfast.cli import main

    def read_only(self, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(self))
    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main(["make-plates", str(tmp_path / "p"), "--count", "10"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write the plates (Read-only file system)" in err

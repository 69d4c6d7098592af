"""Packs are checked when opened: damaged metadata or arrays give one line naming the pack and
what is wrong, from Pack(), `trainfast info`, the Loader and `trainfast train` alike."""

import json
import shutil

import numpy as np
import pytest

import trainfast
from trainfast.cli import main
from trainfast.errors import TrainfastError


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("format")
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)
    raw = trainfast.pack((images, np.arange(40) % 4), tmp / "raw", size=(32, 32), progress=False)
    jpeg = trainfast.pack((images, np.arange(40) % 4), tmp / "jpeg", size=(32, 32), encoding="jpeg", progress=False)
    return raw, jpeg


def _meta(key, value):
    def damage(p):
        m = json.loads((p / "meta.json").read_text())
        if value is KeyError:
            del m[key]
        else:
            m[key] = value
        (p / "meta.json").write_text(json.dumps(m))
    return damage


def _array(name, fn):
    def damage(p):
        np.save(p / name, fn(np.load(p / name)))
    return damage


DAMAGE = {
    "labels beyond the classes": ("raw", _array("labels.npy", lambda a: a + 3), "labels from 3 to 6"),
    "float labels": ("raw", _array("labels.npy", lambda a: a.astype(np.float32)), "not integers"),
    "int16 images": ("raw", _array("images.npy", lambda a: a.astype(np.int16)), "not uint8"),
    "a string mean": ("raw", _meta("mean", ["0.5", 0.5, 0.5]), "mean"),
    "a zero std": ("raw", _meta("std", [0.2, 0.0, 0.2]), "≤ 0"),
    "no shape": ("raw", _meta("shape", KeyError), "has no shape"),
    "no classes": ("raw", _meta("classes", None), "neither classes nor an alphabet"),
    "offsets out of order": ("jpeg", _array("offsets.npy", lambda a: a[[0, 2, 1, *range(3, len(a))]]), "not increasing"),
    "offsets past the bytes": ("jpeg", _array("offsets.npy", lambda a: a + 5), "not increasing"),
    "labels.npy one short": ("raw", _array("labels.npy", lambda a: a[:-1]), "labels.npy holds 39 labels for 40 images"),
    "2-D labels in a class pack": ("raw", _array("labels.npy", lambda a: np.stack([a, a], 1)),
                                   r"labels.npy holds sequences \(40, 2\) but meta.json has no alphabet"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_pack_is_one_clear_line_everywhere(good, tmp_path, capsys, case):
    kind, damage, says = DAMAGE[case]
    p = tmp_path / "p"
    shutil.copytree(good[0 if kind == "raw" else 1].path, p)
    damage(p)
    with pytest.raises(TrainfastError, match=f"{p}: damaged pack .*{says}"):
        trainfast.Pack(p)
    with pytest.raises(TrainfastError, match="damaged pack"):
        trainfast.Loader(p, batch_size=8, device="cpu")
    for argv in (["info", str(p)], ["train", str(p), "--model", "cifar_cnn", "--no-tune", "--device", "cpu",
                                    "--run-dir", str(tmp_path / "run")]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "damaged pack" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_the_packs_trainfast_writes_pass(good):
    for pk in good:
        assert len(trainfast.Pack(pk.path)) == 40


def test_info_says_what_meta_and_skipped_json_do_not_record(good, tmp_path, capsys):
    p = tmp_path / "p"
    shutil.copytree(good[0].path, p)
    _meta("source", KeyError)(p)
    (p / "skipped.json").unlink()
    assert main(["info", str(p)]) == 0
    out = capsys.readouterr().out
    assert "source: not recorded" in out and "skipped not known" in out


def test_garbled_jpeg_bytes_are_one_line_naming_the_image(good, tmp_path, capsys):
    """Bytes changed after the build pass the pack's checks (offsets still agree); the Loader
    names the image it cannot decode instead of raising the decoder's own error."""
    p = tmp_path / "p"
    shutil.copytree(good[1].path, p)
    jpeg, off = np.load(p / "jpeg.npy"), np.load(p / "offsets.npy")
    jpeg[off[5] + 2: off[6] - 2] = 7
    np.save(p / "jpeg.npy", jpeg)
    loader = trainfast.Loader(p, batch_size=8, shuffle=False, device="cpu")
    with pytest.raises(TrainfastError, match=r"image 5 in jpeg.npy cannot be decoded .* the pack is damaged"):
        list(loader)
    p = tmp_path / "p2"  # another copy: the Loader above still maps the first one's bytes
    shutil.copytree(good[1].path, p)
    jpeg[off[0] + 2: off[1] - 2] = 7  # the first image, which train's check of the model reads (issue 50.10)
    np.save(p / "jpeg.npy", jpeg)
    assert main(["train", str(p), "--model", "cifar_cnn", "--epochs", "1", "--no-tune", "--device", "cpu",
                 "--run-dir", str(tmp_path / "run"), "-q"]) == 1
    assert "p2: image 0 in jpeg.npy cannot be decoded" in capsys.readouterr().err


def test_nan_images_are_refused_before_packing(tmp_path):
    x = np.random.default_rng(0).random((10, 8, 8, 3)).astype(np.float32)
    x[3, 0, 0, 0] = np.nan
    with pytest.raises(TrainfastError, match=r"1 image holds NaN or infinite values \(first: image 3\)"):
        trainfast.pack((x, np.arange(10) % 2), tmp_path / "p", progress=False)
    assert not (tmp_path / "p").exists()

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

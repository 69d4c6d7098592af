import io
import os
import pickle
import tarfile

import numpy as np
import pytest
from conftest import write_images

from trainfast.data.held import from_arrays, from_cifar
from trainfast.data.sources import from_csv, from_folder, open_source
from trainfast.errors import TrainfastError


def test_folder_classes_sorted_and_recursive(tmp_path):
    root = write_images(tmp_path / "d", classes=("zebra", "ant"), per_class=3)
    (root / "ant" / "sub").mkdir()
    write_images(tmp_path / "extra", classes=("x",), per_class=1)
    (tmp_path / "extra" / "x" / "000.jpg").rename(root / "ant" / "sub" / "deep.jpg")
    (root / "ant" / "notes.txt").write_text("not an image")
    src = from_folder(root)
    assert src.classes == ["ant", "zebra"]
    assert len(src) == 7 and "ant/sub/deep.jpg" in src.keys
    assert list(src.labels).count(0) == 4


def test_the_printed_pack_command_is_shell_quoted(tmp_path):
    """Pasting the doctor's command for a folder named `photos $(id>PWNED)` runs nothing and keeps
    each path one argument."""
    import shlex
    import subprocess

    root = write_images(tmp_path / "photos $(id>PWNED)", classes=("a b", "c"), per_class=1)
    cmd = from_folder(root).pack_command("my out.pack", "64x128")
    assert shlex.split(cmd)[2:4] == [str(root), "my out.pack"]
    subprocess.run(["bash", "-c", "echo " + cmd], cwd=tmp_path, check=True, capture_output=True)
    assert not (tmp_path / "PWNED").exists()


def test_folder_without_class_subfolders_says_how(tmp_path):
    write_images(tmp_path / "d", classes=("a",), per_class=2)
    flat = tmp_path / "d" / "a"
    with pytest.raises(TrainfastError, match="one subfolder per class"):
        from_folder(flat)


def test_a_folder_whose_labels_are_in_a_csv_points_to_the_csv(tmp_path):
    """make-plates' layout (images/ and labels.csv): packed as a folder, every image would be of
    the one class 'images'."""
    root = write_images(tmp_path / "plates", classes=("images",), per_class=2)
    assert from_folder(root).classes == ["images"]  # one class folder alone is allowed
    (root / "labels.csv").write_text("path,plate\nimages/000.jpg,AB12CD34\n")
    with pytest.raises(TrainfastError, match=r"one subfolder \(images/\), so every image would get the same "
                                             r"class; its labels are likely in labels.csv"):
        open_source(root)


def test_csv_class_labels_and_relative_paths(tmp_path):
    write_images(tmp_path / "d", classes=("a",), per_class=3)
    (tmp_path / "list.csv").write_text("path,label\nd/a/000.jpg,cat\nd/a/001.jpg,dog\nd/a/002.jpg,cat\n")
    src = from_csv(tmp_path / "list.csv")
    assert src.classes == ["cat", "dog"] and list(src.labels) == [0, 1, 0]
    assert src.files[0] == str(tmp_path / "d/a/000.jpg")


def test_csv_plate_sequences_with_bad_rows(tmp_path):
    rows = ["file,plate", "a.jpg,AB12CD34", "b.jpg,ZZ99ZZ99", "c.jpg,SHORT", "d.jpg,ab12cd34",
            "e.jpg,XY12XY34,extra", ",AB12CD34", "f.jpg,QQ11QQ22", "g.jpg,WW33WW44", "h.jpg,RR55RR66",
            "i.jpg,TT77TT88", "j.jpg,KK00KK11", "k.jpg,MM22MM33", "l.jpg,NN44NN55", "m.jpg,PP66PP77",
            "n.jpg,LL88LL99", "o.jpg,HH00HH11", "p.jpg,GG22GG33", "q.jpg,FF44FF55", "r.jpg,EE66EE77"]
    (tmp_path / "p.csv").write_text("\n".join(rows) + "\n")
    src = from_csv(tmp_path / "p.csv", path_column="file", label_column="plate")
    assert src.alphabet == "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    assert src.labels.shape == (len(src), 8)
    assert "".join(src.alphabet[i] for i in src.labels[0]) == "AB12CD34"
    reasons = " | ".join(r for _, r in src.skipped)
    assert "5 characters, expected 8" in reasons
    assert "not in the alphabet" in reasons
    assert "malformed row" in reasons and "empty path" in reasons
    assert all(k.startswith("p.csv:") for k, _ in src.skipped)


def test_csv_missing_column_lists_columns(tmp_path):
    (tmp_path / "x.csv").write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TrainfastError, match="no column 'path'.*columns are a, b, c"):
        from_csv(tmp_path / "x.csv")


def test_csv_empty(tmp_path):
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(TrainfastError, match="empty CSV"):
        from_csv(tmp_path / "e.csv")
    (tmp_path / "h.csv").write_text("path,label\n")
    with pytest.raises(TrainfastError, match="no usable rows"):
        from_csv(tmp_path / "h.csv")


def test_arrays_validation():
    with pytest.raises(TrainfastError, match="3 images but 2 labels"):
        from_arrays(np.zeros((3, 4, 4, 3), np.uint8), np.zeros(2, np.int64))
    with pytest.raises(TrainfastError, match="empty"):
        from_arrays(np.zeros((0, 4, 4, 3), np.uint8), np.zeros(0, np.int64))


def make_cifar(path, n_per_batch=20, hundred=False):
    """A tarball laid out like the authors' CIFAR python version (pickled dicts of arrays)."""
    rng = np.random.default_rng(0)
    with tarfile.open(path, "w:gz") as tar:
        def add(name, obj):
            data = pickle.dumps(obj, protocol=2)
            info = tarfile.TarInfo(f"cifar-python/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if hundred:
            add("meta", {"fine_label_names": [f"c{i}" for i in range(100)], "coarse_label_names": ["x"] * 20})
            for split in ("train", "test"):
                add(split, {"data": rng.integers(0, 255, (n_per_batch, 3072), dtype=np.uint8),
                            "fine_labels": [int(x) for x in rng.integers(0, 100, n_per_batch)]})
        else:
            add("batches.meta", {"label_names": ["airplane", "automobile", "bird", "cat", "deer",
                                                 "dog", "frog", "horse", "ship", "truck"]})
            for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
                add(name, {b"data": rng.integers(0, 255, (n_per_batch, 3072), dtype=np.uint8),
                           b"labels": [int(x) for x in rng.integers(0, 10, n_per_batch)]})
    return path


def test_cifar10_and_100(tmp_path):
    src = from_cifar(make_cifar(tmp_path / "cifar-10-python.tar.gz"))
    assert len(src) == 100 and src.array.shape == (100, 32, 32, 3) and src.classes[3] == "cat"
    assert len(from_cifar(tmp_path / "cifar-10-python.tar.gz", split="test")) == 20
    src100 = from_cifar(make_cifar(tmp_path / "cifar-100-python.tar.gz", hundred=True))
    assert len(src100.classes) == 100 and len(src100) == 20


def test_cifar_pickle_cannot_run_code(tmp_path):
    class Evil:
        def __reduce__(self):
            import os
            return (os.system, ("touch " + str(tmp_path / "pwned"),))
    data = pickle.dumps({"label_names": Evil()}, protocol=2)
    with tarfile.open(tmp_path / "evil.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("x/batches.meta")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for n in [f"data_batch_{i}" for i in range(1, 6)]:
            info = tarfile.TarInfo(f"x/{n}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(TrainfastError, match="refusing to load"):
        from_cifar(tmp_path / "evil.tar.gz")
    assert not (tmp_path / "pwned").exists()


def test_open_source_unknown(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(TrainfastError, match="not a source"):
        open_source(tmp_path / "x.txt")
    with pytest.raises(TrainfastError, match="no such file"):
        open_source(tmp_path / "missing")


def test_a_pack_inside_a_class_folder_tree_is_not_a_class(image_folder, tmp_path):
    import shutil

    import trainfast
    from trainfast.data.sources import from_folder

    pk = trainfast.pack(image_folder, tmp_path / "p", size=(8, 8), progress=False)
    shutil.copytree(pk.path, image_folder / "old.pack")  # where an older trainfast let OUT be
    assert from_folder(image_folder).classes == ["cat", "dog"]


def test_arrays_as_users_hold_them():
    """Channels-first images, class names, one-hot and whole-number float labels are read, and said."""
    x = np.arange(4 * 3 * 8 * 6, dtype=np.uint8).reshape(4, 3, 8, 6)  # (N, C, H, W)
    src = from_arrays(x, np.array(["dog", "cat", "frog", "cat"]))
    assert src.array.shape == (4, 8, 6, 3) and np.array_equal(src.array[1], x[1].transpose(1, 2, 0))
    assert src.classes == ["cat", "dog", "frog"] and src.labels.tolist() == [1, 0, 2, 0]
    assert any("channels-first" in n for n in src.notes) and any("cat=0" in n for n in src.notes)
    one_hot = np.eye(3, dtype=np.float32)[[2, 0, 1, 1]]
    assert from_arrays(x, one_hot).labels.tolist() == [2, 0, 1, 1]
    assert from_arrays(x, np.array([1.0, 0.0, 2.0, 2.0])).labels.tolist() == [1, 0, 2, 2]
    assert from_arrays(x, [b"a", b"b", b"a", b"b"]).classes == ["a", "b"]
    assert from_arrays(x.astype(np.int64), [0, 1, 0, 1]).array.dtype == np.uint8  # ints in 0-255
    # integer and boolean one-hot rows (np.eye(K, dtype=int), pandas.get_dummies) as the float ones
    assert from_arrays(x, np.eye(3, dtype=np.int64)[[2, 0, 1, 1]]).labels.tolist() == [2, 0, 1, 1]
    assert from_arrays(x, np.eye(3, dtype=bool)[[2, 0, 1, 1]]).labels.tolist() == [2, 0, 1, 1]
    # (N, 1) labels, as keras.datasets.cifar10.load_data() returns them
    assert from_arrays(x, np.array([[3], [1], [0], [3]], np.uint8)).labels.tolist() == [3, 1, 0, 3]
    masks = from_arrays(np.arange(4 * 8 * 8).reshape(4, 8, 8) % 2 == 0, [0, 1, 0, 1])  # boolean images
    assert set(np.unique(masks.array)) == {0, 255} and any("boolean" in n for n in masks.notes)


def test_arrays_refused_in_one_line_that_says_the_fix():
    x = np.zeros((4, 8, 8, 3), np.uint8)
    with pytest.raises(TrainfastError, match=r"x.transpose\(0, 2, 3, 1\)"):
        from_arrays(np.zeros((4, 8, 8, 7), np.uint8), [0, 1, 0, 1])
    with pytest.raises(TrainfastError, match="np.unique"):
        from_arrays(x, np.array([0.5, 1, 0, 1]))
    with pytest.raises(TrainfastError, match="≥ 0"):
        from_arrays(x, np.array([0, -1, 0, 1]))
    with pytest.raises(TrainfastError, match="need an alphabet"):
        from_arrays(x, np.zeros((4, 5), np.int64))
    with pytest.raises(TrainfastError, match="values from 1000 to 1000"):
        from_arrays(np.full((4, 8, 8, 3), 1000, np.int32), [0, 1, 0, 1])
    with pytest.raises(TrainfastError, match="mix strings with int"):
        from_arrays(x, np.array(["a", 1, "b", 2], dtype=object))
    with pytest.raises(TrainfastError, match="x / 65535"):  # 16-bit images: how to bring them to [0, 1]
        from_arrays(np.full((4, 8, 8, 3), 4000, np.uint16), [0, 1, 0, 1])
    with pytest.raises(TrainfastError, match="one label per image, not None"):
        from_arrays(x, None)
    with pytest.raises(TrainfastError, match=r"\(4, 0, 8, 3\) hold no pixels"):
        from_arrays(np.zeros((4, 0, 8, 3), np.uint8), [0, 1, 0, 1])


def test_a_path_listed_twice_with_two_labels_is_an_error_naming_both_rows(tmp_path):
    (tmp_path / "labels.csv").write_text("path,label\na.png,cat\nb.png,dog\n./a.png,dog\nb.png,dog\n")
    with pytest.raises(TrainfastError, match=r"a.png is listed twice with different labels \(labels.csv:2: 'cat', "
                                             r"labels.csv:4: 'dog'\)"):
        from_csv(tmp_path / "labels.csv")


def test_float_images_in_minus_one_to_one_keep_their_negative_half():
    """Images normalised to [-1, 1] (the usual form) are read as such, not clipped to [0, 1]
    (their negative half used to become black); standardised images are refused in one line."""
    from trainfast.data.held import from_arrays

    x = np.linspace(-1, 1, 4 * 8 * 8 * 3, dtype=np.float32).reshape(4, 8, 8, 3)
    src = from_arrays(x, np.arange(4) % 2)
    assert any("[-1, 1]" in n for n in src.notes)
    assert np.allclose(src.array, (x + 1) / 2)
    with pytest.raises(TrainfastError, match="before normalisation"):
        from_arrays(np.full((2, 8, 8, 3), -2.5, np.float32), np.arange(2))


@pytest.mark.parametrize("labels", [np.array([0, 1, 2, 10**12]), np.array([0.0, 1.0, 2.0, 1e12]),
                                    np.array([0, 5000], dtype=np.uint16)])
def test_sparse_class_ids_are_refused_not_made_into_classes(labels):
    """A label of 10¹² would have named 10¹² classes (memory exhausted); ids far beyond the
    distinct values are refused with how to number them."""
    from trainfast.data.held import from_arrays

    with pytest.raises(TrainfastError, match="np.unique"):
        from_arrays(np.zeros((len(labels), 8, 8, 3), np.uint8), labels)


def test_a_link_loop_in_a_source_folder_is_skipped_not_a_traceback(tmp_path):
    """A file that links to itself and a folder link that loops: the loop is an input that
    cannot be read (skipped, with its reason), never a RuntimeError from resolving it."""
    import trainfast

    root = write_images(tmp_path / "src", per_class=3)
    os.symlink("loop.jpg", root / "cat" / "loop.jpg")
    os.symlink("..", root / "dog" / "up")
    src = from_folder(root)
    assert "cat/loop.jpg" in src.keys and src.classes == ["cat", "dog"]
    pk = trainfast.pack(root, tmp_path / "p.pack", size=(16, 16), progress=False)
    assert len(pk) == 6 and [s["input"] for s in pk.skipped] == ["cat/loop.jpg"]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any folder")
def test_an_unreadable_class_folder_is_one_line(tmp_path):
    root = write_images(tmp_path / "src", per_class=2)
    (root / "dog").chmod(0)
    try:
        with pytest.raises(TrainfastError, match="cannot read this folder"):
            from_folder(root)
    finally:
        (root / "dog").chmod(0o755)

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import png_bomb, write_images
from test_sources import make_cifar

import trainfast
from trainfast.data.format import Pack
from trainfast.errors import TrainfastError


def _bad_inputs(root):
    """One of each kind of bad input, inside the class folder 'cat'."""
    (root / "cat" / "zero.jpg").write_bytes(b"")
    (root / "cat" / "text.png").write_text("I am not a PNG")
    good = (root / "cat" / "000.jpg").read_bytes()
    (root / "cat" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "cat" / "folder.jpg").mkdir()  # unreadable as a file
    png_bomb(root / "cat" / "bomb.png")
    return 5


def test_folder_pack_layout_and_contents(image_folder, tmp_path):
    pk = trainfast.pack(image_folder, tmp_path / "p.pack", size=(24, 32), workers=2, chunk=5, progress=False)
    assert len(pk) == 24 and pk.shape == (24, 32, 3) and pk.classes == ["cat", "dog"]
    images = np.load(tmp_path / "p.pack" / "images.npy", mmap_mode="r")  # numpy alone reads it
    assert images.shape == (24, 24, 32, 3) and images.dtype == np.uint8
    labels = np.load(tmp_path / "p.pack" / "labels.npy")
    # the class is visible in the colour (dark cats, bright dogs): labels follow their images
    assert np.all((images.reshape(24, -1).mean(1) > 120) == (labels == 1))
    meta = json.loads((tmp_path / "p.pack" / "meta.json").read_text())
    assert meta["schema"] == 1 and meta["count"] == 24 and meta["encoding"] == "raw"
    assert len(meta["mean"]) == 3 and all(0 < s < 1 for s in meta["std"])
    assert not list(tmp_path.glob(".p.pack*")), "build folders are removed"


def test_memmap_is_read_only(image_folder, tmp_path):
    pk = trainfast.pack(image_folder, tmp_path / "p", size=(8, 8), progress=False)
    assert isinstance(pk.images, np.memmap)
    with pytest.raises(ValueError):
        pk.images[0, 0, 0, 0] = 1


def test_bad_inputs_skipped_with_reasons(image_folder, tmp_path):
    n_bad = _bad_inputs(image_folder)
    pk = trainfast.pack(image_folder, tmp_path / "p", size=(16, 16), workers=2, chunk=4, progress=False)
    assert len(pk) == 24
    reasons = {os.path.basename(s["input"]): s["reason"] for s in pk.skipped}
    assert len(reasons) == n_bad
    assert "empty" in reasons["zero.jpg"]
    assert "not an image" in reasons["text.png"]
    assert "truncated" in reasons["truncated.jpg"]
    assert "folder" in reasons["folder.jpg"]
    assert "decompression bomb" in reasons["bomb.png"]


def test_fail_mode_writes_nothing_and_keeps_old_pack(image_folder, tmp_path):
    out = tmp_path / "p"
    first = trainfast.pack(image_folder, out, size=(16, 16), progress=False)
    before = (out / "images.npy").read_bytes()
    _bad_inputs(image_folder)
    with pytest.raises(TrainfastError, match=r"(zero|text|truncated|folder|bomb)\.(jpg|png): .*nothing was written"):
        trainfast.pack(image_folder, out, size=(16, 16), on_error="fail", overwrite=True, chunk=3, progress=False)
    assert (out / "images.npy").read_bytes() == before and len(Pack(out)) == len(first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p", "photos"]
    with pytest.raises(TrainfastError):
        trainfast.pack(image_folder, tmp_path / "new", size=(16, 16), on_error="fail", progress=False)
    assert not (tmp_path / "new").exists()


def test_out_that_is_not_a_pack_is_refused_even_with_overwrite(image_folder, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(TrainfastError, match="not a trainfast pack; trainfast replaces only packs it made"):
            trainfast.pack(image_folder, out, size=(8, 8), overwrite=overwrite, progress=False)
        assert (out / "precious.txt").read_text() == "keep me"
    (tmp_path / "notes.json").mkdir()
    (tmp_path / "notes.json" / "meta.json").write_text('{"mine": 1}')  # a meta.json of someone else's
    with pytest.raises(TrainfastError, match="not a trainfast pack"):
        trainfast.pack(image_folder, tmp_path / "notes.json", size=(8, 8), overwrite=True, progress=False)
    assert (tmp_path / "notes.json" / "meta.json").read_text() == '{"mine": 1}'


def _tree(root):
    return sorted((str(p.relative_to(root)), p.read_bytes() if p.is_file() else b"") for p in root.rglob("*"))


@pytest.mark.parametrize("where", ["source", "parent", "cwd", "inside"])
def test_overwrite_never_touches_the_source_or_what_holds_it(image_folder, tmp_path, monkeypatch, capsys, where):
    """`trainfast pack photos photos --overwrite` and its cousins: refused in one line, nothing lost or left."""
    from trainfast.cli import main

    (tmp_path / "unrelated.txt").write_text("beside the source")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere" if where == "parent" else tmp_path)
    source = str(image_folder) if where == "parent" else "photos"
    out = {"source": "photos", "parent": str(tmp_path), "cwd": ".", "inside": "photos/photos.pack"}[where]
    before = _tree(tmp_path)
    assert main(["pack", source, out, "--size", "8x8", "--overwrite", "-q"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert {"source": "holds the source", "parent": "holds the source", "cwd": "working directory",
            "inside": "inside the source folder"}[where] in err
    assert _tree(tmp_path) == before  # nothing deleted, nothing written, no build folder left


def test_out_that_holds_a_csv_s_images_is_refused(tmp_path, image_folder):
    rows = ["path,label"] + [f"{p},{p.parent.name}" for p in sorted(image_folder.rglob("*.jpg"))]
    (tmp_path / "list.csv").write_text("\n".join(rows))
    with pytest.raises(TrainfastError, match="an input of this pack"):
        trainfast.pack(tmp_path / "list.csv", image_folder / "cat", size=(8, 8), overwrite=True, progress=False)
    assert len(list((image_folder / "cat").iterdir())) == 12


def test_different_pack_needs_overwrite_same_is_up_to_date(image_folder, tmp_path):
    out = tmp_path / "p"
    trainfast.pack(image_folder, out, size=(8, 8), progress=False)
    mtime = (out / "images.npy").stat().st_mtime_ns
    trainfast.pack(image_folder, out, size=(8, 8), progress=False)  # up to date: untouched
    assert (out / "images.npy").stat().st_mtime_ns == mtime
    with pytest.raises(TrainfastError, match="--overwrite"):
        trainfast.pack(image_folder, out, size=(9, 9), progress=False)
    assert trainfast.pack(image_folder, out, size=(9, 9), overwrite=True, progress=False).shape == (9, 9, 3)


def test_empty_source(tmp_path):
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(TrainfastError, match="no images found"):
        trainfast.pack(tmp_path / "empty", tmp_path / "p", size=(8, 8), progress=False)


def test_all_inputs_bad(tmp_path):
    (tmp_path / "d" / "a").mkdir(parents=True)
    (tmp_path / "d" / "a" / "x.jpg").write_bytes(b"nope")
    with pytest.raises(TrainfastError, match="none of the 1 inputs could be packed.*x.jpg"):
        trainfast.pack(tmp_path / "d", tmp_path / "p", size=(8, 8), progress=False)
    assert not (tmp_path / "p").exists()


def test_csv_plates_with_missing_files(tmp_path):
    write_images(tmp_path / "img", classes=("x",), per_class=6)
    plates = ["AB12CD34", "ZZ99YY88", "QW12ER34", "TY56UI78", "OP90AS12", "DF34GH56"]
    lines = ["path,plate"] + [f"img/x/{i:03d}.jpg,{p}" for i, p in enumerate(plates)] + ["img/x/gone.jpg,AA00BB11"]
    (tmp_path / "plates.csv").write_text("\n".join(lines) + "\n")
    pk = trainfast.pack(tmp_path / "plates.csv", tmp_path / "p", size=(16, 32), label_column="plate", progress=False)
    assert len(pk) == 6 and pk.alphabet and pk.labels.shape == (6, 8)
    assert sorted(pk.label_text(pk.labels[i]) for i in range(6)) == sorted(plates)
    assert pk.skipped == [{"input": "img/x/gone.jpg", "reason": "file not found"}]


def test_arrays_limit_seed_and_grayscale(tmp_path):
    images = np.random.default_rng(0).integers(0, 255, (50, 10, 12, 3), dtype=np.uint8)
    labels = np.arange(50) % 5
    pk = trainfast.pack((images, labels), tmp_path / "p", size=(10, 12), limit=20, seed=3, progress=False)
    assert len(pk) == 20
    idx = [int(k.split("[")[1].rstrip("]")) for k in pk.inputs]
    assert len(set(idx)) == 20 and idx != sorted(idx)  # a seeded random subset
    assert np.array_equal(pk.images[0], images[idx[0]])  # same size: stored exactly
    assert np.array_equal(pk.labels, labels[idx])
    g = trainfast.pack((images, labels), tmp_path / "g", size=(5, 6), channels=1, progress=False)
    assert g.shape == (5, 6, 1)


def test_cifar_tarball(tmp_path):
    pk = trainfast.pack(make_cifar(tmp_path / "cifar-10-python.tar.gz"), tmp_path / "c", size=(32, 32), progress=False)
    assert len(pk) == 100 and pk.classes[0] == "airplane" and pk.encoding == "raw"


def test_jpeg_encoding_round_trip(image_folder, tmp_path):
    raw = trainfast.pack(image_folder, tmp_path / "r", size=(32, 32), encoding="raw", progress=False)
    jpg = trainfast.pack(image_folder, tmp_path / "j", size=(32, 32), encoding="jpeg", quality=95, progress=False)
    assert jpg.encoding == "jpeg" and jpg.images is None
    offsets = np.load(tmp_path / "j" / "offsets.npy")
    assert offsets.shape == (25,) and offsets[0] == 0
    for i in (0, 7, 23):
        assert np.abs(jpg.image(i).astype(int) - raw.image(i).astype(int)).mean() < 6
    assert trainfast.pack(image_folder, tmp_path / "a", size=(300, 300), progress=False).encoding == "jpeg"


def test_kill_and_resume_is_byte_identical(tmp_path):
    write_images(tmp_path / "d", per_class=150)
    reference = trainfast.pack(tmp_path / "d", tmp_path / "ref", size=(48, 48), chunk=10, progress=False)
    out = tmp_path / "p"
    code = (f"import trainfast; trainfast.pack({str(tmp_path / 'd')!r}, {str(out)!r}, size=(48, 48), "
            "chunk=10, workers=1, progress=False)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    chunks = tmp_path / ".p.trainfast-build" / "chunks"
    deadline = time.time() + 60
    while time.time() < deadline and len(list(chunks.glob("*.json"))) < 3:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists(), "a killed build leaves nothing at OUT"
    done = len(list(chunks.glob("*.json")))
    assert 3 <= done < 30
    pk = trainfast.pack(tmp_path / "d", out, size=(48, 48), chunk=10, progress=False)
    for name in ("images.npy", "labels.npy"):
        assert (out / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
    assert pk.inputs == reference.inputs


def test_bad_options(image_folder, tmp_path):
    for kw, msg in [({"size": (0, 5)}, "out of range"), ({"resize": "squash"}, "resize must be"),
                    ({"channels": 2}, "channels"), ({"encoding": "png"}, "encoding"),
                    ({"quality": 0}, "quality")]:
        kw.setdefault("size", (8, 8))
        with pytest.raises(TrainfastError, match=msg):
            trainfast.pack(image_folder, tmp_path / "p", progress=False, **kw)


def test_a_worker_holds_its_chunk_once_not_a_float_copy(tmp_path):
    """Running sums for the mean and std: the chunk's decoded bytes are the largest thing a
    worker holds (a float64 copy of them was 8× that: 15.7 GB at 1024×1024)."""
    import tracemalloc

    from trainfast.config import PackConfig
    from trainfast.data import chunks
    from trainfast.data import pack as pack_mod

    images = np.random.default_rng(0).integers(0, 256, (8, 256, 256, 3), dtype=np.uint8)
    src = trainfast.data.held.from_arrays(images, np.arange(8) % 2)
    cfg = pack_mod._checked(PackConfig(size=(256, 256), encoding="raw"), src)
    task = chunks.chunk_task(src, 0, np.arange(8), cfg, tmp_path)
    tracemalloc.start()
    result = chunks.build_chunk(task)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 3 * images.nbytes, f"peak {peak / 1e6:.1f} MB for a {images.nbytes / 1e6:.1f} MB chunk"
    pix = images.reshape(-1, 3).astype(np.float64)
    assert result["sum"] == pix.sum(0).tolist() and result["sumsq"] == np.square(pix).sum(0).tolist()


def test_chunks_of_large_images_are_bounded_in_bytes():
    from trainfast.config import PackConfig
    from trainfast.data.pack import CHUNK_BYTES, chunk_images

    assert chunk_images(PackConfig(size=(64, 128))) == 512  # small images: the configured chunk
    for side in (512, 1024, 4096):
        n = chunk_images(PackConfig(size=(side, side)))
        assert 1 <= n and n * side * side * 3 <= max(CHUNK_BYTES, side * side * 3)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table with ps --ppid")
def test_workers_end_when_the_packing_process_is_killed(tmp_path):
    """SIGKILL of `trainfast pack` (what the OOM killer sends) leaves no worker behind."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (tmp_path / "src" / c).mkdir(parents=True)
        for i in range(150):
            Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(tmp_path / "src" / c / f"{i}.png")
    proc = subprocess.Popen([sys.executable, "-m", "trainfast", "pack", str(tmp_path / "src"), str(tmp_path / "out"),
                             "--size", "1024x1024", "--encoding", "jpeg", "--workers", "2", "-q"])

    def children():
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    deadline = time.time() + 60
    while len(children()) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    workers = children()
    assert len(workers) == 2, "the workers never started"
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(os.path.exists(f"/proc/{w}") and "Z" not in _state(w) for w in workers):
        time.sleep(0.1)
    assert not [w for w in workers if os.path.exists(f"/proc/{w}") and "Z" not in _state(w)]


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_two_writers_to_one_out_one_wins_the_other_says_so(image_folder, tmp_path):
    from trainfast.data import pack as pack_mod

    out = tmp_path / "p"
    with pack_mod._only_writer(out):  # another process holds OUT's lock
        with pytest.raises(TrainfastError, match="another trainfast process is building this pack now"):
            trainfast.pack(image_folder, out, size=(8, 8), progress=False)
        assert not out.exists()
    assert len(trainfast.pack(image_folder, out, size=(8, 8), progress=False)) == 24
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p", "photos"]  # no lock file left


def test_two_pack_commands_at_once(image_folder, tmp_path):
    cmd = [sys.executable, "-m", "trainfast", "pack", str(image_folder), str(tmp_path / "p"), "--size", "512x512",
           "--encoding", "jpeg", "--workers", "1"]
    runs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errs = [r.communicate(timeout=120)[1] for r in runs]
    codes = sorted(r.returncode for r in runs)
    assert codes in ([0, 0], [0, 1]), errs  # the second either found the pack done, or was told to wait
    if codes == [0, 1]:
        assert any("another trainfast process is building this pack now" in e for e in errs)
    assert "Traceback" not in "".join(errs) and len(Pack(tmp_path / "p")) == 24


def test_a_full_disk_is_one_line_and_a_rerun_resumes(image_folder, tmp_path, monkeypatch):
    import errno

    from trainfast.data import chunks

    real = chunks.save_npy_atomic
    calls = []

    def fills_up(path, array):
        calls.append(path)
        if len(calls) == 2:  # the second chunk finds the disk full
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, array)
    monkeypatch.setattr(chunks, "save_npy_atomic", fills_up)
    out = tmp_path / "p"
    with pytest.raises(TrainfastError, match=r"no space left on the device .* rerun the same command"):
        trainfast.pack(image_folder, out, size=(16, 16), chunk=8, workers=1, progress=False)
    assert not out.exists()
    monkeypatch.setattr(chunks, "save_npy_atomic", real)
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")), raising=False)
    with pytest.raises(TrainfastError, match=r"images.npy: no space left on the device"):  # assembling, not SIGBUS
        trainfast.pack(image_folder, out, size=(16, 16), chunk=8, workers=1, progress=False)
    monkeypatch.undo()
    assert len(trainfast.pack(image_folder, out, size=(16, 16), chunk=8, workers=1, progress=False)) == 24


def test_float_images_beyond_one_are_refused(tmp_path):
    x = np.random.default_rng(0).uniform(0, 255, (4, 8, 8, 3)).astype(np.float32)
    with pytest.raises(TrainfastError, match="float images must be in \\[0, 1\\], and these reach 25"):
        trainfast.pack((x, np.arange(4)), tmp_path / "p", size=(8, 8), progress=False)
    assert len(trainfast.pack((x / 255, np.arange(4)), tmp_path / "p", size=(8, 8), progress=False)) == 4


def test_an_unreadable_class_folder_is_an_error_not_an_empty_class(image_folder, tmp_path, monkeypatch):
    real = os.scandir

    def scandir(path="."):  # what a folder without read permission does (root reads every folder)
        if os.fspath(path).endswith("dog"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)
    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(TrainfastError, match="dog: cannot read this folder \\(Permission denied\\)"):
        trainfast.pack(image_folder, tmp_path / "p", size=(8, 8), progress=False)
    assert not (tmp_path / "p").exists()


def test_arrays_keep_their_own_size_files_need_a_size(image_folder, tmp_path, capsys):
    """pack((x, y)) of 32×32 arrays is a 32×32 pack (it was the plate story's 64×128, silently)."""
    x = np.random.default_rng(0).integers(0, 255, (20, 32, 32, 3), dtype=np.uint8)
    pk = trainfast.pack((x, np.arange(20) % 4), tmp_path / "a", progress=False)
    assert pk.shape == (32, 32, 3) and np.array_equal(pk.image(0), x[int(pk.inputs[0].split("[")[1][:-1])])
    assert trainfast.pack((x[..., 0], np.arange(20) % 4), tmp_path / "g", progress=False).shape == (32, 32, 3)
    assert trainfast.pack((x, np.arange(20) % 4), tmp_path / "s", size=(16, 8), progress=False).shape == (16, 8, 3)
    chw = trainfast.pack((x.transpose(0, 3, 1, 2), np.array(["b", "a"] * 10)), tmp_path / "c")
    assert chw.shape == (32, 32, 3) and chw.classes == ["a", "b"]
    out = capsys.readouterr().out
    assert "channels-first" in out and "a=0, b=1" in out  # said once, with the pack's summary (on log: print)
    with pytest.raises(TrainfastError, match=r"image files can differ in size; .*size=\(64, 128\)"):
        trainfast.pack(image_folder, tmp_path / "f", progress=False)


@pytest.mark.parametrize("source, says", [
    ({"pixels": 1}, "a dict source needs 'images'"),
    (42, "cannot pack a int; give an image folder"),
])
def test_what_pack_takes_is_named(tmp_path, source, says):
    with pytest.raises(TrainfastError, match=says):
        trainfast.pack(source, tmp_path / "p", progress=False)


def test_pack_as_list_or_dict_and_into_new_folders(tmp_path):
    x = np.zeros((8, 6, 6, 3), np.uint8)
    y = np.arange(8) % 2
    assert len(trainfast.pack([x, y], tmp_path / "new" / "sub" / "l.pack", progress=False)) == 8
    assert len(trainfast.pack({"images": x, "labels": y}, tmp_path / "d.pack", progress=False)) == 8


def test_jpegs_already_at_the_packs_size_keep_their_bytes(tmp_path):
    """No second generation of JPEG loss (and no re-encoding time) for files already at the pack's
    size and quality; a larger or better file is resized and encoded as before."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for name, size, q in (("a", (24, 16), 85), ("b", (24, 16), 75), ("c", (48, 32), 85), ("d", (24, 16), 100)):
        (tmp_path / "src" / name).mkdir(parents=True)
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(
            tmp_path / "src" / name / "0.jpg", quality=q)
    pk = trainfast.pack(tmp_path / "src", tmp_path / "p", size=(16, 24), encoding="jpeg", quality=85, progress=False)
    assert pk.meta["jpeg_kept"] == 2  # a (85) and b (75); c is larger, d is better than 85 + 5
    for i, key in enumerate(pk.inputs):
        stored = bytes(pk.jpeg[pk.offsets[i]: pk.offsets[i + 1]])
        assert (stored == (tmp_path / "src" / key).read_bytes()) == (key[0] in "ab")
        assert pk.image(i).shape == (16, 24, 3)
    again = trainfast.pack(tmp_path / "src", tmp_path / "q", size=(16, 24), encoding="jpeg", quality=85, progress=False)
    assert (again.path / "jpeg.npy").read_bytes() == (pk.path / "jpeg.npy").read_bytes()


def test_files_that_are_not_files_are_skipped_unread(tmp_path):
    """A FIFO named like an image (opening it would wait for a writer for ever), a link to
    /dev/zero (endless), a file larger than any image could be (a 2 GB sparse file was read
    whole): each skipped with its reason before a byte is read; links out of the source are
    not followed."""
    from trainfast.data import chunks
    from trainfast.data.decode import DecodeError

    root = write_images(tmp_path / "photos", per_class=3)
    os.mkfifo(root / "cat" / "pipe.png")
    os.symlink("/dev/zero", root / "dog" / "zero.png")
    with open(root / "dog" / "huge.jpg", "wb") as f:
        f.truncate(chunks.MAX_INPUT_BYTES + 1)  # sparse: no disk used
    os.symlink(root / "cat" / "000.jpg", root / "dog" / "inside.jpg")  # a link within the source is fine
    pk = trainfast.pack(root, tmp_path / "out", size=(16, 16), progress=False)
    reasons = {s["input"]: s["reason"] for s in json.loads((tmp_path / "out" / "skipped.json").read_text())}
    assert len(pk) == 7 and set(reasons) == {"cat/pipe.png", "dog/zero.png", "dog/huge.jpg"}
    assert "FIFO" in reasons["cat/pipe.png"] and "outside the source" in reasons["dog/zero.png"]
    assert "more than any image" in reasons["dog/huge.jpg"]
    with pytest.raises(DecodeError, match="it is a device"):
        chunks.read_input("/dev/zero")  # named directly (in a CSV, say): refused by what it is


def test_a_class_folder_linking_out_of_the_source_is_refused(tmp_path):
    root = write_images(tmp_path / "photos", per_class=2)
    os.symlink("..", root / "loop")
    with pytest.raises(TrainfastError, match=r"loop: a class folder that is a link to .*outside"):
        trainfast.pack(root, tmp_path / "out", size=(16, 16), progress=False)
    assert not (tmp_path / "out").exists()


def test_a_class_folder_name_that_is_not_utf8_packs(tmp_path):
    root = write_images(tmp_path / "photos", per_class=2)
    os.rename(root / "cat", os.path.join(os.fsencode(root), b"caf\xe9"))  # Latin-1 bytes, not UTF-8
    pk = trainfast.pack(root, tmp_path / "out", size=(16, 16), progress=False)
    assert len(pk) == 4 and pk.classes == [os.fsdecode(b"caf\xe9"), "dog"]


def test_a_script_without_a_main_guard_under_spawn_is_told_why(image_folder, tmp_path):
    """macOS and Windows start pack's workers with 'spawn', which runs the user's script again in
    each: without `if __name__ == "__main__":` it would call pack again there. Both the workers
    and the parent say what to do (TRAINFAST_START_METHOD=spawn does here what those platforms do)."""
    import os
    import subprocess
    import sys
    script = tmp_path / "noguard.py"
    script.write_text(f"import trainfast\ntrainfast.pack({str(image_folder)!r}, 'out.pack', size=(16, 16), workers=2, "
                      "chunk=4, progress=False)\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "TRAINFAST_START_METHOD": "spawn"})
    assert p.returncode == 1
    assert "trainfast.pack was called while a worker process started" in p.stderr  # a worker's own line
    assert p.stderr.strip().splitlines()[-1].startswith("trainfast.errors.TrainfastError: a pack worker process died "
                                                        "(with the 'spawn' start method")
    assert 'put that under `if __name__ == "__main__":`' in p.stderr


def test_a_short_write_without_errno_is_a_full_disk_too(image_folder, tmp_path, monkeypatch):
    """numpy reports a write the disk cut short as OSError("N requested and M written") with no
    errno; it used to escape the full-disk handler as a traceback."""
    from trainfast.data import chunks

    def short(path, array):
        raise OSError(f"{array.nbytes} requested and 4096 written")
    monkeypatch.setattr(chunks, "save_npy_atomic", short)
    with pytest.raises(TrainfastError, match=r"no space left on the device .* rerun the same command"):
        trainfast.pack(image_folder, tmp_path / "p", size=(16, 16), chunk=8, workers=1, progress=False)


def test_arrays_packed_by_another_process_now_are_waited_for(tmp_path, monkeypatch):
    """Every torchrun rank calls fit((x, y)) and so packs the same arrays into the same cache
    folder: the second waits for the first and takes its pack (it used to stop on the lock)."""
    import threading

    from trainfast import files
    from trainfast.data import arrays as pack_mod
    from trainfast.data.held import from_arrays
    monkeypatch.setattr(pack_mod, "cache_dir", lambda: tmp_path)
    x = np.random.default_rng(0).integers(0, 255, (20, 8, 8, 3), dtype=np.uint8)
    y = np.arange(20) % 2
    out = tmp_path / "packs" / f"{from_arrays(x, y).fingerprint()[:16]}.pack"
    got = []
    with files.only_one(out.parent / f".{out.name}.trainfast-lock", "another trainfast process is building it"):
        t = threading.Thread(target=lambda: got.append(pack_mod.pack_arrays(x, y)[0]))
        t.start()
        t.join(0.6)
        assert t.is_alive()  # waiting, not failing
    t.join(30)
    assert len(got) == 1 and len(got[0]) == 20


def test_a_link_planted_as_the_build_folder_is_refused(image_folder, tmp_path):
    from trainfast.data.pack import _build_dir
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "p"
    _build_dir(out).symlink_to(elsewhere)
    with pytest.raises(TrainfastError, match="trainfast builds nothing through a link"):
        trainfast.pack(image_folder, out, size=(16, 16), progress=False)
    assert not any(elsewhere.iterdir()) and not out.exists()


def test_the_same_arrays_are_packed_once_and_the_cache_keeps_the_latest(tmp_path, monkeypatch):
    """fit((x, y)) packs arrays into the cache: the same arrays again reuse that pack (not
    rebuilt: its files keep their inode), other arrays get their own, and only the packs used
    last are kept once the others have been idle."""
    from trainfast.data import arrays as pack_mod

    monkeypatch.setenv("TRAINFAST_CACHE", str(tmp_path / "cache"))
    x = np.random.default_rng(0).integers(0, 255, (40, 8, 8, 3), dtype=np.uint8)
    y = np.arange(40) % 4
    first, _ = pack_mod.pack_arrays(x, y)
    inode = (first.path / "meta.json").stat().st_ino
    again, _ = pack_mod.pack_arrays(x.copy(), y.copy())
    assert again.path == first.path and (again.path / "meta.json").stat().st_ino == inode
    monkeypatch.setattr(pack_mod, "ARRAYS_KEEP", 2)
    monkeypatch.setattr(pack_mod, "ARRAYS_IDLE_S", 0.0)
    made = [pack_mod.pack_arrays(x + k, y)[0].path for k in range(1, 4)]
    left = sorted(p.name for p in (tmp_path / "cache" / "packs").glob("*.pack"))
    assert left == sorted(p.name for p in made[-2:]) and first.path.name not in left


@pytest.mark.parametrize("damage", ["truncated", "cut mid-scan", "extraneous bytes", "no end marker"])
def test_a_damaged_jpeg_at_the_packs_size_never_fails_the_pack(tmp_path, damage):
    """A JPEG already at the pack's size and quality keeps its bytes only where the Loader's
    strict decoder reads them; a damaged one is decoded leniently and re-encoded, or skipped with
    its reason, and every image of the pack loads (a truncated one used to stop the whole pack
    with 'Premature end of JPEG file')."""
    import io

    from PIL import Image
    rng = np.random.default_rng(0)
    (tmp_path / "src" / "a").mkdir(parents=True)
    for i in range(3):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (16, 24, 3), dtype=np.uint8)).save(buf, "JPEG", quality=80)
        data = buf.getvalue()
        if i == 1:
            data = {"truncated": data[: len(data) // 3], "cut mid-scan": data[:-40],
                    "extraneous bytes": data[:-2] + b"\x00" * 70 + data[-2:], "no end marker": data[:-2]}[damage]
        (tmp_path / "src" / "a" / f"{i}.jpg").write_bytes(data)
    pk = trainfast.pack(tmp_path / "src", tmp_path / "p", size=(16, 24), encoding="jpeg", quality=85, progress=False)
    assert len(pk) + len(pk.skipped) == 3 and len(pk) >= 2
    x, _ = next(iter(trainfast.Loader(pk, len(pk), shuffle=False, device="cpu")))
    assert x.shape == (len(pk), 3, 16, 24)

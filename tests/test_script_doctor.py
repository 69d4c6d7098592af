"""`trainfast doctor -- python SCRIPT`: real scripts, run in-process, stopped and diagnosed."""

import json
import os
import shlex
import textwrap
from pathlib import Path

import numpy as np
import pytest

from trainfast.cli import main
from trainfast.data.format import Pack
from trainfast.diagnose.script import doctor_script
from trainfast.errors import TrainfastError

KERAS_SEQUENCE = '''
import csv, math, os, sys
import numpy as np
import keras
from keras import layers
from skimage.io import imread
from skimage.transform import resize

ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
root = sys.argv[1]
rows = list(csv.reader(open(os.path.join(root, "labels.csv"))))[1:]  # path, plate, font


class PlateGenerator(keras.utils.Sequence):
    """What the license-plate story's user wrote: decode and resize every image of every batch,
    pixels 0-255, one-hot labels (batch, 8, 36)."""

    def __init__(self, rows, batch_size=16):
        super().__init__()
        self.rows, self.batch_size = rows, batch_size

    def __len__(self):
        return math.ceil(len(self.rows) / self.batch_size)

    def __getitem__(self, i):
        chunk = self.rows[i * self.batch_size:(i + 1) * self.batch_size]
        x = np.stack([resize(imread(os.path.join(root, r[0])), (64, 128), preserve_range=True) for r in chunk])
        y = keras.utils.to_categorical([[ALPHABET.index(c) for c in r[1]] for r in chunk], 36)
        return x.astype("float32"), y


train_gen = PlateGenerator(rows)
model = keras.Sequential([keras.Input((64, 128, 3)), layers.Rescaling(1 / 255), layers.Conv2D(8, 3, activation="relu"),
                          layers.MaxPooling2D(4), layers.Flatten(), layers.Dense(8 * 36), layers.Reshape((8, 36)),
                          layers.Softmax()])
model.compile(optimizer="adam", loss="categorical_crossentropy")
history = model.fit(train_gen, epochs=int(sys.argv[3]) if len(sys.argv) > 3 else 5, verbose=0)
open(sys.argv[2], "w").write(str(history.history["loss"][-1]))
'''

TORCH_IN_MEMORY = '''
import sys
import torch
import torch.nn as nn

torch.manual_seed(0)
x, y = torch.rand(512, 3, 32, 32), torch.randint(0, 10, (512,))
net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
opt = torch.optim.SGD(net.parameters(), lr=0.05)
FAIL_AT = int(sys.argv[1]) if len(sys.argv) > 1 else -1


def train_step(step, xb, yb):
    if step == FAIL_AT:
        raise RuntimeError("the user's bug at step %d" % step)
    loss = nn.functional.cross_entropy(net(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()


for epoch in range(50):
    for i, k in enumerate(range(0, 512, 64)):
        train_step(epoch * 8 + i, x[k:k + 64], y[k:k + 64])
'''


@pytest.fixture(scope="module")
def plates_dir(tmp_path_factory):
    from trainfast.datasets.plates import make_plates
    root = tmp_path_factory.mktemp("plates")
    make_plates(root, count=120, seed=3, progress=False)
    return root


def _script(tmp_path, text, name="train.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_keras_sequence_with_skimage_is_input_bound_and_the_culprit_is_named(tmp_path, plates_dir, monkeypatch):
    pytest.importorskip("keras")
    script = _script(tmp_path, KERAS_SEQUENCE)
    marker = tmp_path / "finished.txt"
    # 8 steps: the profiler samples every 5 ms, and 4 steps' few dozen samples could rank imread first
    r = doctor_script(["python", str(script), str(plates_dir), str(marker)], steps=8, log=lambda m: None)
    assert r.framework == "keras" and r.stopped == "stopped after the requested steps"
    assert len(r.timed) == 8 and not marker.exists()  # --steps honoured, the script stopped before its end
    assert r.data_share >= 0.20 and r.verdict.startswith("highly input-bound")
    names = [n for n, _ in r.data_functions]
    assert "skimage.transform.resize" in names[:4], names
    assert "skimage.io.imread" in names, names
    assert any("skimage.transform.resize" in f for f in r.findings)
    assert r.model["params"] == sum(l["params"] for l in r.layers) > 0
    assert r.data_source["kind"].startswith("keras PyDataset")

    # the recipe: the exact pack command for the CSV the script read, with the column that fits the
    # script's labels (8 characters of 36, not the font's 6 classes), the line to change, measured
    rec = r.recommendations[0]
    assert rec.title.startswith("Pack the images once") and rec.measured and rec.speedup > 1.2, rec
    # measured as felt: the script's own Sequence and the pack fed to its model in turns, the rounds' range shown
    assert rec.spread[0] <= rec.speedup <= rec.spread[1] and "interleaved rounds" in rec.evidence, rec.evidence
    assert "fed by PlateGenerator(...)" in rec.evidence
    after = r.recommendations[1:2]  # Keras's settings, if any won, are measured on top of the pack: right after it
    assert all(a.builds_on == rec.title and a.title.endswith("on top of the pack") for a in after
               if a.title.startswith("Keras's own settings")), after
    command = rec.action.splitlines()[0]
    out = f"{plates_dir.name}.pack"  # named after the CSV's folder
    assert command == f"trainfast pack {plates_dir / 'labels.csv'} {out} --size 64x128 --label-column plate"
    line = script.read_text().splitlines().index("train_gen = PlateGenerator(rows)") + 1
    assert f"train_gen = PackDataset('{out}', batch_size=16, one_hot=True, scale=255)   # in place of " \
           f"{script}:{line}: train_gen = PlateGenerator(rows)" in rec.action
    assert any(f.startswith(f"the images the script reads (under {plates_dir / 'images'})") for f in r.findings)
    assert "What to do, ranked by expected gain" in r.text() and "<ol>" in r.html()
    assert "model on keras torch backend" in r.text() and "drawn on ?" not in r.text()

    # pasted as printed, it trains; the doctor then sees the pack reader: no recipe, no storage line
    # for the folder the script no longer opens
    switched = _paste(script, rec.action, tmp_path)
    loss = _run(switched, [str(plates_dir), str(marker), "1"], tmp_path)
    assert np.isfinite(loss)
    monkeypatch.chdir(tmp_path)  # where the pack is
    r2 = doctor_script(["python", str(switched), str(plates_dir), str(marker)], steps=4, fixes=False,
                       log=lambda m: None)
    assert r2.data_source.get("reads") == "a trainfast pack" and len(r2.timed) == 4, r2.stopped
    assert not r2.recommendations and not any("the images the script reads" in f for f in r2.findings)


KERAS_CSV_CLASSES = '''
import csv, os, sys
import numpy as np
import keras
from keras import layers
from PIL import Image

listing = sys.argv[1]
rows = list(csv.DictReader(open(listing)))  # file, animal, photographer
names = sorted({r["animal"] for r in rows})
classes = len(names)


def load(r, size):
    return np.asarray(Image.open(os.path.join(os.path.dirname(listing), r["file"])).convert("RGB").resize(size))


class Photos(keras.utils.PyDataset):
    def __init__(self, rows, batch_size):
        super().__init__()
        self.rows, self.batch_size = rows, batch_size

    def __len__(self):
        return len(self.rows) // self.batch_size

    def __getitem__(self, i):
        chunk = self.rows[i * self.batch_size:(i + 1) * self.batch_size]
        x = np.stack([load(r, (40, 32)) for r in chunk]).astype("float32") / 255
        time_sink = sum(load(r, (400, 320)).sum() for r in chunk for _ in range(3))
        return x, keras.utils.to_categorical([names.index(r["animal"]) for r in chunk], classes)


photos = Photos(
    rows,
    batch_size=4)
model = keras.Sequential([keras.Input((32, 40, 3)), layers.Conv2D(4, 3, activation="relu"),
                          layers.GlobalAveragePooling2D(), layers.Dense(classes, activation="softmax")])
model.compile(optimizer="adam", loss="categorical_crossentropy")
history = model.fit(photos, epochs=3, verbose=0)
open(sys.argv[2], "w").write(str(history.history["loss"][-1]))
'''


def test_a_keras_script_reading_a_csv_of_classes_gets_a_recipe_that_pastes(tmp_path, image_folder, monkeypatch):
    """Labels one-hot over 2 classes, pixels 0-1, the data made over three lines: the column whose
    values fit (not the photographer's 4 names), one_hot=True, and the three lines replaced."""
    pytest.importorskip("keras")
    import trainfast.keras.doctor as keras_doctor
    monkeypatch.setattr(keras_doctor, "KERAS_TUNE_S", 3.0)
    files = sorted(image_folder.rglob("*.jpg"))
    listing = tmp_path / "photos.csv"
    listing.write_text("file,animal,photographer\n" + "".join(
        f"{f.relative_to(tmp_path)},{f.parent.name},{'abcd'[i % 4]}\n" for i, f in enumerate(files)))
    script = _script(tmp_path, KERAS_CSV_CLASSES)
    r = doctor_script(["python", str(script), str(listing), str(tmp_path / "loss")], steps=2, log=lambda m: None)
    rec = next(x for x in r.recommendations if x.title.startswith("Pack the images once"))
    assert rec.measured and rec.speedup > 1, rec
    assert rec.action.splitlines()[0] == f"trainfast pack {listing} {tmp_path.name}.pack --size 32x40 " \
                                         "--path-column file --label-column animal"
    first = script.read_text().splitlines().index("photos = Photos(") + 1
    assert f"photos = PackDataset('{tmp_path.name}.pack', batch_size=4, one_hot=True)   # in place of " \
           f"{script}:{first}-{first + 2}: photos = Photos( rows, batch_size=4)" in rec.action
    assert np.isfinite(_run(_paste(script, rec.action, tmp_path), [str(listing), str(tmp_path / "loss")], tmp_path))

    # labels no column holds (here 3 classes one-hot): refused, with the columns named
    script3 = _script(tmp_path, KERAS_CSV_CLASSES.replace("classes = len(names)", "classes = 3"), name="three.py")
    r = doctor_script(["python", str(script3), str(listing), str(tmp_path / "loss")], steps=2, fixes=False,
                      log=lambda m: None)
    assert not any(x.title.startswith("Pack the images once") for x in r.recommendations)
    assert any("none of its other columns ('animal', 'photographer') holds labels like the script's "
               "(one class per image, one-hot over 3" in f for f in r.findings), r.findings


KERAS_ARRAYS = '''
import numpy as np
import keras
from keras import layers

rng = np.random.default_rng(0)
x, y = rng.random((2048, 32, 32, 3), dtype=np.float32), rng.integers(0, 10, 2048)
model = keras.Sequential([keras.Input((32, 32, 3)), layers.Conv2D(16, 3, activation="relu"), layers.MaxPooling2D(),
                          layers.Conv2D(32, 3, activation="relu"), layers.GlobalAveragePooling2D(), layers.Dense(10)])
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=64, epochs=5, verbose=0)
'''


def test_a_keras_script_on_arrays_gets_its_settings_timed_and_the_cores_answer(tmp_path, monkeypatch):
    """The CIFAR story asked how to make Keras use all its cores: the settings are timed on a copy
    of the model fed from the arrays' first batch, and the threads the backend trains with are
    said, with fewer timed on a copy (the torch backend can change them in a running process)."""
    pytest.importorskip("keras")
    import torch

    import trainfast.keras.doctor as keras_doctor
    monkeypatch.setattr(keras_doctor, "KERAS_TUNE_S", 12.0)
    r = doctor_script(["python", str(_script(tmp_path, KERAS_ARRAYS))], steps=4, log=lambda m: None)
    assert r.data_source["kind"] == "in-memory arrays" and len(r.timed) == 4, r.stopped
    said = " ".join(r.findings) + " ".join(x.title for x in r.recommendations)
    assert "Keras's own settings" in said, r.findings
    cores = [f for f in r.findings if f.startswith("cores: Keras on torch trains with")]
    if torch.cuda.is_available():  # Keras's torch backend trains on the GPU there: no CPU threads to answer for
        assert not cores, cores
        return
    n = torch.get_num_threads()
    assert cores and f"with {n} CPU thread" in cores[0], r.findings
    if n >= 2:  # half the threads timed on a copy of the model
        assert f"a copy of the model with {n // 2}:" in cores[0], cores


def _paste(script: Path, action: str, where: Path) -> Path:
    """A recipe as a user follows it: the pack command run in `where`, the code lines put in a copy
    of the script where the recipe says (the lines it replaces, or before the statement that uses
    the data, with the name written in place of the expression). Returns the copy."""
    import re
    lines = action.splitlines()
    cwd = os.getcwd()
    os.chdir(where)
    try:
        assert main(shlex.split(lines[0])[1:]) == 0
    finally:
        os.chdir(cwd)
    code = [line.split("   # ")[0] for line in lines[2:] if not line.startswith("#")]
    text = script.read_text().splitlines()
    named = re.search(r"# in place of .*:(\d+)(?:-(\d+))?: ", action)
    if named:
        first, last = int(named[1]), int(named[2] or named[1])
        indent = text[first - 1][:len(text[first - 1]) - len(text[first - 1].lstrip())]
        text[first - 1:last] = [indent + c for c in code]
    else:
        handed = re.search(r"# then write data in place of `(.+)` at .*:(\d+)$", action, re.MULTILINE)
        line = int(handed[2])
        text[line - 1] = text[line - 1].replace(handed[1], "data")
        top = max(i for i in range(line) if text[i] and not text[i][0].isspace())  # the statement holding it
        text[top:top] = code
    copy = script.with_name("pasted_" + script.name)
    copy.write_text("\n".join(text) + "\n")
    return copy


def _run(script: Path, args: list[str], cwd: Path) -> float:
    """Run a script in this process, as `python script args` from `cwd`; its last loss, as it wrote
    it in the file named by its second argument."""
    import runpy
    import sys
    old = os.getcwd(), sys.argv
    os.chdir(cwd)
    sys.argv = [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        os.chdir(old[0])
        sys.argv = old[1]
    return float(Path(args[1]).read_text())


def test_pytorch_in_memory_is_not_input_bound(tmp_path):
    script = _script(tmp_path, TORCH_IN_MEMORY)
    r = doctor_script(["python", str(script)], steps=6, log=lambda m: None)
    assert r.framework == "pytorch" and len(r.timed) == 6
    assert r.verdict.startswith("not input-bound")
    assert r.mean("backward") > 0 and r.mean("optimizer") > 0
    assert r.devices["model"] == ["cpu"]
    assert r.model["input_shape"] == [3, 32, 32] and r.model["params"] == 10_474
    assert "Where the time goes" in r.text()


def test_a_failing_script_shows_its_own_traceback_and_what_was_measured(tmp_path, capsys):
    script = _script(tmp_path, TORCH_IN_MEMORY)
    code = main(["doctor", "--steps", "50", "--", "python", str(script), "5"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "RuntimeError: the user's bug at step 5" in err and f'File "{script}"' in err
    assert "runpy" not in err and "trainfast/diagnose" not in err  # the traceback is the script's own
    assert "the script failed" in out and "3 timed steps after 2 warm-up" in out


def test_a_script_that_never_trains_is_told_so(tmp_path, capsys):
    script = _script(tmp_path, '''
        import time

        def wait_for_the_network_drive():
            t = time.time()
            while time.time() - t < 30:
                sum(range(10000))

        wait_for_the_network_drive()
    ''')
    code = main(["doctor", "--seconds", "1", "--", "python", str(script)])
    out, _ = capsys.readouterr()
    assert code == 1
    assert "never trained" in out and "time limit reached" in out
    assert "train.py:wait_for_the_network_drive" in out


def test_json_output_and_module_mode(tmp_path, capsys, monkeypatch):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    _script(pkg, TORCH_IN_MEMORY, name="train.py")
    monkeypatch.chdir(tmp_path)
    assert main(["doctor", "--steps", "3", "--json", "-", "--", "python", "-m", "mypkg.train"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["framework"] == "pytorch" and d["schema"] == 1 and len(d["steps"]) == 5
    assert d["verdict"].startswith("not input-bound")


@pytest.mark.parametrize("argv, message", [
    (["doctor", "--", "python", "no_such_script.py"], "no_such_script.py: no such script"),
    (["doctor", "--", "python", "-m", "no_such_module_xyz"], "no module named 'no_such_module_xyz'"),
    (["doctor", "--"], "give the command after --"),
    (["doctor", "--model", "cifar_cnn", "--", "python", "x.py"], "not both"),
    (["doctor"], "give --model and --data, or your training script after --"),
])
def test_bad_commands_get_clear_errors(argv, message, capsys):
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_steps_must_be_positive():
    with pytest.raises(TrainfastError, match="--steps must be ≥ 1"):
        doctor_script(["python", "x.py"], steps=0)


def _report_with(data_source, data_functions):
    from trainfast.diagnose.fixes import _findings
    from trainfast.diagnose.script import ScriptReport, Step
    steps = [Step(seconds=0.1, data=0.03, batch_size=64) for _ in range(6)]
    system = {"device": "cpu", "usable_cores": 2, "torch_threads": 2, "cuda_available": False}
    r = ScriptReport(command=["python", "t.py"], framework="keras", stopped="", steps=steps, warmup=2,
                     system=system, data_source=data_source, data_functions=data_functions)
    return _findings(r)


def test_findings_blame_a_named_function_only_when_it_holds_the_time():
    slow = _report_with({"kind": "keras PyDataset (S)"}, [("skimage.transform.resize", 0.6)])
    assert "most of it in skimage.transform.resize (60% of the data time)" in slow[0]
    minor = _report_with({"kind": "keras PyDataset (S)"}, [("numpy.take", 0.04)])
    assert "numpy.take" not in minor[0] and "trainfast pack" in minor[0]


def test_the_storage_of_the_images_the_script_read_is_measured(image_folder, tmp_path):
    """The plate story's images sat on a network drive: the doctor reads the images the script
    read again, alone and cold, against the data time per image; a script that reads no image
    file (it moved to a pack) gets no storage line."""
    from trainfast.diagnose.fixes import _storage_findings
    from trainfast.diagnose.script import ScriptReport, Step
    system = {"device": "cpu", "usable_cores": 2, "torch_threads": 2, "cuda_available": False}
    files = sorted(str(p) for p in image_folder.rglob("*.jpg"))

    def report(data_s):
        steps = [Step(seconds=0.1, data=data_s, batch_size=64) for _ in range(6)]
        return ScriptReport(command=["python", "t.py", str(image_folder)], framework="pytorch", stopped="",
                            steps=steps, warmup=2, system=system)
    found = _storage_findings(report(0.05), files)
    assert len(found) == 1 and found[0].startswith(f"the images the script reads (under {image_folder}): "
                                                   "reading the files alone")
    assert "files/s" in found[0] and "of the data time per image" in found[0]
    assert _storage_findings(report(0.001), files) == []  # not input-bound: nothing to say
    assert _storage_findings(report(0.05), []) == []  # read nothing (a pack): the folder named is not measured


def test_findings_on_a_pack_reader_do_not_advise_packing():
    out = _report_with({"kind": "keras PyDataset (PackDataset)", "reads": "a trainfast pack"}, [("numpy.take", 0.04)])
    assert "already come from a trainfast pack" in out[0] and "2 cores" in out[0]
    assert "do that once" not in " ".join(out)


def test_the_keras_example_diagnosed_on_a_pack(tmp_path, plates_dir):
    """docs/KERAS.md's example, switched to a pack: the doctor sees the pack reader and does not advise packing."""
    pytest.importorskip("keras")
    pytest.importorskip("skimage")
    import trainfast
    pack = trainfast.pack(plates_dir / "labels.csv", tmp_path / "plates.pack", size=(64, 128), label_column="plate",
                          alphabet="0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", progress=False)
    example = Path(__file__).resolve().parents[1] / "examples" / "keras_plates.py"
    r = doctor_script(["python", str(example), str(plates_dir), "--pack", str(pack.path), "--batch-size", "16"],
                      steps=4, log=lambda m: None)
    assert r.framework == "keras" and len(r.timed) == 4, r.stopped
    assert r.data_source == {"kind": "keras PyDataset (PackDataset)", "workers": 1, "use_multiprocessing": False,
                             "reads": "a trainfast pack"}
    assert not any("do that once" in f for f in r.findings)
    assert r.model["params"] == 264_560


def test_the_command_exits_though_the_stopped_script_left_threads_behind(tmp_path):
    """A script stopped mid-run may leave threads that would block a normal interpreter exit
    (TensorFlow's prefetch iterator does); the command still ends, with the report printed."""
    import subprocess
    import sys
    script = _script(tmp_path, '''
        import threading, torch
        threading.Thread(target=threading.Event().wait).start()  # never ends, not a daemon
        data = torch.utils.data.TensorDataset(torch.rand(800, 4), torch.randint(0, 2, (800,)))
        net = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for x, y in torch.utils.data.DataLoader(data, batch_size=8):
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    ''')
    p = subprocess.run([sys.executable, "-m", "trainfast", "doctor", "--steps", "3", "--", "python", str(script)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "VERDICT" in p.stdout and "3 timed steps" in p.stdout


TORCH_FOLDER = '''
import os, sys
import numpy as np
import torch
import torch.nn as nn
from PIL import Image

root = sys.argv[1]
files = [(os.path.join(root, c, f), i) for i, c in enumerate(sorted(os.listdir(root))) for f in sorted(os.listdir(os.path.join(root, c)))]


class Photos(torch.utils.data.Dataset):
    def __len__(self):
        return len(files)

    def __getitem__(self, i):
        path, label = files[i]
        img = np.asarray(Image.open(path).convert("RGB").resize((40, 32)), np.float32) / 255
        time_sink = sum(np.asarray(Image.open(path).convert("RGB").resize((400, 320))).sum() for _ in range(3))
        return torch.from_numpy(img).permute(2, 0, 1), label


net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for epoch in range(20):
    for x, y in torch.utils.data.DataLoader(Photos(), batch_size=4, shuffle=False):
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
if len(sys.argv) > 2:
    open(sys.argv[2], "w").write(str(loss.item()))
'''


def test_a_pytorch_script_reading_class_folders_gets_the_folder_pack_command(tmp_path, image_folder):
    """Files read from class folders (here in order, so the first steps read one class only): the
    recipe packs the whole folder at the batches' own size, with the Loader's time per batch."""
    import shlex
    script = _script(tmp_path, TORCH_FOLDER)
    r = doctor_script(["python", str(script), str(image_folder)], steps=1, log=lambda m: None)  # 12 images: cat/ only
    assert r.framework == "pytorch" and r.data_share >= 0.2, r.verdict
    rec = r.recommendations[0]
    assert rec.title == "Pack the images once, then stream the pack" and rec.measured and rec.speedup > 1
    assert rec.spread[0] <= rec.speedup <= rec.spread[1] and "drawn in turns" in rec.evidence, rec.evidence
    assert shlex.split(rec.action.splitlines()[0]) == ["trainfast", "pack", str(image_folder), "photos.pack",
                                                       "--size", "32x40"]
    assert "Loader('photos.pack', batch_size=4" in rec.action and "2 class folders" not in rec.evidence
    assert f"the 24 images in the class folders of {image_folder}" in rec.evidence
    # made in the loop itself: the recipe names the expression to replace, and pasted, it trains
    assert "# then write data in place of `torch.utils.data.DataLoader(Photos(), batch_size=4, shuffle=False)` " \
           f"at {script}:" in rec.action
    assert np.isfinite(_run(_paste(script, rec.action, tmp_path), [str(image_folder), str(tmp_path / "loss")],
                            tmp_path))


def _probe_with(files, csvs=(), batch=None):
    from trainfast.diagnose.probes import _Probe
    p = _Probe(1, 1.0, 0)
    for f in files:
        p.files_read[str(f)] = True
    p.csvs_read = [str(c) for c in csvs]
    p.first_batch = batch if batch is not None else (np.zeros((2, 64, 128, 3), np.float32), np.zeros((2, 8)))
    return p


def _found(probe):
    from trainfast.diagnose.recipe import batch_images, find_recipe
    return find_recipe(probe, batch_images(probe.first_batch, "keras"))


def test_the_recipe_finds_the_csv_that_lists_the_images_and_guesses_its_label_column(tmp_path, image_folder):
    files = sorted(image_folder.rglob("*.jpg"))
    rows = "\n".join(f"{f.relative_to(tmp_path)},{f.parent.name},x" for f in files)
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    listed = tmp_path / "list.csv"
    listed.write_text("file,kind,extra\n" + rows + "\n")
    class_batch = (np.zeros((2, 64, 128, 3), np.float32), np.array([0, 1]))  # the script's labels: classes
    recipe, why = _found(_probe_with(files[:6], [listed, tmp_path / "other.csv"], class_batch))
    assert recipe is not None, why
    assert recipe.command == f"trainfast pack {listed} {tmp_path.name}.pack --size 64x128 --path-column file " \
                             "--label-column kind"
    assert not recipe.notes  # 'kind' repeats 2 values, 'extra' holds one: the labels decide
    assert recipe.source.classes == ["cat", "dog"] and len(recipe.source) == len(files)
    seq_batch = (class_batch[0], np.zeros((2, 8), np.int64))  # 8-character labels: no column fits, refused
    recipe, why = _found(_probe_with(files[:6], [listed], seq_batch))
    assert recipe is None and why == f"{listed} lists the images the script read, but none of its other columns " \
        "('kind', 'extra') holds labels like the script's (sequences of 8, as indices): pack it with --label-column " \
        "naming the column that does"
    unknown = (class_batch[0], np.array([0.5, 2.25]))  # not labels trainfast knows (a regression target): a guess
    recipe, why = _found(_probe_with(files[:6], [listed], unknown))
    assert "--label-column kind" in recipe.command and "'kind' is a guess among 'kind', 'extra'" in recipe.notes[0]

    flat = tmp_path / "flat"
    flat.mkdir()
    for f in files[:3]:
        (flat / f.name).write_bytes(f.read_bytes())
    recipe, why = _found(_probe_with(sorted(flat.iterdir())))
    assert recipe is None and "sit in one folder" in why and "cannot tell their labels" in why

    recipe, why = _found(_probe_with(files[:2], batch=(np.zeros((2, 64, 128, 4)), None)))
    assert recipe is None and "4 channels" in why


def test_the_script_report_warns_on_a_busy_machine_and_charts_its_layers(tmp_path, monkeypatch):
    from conftest import other_load

    from trainfast import hardware
    other_load(monkeypatch, 1.0)
    script = _script(tmp_path, TORCH_IN_MEMORY)
    r = doctor_script(["python", str(script)], steps=3, log=lambda m: None)
    assert hardware.is_busy(r.other_cores) and "other processes kept 1.0" in r.load_warning
    assert "WARNING  other processes kept" in r.text()
    page = r.html()
    assert "Busy machine" in page and 'id="layer-cost"' in page and 'id="step-breakdown"' in page


STORY_512 = '''
import sys
import keras
from keras import layers

train = keras.utils.image_dataset_from_directory(sys.argv[1], image_size=(64, 64), batch_size=5)
model = keras.Sequential([keras.Input((64, 64, 3)), layers.Rescaling(1 / 255), layers.Conv2D(8, 3, activation="relu"),
                          layers.GlobalAveragePooling2D(), layers.Dense(2)])
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(train, epochs=50, verbose=0)
'''


def test_image_dataset_from_directory_on_tensorflow_gets_the_folder_recipe(tmp_path, image_folder):
    """The 512² story's Keras 3 form: tf.data reads in C++, so the doctor takes the folder from
    image_dataset_from_directory's arguments and times the dataset alone after the run. Needs
    TensorFlow (not in CI): run in a subprocess on the tensorflow backend."""
    import os
    import subprocess
    import sys
    if subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True).returncode:
        pytest.skip("TensorFlow is not installed")
    script = _script(tmp_path, STORY_512)
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "trainfast", "doctor", "--steps", "6", "--json", str(out), "--",
                        "python", str(script), str(image_folder)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["data_source"]["kind"] == "tf.data Dataset" and r["generator_s_per_batch"] > 0
    assert "model on keras tensorflow backend\n" in p.stdout  # tf.data's batches are not seen: no "drawn on ?"
    recipe = [x for x in r["recommendations"] if x["title"].startswith("Pack the images once")]
    from trainfast.diagnose.verdict import MODERATELY_INPUT_BOUND
    if r["data_share"] >= MODERATELY_INPUT_BOUND:  # 14% here: a 5-image step of a tiny model is 2.5 ms
        assert recipe and recipe[0]["action"].startswith(f"trainfast pack {image_folder} photos.pack --size 64x64")
        assert "train = PackDataset('photos.pack', batch_size=5, scale=255)   # in place of " in recipe[0]["action"]
        assert ": train = keras.utils.image_dataset_from_directory(" in recipe[0]["action"]


# The doctor's time limit is one alarm: landing in the except clause or on the loop's jump back (a
# few bytecodes, hit once in a loaded full run), it would leave a one-level loop, which would then
# end as asked. The outer loop swallows that too; it only runs after the inner one let something out.
STUBBORN = '''
import time, torch
net = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
x, y = torch.rand(64, 4), torch.randint(0, 2, (64,))

def train():
    while True:
        try:
            for i in range(0, 64, 8):
                torch.nn.functional.cross_entropy(net(x[i:i + 8]), y[i:i + 8]).backward()
                opt.step()
                opt.zero_grad()
                time.sleep(0.01)
        except:  # noqa: E722 - the user's bare except swallows the doctor's stop
            pass

while True:
    try:
        train()
    except:  # noqa: E722
        pass
'''


def test_a_script_that_swallows_the_stop_still_ends_with_a_report(tmp_path):
    """The time limit holds from outside the script: a watchdog reports what was measured and ends
    the process when the script ignores the stop (a bare except)."""
    import subprocess
    import sys
    import time
    script = _script(tmp_path, STUBBORN)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "trainfast", "doctor", "--steps", "5", "--seconds", "4", "--", "python",
                        str(script)], capture_output=True, text=True, timeout=120)
    assert time.perf_counter() - t < 60
    assert p.returncode == 1 and p.stdout.count("VERDICT") == 1, (p.returncode, p.stdout[-1500:], p.stderr[-500:])
    assert "the script ignored the doctor's stop" in p.stdout and "the doctor ended it" in p.stdout


EXITER = '''
import os, torch
net = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
x, y = torch.rand(64, 4), torch.randint(0, 2, (64,))
print("the script's own output")
for i in range(0, 64, 8):
    torch.nn.functional.cross_entropy(net(x[i:i + 8]), y[i:i + 8]).backward()
    opt.step()
    opt.zero_grad()
if os.fork() == 0:
    print("a child")
else:
    os.wait()
os.chdir(os.path.dirname(os.getcwd()))
os._exit(0)
'''


def test_os_exit_forks_chdir_and_json_on_stdout_give_one_clean_report(tmp_path):
    """os._exit in the script ends the run, not the doctor; a forked child gives no second report;
    the script's prints go to stderr when the JSON report goes to stdout; --html lands where the
    command line meant though the script changed directory."""
    import subprocess
    import sys
    work = tmp_path / "work"
    work.mkdir()
    script = _script(tmp_path, EXITER)
    p = subprocess.run([sys.executable, "-m", "trainfast", "doctor", "--steps", "50", "--json", "-", "--html",
                        "rel.html", "--", "python", str(script)], capture_output=True, text=True, timeout=120, cwd=work)
    report = json.loads(p.stdout)  # nothing but the report on stdout
    assert report["stopped"] == "the script called os._exit(0)" and len(report["steps"]) == 8
    assert "the script's own output" in p.stderr and "a child" in p.stderr
    assert (work / "rel.html").is_file() and not (tmp_path / "rel.html").exists()


def test_data_that_yields_no_batch_is_one_line(tmp_path, capsys):
    csv = tmp_path / "missing.csv"
    csv.write_text("path,label\nnope1.jpg,a\nnope2.jpg,b\n")
    assert main(["doctor", "--model", "cifar_cnn", "--data", str(csv), "--device", "cpu"]) == 1
    assert "2 images, fewer than one batch of 64; give --batch-size 2 or fewer" in capsys.readouterr().err
    assert main(["doctor", "--model", "cifar_cnn", "--data", str(csv), "--batch-size", "2", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the doctor's progress lines
    assert "Traceback" not in err and "no file of batch 0 could be read (first: " in last and "nope1.jpg" in last


def test_the_pack_command_pastes_after_a_chdir_and_for_odd_folder_names(tmp_path, image_folder, monkeypatch):
    """Issue 50.9: a script that changes directory (paths were printed relative to its new one), a
    folder whose name begins with `-` (an option to argparse) and holds a newline (plain quotes
    kept it, and the indented text report put spaces inside them). Pasted into bash from where
    the user ran the doctor, the printed command packs the folder."""
    import shutil
    import subprocess
    import sys
    odd = "-pho\ntos"
    shutil.copytree(image_folder, tmp_path / "data" / odd)
    script = _script(tmp_path, TORCH_FOLDER.replace("root = sys.argv[1]", "os.chdir('..'); root = sys.argv[1]"))
    monkeypatch.chdir(tmp_path / "data")
    r = doctor_script(["python", str(script), f"data/{odd}"], steps=1, log=lambda m: None)
    assert os.getcwd() == str(tmp_path / "data")  # the doctor's own directory is given back
    command = r.recommendations[0].action.splitlines()[0]
    assert command.startswith("trainfast pack $'./-pho\\ntos' "), command
    assert command in r.text()  # whole, on one line of the report
    p = subprocess.run(["bash", "-c", f"{shlex.quote(sys.executable)} -m {command}"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-1000:]
    pk = Pack(tmp_path / "data" / f"{odd}.pack")  # named after the folder, beside where the user is
    assert len(pk) == 24 and pk.classes == ["cat", "dog"]


SLOWING = '''
import time
import numpy as np
import keras
from keras import layers


class Slowing(keras.utils.PyDataset):  # each batch takes longer than the last, as a draining prefetch buffer would
    calls = 0

    def __len__(self):
        return 64

    def __getitem__(self, i):
        Slowing.calls += 1
        time.sleep(0.01 * Slowing.calls)
        return np.zeros((8, 8, 8, 3), np.float32), np.zeros(8, np.int64)


model = keras.Sequential([keras.Input((8, 8, 3)), layers.Flatten(), layers.Dense(2)])
model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(Slowing(), epochs=1, verbose=0)
'''

EPOCHS = '''
import numpy as np
import keras
from keras import layers

x, y = np.zeros((256, 8, 8, 3), np.float32), np.zeros(256, np.int64)
model = keras.Sequential([keras.Input((8, 8, 3)), layers.Flatten(), layers.Dense(2)])
model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=64, epochs=5, verbose=0)
'''


def test_steps_that_slow_down_as_the_script_runs_are_said_with_the_pace_to_trust(tmp_path):
    pytest.importorskip("keras")
    r = doctor_script(["python", str(_script(tmp_path, SLOWING))], steps=9, fixes=False, log=lambda m: None)
    assert r.steps_per_epoch == 64 and "an epoch of 64 steps:" in r.text()
    slowed = [f for f in r.findings if f.startswith("the steps slowed down as the script ran")]
    assert slowed and "trust the last steps" in slowed[0], r.findings


def test_whole_epochs_seen_in_the_run_are_recorded_and_compared_with_the_timed_step(tmp_path):
    """Keras's epochs of 4 steps: those that began after the warm-up and ended before the stop."""
    pytest.importorskip("keras")
    from dataclasses import replace

    from trainfast.diagnose.script_report import pace_findings

    r = doctor_script(["python", str(_script(tmp_path, EPOCHS))], steps=12, fixes=False, log=lambda m: None)
    assert r.steps_per_epoch == 4 and [steps for _, steps in r.epochs] == [4, 4], r.epochs
    step = r.mean("seconds")
    slow = replace(r, epochs=[(4 * 3 * step, 4)], findings=[])  # as if each epoch's steps took 3× the timed ones
    said = [f for f in pace_findings(slow) if f.startswith("a whole epoch of the script took")]
    assert said and "×3.00 the" in said[0] and "Trust the epoch" in said[0], said
    assert not [f for f in pace_findings(replace(r, epochs=[(4 * step, 4)])) if f.startswith("a whole epoch")]

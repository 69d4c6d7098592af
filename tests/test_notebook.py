"""The Python API in a Jupyter kernel, as notebook users call it: pack, doctor, fit and tune on
numpy arrays, executed with nbclient. Outputs are checked by stream and MIME type."""

import json
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

CELLS = [
    """import numpy as np, torch, trainfast
from trainfast.datasets.digits import load_digits
x, y, _ = load_digits(32)
x, y = x[:600], y[:600]
x.shape, y.shape""",
    """pk = trainfast.pack((x, y), "nb.pack")
pk""",
    """report = trainfast.doctor("cifar_cnn", pk, device="cpu", steps=4, warmup=1)
report""",
    """result = trainfast.fit("cifar_cnn", pk, epochs=1, device="cpu", run_dir="run")
result""",
    """net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(10))
trainfast.tune(net, pk, device="cpu", max_seconds=6, try_compile=False)""",
]


@pytest.mark.slow
def test_a_notebook_renders_and_writes_nothing_to_stderr_but_progress(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outs = [cell.outputs for cell in nb.cells]
    stderr = [o["text"] for cell in outs for o in cell if o.get("name") == "stderr"]
    assert stderr == [], stderr  # progress is a widget in a notebook; messages are stdout
    errors = [o for cell in outs for o in cell if o["output_type"] == "error"]
    assert errors == [], errors

    def result(i):
        return next(o for o in outs[i] if o["output_type"] == "execute_result")["data"]

    assert "32×32×3" in result(1)["text/plain"]  # the arrays' own size, not 64×128
    doctor = result(2)
    assert "text/html" in doctor and "<h2>What to do</h2>" in doctor["text/html"] and "<svg" in doctor["text/html"]
    assert doctor["text/html"].index("What to do") < doctor["text/html"].index("<svg")  # advice above the charts
    assert len(doctor["text/plain"]) < 400 and doctor["text/plain"].startswith("<doctor report: cifar_cnn")
    fit = result(3)["text/plain"]
    assert fit.startswith("FitResult(1 epochs") and len(fit) < 400
    tune = result(4)
    assert "chosen:" in tune["text/plain"] and "text/html" in tune
    widgets = [o for cell in outs for o in cell if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert widgets, "progress bars should be notebook widgets (tqdm.auto with ipywidgets)"
    json.dumps(nb)  # the executed notebook is plain JSON, as a user would save it


def test_without_ipywidgets_a_bar_is_one_updating_line():
    """Issue 49.5: tqdm.auto, without ipywidgets, printed a warning and then each refresh as its own
    stderr block (70+ lines an epoch in a saved notebook). trainfast's bar is one display output
    that each refresh replaces: one line in the saved notebook, at its final state."""
    cells = ["import sys\nsys.modules['ipywidgets'] = None  # as on a machine without it",
             ("from trainfast.datasets.plates import make_plates\n"
              "make_plates('plates', count=120, seed=0, workers=1, progress=True)\nNone")]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp}}).execute()
    outs = nb.cells[1].outputs
    assert not [o for o in outs if o.get("name") == "stderr"], outs  # no warning, no stream of bars
    shown = [o for o in outs if o["output_type"] == "display_data"]
    assert len(shown) == 1 and len(outs) == 1, outs
    text = shown[0]["data"]["text/plain"]
    assert "making plates: 100%" in text and "120/120" in text and "\n" not in text.strip(), text


BROWSER_CELLS = [
    "import sys\nsys.modules['ipywidgets'] = None  # a notebook without the widgets",
    """import numpy as np, torch, trainfast
from trainfast.datasets.digits import load_digits
x, y, _ = load_digits(32)
pk = trainfast.pack((x[:300], y[:300]), "nb.pack", progress=True)""",
    """net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(10))
trainfast.tune(net, pk, device="cpu", max_seconds=4, try_compile=False)""",
    """import keras
from trainfast.keras import SpeedDoctor
model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(8, 3), keras.layers.Flatten(),
                          keras.layers.Dense(10)])
model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
xk = np.random.default_rng(0).random((256, 32, 32, 3), dtype=np.float32)
model.fit(xk, y[:256], batch_size=32, epochs=1, verbose=0, callbacks=[SpeedDoctor()])
None""",
]


def _chromium() -> str | None:
    import shutil
    return next((p for p in map(shutil.which, ("chromium-headless-shell", "chromium", "chromium-browser",
                                              "google-chrome")) if p), None)


@pytest.mark.slow
def test_the_saved_notebook_reads_right_in_a_browser(tmp_path, monkeypatch):
    """Issue 49.5, as a user sees it: the executed notebook exported to HTML by nbconvert and
    rendered by headless Chromium. One line of progress per bar, the tune table in one monospace
    block, SpeedDoctor naming its device and its advice, no torch._dynamo warning."""
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no headless Chromium here (apt-get install chromium-headless-shell): the notebook's HTML "
                    "was not rendered in a browser")
    nbconvert = pytest.importorskip("nbconvert")
    import subprocess
    from html.parser import HTMLParser

    monkeypatch.setenv("KERAS_BACKEND", "torch")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in BROWSER_CELLS])
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    page, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    (tmp_path / "nb.html").write_text(page)
    if os.environ.get("TRAINFAST_KEEP_HTML"):  # to look at it: the page and a screenshot
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,2400",
                        f"--screenshot={os.environ['TRAINFAST_KEEP_HTML']}", (tmp_path / "nb.html").as_uri()],
                       capture_output=True, timeout=120)
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          (tmp_path / "nb.html").as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert "</html>" in dom, dom[-500:]

    class Text(HTMLParser):  # the text a reader sees, and the blocks of preformatted text
        def __init__(self):
            super().__init__()
            self.text, self.pre, self.depth, self.skip = [], [], 0, 0

        def handle_starttag(self, tag, attrs):
            self.skip += tag in ("script", "style")
            if tag == "pre":
                self.depth += 1
                self.pre.append("")

        def handle_endtag(self, tag):
            self.skip -= tag in ("script", "style")
            self.depth -= tag == "pre"

        def handle_data(self, data):
            if not self.skip:
                self.text.append(data)
                if self.depth:
                    self.pre[-1] += data

    seen = Text()
    seen.feed(dom)
    text = "".join(seen.text)
    assert "graph break" not in text.lower() and "torch._dynamo" not in text and "TqdmWarning" not in text
    bars = [line for line in text.splitlines() if "packing" in line and "%" in line]
    assert len(bars) == 1 and "100%" in bars[0], bars  # one line, at its end state
    table = next(p for p in seen.pre if "TuneResult" in p)
    rows = [line for line in table.splitlines() if line[:4].strip().isdigit()]
    assert rows and len({line.index("×") for line in rows if "×" in line}) == 1, table  # the columns line up
    doctor = next(p for p in seen.pre if "VERDICT" in p)
    import torch
    device = "device gpu" if torch.cuda.is_available() else "device cpu"  # where Keras's torch backend trains
    # its advice: the train step's tune on a CPU; on a GPU the step is fast enough that the arrays' slicing
    # may be the larger part, and the advice the data's
    advice = ("tune(model, data)",) if device == "device cpu" else ("tune(model, data)", "trainfast doctor --")
    assert device in doctor and "batches drawn on ?" not in doctor and any(a in doctor for a in advice), doctor

import csv
import json
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn

import trainfast
from trainfast.cli import main
from trainfast.config import Speed, TrainConfig
from trainfast.errors import TrainfastError
from trainfast.train import fit
from trainfast.train.trainer import evaluate

FAST = Speed("bf16" if "AVX512-BF16" in trainfast.hardware.isa_features() else "fp32", True, batch_size=64)


def test_digits_reach_97_percent_with_a_complete_run_dir(digits_packs, tmp_path):
    train, test = digits_packs
    r = fit("cifar_resnet", train, test, config=TrainConfig(epochs=4, seed=0), speed=FAST,
            run_dir=tmp_path / "run", progress=False, log=lambda *a: None)
    assert r.best >= 0.97, r.history
    files = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"config.json", "metrics.csv", "curves.png", "speed.json", "last.pt", "best.pt"} <= files
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert len(rows) == 4 and float(rows[-1]["val_acc"]) >= 0.9
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["model"] == "cifar_resnet" and cfg["speed"]["batch_size"] == 64 and cfg["train"]["epochs"] == 4
    assert "machine" in json.loads((tmp_path / "run" / "speed.json").read_text())


def _weights(path):
    return torch.load(path, weights_only=True)["model"]


def test_kill_and_resume_matches_uninterrupted(digits_packs, small_net_file, tmp_path):
    train, _ = digits_packs
    spec = f"{small_net_file}:small"
    args = ["train", str(train.path), "--model", spec, "--epochs", "3", "--no-tune", "--precision", "fp32",
            "--batch-size", "32", "--save-every", "7", "--val-fraction", "0.1", "-q"]
    assert main(args + ["--run-dir", str(tmp_path / "whole")]) == 0
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "trainfast", *args, "--run-dir", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "metrics.csv").exists() or \
            len((run / "metrics.csv").read_text().splitlines()) < 2:
        time.sleep(0.01)
        if time.time() > deadline:
            break
    time.sleep(0.3)  # a little into the second epoch, past a mid-epoch checkpoint
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (run / "last.pt").exists()
    assert main(["train", "--resume", str(run), "-q"]) == 0
    a, b = _weights(tmp_path / "whole" / "last.pt"), _weights(run / "last.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows_a = (tmp_path / "whole" / "metrics.csv").read_text()
    rows_b = (run / "metrics.csv").read_text()
    assert [l.split(",")[:6] for l in rows_a.splitlines()] == [l.split(",")[:6] for l in rows_b.splitlines()]


class Explodes(nn.Module):
    """Fine for `ok_steps` training steps, then NaN."""

    input_shape, output_shape = (3, 32, 32), (10,)

    def __init__(self, ok_steps=25):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
        self.calls, self.ok = 0, ok_steps

    def forward(self, x):
        if self.training:
            self.calls += 1
        y = self.net(x)
        return y * float("nan") if self.calls > self.ok else y


def test_nan_guard_names_the_step_and_keeps_last_good(digits_packs, tmp_path):
    train, test = digits_packs
    run = tmp_path / "run"
    with pytest.raises(TrainfastError, match=r"loss became nan at epoch 2, step 4 \(global step 26\).*last.pt"):
        fit(Explodes(25), train, test, config=TrainConfig(epochs=3), speed=Speed(batch_size=64),
            run_dir=run, progress=False, log=lambda *a: None)
    ck = torch.load(run / "last.pt", weights_only=True)
    assert ck["state"]["epoch"] == 1 and all(torch.isfinite(v).all() for v in ck["model"].values())


def test_bad_inputs(digits_packs, tmp_path, small_net_file):
    train, test = digits_packs
    quiet = dict(progress=False, log=lambda *a: None)
    with pytest.raises(TrainfastError, match="holds 3×32×32 images; the model takes 3×64×128"):
        fit("plate_cnn", train, config=TrainConfig(epochs=1), speed=Speed(), run_dir=tmp_path / "a", **quiet)
    with pytest.raises(TrainfastError, match="fp16 training needs a CUDA device"):
        fit("cifar_cnn", train, speed=Speed("fp16"), device="cpu", run_dir=tmp_path / "b", **quiet)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TrainfastError, match="cannot write the run directory"):
        fit("cifar_cnn", train, speed=Speed(), run_dir=blocker / "run", **quiet)
    with pytest.raises(TrainfastError, match="not a run directory to resume"):
        fit("cifar_cnn", train, run_dir=tmp_path / "nothing", resume=True, **quiet)
    run = tmp_path / "r"
    fit(f"{small_net_file}:small", train, config=TrainConfig(epochs=1), speed=Speed(batch_size=64), run_dir=run, **quiet)
    (run / "last.pt").write_bytes(b"garbage")
    with pytest.raises(TrainfastError, match="not a readable checkpoint"):
        fit(f"{small_net_file}:small", train, run_dir=run, resume=True, **quiet)


def test_checkpoint_of_another_model_is_refused(digits_packs, tmp_path, small_net_file):
    from trainfast.train import checkpoint

    train, _ = digits_packs
    run = tmp_path / "r"
    fit(f"{small_net_file}:small", train, config=TrainConfig(epochs=1), speed=Speed(batch_size=64), run_dir=run,
        progress=False, log=lambda *a: None)
    with pytest.raises(TrainfastError, match="does not fit 'cifar_cnn'"):
        checkpoint.load(run / "last.pt", "cifar_cnn", trainfast.models.create("cifar_cnn"))


def test_sequence_metrics(tmp_path):
    import numpy as np
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (64, 64, 128, 3), dtype=np.uint8)
    labels = rng.integers(0, 36, (64, 8))
    src = trainfast.data.sources.from_arrays(images, labels, alphabet="0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    pk = trainfast.pack(src, tmp_path / "p", size=(64, 128), progress=False)
    net = trainfast.models.create("plate_net")
    m = evaluate(net, trainfast.Loader(pk, 16, shuffle=False), Speed(), torch.device("cpu"),
                 trainfast.train.distributed.World())
    assert 0 <= m["seq_acc"] <= m["acc"] <= 1 and m["loss"] > 0


def test_cosine_schedule_warms_up_linearly_then_decays_to_zero():
    from trainfast.train.trainer import lr_factor

    cfg = TrainConfig(schedule="cosine", warmup=0.2)
    f = [lr_factor(cfg, s, 100) for s in range(100)]
    assert f[0] == pytest.approx(1 / 20) and f[19] == pytest.approx(1.0) and f[20] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(f[:20], f[1:20])) and all(a >= b for a, b in zip(f[20:], f[21:]))
    assert f[60] == pytest.approx(0.5, abs=0.02) and f[99] < 0.001
    assert {lr_factor(TrainConfig(schedule="constant"), s, 100) for s in range(100)} == {1.0}

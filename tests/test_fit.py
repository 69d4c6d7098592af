import copy
import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import SMALL_NET as SMALL_NET_SOURCE
from conftest import Signals, other_load, step_clock

import trainfast
from trainfast.cli import main
from trainfast.config import Speed, TrainConfig
from trainfast.data.loader import Loader
from trainfast.errors import TrainfastError
from trainfast.train import fit
from trainfast.train.evaluate import evaluate


def fast(device: str) -> Speed:
    """bf16 + channels_last where the device runs bf16 fast, else fp32 + channels_last."""
    bf16 = trainfast.step.supports_bf16(torch.device(device))
    return Speed("bf16" if bf16 else "fp32", True, batch_size=64)


def test_digits_reach_97_percent_with_a_complete_run_dir(digits_packs, tmp_path, device):
    """Two epochs of the residual net (0.98 after its first on this data) and every file of a run."""
    train, test = digits_packs
    r = fit("cifar_resnet", train, test, config=TrainConfig(epochs=2, seed=0), speed=fast(device), device=device,
            run_dir=tmp_path / "run", progress=False, log=lambda *a: None)
    assert r.best >= 0.97, r.history
    files = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"config.json", "metrics.csv", "curves.png", "speed.json", "last.pt", "best.pt"} <= files
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert len(rows) == 2 and float(rows[-1]["val_acc"]) >= 0.9
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["model"] == "cifar_resnet" and cfg["speed"]["batch_size"] == 64 and cfg["train"]["epochs"] == 2
    saved = json.loads((tmp_path / "run" / "speed.json").read_text())
    assert "machine" in saved
    assert cfg["device"].startswith(device)
    # issue 48: where the call's time went, phase by phase, adding up to the whole call
    costs = r.costs
    assert saved["costs"] == pytest.approx(costs, abs=1e-3)
    assert costs["training"] > 0 and costs["validation"] > 0 and costs["checkpoints"] > 0
    assert sum(v for k, v in costs.items() if k != "total") == pytest.approx(costs["total"], rel=1e-6)


def _checkpoint_step(path):
    return torch.load(path, map_location="cpu", weights_only=True)["state"]["step"]


def _weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def test_curves_are_drawn_at_most_every_few_seconds_and_always_at_the_end(digits_packs, small_net_file, tmp_path,
                                                                          monkeypatch):
    """A draw costs 0.1-0.4 s, 5-20% of a 2 s epoch: short epochs draw once, at the end; with
    no interval every epoch draws."""
    from trainfast.train import run as trainer
    drawn = []
    monkeypatch.setattr(trainer, "plot_curves", lambda rows, path, seq: drawn.append(len(rows)))
    train, test = digits_packs
    kw = dict(config=TrainConfig(epochs=3, lr=1e-3, optimizer="adamw"), speed=Speed(batch_size=64), device="cpu",
              progress=False, log=lambda *a: None)
    fit(str(small_net_file) + ":small", train, test, run_dir=tmp_path / "a", **kw)
    assert drawn == [3]
    drawn.clear()
    monkeypatch.setattr(trainer, "PLOT_EVERY_S", 0.0)
    fit(str(small_net_file) + ":small", train, test, run_dir=tmp_path / "b", **kw)
    assert drawn == [1, 2, 3]


def test_drawing_leaves_a_notebooks_plotting_backend_as_it_was(tmp_path):
    """curves.png and the doctor's charts draw on their own Figure: a notebook user's backend (the
    inline one) is not switched to Agg under them, which would leave plt.show() blank afterwards."""
    import matplotlib

    from trainfast.diagnose.report import layers_chart, stages_chart
    from trainfast.train.metrics import plot_curves
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # stands in for the notebook's backend
    try:
        plot_curves([{"epoch": 0, "train_loss": 1.0, "train_acc": 0.5, "val_loss": 1.1, "val_acc": 0.4}],
                    tmp_path / "curves.png", False)
        assert stages_chart([("data", 1.0), ("compute", 2.0)]).startswith("<svg")
        assert layers_chart([("conv", "Conv2d", 1e6, 100)]).startswith("<svg")
        assert matplotlib.get_backend() == "svg" and (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    finally:
        matplotlib.use(before)


def test_kill_and_resume_matches_uninterrupted(digits_packs, small_net_file, tmp_path, device):
    train, _ = digits_packs
    spec = f"{small_net_file}:small"
    args = ["train", str(train.path), "--model", spec, "--epochs", "3", "--no-tune", "--precision", "fp32",
            "--batch-size", "32", "--save-every", "7", "--val-fraction", "0.1", "-q", "--device", device,
            "--deterministic"]  # deterministic cuDNN/cuBLAS kernels: two CUDA runs agree bit for bit
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
    time.sleep(0.02)  # about the end of the first epoch: a mid-epoch checkpoint is written, the run is not done
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _checkpoint_step(run / "last.pt") < 3 * 40  # 40 steps an epoch: the kill landed before the end
    assert main(["train", "--resume", str(run), "--model", spec, "-q", "--device", device]) == 0
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
        if self.training and torch.is_grad_enabled():  # training steps, not fit's no-gradient probes
            self.calls += 1
        y = self.net(x)
        return y * float("nan") if self.calls > self.ok else y


def test_nan_guard_names_the_step_and_keeps_last_good(digits_packs, tmp_path, device, monkeypatch):
    """On CUDA the guard reads the device every 25 steps: step 26 is still named, and the
    checkpoint kept is still the last good one."""
    monkeypatch.setattr(trainfast.train.run, "SAVE_EVERY_S", 0.0)  # every epoch's end saves
    train, test = digits_packs
    run = tmp_path / "run"
    with pytest.raises(TrainfastError, match=r"loss became nan at epoch 2, step 4 \(global step 26\).*last.pt"):
        fit(Explodes(25), train, test, config=TrainConfig(epochs=3), speed=Speed(batch_size=64), device=device,
            run_dir=run, progress=False, log=lambda *a: None)
    ck = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    assert ck["state"]["epoch"] == 1 and all(torch.isfinite(v).all() for v in ck["model"].values())


def test_bad_inputs(digits_packs, tmp_path, small_net_file):
    train, test = digits_packs
    quiet = dict(progress=False, log=lambda *a: None)
    with pytest.raises(TrainfastError, match="holds 3×32×32 images; the model takes 3×64×128"):
        fit("plate_cnn", train, config=TrainConfig(epochs=1), speed=Speed(), device="cpu", run_dir=tmp_path / "a",
            **quiet)
    with pytest.raises(TrainfastError, match="fp16 training needs a CUDA device"):
        fit("cifar_cnn", train, speed=Speed("fp16"), device="cpu", run_dir=tmp_path / "b", **quiet)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TrainfastError, match="cannot write the run directory"):
        fit("cifar_cnn", train, speed=Speed(), device="cpu", run_dir=blocker / "run", **quiet)
    with pytest.raises(TrainfastError, match="not a run directory to resume"):
        fit("cifar_cnn", train, device="cpu", run_dir=tmp_path / "nothing", resume=True, **quiet)
    with pytest.raises(TrainfastError, match="lr must be ≥ 0, not -1"):
        fit("cifar_cnn", train, lr=-1, device="cpu", run_dir=tmp_path / "c", **quiet)
    with pytest.raises(TrainfastError, match="label_smoothing must be in"):
        fit("cifar_cnn", train, config=TrainConfig(label_smoothing=float("nan")), device="cpu", run_dir=tmp_path / "d",
            **quiet)
    with pytest.raises(TrainfastError, match=r"1,?\d+ training images \(\d+ held out for validation\) are too few for "
                                             r"batch size 4096: give a batch size of at most"):
        fit("cifar_cnn", train, batch_size=4096, device="cpu", run_dir=tmp_path / "e", **quiet)  # before any tuning
    csv = tmp_path / "labels.csv"
    csv.write_text("path,label\n")
    with pytest.raises(TrainfastError, match="not a pack but a file; make a pack from it first"):
        fit("cifar_cnn", csv, device="cpu", run_dir=tmp_path / "f", **quiet)
    run = tmp_path / "r"
    fit(f"{small_net_file}:small", train, config=TrainConfig(epochs=1), speed=Speed(batch_size=64), device="cpu",
        run_dir=run, **quiet)
    (run / "last.pt").write_bytes(b"garbage")
    with pytest.raises(TrainfastError, match="not a readable checkpoint"):
        fit(f"{small_net_file}:small", train, device="cpu", run_dir=run, resume=True, **quiet)


def test_checkpoint_of_another_model_is_refused(digits_packs, tmp_path, small_net_file):
    from trainfast.train import checkpoint

    train, _ = digits_packs
    run = tmp_path / "r"
    fit(f"{small_net_file}:small", train, config=TrainConfig(epochs=1), speed=Speed(batch_size=64), device="cpu",
        run_dir=run, progress=False, log=lambda *a: None)
    with pytest.raises(TrainfastError, match="does not fit 'cifar_cnn'"):
        checkpoint.load(run / "last.pt", "cifar_cnn", trainfast.models.create("cifar_cnn"))


def test_sequence_metrics(tmp_path, device):
    import numpy as np
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (64, 64, 128, 3), dtype=np.uint8)
    labels = rng.integers(0, 36, (64, 8))
    src = trainfast.data.held.from_arrays(images, labels, alphabet="0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    pk = trainfast.pack(src, tmp_path / "p", size=(64, 128), progress=False)
    net = trainfast.models.create("plate_net").to(device)
    m = evaluate(net, trainfast.Loader(pk, 16, shuffle=False, device=device), Speed(), torch.device(device),
                 trainfast.train.distributed.World(device=torch.device(device)))
    assert 0 <= m["seq_acc"] <= m["acc"] <= 1 and m["loss"] > 0


def test_cosine_schedule_warms_up_linearly_then_decays_to_zero():
    from trainfast.train.optim import lr_factor

    cfg = TrainConfig(schedule="cosine", warmup=0.2)
    f = [lr_factor(cfg, s, 100) for s in range(100)]
    assert f[0] == pytest.approx(1 / 20) and f[19] == pytest.approx(1.0) and f[20] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(f[:20], f[1:20])) and all(a >= b for a, b in zip(f[20:], f[21:]))
    assert f[60] == pytest.approx(0.5, abs=0.02) and f[99] < 0.001
    assert {lr_factor(TrainConfig(schedule="constant"), s, 100) for s in range(100)} == {1.0}


def test_nan_guard_read_late_still_names_the_step_and_keeps_last_good(digits_packs, tmp_path, monkeypatch):
    """The guard as it runs on CUDA (the device read every few steps), here on the CPU."""
    monkeypatch.setitem(trainfast.train.run.READ_EVERY, "cpu", 7)
    monkeypatch.setattr(trainfast.train.run, "SAVE_EVERY_S", 0.0)  # epoch 1's end saves (step 22)
    train, test = digits_packs
    with pytest.raises(TrainfastError, match=r"loss became nan at epoch 2, step 4 \(global step 26\).*last.pt"):
        fit(Explodes(25), train, test, config=TrainConfig(epochs=3, save_every=20), speed=Speed(batch_size=64),
            device="cpu", run_dir=tmp_path / "run", progress=False, log=lambda *a: None)
    ck = torch.load(tmp_path / "run" / "last.pt", map_location="cpu", weights_only=True)
    assert ck["state"]["step"] == 22 and all(torch.isfinite(v).all() for v in ck["model"].values())


def test_nan_before_any_checkpoint_names_none(digits_packs, tmp_path):
    train, test = digits_packs
    with pytest.raises(TrainfastError, match="global step 3\\).*No checkpoint was written before it"):
        fit(Explodes(2), train, test, config=TrainConfig(epochs=1), speed=Speed(batch_size=64), device="cpu",
            run_dir=tmp_path / "run", progress=False, log=lambda *a: None)


@pytest.mark.parametrize("sig,when,at", [(signal.SIGINT, "train", 5), (signal.SIGTERM, "train", 30),
                                         (signal.SIGINT, "eval", 2)])
def test_interrupt_at_any_moment_resumes_to_the_same_weights(digits_packs, tmp_path, sig, when, at):
    """Mid-step (the signal lands inside the forward pass) or during validation: the checkpoint's
    weights, step and loader position agree, and the resumed run ends where an uninterrupted one does."""
    train, test = digits_packs
    # threads pinned: fit otherwise follows other programs' load with its thread count, which changes CPU sums
    kw = dict(config=TrainConfig(epochs=2, optimizer="adamw"), device="cpu", progress=False, log=lambda *a: None,
              speed=Speed(batch_size=64, threads=torch.get_num_threads()))
    fit(Signals(), train, test, run_dir=tmp_path / "whole", **kw)
    with pytest.raises(KeyboardInterrupt):
        fit(Signals(at, sig, when), train, test, run_dir=tmp_path / "cut", **kw)
    ck = torch.load(tmp_path / "cut" / "last.pt", map_location="cpu", weights_only=True)
    steps = 22  # 1,438 images in batches of 64
    assert ck["loader"]["position"] == ck["state"]["position"] == ((at - 1) % steps + 1 if when == "train" else steps)
    assert ck["state"]["step"] == (at if when == "train" else steps)
    notes = []
    fit(Signals(), train, test, run_dir=tmp_path / "cut", resume=True, **{**kw, "log": notes.append})
    a, b = _weights(tmp_path / "whole" / "last.pt"), _weights(tmp_path / "cut" / "last.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any("random streams" in n for n in notes)  # same device: nothing to warn about


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs to change the thread count between runs")
def test_a_deterministic_resume_trains_with_the_checkpoint_threads_after_a_load_change(digits_packs, tmp_path):
    """Issue 50.6: other programs' load changed torch's threads between the cut and the resume
    (here: set to 1 by hand); a --deterministic run goes on with the count it was trained with."""
    train, test = digits_packs
    kw = dict(config=TrainConfig(epochs=2, optimizer="adamw", deterministic=True), device="cpu", progress=False,
              log=lambda *a: None, speed=Speed(batch_size=64))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fit(Signals(), train, test, run_dir=tmp_path / "whole", **kw)
        with pytest.raises(KeyboardInterrupt):
            fit(Signals(30, signal.SIGINT, "train"), train, test, run_dir=tmp_path / "cut", **kw)
        torch.set_num_threads(1)
        notes = []
        fit(Signals(), train, test, run_dir=tmp_path / "cut", resume=True, **{**kw, "log": notes.append})
        assert torch.get_num_threads() == 1  # fit puts the caller's count back
    finally:
        torch.set_num_threads(before)
    assert any("threads 1 → 2: as the checkpoint was trained" in n for n in notes), notes
    rows = (tmp_path / "cut" / "metrics.csv").read_text().splitlines()
    threads = rows[0].split(",").index("threads")
    assert [float(r.split(",")[threads]) for r in rows[1:]] == [2, 2]
    a, b = _weights(tmp_path / "whole" / "last.pt"), _weights(tmp_path / "cut" / "last.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_on_another_device_kind_works_and_says_the_stream_differs(digits_packs, tmp_path):
    """A run saved on a GPU in fp16 (checkpoint and config as CUDA writes them), resumed on this CPU."""
    train, test = digits_packs
    run = tmp_path / "run"
    kw = dict(speed=Speed(batch_size=64), device="cpu", progress=False)
    with pytest.raises(KeyboardInterrupt):
        fit(Signals(5), train, test, config=TrainConfig(epochs=2, lr_test=False), run_dir=run, log=lambda *a: None, **kw)
    ck = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    ck["rng"] = {"cpu": ck["rng"]["cpu"], "device": "cuda", "cuda": torch.zeros(16, dtype=torch.uint8)}
    ck["scaler"] = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                    "_growth_tracker": 3}
    trainfast.train.checkpoint.save(run / "last.pt", ck)
    cfg = json.loads((run / "config.json").read_text())
    cfg["speed"]["precision"] = "fp16"
    (run / "config.json").write_text(json.dumps(cfg))
    notes = []
    r = fit(Signals(), train, test, run_dir=run, resume=True, log=notes.append, **kw)
    assert len(r.history) == 2 and r.speed.precision in ("bf16", "fp32")
    assert any(n.startswith("fp16 cannot run on cpu: resuming in") for n in notes)
    assert any("saved on cuda and resumes on cpu" in n for n in notes)


def _run_small(digits_packs, small_net_file, run, cwd_relative_pack=None):
    train, _ = digits_packs
    pack = cwd_relative_pack or str(train.path)
    assert main(["train", pack, "--model", f"{small_net_file}:small", "--epochs", "1", "--no-tune", "--batch-size",
                 "64", "--device", "cpu", "--run-dir", str(run), "-q"]) == 0


def test_resume_runs_no_code_that_the_run_directory_names(digits_packs, tmp_path, capsys):
    """A run directory someone hands you is data: its config.json must not make trainfast import a .py."""
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'w').write('x')\n" + SMALL_NET_SOURCE)
    run = tmp_path / "run"
    _run_small(digits_packs, evil.with_suffix(".py"), run)  # the user's own run, on purpose
    marker.unlink()
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--device", "cpu", "-q"]) == 1
    err = capsys.readouterr().err
    assert "runs no code that a run directory names" in err and f"--model {evil}:small" in err
    assert not marker.exists()
    assert main(["train", "--resume", str(run), "--model", f"{evil}:small", "--device", "cpu", "-q"]) == 0
    assert marker.exists()  # named on the command line: run on purpose


def test_resume_refuses_options_it_would_ignore(digits_packs, small_net_file, tmp_path, capsys):
    run = tmp_path / "run"
    _run_small(digits_packs, small_net_file, run)
    capsys.readouterr()
    train, _ = digits_packs
    assert main(["train", str(train.path), "--resume", str(run), "--epochs", "5", "--lr", "0.1",
                 "--model", f"{small_net_file}:small", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "PACK, --epochs, --lr would change it" in err and err.count("\n") == 1
    saved = json.loads((run / "config.json").read_text())["train"]["epochs"]
    assert saved != 10
    # --epochs 10 is the default's value, and was ignored silently; the run's own count passes
    assert main(["train", "--resume", str(run), "--epochs", "10", "--model", f"{small_net_file}:small"]) == 1
    assert f"as its config.json says ({saved} epochs); --epochs would change it" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "--epochs", str(saved), "--model", f"{small_net_file}:small",
                 "--device", "cpu", "-q"]) == 0


@pytest.mark.parametrize("text,says", [("{not json", "unreadable"), ('{"model": "cifar_cnn"}', "no 'train'"),
                                       ('{"model": 3, "train": {}}', "'model' is int"), ("[]", "not a JSON object")])
def test_a_damaged_config_json_is_one_line(digits_packs, small_net_file, tmp_path, capsys, text, says):
    run = tmp_path / "run"
    _run_small(digits_packs, small_net_file, run)
    capsys.readouterr()
    (run / "config.json").write_text(text)
    assert main(["train", "--resume", str(run), "--model", f"{small_net_file}:small", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json" in err and says in err and "Traceback" not in err


def test_resume_finds_its_pack_from_anywhere_and_refuses_another(digits_packs, small_net_file, tmp_path, monkeypatch,
                                                                 capsys):
    train, test = digits_packs
    monkeypatch.chdir(train.path.parent)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):  # a relative PACK, a run cut short
        fit(Signals(5), train.path.name, config=TrainConfig(epochs=1, lr_test=False), speed=Speed(batch_size=64), device="cpu",
            run_dir=run, progress=False, log=lambda *a: None)
    monkeypatch.chdir(tmp_path)  # elsewhere, where "train" is another pack
    trainfast.pack((np.full((80, 32, 32, 3), 7, np.uint8), np.arange(80) % 10), tmp_path / train.path.name,
                   size=(32, 32), progress=False)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["train_pack"]["path"] == str(train.path.resolve())
    r = fit(Signals(), cfg["train_pack"]["path"], device="cpu", run_dir=run, resume=True, progress=False,
            log=lambda *a: None)
    assert len(r.history) == 1
    with pytest.raises(TrainfastError, match="not the training pack this run trained on"):
        fit(Signals(), train.path.name, device="cpu", run_dir=run, resume=True, progress=False, log=lambda *a: None)


def test_the_api_as_users_spell_it(tmp_path):
    """pack((images, labels), out, alphabet=...) for sequences; fit with Keras-like keywords."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (96, 64, 128, 3), dtype=np.uint8)
    pk = trainfast.pack((images, rng.integers(0, 36, (96, 8))), tmp_path / "plates", size=(64, 128),
                        alphabet="0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", progress=False)
    assert pk.sequence_length == 8 and len(pk.alphabet) == 36
    r = trainfast.fit("plate_net", pk, epochs=1, batch_size=32, lr=1e-3, optimizer="adamw", tune=False,
                      device="cpu", run_dir=tmp_path / "run", progress=False, log=lambda *a: None)
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert len(r.history) == 1 and r.speed.batch_size == 32
    assert (cfg["train"]["epochs"], cfg["train"]["lr"], cfg["train"]["optimizer"]) == (1, 1e-3, "adamw")


def test_loss_watch_names_a_stuck_and_a_diverging_run():
    from trainfast.train.watch import loss_watch
    chance = math.log(36)
    finding = "per_position predicts each of 8 positions from a single number: a width-1 bottleneck"
    stuck = loss_watch([3.68, 3.62, chance + 0.01], 10, 36, 0.05, [finding], steps=300)
    assert loss_watch([3.68, 3.62, chance + 0.01], 10, 36, 0.05, [], steps=30) is None  # 30 steps: too few to judge
    assert "has not left chance after 3 of 10 epochs" in stuck and "ln 36 = 3.584" in stuck
    assert "--lr 0.5" in stuck and "--lr 0.005" in stuck and "width-1 bottleneck" in stuck
    # every output measured frozen: the model is the cause, and no learning rate is offered
    frozen = loss_watch([3.68, 3.62, chance + 0.01], 10, 36, 0.05, [finding], steps=300, frozen=True)
    assert "no learning rate can revive it" in frozen and "--lr 0." not in frozen
    # ... which is judged after any epoch at chance: dead units stay dead (one still learning is not stuck)
    assert "after 1 of 10 epochs" in loss_watch([chance + 0.01], 10, 36, 0.05, [], steps=20, frozen=True)
    assert loss_watch([chance + 0.01], 10, 36, 0.05, [], steps=20) is None
    assert loss_watch([chance + 0.01], 10, 36, 0.05, [], steps=20, frozen=True, acc=0.2) is None
    assert loss_watch([3.68, 3.62], 10, 36, 0.05, []) is None  # too early to judge (a warm-up)
    # the CIFAR CNN on digits with the defaults: at chance for two epochs, then it learns
    assert all(loss_watch(ls, 15, 10, 0.025, []) is None for ls in
               ([2.303], [2.303, 2.302], [2.303, 2.302, 2.2], [2.303, 2.302, 2.2, 1.166, 0.496]))
    diverging = loss_watch([2.2, 2.9, 3.6], 20, 10, 0.4, [])
    assert "diverging" in diverging and "too high: try --lr 0.04" in diverging
    assert loss_watch([0.9, 0.5, 0.2], 3, 10, 0.1, []) is None
    # far above chance but falling fast (hand-set lines that start the loss at 48): not stuck, until it stops falling
    assert loss_watch([48.5, 34.8], 3, 36, 0.003, [], steps=300) is None
    assert "not left chance" in loss_watch([48.5, 34.8, 33.9], 3, 36, 0.003, [], steps=300)
    # above chance in loss, but reading 5× chance (a hand-set ordinal head at epoch 8): learning, not stuck
    assert loss_watch([52.3, 5.46, 4.94], 10, 36, 0.003, [], steps=2500, acc=0.14) is None
    assert "not left chance" in loss_watch([52.3, 5.46, 4.94], 10, 36, 0.003, [], steps=2500, acc=0.03)


def test_a_run_that_does_not_learn_is_told_why_and_trains_on(digits_packs, tmp_path, device):
    """lr 1e-9: the loss cannot move, but nothing measured says it never will (a model can leave
    chance late): after 3 of 4 epochs (2 would be 44 steps, under the 50 the watch waits for) fit
    says why, once, and trains to the end; a diverging loss is stopped (below)."""
    import torch.nn as nn

    def linear():  # the watch reads the loss, not the model: the cheapest one that reads digits
        torch.manual_seed(0)
        net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
        net.input_shape, net.output_shape = (3, 32, 32), (10,)
        return net

    train, test = digits_packs
    cfg = TrainConfig(epochs=4, lr=1e-9, optimizer="adamw", schedule="constant")
    said = []
    r = fit(linear(), train, test, config=cfg, speed=Speed(batch_size=64), device=device, run_dir=tmp_path / "r",
            progress=False, log=said.append)
    warnings = [m for m in said if m.startswith("warning:")]
    assert len(r.history) == 4 and len(warnings) == 1, said
    assert re.search(r"has not left chance after 3 of 4 epochs.*too low \(try --lr 1e-08\).*so it trains on",
                     warnings[0])
    said.clear()
    fit(linear(), train, test, config=replace(cfg, loss_watch=False), speed=Speed(batch_size=64), device=device,
        run_dir=tmp_path / "r2", progress=False, log=said.append)
    assert not any(m.startswith("warning:") for m in said)


def test_a_network_whose_units_are_dead_is_stopped_without_learning_rate_advice(digits_packs, tmp_path, device):
    """Every hidden unit's input negative for every image: the output cannot depend on the image,
    so fit stops after the first epoch (not the third, when "stuck" is judged), naming the dead
    layer, and offers no other learning rate."""
    import torch.nn as nn
    train, test = digits_packs
    net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 16), nn.ReLU(), nn.Linear(16, 10))
    nn.init.constant_(net[1].bias, -1e4)
    net.input_shape, net.output_shape = (3, 32, 32), (10,)
    cfg = TrainConfig(epochs=4, lr=1e-3, optimizer="adamw", schedule="constant")
    with pytest.raises(TrainfastError) as e:
        fit(net, train, test, config=cfg, speed=Speed(batch_size=64), device=device, run_dir=tmp_path / "r",
            progress=False, log=lambda *a: None)
    why = str(e.value)
    assert "has not left chance after 1 of 4 epochs" in why and "no learning rate can revive it" in why
    assert "stopped seeing its input at 2 (ReLU)" in why and "--lr 0.0" not in why


def test_sequence_errors_count_positions_pairs_and_groups():
    from trainfast.train.metrics import sequence_errors
    true = np.array([[0, 1, 2], [0, 1, 2], [2, 2, 2], [1, 0, 1]])
    pred = np.array([[0, 1, 2], [1, 1, 2], [2, 2, 1], [1, 1, 1]])  # errors: 0→1 twice, 2→1 once
    e = sequence_errors(pred, true, "O0I", groups=["a", "a", "b", "b"])
    assert (e["sequences"], e["characters"], e["errors"]) == (4, 12, 3)
    assert e["character_accuracy"] == 9 / 12 and e["sequence_accuracy"] == 1 / 4
    assert e["per_position"] == [0.75, 0.75, 0.75]
    assert e["confusions"][0] == {"true": "O", "predicted": "0", "count": 2, "share_of_errors": 2 / 3}
    assert e["confusions"][1]["true"] == "I" and e["confusions"][1]["count"] == 1
    assert e["per_character"] == [{"character": "O", "count": 3, "error_rate": 2 / 3},
                                  {"character": "I", "count": 5, "error_rate": 1 / 5},
                                  {"character": "0", "count": 4, "error_rate": 0.0}]
    assert e["groups"] == {"a": {"sequences": 2, "character_accuracy": 5 / 6, "sequence_accuracy": 0.5},
                           "b": {"sequences": 2, "character_accuracy": 4 / 6, "sequence_accuracy": 0.0}}


def test_the_one_cycle_rate_stays_positive_to_the_end():
    """The scheduler also steps after the last update; that step must not take the rate below zero
    (it did: -1.1e-05 logged for a run's last epoch at a peak of 1e-3)."""
    from trainfast.config import TrainConfig
    from trainfast.train.optim import scheduler_for as _scheduler
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = _scheduler(opt, TrainConfig(), 100, 1e-3)
    rates = []
    for _ in range(100):
        opt.step()
        sched.step()
        rates.append(opt.param_groups[0]["lr"])
    assert min(rates) > 0 and rates[-1] == pytest.approx(1e-6) and max(rates) == pytest.approx(1e-3, rel=0.01)


def test_default_run_dir_is_one_plain_folder_per_model():
    """A model given as a file ('nets/plate.py:build') names its run folder without the slash
    that would nest folders or the colon some file systems refuse."""
    from trainfast.train.rundir import dir_name as _dir_name
    assert _dir_name("plate_net") == "plate_net"
    assert _dir_name("nets/my models/plate.py:build") == "plate.build"
    assert _dir_name("weird name!") == "weird-name"


def test_fit_names_what_it_takes_and_takes_what_users_hold(digits_packs, tmp_path):
    """fit checks its data and the model against it before any tuning, in one line each; a Loader
    and (x, y) arrays are taken as a notebook user hands them over."""
    import torch.nn as nn
    train, _ = digits_packs
    said = []
    quiet = dict(epochs=1, tune=False, device="cpu", progress=False, log=said.append)

    def net(c=3, out=10):
        return nn.Sequential(nn.Conv2d(c, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                             nn.LazyLinear(out))

    with pytest.raises(TrainfastError, match=r"does not take .*3×32×32.*to have 1 channels"):
        fit(net(c=1), train, run_dir=tmp_path / "a", **quiet)
    with pytest.raises(TrainfastError, match=r"has 10 classes; the model predicts 5 per image"):
        fit(net(out=5), train, run_dir=tmp_path / "b", **quiet)
    with pytest.raises(TrainfastError, match="must be a trainfast Pack or a pack's path, not a dict"):
        fit(net(), {"x": 1}, run_dir=tmp_path / "c", **quiet)
    with pytest.raises(TrainfastError, match=r"returns a tuple \(item 0, item 1\) with no obvious logits"):
        fit(TupleNet(), train, run_dir=tmp_path / "d", **quiet)
    r = fit(net(), Loader(train, 32, device="cpu"), run_dir=tmp_path / "e", **quiet)  # lazy: materialised first
    assert r.speed.batch_size == 32 and any("the Loader's pack" in s for s in said)
    x = np.stack([train.image(i) for i in range(200)])
    r = fit(net(), (x, np.asarray(train.labels[:200])), run_dir=tmp_path / "f", **quiet)
    assert len(r.history) == 1 and any("packed the (200 images 32×32×3, labels) arrays" in s for s in said)


class TupleNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3 * 32 * 32, 10)

    def forward(self, x):
        out = self.fc(x.flatten(1))
        return out, x.flatten(1)  # logits and features: which is which is not for trainfast to guess


def test_cpu_threads_are_chosen_by_timing_the_runs_own_steps(digits_packs, tmp_path, monkeypatch):
    """Issue 51.2: a neighbour at equal priority makes two threads slower than one (epoch 1's
    trial keeps one); it leaves, and the next trial (epoch 2) takes the second thread back. Each
    change said with what was timed; metrics.csv has each epoch's threads; torch's threads as
    they were after; the load sample alone (1.5 cores busy, from a neighbour that yields) moves
    nothing."""
    from trainfast.train import adapt

    train, _ = digits_packs
    other_load(monkeypatch, 1.5)
    monkeypatch.setattr(adapt.Threads, "RECHECK", 1)  # a trial every 16 steps: one per 20-step epoch
    calls = [0]

    def seconds(threads):  # the neighbour is there for the first trial's readings, then gone
        calls[0] += 1
        return {2: 0.25, 1: 0.05}[threads] if calls[0] <= 9 else {2: 0.05, 1: 0.09}[threads]  # 1 + 2 laps of 4
    step_clock(monkeypatch, seconds)
    torch.set_num_threads(2)
    said = []
    r = fit(_linear(), train, config=TrainConfig(epochs=2), speed=Speed(batch_size=64), device="cpu",
            run_dir=tmp_path / "run", progress=False, log=said.append)  # the clock is fake: any model serves
    assert [row["threads"] for row in r.history] == [1, 2] and torch.get_num_threads() == 2
    assert "threads 2 → 1: timed on the run's own steps (50.0 ms a step with 1, 250 ms with 2)" in said, said
    assert "threads 1 → 2: timed on the run's own steps (90.0 ms a step with 1, 50.0 ms with 2)" in said, said
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert [float(row["threads"]) for row in rows] == [1, 2] and [float(r["other_cores"]) for r in rows] == [1.5, 1.5]
    # issue 51.4: every decision by timing, in order, in speed.json, so that two runs can be compared
    decisions = json.loads((tmp_path / "run" / "speed.json").read_text())["decisions"]
    assert decisions == [
        {"what": "settings", "chose": r.speed.label(), "by": "given (or resumed), or the defaults with the pins"},
        {"what": "threads", "chose": 1, "was": 2, "step_ms": {"1": 50.0, "2": 250.0}, "epoch": 1},
        {"what": "threads", "chose": 2, "was": 1, "step_ms": {"1": 90.0, "2": 50.0}, "epoch": 2}], decisions


def _linear():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))


@pytest.mark.parametrize("ms,kept", [({2: 50, 1: 48}, 2), ({2: 50, 1: 45}, 1), ({2: 50, 1: 90}, 2)])
def test_fewer_threads_are_kept_only_where_clearly_faster(digits_packs, tmp_path, monkeypatch, ms, kept):
    train, _ = digits_packs
    step_clock(monkeypatch, {n: v / 1e3 for n, v in ms.items()})
    torch.set_num_threads(2)
    said = []
    r = fit(_linear(), train, epochs=1, speed=Speed(batch_size=64), device="cpu", run_dir=tmp_path / "run",
            progress=False, log=said.append)
    assert r.history[0]["threads"] == kept
    assert any(m.startswith("threads: 2, timed" if kept == 2 else "threads 2 → 1: timed") for m in said), said


def test_a_steady_pace_is_not_timed_again(digits_packs, tmp_path, monkeypatch):
    """All threads kept and the steps' pace steady: one trial for the run (a trial every 64 steps
    cost 7% of a quiet CIFAR CNN run); fewer kept: timed again, the neighbour may have left."""
    from trainfast.train import adapt

    train, _ = digits_packs
    monkeypatch.setattr(adapt.Threads, "RECHECK", 1)
    begun = []
    real = adapt.Threads._begin
    monkeypatch.setattr(adapt.Threads, "_begin", lambda self, t: begun.append(t) or real(self, t))
    torch.set_num_threads(2)
    for costs, trials in (({2: 0.05, 1: 0.09}, 1), ({2: 0.1, 1: 0.05}, 4)):
        begun.clear()
        step_clock(monkeypatch, costs)
        fit(_linear(), train, epochs=4, speed=Speed(batch_size=64), device="cpu", run_dir=tmp_path / f"r{trials}",
            progress=False, log=lambda *a: None)
        assert len(begun) == trials, (costs, len(begun))


@pytest.mark.parametrize("later,trials", [(1.3, 1), (2.0, 2)])
def test_a_drift_is_not_timed_again_a_neighbour_is(digits_packs, tmp_path, monkeypatch, later, trials):
    """Issue 51.4: a trial's laps at fewer threads sum in another order, so each trial moves the
    run's numbers. After the first, the steps slowing 1.3× (a shared machine's own drift) is not
    timed again, so two runs of the same call keep the same numbers; 2× slower (a neighbour at
    equal priority) is."""
    from trainfast.train import adapt

    train, _ = digits_packs
    monkeypatch.setattr(adapt.Threads, "RECHECK", 1)
    begun, kept = [], []
    real_begin, real_keep = adapt.Threads._begin, adapt.Threads._keep
    monkeypatch.setattr(adapt.Threads, "_begin", lambda self, t: begun.append(t) or real_begin(self, t))
    monkeypatch.setattr(adapt.Threads, "_keep", lambda self, med: kept.append(med) or real_keep(self, med))
    step_clock(monkeypatch, lambda n: {2: 0.05, 1: 0.09}[n] * (later if kept else 1.0))
    torch.set_num_threads(2)
    fit(_linear(), train, epochs=4, speed=Speed(batch_size=64), device="cpu", run_dir=tmp_path / "run",
        progress=False, log=lambda *a: None)
    assert len(begun) == trials


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs")
def test_a_low_priority_neighbour_does_not_take_a_thread(digits_packs, tmp_path):
    """Issue 51.2: a spinning process at nice 19 keeps a core busy and yields it at once; the
    run times its own steps and keeps both threads (reading the neighbour's CPU share gave one
    away). Two epochs: the first trial, and the load measured during epoch 1."""
    train, _ = digits_packs
    spinner = subprocess.Popen([sys.executable, "-c", "import os; os.nice(19)\nwhile 1: pass"])
    try:
        time.sleep(0.3)
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        r = fit("cifar_cnn", train, epochs=2, speed=Speed(batch_size=64), device="cpu", run_dir=tmp_path / "run",
                progress=False, log=lambda *a: None)
    finally:
        spinner.kill()
        spinner.wait()
        torch.set_num_threads(before)
    assert [row["threads"] for row in r.history] == [2, 2], r.history


def test_a_time_budget_shortens_the_run_and_a_resume_keeps_the_shorter_plan(digits_packs, tmp_path, monkeypatch):
    """Each epoch takes 10 s of a fake clock and the budget is 35 s: after epoch 1 only two more
    fit, so the run plans 3 of its 6 epochs, its learning rate annealed to the end; resumed after
    epoch 2, it trains epoch 3 and stops there."""
    from trainfast.train import run as trainer

    train, _ = digits_packs
    clock = {"t": 0.0}

    def now():
        return clock["t"]
    monkeypatch.setattr(trainer, "clock", now)
    real_end = trainer.Run.end_epoch

    def end_epoch(self, epoch, row):
        clock["t"] += 10.0
        done = real_end(self, epoch, row)
        if epoch == 1 and not resumed:
            raise KeyboardInterrupt  # stopped after epoch 2, as a Ctrl-C would
        return done
    monkeypatch.setattr(trainer.Run, "end_epoch", end_epoch)
    resumed, said = False, []
    cfg = TrainConfig(epochs=6, minutes=35 / 60, schedule="cosine")
    with pytest.raises(KeyboardInterrupt):
        fit("cifar_cnn", train, config=cfg, speed=Speed(batch_size=64), device="cpu", run_dir=tmp_path / "run",
            progress=False, log=said.append)
    assert any("epoch 1 took 10.0 s, so 2 more fit the 35 s: 3 epochs instead of 6" in m for m in said)
    resumed = True
    r = fit("cifar_cnn", train, device="cpu", run_dir=tmp_path / "run", resume=True, progress=False,
            log=said.append)
    assert len(r.history) == 3 and r.stopped == "finished"
    assert r.history[-1]["lr"] < 0.01 * r.history[0]["lr"]  # annealed by the end of the shorter plan


def test_a_spent_time_budget_stops_after_the_epoch(digits_packs, tmp_path):
    train, _ = digits_packs
    said = []
    r = fit("cifar_cnn", train, epochs=5, minutes=1e-5, speed=Speed(batch_size=64),
            device="cpu", run_dir=tmp_path / "run", progress=False, log=said.append)
    assert r.stopped == "out-of-time" and len(r.history) == 1
    assert any("time budget: " in m and " s spent; stopping after epoch 1" in m for m in said)


def test_an_epoch_far_slower_than_tune_timed_is_said_and_a_stale_cached_choice_dropped(monkeypatch):
    from trainfast.train import adapt as trainer
    from trainfast.tuning import TuneResult

    speed = Speed(batch_size=64)
    tried = [{"label": speed.label(), "images_per_s": 1000.0}]
    dropped, said = [], []
    monkeypatch.setattr("trainfast.tuning.forget", dropped.append)
    cached = TuneResult(speed, cached=True)
    row = {"epoch": 1, "images_per_s": 800.0, "seconds": 1.0, "other_cores": 0.0}
    trainer.check_tuned_rate(cached, tried, speed, row, said.append)
    assert not said and not dropped  # within RATE_OFF: nothing to say
    row = {"epoch": 1, "images_per_s": 300.0, "seconds": 1.0, "other_cores": 1.5}
    trainer.check_tuned_rate(cached, tried, speed, row, said.append)
    assert "0.30× the 1,000 tune timed" in said[-1] and "other processes kept 1.5 cores busy" in said[-1]
    assert not dropped  # the load explains it: the choice stays
    slow_data = {"epoch": 1, "images_per_s": 300.0, "seconds": 10.0, "other_cores": 0.0, "waited": 6.0}
    assert not trainer.check_tuned_rate(cached, tried, speed, slow_data, said.append)
    assert not dropped and "its steps waited 6.0 s of 10.0 s for batches (without the waits: 750 images/s)" in said[-1]
    slow_steps = {**slow_data, "waited": 1.0}  # the steps themselves were slow
    assert trainer.check_tuned_rate(cached, tried, speed, slow_steps, said.append)
    assert dropped == [cached] and "looks stale" in said[-1]


def _small_run(small_net_file, train, run, **kw):
    return fit(f"{small_net_file}:small", train, config=TrainConfig(epochs=kw.pop("epochs", 1)),
               speed=Speed(batch_size=64), device="cpu", run_dir=run, progress=False, log=kw.pop("log", lambda *a: None),
               **kw)


def test_resume_writes_nothing_through_links_in_the_run_dir(digits_packs, tmp_path, small_net_file):
    """A run directory holding links (metrics.csv -> ~/.bashrc, curves.png -> another file) is
    refused on resume, each named, with the files outside untouched; a link planted under a
    temporary file's name is never opened; the temporaries a killed save left are removed."""
    train, _ = digits_packs
    run = tmp_path / "run"
    _small_run(small_net_file, train, run, epochs=2)
    (run / "last.pt").rename(run / "keep.pt")  # resume from epoch 1 of 2: the run will write again
    bashrc, other = tmp_path / "bashrc", tmp_path / "other.png"
    bashrc.write_text("export PATH\n")
    other.write_bytes(b"mine")
    (run / "metrics.csv").unlink()
    (run / "metrics.csv").symlink_to(bashrc)
    (run / "curves.png").unlink()
    (run / "curves.png").symlink_to(other)
    with pytest.raises(TrainfastError, match=r"metrics.csv, curves.png are links; trainfast writes nothing through a "
                                             r"link in a run directory: remove them"):
        fit(f"{small_net_file}:small", train, device="cpu", run_dir=run, resume=True, progress=False,
            log=lambda *a: None)
    assert bashrc.read_text() == "export PATH\n" and other.read_bytes() == b"mine"

    (run / "metrics.csv").unlink()
    (run / "curves.png").unlink()
    (run / ".last.pt.123.tmp").symlink_to(bashrc)  # where an older trainfast wrote its temporary
    (run / ".best.pt.x1y2.tmp").write_bytes(b"\0" * 1000)  # what a killed save leaves
    (run / "keep.pt").rename(run / "last.pt")
    r = fit(f"{small_net_file}:small", train, device="cpu", run_dir=run, resume=True, progress=False,
            log=lambda *a: None)
    assert r.stopped == "finished" and (run / "metrics.csv").is_file() and not (run / "metrics.csv").is_symlink()
    assert bashrc.read_text() == "export PATH\n"
    assert not (run / ".best.pt.x1y2.tmp").exists() and (run / ".last.pt.123.tmp").is_symlink()


def test_one_run_at_a_time_in_a_run_dir(digits_packs, tmp_path, small_net_file):
    from trainfast import files
    train, _ = digits_packs
    run = tmp_path / "run"
    with files.only_one(run / ".trainfast-lock", "held"):  # another run holds it
        with pytest.raises(TrainfastError, match="another trainfast run is using this run directory now"):
            _small_run(small_net_file, train, run)
    assert not any(p.name != ".trainfast-lock" for p in run.iterdir())  # it wrote nothing
    _small_run(small_net_file, train, run)  # free again: the run goes
    assert (run / "last.pt").is_file() and not (run / ".trainfast-lock").exists()


def test_a_run_killed_before_its_first_checkpoint_starts_over_on_resume(digits_packs, tmp_path, small_net_file):
    train, _ = digits_packs
    run = tmp_path / "run"
    _small_run(small_net_file, train, run)
    for name in ("last.pt", "best.pt", "metrics.csv"):
        (run / name).unlink()  # what a SIGKILL during the first epoch leaves: config.json and speed.json
    said = []
    r = fit(f"{small_net_file}:small", train, device="cpu", run_dir=run, resume=True, progress=False, log=said.append)
    assert any("stopped before its first checkpoint; starting it over" in m for m in said)
    assert r.stopped == "finished" and (run / "last.pt").is_file()


def test_a_full_disk_while_saving_keeps_the_last_checkpoint_and_says_so(tmp_path, monkeypatch):
    import errno
    from collections import namedtuple

    from trainfast import files
    from trainfast.train import checkpoint
    shutil_usage = namedtuple("usage", "total used free")
    net = torch.nn.Linear(2, 2)
    state = {"model_name": "lin", "signature": checkpoint.signature(net), "model": net.state_dict()}
    checkpoint.save(tmp_path / "last.pt", state)
    before = (tmp_path / "last.pt").read_bytes()

    def full(obj, f):
        f.write(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(TrainfastError, match=r"last.pt: cannot write \(No space left on device\); nothing was "
                                             r"replaced"):
        checkpoint.save(tmp_path / "last.pt", state)
    assert (tmp_path / "last.pt").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary left behind

    def short(obj, f):  # what torch.save raises on a full disk: its zip writer finds a write fell short
        f.write(b"x" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 896 vs 790")
    monkeypatch.setattr(torch, "save", short)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda folder: shutil_usage(total=10**9, used=10**9, free=0))
    with pytest.raises(TrainfastError, match=r"last.pt: cannot write \(no space left on the device: 0.0 MB free "
                                             r"there\); nothing was replaced"):
        checkpoint.save(tmp_path / "last.pt", state)
    assert (tmp_path / "last.pt").read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["last.pt"]


@pytest.mark.parametrize("threads,says", [(100000, "threads must be at most this machine's"),
                                          (-1, "threads must be a whole number ≥ 0, not -1"),
                                          ("4", "threads must be a whole number ≥ 0, not '4'")])
def test_config_json_threads_out_of_range_is_one_line(digits_packs, small_net_file, tmp_path, capsys, threads, says):
    run = tmp_path / "run"
    _run_small(digits_packs, small_net_file, run)
    capsys.readouterr()
    cfg = json.loads((run / "config.json").read_text())
    cfg["speed"]["threads"] = threads
    (run / "config.json").write_text(json.dumps(cfg))
    assert main(["train", "--resume", str(run), "--model", f"{small_net_file}:small", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "config.json" in err


@pytest.mark.parametrize("change,says", [
    (lambda ck: ck.update(state={**ck["state"], "epoch": "x"}), "state epoch is 'x'"),
    (lambda ck: ck.update(loader={**ck["loader"], "position": -5}), "loader position is -5"),
    (lambda ck: ck.pop("optimizer"), "no 'optimizer'"),
    (lambda ck: ck.update(loader={**ck["loader"], "position": 10 ** 6}), "position 1000000 is past this epoch's"),
])
def test_a_crafted_checkpoint_is_one_line(digits_packs, small_net_file, tmp_path, capsys, change, says):
    from trainfast.train import checkpoint
    run = tmp_path / "run"
    _run_small(digits_packs, small_net_file, run)
    capsys.readouterr()
    ck = torch.load(run / "last.pt", weights_only=True)
    change(ck)
    checkpoint.save(run / "last.pt", {k: v for k, v in ck.items() if k not in ("format", "version")})
    assert main(["train", "--resume", str(run), "--model", f"{small_net_file}:small", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "Traceback" not in err


def test_an_empty_last_pt_is_one_line(digits_packs, small_net_file, tmp_path, capsys):
    run = tmp_path / "run"
    _run_small(digits_packs, small_net_file, run)
    (run / "last.pt").write_bytes(b"")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--model", f"{small_net_file}:small", "--device", "cpu"]) == 1
    assert "last.pt: an empty file, not a checkpoint" in capsys.readouterr().err


def test_odd_fit_arguments_are_one_line_each(digits_packs, tmp_path):
    train, _ = digits_packs
    (tmp_path / "afile").write_text("x")
    quiet = dict(device="cpu", tune=False, progress=False, log=lambda *a: None)
    for kwargs, says in ((dict(config=TrainConfig(seed=None)), "seed must be a whole number ≥ 0, not None"),
                         (dict(augment={"flop": 1}), "augment: flop is not an augmentation trainfast has"),
                         (dict(augment=[1]), "augment must be a trainfast.Augment"),
                         (dict(augment={"crop_pad": -1}), "augment crop_pad must be a whole number of pixels ≥ 0"),
                         (dict(pin={"bogus": 1}), "pin: bogus is not a speed setting (precision, channels_last"),
                         (dict(pin=["fp32"]), "pin must be a dict of speed settings"),
                         (dict(pin={"precision": "fp64"}), "precision must be one of"),
                         (dict(batch_size=0), "batch_size must be a whole number ≥ 1, not 0"),
                         (dict(run_dir=tmp_path / "afile"), "afile: a file, not a run directory")):
        with pytest.raises(TrainfastError, match=re.escape(says)):
            fit("cifar_cnn", train, **quiet, **kwargs)
    r = fit("cifar_cnn", train, epochs=1, augment={"flip": True}, run_dir=tmp_path / "run", **quiet)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["augment"]["flip"] is True and r.history


def test_a_model_with_nothing_to_train_is_one_line(digits_packs, tmp_path):
    train, _ = digits_packs

    class NoParams(nn.Module):
        def forward(self, x):
            return x.mean((2, 3)).repeat(1, 4)[:, :10]
    frozen = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10)).requires_grad_(False)
    quiet = dict(epochs=1, device="cpu", tune=False, progress=False, log=lambda *a: None)
    with pytest.raises(TrainfastError, match="nothing to train: the model has no parameters"):
        fit(NoParams(), train, run_dir=tmp_path / "a", **quiet)
    with pytest.raises(TrainfastError, match=r"nothing to train: all 30,730 parameters are frozen"):
        fit(frozen, train, run_dir=tmp_path / "b", **quiet)


def test_an_edited_epoch_count_in_config_json_is_one_line(digits_packs, small_net_file, tmp_path, capsys):
    run = tmp_path / "run"
    _run_small(digits_packs, small_net_file, run)
    cfg = json.loads((run / "config.json").read_text())
    cfg["train"]["epochs"] = 5  # the run was planned (and scheduled) for 1
    (run / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--model", f"{small_net_file}:small", "--device", "cpu", "-q"]) == 1
    err = capsys.readouterr().err
    assert "config.json plans 5 epochs, but the run's learning-rate schedule was made for 1" in err
    assert err.count("\n") == 1


def test_a_stale_cached_choice_is_re_tuned_by_the_run_that_finds_it(digits_packs, small_net_file, tmp_path, monkeypatch):
    """A cached choice timed far faster than the run trains (a stale cache on a quiet machine):
    the run measures again at its own batch and goes on with what it finds; config.json says
    it, so a resume goes on with it too."""
    import json

    from trainfast import tuning

    train, _ = digits_packs
    monkeypatch.setenv("TRAINFAST_CACHE", str(tmp_path / "cache"))
    other_load(monkeypatch, 0.0, machine_cores=None)  # quiet, whatever this machine is doing
    said = []
    model = f"{small_net_file}:small"
    fit(model, train, config=TrainConfig(epochs=1, tune_share=0), device="cpu", run_dir=tmp_path / "first",
        progress=False, log=said.append)  # tune_share 0: a search, cached, however short the run
    cache = json.loads((tmp_path / "cache" / "tune.json").read_text())
    for entry in cache.values():  # as if the machine had been 100× faster when it was timed
        for row in entry["rows"]:
            row["images_per_s"] = row["images_per_s"] and row["images_per_s"] * 100
    (tmp_path / "cache" / "tune.json").write_text(json.dumps(cache))

    real, retuned = tuning.tune, []

    def tune(model, shape, **kw):  # the re-tune finds the other memory format fastest
        if not kw.get("retune"):
            return real(model, shape, **kw)
        first = Speed(**next(iter(cache.values()))["best"])
        new = replace(first, channels_last=not first.channels_last, compile=False)
        retuned.append(kw["batch_size"])
        return tuning.TuneResult(new, [tuning.Trial(new, 5000.0, 2.3)])
    monkeypatch.setattr(tuning, "tune", tune)
    said.clear()
    run = tmp_path / "run"
    r = fit(model, train, epochs=3, device="cpu", run_dir=run, progress=False, log=said.append)
    first = Speed(**next(iter(cache.values()))["best"])
    assert any("looks stale" in m for m in said) and retuned == [first.batch_size]
    assert any(m.startswith(f"re-tuned at batch {first.batch_size}") and "training on with" in m for m in said), said
    assert r.stopped == "finished" and len(r.history) == 3 and r.speed.channels_last != first.channels_last
    assert all(math.isfinite(row["train_loss"]) for row in r.history)
    assert Speed(**json.loads((run / "config.json").read_text())["speed"]) == r.speed


def test_best_pt_is_the_same_file_as_last_pt_under_a_second_name(digits_packs, tmp_path, small_net_file, monkeypatch):
    """An epoch that improves writes last.pt once and links best.pt to it (serialising 135 MB
    twice cost ResNet-18 0.12 s an epoch); the next last.pt is a new file, best.pt stays."""
    from trainfast import files
    from trainfast.train import checkpoint
    saved = []
    real = checkpoint.save
    monkeypatch.setattr(checkpoint, "save", lambda path, state: (saved.append(path.name), real(path, state)))
    train, _ = digits_packs
    run = tmp_path / "run"
    _small_run(small_net_file, train, run)
    assert saved == ["last.pt"] and (run / "best.pt").samefile(run / "last.pt")  # epoch 1 always improves
    before = (run / "best.pt").read_bytes()
    checkpoint.save(run / "last.pt", {"model": {}})  # as the next epoch's save puts a new file there
    assert (run / "best.pt").read_bytes() == before and not (run / "best.pt").samefile(run / "last.pt")
    assert not files.stale_temporaries(run, ["best.pt", "last.pt"])
    monkeypatch.setattr(files.os, "link", lambda a, b: (_ for _ in ()).throw(OSError("no hard links here")))
    saved.clear()
    _small_run(small_net_file, train, tmp_path / "other")  # a file system without hard links: written twice
    assert saved == ["last.pt", "best.pt"] and _weights(tmp_path / "other" / "best.pt").keys()


def test_short_epochs_save_once_a_minute_and_best_pt_is_the_best_epoch(digits_packs, tmp_path, small_net_file,
                                                                       monkeypatch):
    """Epochs of a few seconds write no checkpoint until SAVE_EVERY_S has passed, and the last
    epoch always writes: a 3-epoch run writes last.pt once. Where the best epoch is not the last,
    best.pt holds that epoch's weights, kept in memory until the save; with the throttle off,
    each epoch's end writes, as a long epoch's does."""
    from trainfast.train import checkpoint
    from trainfast.train import run as trainer
    saved, real = [], checkpoint.save
    monkeypatch.setattr(checkpoint, "save", lambda path, state: (saved.append((path.name, state["state"]["epoch"])),
                                                                  real(path, state)))
    accs = iter([0.5, 0.9, 0.7, 0.5, 0.9, 0.7])  # epoch 2 is the best, twice
    real_eval = trainer.evaluate
    weights = {}

    def evaluate(model, *a):
        weights[len(weights)] = {k: v.clone() for k, v in model.state_dict().items()}
        return {**real_eval(model, *a), "acc": next(accs)}
    monkeypatch.setattr(trainer, "evaluate", evaluate)
    train, test = digits_packs
    run = tmp_path / "run"
    fit(f"{small_net_file}:small", train, test, config=TrainConfig(epochs=3), speed=Speed(batch_size=64),
        device="cpu", run_dir=run, progress=False, log=lambda *a: None)
    assert saved == [("last.pt", 3), ("best.pt", 2)]
    best = _weights(run / "best.pt")
    assert all(torch.equal(best[k], weights[1][k]) for k in best)  # epoch 2's weights, not the last epoch's
    assert _weights(run / "last.pt").keys() == best.keys() and not (run / "best.pt").samefile(run / "last.pt")
    monkeypatch.setattr(trainer, "SAVE_EVERY_S", 0.0)
    saved.clear()
    fit(f"{small_net_file}:small", train, test, config=TrainConfig(epochs=3), speed=Speed(batch_size=64),
        device="cpu", run_dir=tmp_path / "every", progress=False, log=lambda *a: None)
    assert saved == [("last.pt", 1), ("last.pt", 2), ("last.pt", 3)]  # best.pt linked at epochs 1 and 2


def test_forward_passes_without_a_gradient_take_a_larger_batch_within_a_bound():
    """Evaluation and the batch-norm measurement: the training batch's largest multiple within
    256 images and 32 MB of uint8 input, never below the training batch."""
    from types import SimpleNamespace

    from trainfast.train.evaluate import forward_batch
    small, big = SimpleNamespace(shape=(32, 32, 3)), SimpleNamespace(shape=(512, 512, 3))
    assert [forward_batch(b, small) for b in (32, 24, 100, 512)] == [256, 240, 200, 512]
    assert [forward_batch(b, big) for b in (4, 5, 64)] == [40, 40, 64]


def test_sgd_and_adamw_update_in_one_fused_kernel_and_as_torch_s_loop_does(device):
    """make_optimizer fuses SGD and AdamW on CPU and CUDA (torch's default AdamW loops over the
    tensors on a CPU: 5.7× slower for ResNet-18's 11M parameters), with the loop's results."""
    from trainfast.step import make_optimizer
    dev = torch.device(device)
    torch.manual_seed(0)
    # NOTE: no conv bias before the batch norm: its gradient is rounding noise (~5e-8), which
    # Adam divides by its own square root, and the two implementations round it differently
    ref = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.Flatten(), nn.LazyLinear(4)).to(dev)
    ref(torch.randn(2, 3, 8, 8, device=dev))
    for name in ("adamw", "sgd", "rmsprop"):
        a, b = copy.deepcopy(ref), copy.deepcopy(ref)
        fused = make_optimizer(name, a.parameters(), 1e-2, dev)
        kw = {"momentum": 0.9, "nesterov": True} if name == "sgd" else {"momentum": 0.9} if name == "rmsprop" else {}
        loop = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "rmsprop": torch.optim.RMSprop}[name](
            b.parameters(), lr=1e-2, weight_decay=5e-4, foreach=False, **kw)
        assert bool(fused.defaults.get("fused")) == (name != "rmsprop")
        for _ in range(3):
            x = torch.randn(4, 3, 8, 8, device=dev)
            for net, opt in ((a, fused), (b, loop)):
                net(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    ints = [nn.Parameter(torch.zeros(3, dtype=torch.int64, device=dev), requires_grad=False)]
    assert not make_optimizer("adamw", ints, 1e-3, dev).defaults.get("fused")  # not real floating point: the loop


def test_a_run_that_cannot_learn_at_the_default_rate_starts_over_at_half(digits_packs, tmp_path, monkeypatch):
    """The loss watch fires on a first attempt at the default rate: the run starts over from
    its first weights at half that rate, in the same run directory, with the same settings;
    the result is the run a user would get by asking for that rate. A rate the user gave is
    kept (the watch warns, as before). Where the attempt at half the rate dies too, once more at
    a quarter (START_OVERS), and no more; where it lives, it trains on."""
    from trainfast.config import default_lr
    from trainfast.train import watch as trainer
    train, test = digits_packs
    fired = []

    def watch(losses, epochs, classes, lr, *rest, **kw):  # "not learning" at the default rate only
        if lr == default_lr("adamw", 64):
            fired.append(lr)
            return "the training loss has not left chance (a stand-in)."
        return None
    monkeypatch.setattr(trainer, "loss_watch", watch)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                        nn.Linear(128, 10))
    first = copy.deepcopy(net)
    said, run = [], tmp_path / "run"
    r = fit(net, train, test, epochs=3, speed=Speed(batch_size=64), device="cpu", run_dir=run, progress=False,
            log=said.append)
    half = default_lr("adamw", 64) / 2
    assert fired and any("Starting over from the first weights at half the learning rate" in m for m in said)
    assert r.stopped == "finished" and len(r.history) == 3 and r.model is net
    assert json.loads((run / "config.json").read_text())["lr"] == pytest.approx(half)
    assert len(list(csv.DictReader(open(run / "metrics.csv")))) == 3  # the first attempt's rows are gone
    # the call's account keeps the attempt started over, as one phase, and adds up to the whole call
    assert r.costs["attempts started over"] > 0 and r.costs["training"] > 0
    assert sum(v for k, v in r.costs.items() if k != "total") == pytest.approx(r.costs["total"], rel=1e-6)
    direct = fit(first, train, test, epochs=3, lr=half, speed=Speed(batch_size=64), device="cpu",
                 run_dir=tmp_path / "direct", progress=False, log=lambda m: None)
    for a, b in zip(net.state_dict().values(), direct.model.state_dict().values()):
        torch.testing.assert_close(a, b)  # the same run as asking for half the rate from the same weights
    fired.clear()
    said.clear()
    fit(copy.deepcopy(first), train, epochs=3, lr=default_lr("adamw", 64), speed=Speed(batch_size=64), device="cpu",
        run_dir=tmp_path / "given", progress=False, log=said.append)
    assert fired and not any("Starting over" in m for m in said)  # the user's rate: warned, trained on

    def watch_again(losses, epochs, classes, lr, *rest, **kw):  # half the default rate does not learn either
        if lr >= default_lr("adamw", 64) / 2:
            fired.append(lr)
            return "the training loss has not left chance (a stand-in)."
        return None
    monkeypatch.setattr(trainer, "loss_watch", watch_again)
    monkeypatch.setattr(trainer, "diverging", lambda *a: True)  # each attempt's loss "climbs": hopeless, a dead run
    fired.clear()
    said.clear()
    r = fit(copy.deepcopy(first), train, test, epochs=3, speed=Speed(batch_size=64), device="cpu",
            run_dir=tmp_path / "twice", progress=False, log=said.append)
    assert sum("Starting over from the first weights at half the learning rate" in m for m in said) == 2
    assert r.stopped == "finished" and len(r.history) == 3 and min(fired) == pytest.approx(half)
    assert json.loads((tmp_path / "twice" / "config.json").read_text())["lr"] == pytest.approx(half / 2)
    monkeypatch.setattr(trainer, "loss_watch", lambda *a, **kw: "the training loss has not left chance (a stand-in).")
    said.clear()
    with pytest.raises(TrainfastError, match="a stand-in"):  # dead at every rate: the third attempt stops
        fit(copy.deepcopy(first), train, test, epochs=3, speed=Speed(batch_size=64), device="cpu",
            run_dir=tmp_path / "dead", progress=False, log=said.append)
    assert sum("Starting over" in m for m in said) == 2
    monkeypatch.setattr(trainer, "diverging", lambda *a: False)  # alive (its gradients flow), but not learning
    said.clear()
    r = fit(copy.deepcopy(first), train, test, epochs=3, speed=Speed(batch_size=64), device="cpu",
            run_dir=tmp_path / "alive", progress=False, log=said.append)
    assert sum("Starting over" in m for m in said) == 1 and r.stopped == "finished"  # the second trains on, warned


def test_batch_norm_statistics_are_measured_on_the_trained_weights_at_each_epoch_end(digits_packs, tmp_path,
                                                                                     device):
    """torchvision's MobileNetV3 sets momentum 0.01: over 20 steps an epoch its running
    statistics would stay ~80% the initial ones (mean 0, variance 1), and evaluation would read
    them. fit measures them afresh on the weights as trained: the model given back holds the
    statistics its first layer's outputs have on the training images, and keeps its momentum."""
    train, _ = digits_packs
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=0.01), nn.ReLU(),
                        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    fit(net, train, epochs=1, tune=False, batch_size=64, device=device, run_dir=tmp_path / "r", progress=False,
        log=lambda m: None)
    assert net[1].momentum == 0.01 and net[4].momentum == 0.1 and net.training  # the model's own, as given
    x = torch.cat([b for b, _ in Loader(train, 256, shuffle=False, drop_last=False, device=device)])
    with torch.no_grad():  # what the trained first convolution makes of every training image
        feats = net[0](x)
    mean, var = feats.mean((0, 2, 3)), feats.var((0, 2, 3))
    assert (net[1].running_mean - mean).norm() < 0.1 * mean.norm() + 0.02, (net[1].running_mean, mean)
    assert (net[1].running_var - var).norm() < 0.15 * var.norm(), (net[1].running_var, var)


def test_fit_samples_other_processes_load_once_for_its_threads_and_its_tune(digits_packs, tmp_path, monkeypatch):
    """The start's sample (0.15 s of waiting) serves both the threads and the tune."""
    from trainfast import hardware

    calls, real = [], hardware.other_cores_now
    monkeypatch.setattr(hardware, "other_cores_now", lambda *a, **k: calls.append(1) or real(*a, **k))
    train, _ = digits_packs
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, 10))
    said = []
    fit(net, train, epochs=1, device="cpu", run_dir=tmp_path / "r", progress=False, log=said.append)
    assert any(m.startswith("chosen:") or "no search" in m for m in said), said  # it was tuned
    assert len(calls) == 1


def test_a_short_runs_comparison_is_made_on_its_own_first_steps(digits_packs, tmp_path, monkeypatch):
    """A run too short for a search (one CPU process) times tune's likeliest winner on its own
    first steps, not on a copy: three at the first setting, three at the candidate; it keeps
    the candidate where it ran SHORT_GAIN× faster and its loss on the same batch matched, else
    goes back. config.json and speed.json say what it trains with; every step trained."""
    from trainfast import step, tuning
    from trainfast.train import adapt as trainer

    train, test = digits_packs
    monkeypatch.setenv("TRAINFAST_CACHE", str(tmp_path / "cache"))
    other_load(monkeypatch, 0.0, machine_cores=None)
    said = []
    r = fit(_bn_net(), train, test, epochs=1, device="cpu", run_dir=tmp_path / "real", progress=False,
            log=said.append)  # the real tune: 1,438 images for one epoch are far too few for a search
    tried = json.loads((tmp_path / "real" / "speed.json").read_text())["tried"]
    first = [row for row in tried if row["note"] == "the run's first steps"]
    assert len(first) == 2 and any(m.startswith("first steps: ") for m in said), said
    assert r.speed.label() in {row["label"] for row in first}
    assert Speed(**json.loads((tmp_path / "real" / "config.json").read_text())["speed"]) == r.speed

    ref, candidate = Speed("fp32", False, batch_size=32), Speed("fp32", True, batch_size=32)

    def short_tune(model, shape, **kw):
        assert kw["compare_in_run"]
        return tuning.TuneResult(ref, [tuning.Trial(ref, 1000.0, 2.3, note="a quick timing")], short="no search",
                                 candidate=candidate)
    monkeypatch.setattr(tuning, "tune", short_tune)
    switched = []
    real_use = trainer.use_speed
    monkeypatch.setattr(trainer, "use_speed", lambda run, new: (switched.append(new.label()), real_use(run, new)))
    for gain, kept in ((0.0, candidate), (1e9, ref)):
        monkeypatch.setattr(tuning, "SHORT_GAIN", gain)
        said.clear(), switched.clear()
        run = tmp_path / f"gain-{gain:g}"
        net = _bn_net()
        r = fit(net, train, test, epochs=2, device="cpu", run_dir=run, progress=False, log=said.append)
        assert r.speed == kept and r.stopped == "finished"
        assert switched == ([candidate.label()] if kept == candidate else [candidate.label(), ref.label()])
        assert any(m.startswith(f"first steps: {candidate.label()} ran") and m.endswith(kept.label()) for m in said)
        assert Speed(**json.loads((run / "config.json").read_text())["speed"]) == kept
        decisions = json.loads((run / "speed.json").read_text())["decisions"]  # issue 51.4
        assert [(d["what"], d["chose"]) for d in decisions][:2] == [("settings", ref.label()),
                                                                   ("first steps", kept.label())], decisions
        assert decisions[0]["by"] == "tune's timing; short run: no search"
        assert set(decisions[1]["images_per_s"]) == {ref.label(), candidate.label()}
        assert [row["note"] for row in json.loads((run / "speed.json").read_text())["tried"]] == [
            "a quick timing", "the run's first steps", "the run's first steps"]
        assert all(p.is_contiguous() for p in net.parameters())  # given back in its own layout
        assert r.history[-1]["val_acc"] > 0.5 and all(math.isfinite(row["train_loss"]) for row in r.history)

    calls = []

    def off(loss, ref_loss):  # the candidate's loss is off
        calls.append((loss, ref_loss))
        return False
    monkeypatch.setattr(tuning, "loss_matches", off)
    candidate = Speed("bf16", True, batch_size=32)  # another precision: its loss is compared before any step
    monkeypatch.setattr(step, "supports_bf16", lambda device: True)  # emulated on AVX2-only CPUs: slow, but it runs
    said.clear(), switched.clear()
    r = fit(_bn_net(), train, test, epochs=1, device="cpu", run_dir=tmp_path / "unsound", progress=False,
            log=said.append)
    assert r.speed == ref and switched == [] and len(calls) == 1
    assert any(m.startswith(f"first steps: {candidate.label()} left out: its loss on the first batch") for m in said)
    assert [row["note"] for row in json.loads((tmp_path / "unsound" / "speed.json").read_text())["tried"]] == [
        "a quick timing"]

    class NoBf16Backward(torch.autograd.Function):  # as a user's own operation may be
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            if grad.dtype == torch.bfloat16:
                raise RuntimeError("expected scalar type Float but found BFloat16")
            return grad

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _bn_net()

        def forward(self, x):
            return self.body[-1](NoBf16Backward.apply(self.body[:-1](x)))
    monkeypatch.setattr(tuning, "loss_matches", lambda loss, ref_loss: True)
    said.clear(), switched.clear()
    r = fit(Net(), train, test, epochs=1, device="cpu", run_dir=tmp_path / "fails", progress=False, log=said.append)
    assert r.speed == ref and switched == [candidate.label(), ref.label()] and r.stopped == "finished"
    assert any(m.startswith(f"first steps: {candidate.label()} left out: its training step failed (RuntimeError: "
                            "expected scalar type Float") for m in said), said
    assert r.history[-1]["val_acc"] > 0.5

    class NoBf16(nn.Module):  # its forward refuses bf16: left out before any step
        def __init__(self):
            super().__init__()
            self.body = _bn_net()

        def forward(self, x):
            h = self.body[:-1](x)
            if h.dtype == torch.bfloat16:
                raise TypeError("bf16 is not supported here")
            return self.body[-1](h)
    said.clear(), switched.clear()
    r = fit(NoBf16(), train, test, epochs=1, device="cpu", run_dir=tmp_path / "refuses", progress=False,
            log=said.append)
    assert r.speed == ref and switched == [] and any(
        m == f"first steps: {candidate.label()} left out: its forward pass failed (TypeError: bf16 is not supported "
        "here)" for m in said), said

    said.clear()
    r = fit(_bn_net(), train, epochs=1, batch_size=512, device="cpu", run_dir=tmp_path / "tiny", progress=False,
            log=said.append)  # two steps an epoch: too few to time both settings
    assert r.speed.precision == "fp32" and not r.speed.channels_last and switched == []
    assert any(m.startswith("first steps: ") and "an epoch of 2 steps is too few" in m for m in said), said


def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 8 * 8, 10))


def test_a_checkpoint_whose_moments_are_in_another_layout_resumes_the_same(digits_packs, tmp_path, monkeypatch):
    """A checkpoint written while the run trained channels_last (the first steps' candidate, or
    before a re-tune's switch) and resumed in the default layout: the fused AdamW update reads
    weights and moments as flat memory, so the moments are put in their weights' layout first
    (else the resumed run trains on wrong updates, silently)."""
    from trainfast.train import checkpoint
    from trainfast.train import run as trainer
    train, test = digits_packs
    kw = dict(config=TrainConfig(epochs=2, lr=1e-3, optimizer="adamw", deterministic=True),
              speed=Speed("fp32", False, batch_size=64), device="cpu", progress=False, log=lambda *a: None)
    fit(_bn_net(), train, test, run_dir=tmp_path / "whole", **kw)
    real_end = trainer.Run.end_epoch

    def stop_after_the_first(self, epoch, row):
        real_end(self, epoch, row)
        raise KeyboardInterrupt  # Ctrl-C: last.pt is written at the first epoch's end
    monkeypatch.setattr(trainer.Run, "end_epoch", stop_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        fit(_bn_net(), train, test, run_dir=tmp_path / "stopped", **kw)
    monkeypatch.setattr(trainer.Run, "end_epoch", real_end)
    ck = torch.load(tmp_path / "stopped" / "last.pt", weights_only=True)
    for kept in ck["optimizer"]["state"].values():  # as written by a run training channels_last
        for k, v in kept.items():
            if torch.is_tensor(v) and v.dim() == 4:
                kept[k] = v.contiguous(memory_format=torch.channels_last)
    checkpoint.save(tmp_path / "stopped" / "last.pt", ck)
    fit(_bn_net(), train, test, run_dir=tmp_path / "stopped", resume=True, **kw)
    a, b = _weights(tmp_path / "whole" / "last.pt"), _weights(tmp_path / "stopped" / "last.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_held_out_data_is_scored_with_the_training_statistics(digits_packs, tmp_path):
    """A validation pack with other statistics than the training pack (here: brighter) is
    scored as the model will be used, normalised with the training pack's mean and std; the
    logged accuracy is that score, and config.json records the statistics."""
    import trainfast
    from trainfast.train.distributed import World

    train, test = digits_packs
    x = np.stack([test.image(i) for i in range(len(test))])
    brighter = trainfast.pack((np.clip(x.astype(np.int16) + 60, 0, 255).astype(np.uint8), np.array(test.labels)),
                              tmp_path / "brighter", progress=False)
    assert abs(brighter.mean[0] - train.mean[0]) > 0.1
    net = _bn_net()
    r = fit(net, train, brighter, epochs=1, speed=Speed(batch_size=64), tune=False, device="cpu",
            run_dir=tmp_path / "run", progress=False, log=lambda m: None)
    dev = torch.device("cpu")
    as_used = evaluate(net, Loader(brighter, 100, shuffle=False, device="cpu", normalize=train), Speed(), dev,
                       World(device=dev))
    own = evaluate(net, Loader(brighter, 100, shuffle=False, device="cpu"), Speed(), dev, World(device=dev))
    assert r.history[-1]["val_acc"] == pytest.approx(as_used["acc"], abs=1e-6)
    assert as_used["acc"] != pytest.approx(own["acc"], abs=1e-6)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["normalize"]
    assert saved["mean"] == pytest.approx(list(train.mean)) and saved["std"] == pytest.approx(list(train.std))


@pytest.mark.parametrize("schedule", ["onecycle", "cosine", "constant"])
def test_every_short_schedule_runs_with_every_warmup(schedule):
    """Runs of 1-10 optimizer steps with any warm-up share: every rate finite, ≥ 0 and at most
    the peak (a 4-step onecycle run at warm-up 0.2 died with ZeroDivisionError)."""
    from trainfast.train.optim import scheduler_for

    for total in range(1, 11):
        for warmup in (0.0, 0.05, 0.1, 0.2, 0.25, 0.3, 0.5, 0.9, 1.0):
            opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
            sched = scheduler_for(opt, TrainConfig(schedule=schedule, warmup=warmup), total, 0.1)
            rates = [sched.get_last_lr()[0]]
            for _ in range(total):
                opt.step()
                sched.step()
                rates.append(sched.get_last_lr()[0])
            assert all(math.isfinite(r) and 0 <= r <= 0.1 + 1e-9 for r in rates), (total, warmup, rates)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_run_directory_files_follow_the_umask(digits_packs, tmp_path, umask):
    """Issue 50.10: checkpoints and curves are written beside and renamed (files.write_whole),
    whose temporary file is 0600; the run's files get the mode open() would give them."""
    train, test = digits_packs
    old = os.umask(umask)
    try:
        fit(nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10)), train, test, epochs=1, device="cpu", tune=False,
            run_dir=tmp_path / "run", progress=False, log=lambda *a: None)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "run").iterdir()}
    assert {"last.pt", "best.pt", "curves.png", "config.json", "metrics.csv"} <= set(modes)
    assert set(modes.values()) == {0o666 & ~umask}, {k: oct(v) for k, v in modes.items()}

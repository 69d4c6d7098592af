"""torchrun: 2 processes on CPU (gloo) against one process with the same global batch; the one-line
refusal of more processes than GPUs."""

import csv
import json
import subprocess
import sys

import pytest
import torch

from trainfast.cli import main
from trainfast.errors import TrainfastError
from trainfast.train import distributed


def _losses(run):
    return [float(r["train_loss"]) for r in csv.DictReader(open(run / "metrics.csv"))]


@pytest.mark.slow
def test_torchrun_two_processes_match_one(digits_packs, small_net_file, tmp_path):
    train, _ = digits_packs
    common = ["train", str(train.path), "--model", f"{small_net_file}:small", "--epochs", "2", "--no-tune",
              "--optimizer", "sgd",  # Adam divides by tiny second moments: all-reduce rounding grows there
              "--lr", "0.005",  # a rate where rounding stays small (the default 0.025 grows it to 0.7% by epoch 2)
              "--precision", "fp32", "--threads", "1", "-q",
              "--device", "cpu"]  # gloo on the CPU, even where CUDA exists
    one = subprocess.run([sys.executable, "-m", "trainfast", *common, "--batch-size", "32",
                          "--run-dir", str(tmp_path / "one")], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "trainfast", *common, "--batch-size", "16", "--run-dir", str(tmp_path / "two")],
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "× 2 processes" in two.stderr and two.stderr.count("training ") == 1  # only rank 0 prints
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(a) == len(b) == 2
    assert all(abs(x - y) <= 1e-3 * max(1.0, abs(x)) for x, y in zip(a, b)), (a, b)
    assert (tmp_path / "two" / "last.pt").exists()


def _torchrun_env(monkeypatch, rank, world, tmp_path=None):
    for k, v in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}.items():
        monkeypatch.setenv(k, str(v))


def test_more_processes_than_gpus_is_refused_before_any_process_group(monkeypatch):
    """What every rank of `torchrun --nproc_per_node 2` meets on a machine with one GPU."""
    _torchrun_env(monkeypatch, 1, 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("took a device before refusing"))
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("joined a group"))
    with pytest.raises(TrainfastError, match=r"^2 processes on a machine with 1 CUDA device: use --nproc_per_node 1, "
                                             r"or --device cpu$"):
        distributed.setup(torch.device("cuda"))


@pytest.mark.parametrize("first", [0, 1])
def test_under_torchrun_the_first_to_fail_says_it_and_every_rank_leaves_it_for_torchrun(monkeypatch, tmp_path, capsys,
                                                                                          first):
    """torchrun kills the other processes when one fails: whichever fails first must say why."""
    errors = {}
    for rank in (first, 1 - first):
        _torchrun_env(monkeypatch, rank, 2)
        # torchrun's layout: <log_dir>/attempt_0/<local_rank>/error.json
        (tmp_path / "attempt_0" / str(rank)).mkdir(parents=True)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "attempt_0" / str(rank) / "error.json"))
        assert main(["train", str(tmp_path / "missing.pack"), "--model", "cifar_cnn", "--device", "cpu"]) == 1
        errors[rank] = capsys.readouterr().err
    assert errors[first].count("\n") == 1 and "missing.pack" in errors[first] and errors[1 - first] == ""
    for rank in (0, 1):  # torchrun's failure summary shows this message instead of a link to its docs
        left = json.loads((tmp_path / "attempt_0" / str(rank) / "error.json").read_text())
        assert left["message"] == errors[first].strip() and int(left["timestamp"]) > 0


def test_without_torchrun_error_files_rank_0_says_it(monkeypatch, tmp_path, capsys):
    for rank in (0, 1):
        _torchrun_env(monkeypatch, rank, 2)
        monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
        assert main(["train", str(tmp_path / "missing.pack"), "--model", "cifar_cnn", "--device", "cpu"]) == 1
        assert ("missing.pack" in capsys.readouterr().err) == (rank == 0)

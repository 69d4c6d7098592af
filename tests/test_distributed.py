"""A 2-process torchrun run on CPU (gloo) against one process with the same global batch."""

import csv
import subprocess
import sys

import pytest


def _losses(run):
    return [float(r["train_loss"]) for r in csv.DictReader(open(run / "metrics.csv"))]


@pytest.mark.slow
def test_torchrun_two_processes_match_one(digits_packs, small_net_file, tmp_path):
    train, _ = digits_packs
    common = ["train", str(train.path), "--model", f"{small_net_file}:small", "--epochs", "2", "--no-tune",
              "--precision", "fp32", "--threads", "1", "-q"]
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

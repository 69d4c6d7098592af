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


STOPPABLE = '''
import os
import signal

import torch.nn as nn


def small():
    """SMALL_NET's network; with TEST_STOP_AT=k it sends itself (TEST_STOP_WHO=self) or its
    parent, torchrun (=parent), SIGINT/SIGTERM at its k-th training step: an interruption at a
    known step, on every rank alike."""
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
    net.input_shape, net.output_shape = (3, 32, 32), (10,)
    at, who, seen = int(os.environ.get("TEST_STOP_AT", "0")), os.environ.get("TEST_STOP_WHO", "self"), [0]

    def hook(module, args):
        if module.training and args[0].shape[0] > 2:
            seen[0] += 1
            if seen[0] == at:
                if who == "parent":
                    if int(os.environ.get("RANK", "0")) == 0:
                        os.kill(os.getppid(), signal.SIGTERM)  # a scheduler's preemption of torchrun
                elif who == "rank1-dies":
                    if int(os.environ.get("RANK", "0")) == 1:
                        os.kill(os.getpid(), signal.SIGKILL)  # a node lost: no handler, no save
                else:
                    os.kill(os.getpid(), signal.SIGINT)
    net.register_forward_pre_hook(hook)
    return net
'''

COMMON = ["--optimizer", "sgd", "--lr", "0.005", "--precision", "fp32", "--device", "cpu", "-q"]


def _trainfast(args, nproc=1, env=None, timeout=300):
    import os
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] \
        if nproc > 1 else [sys.executable]
    return subprocess.run([*launch, "-m", "trainfast", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def stoppable(digits_packs, tmp_path_factory):
    """The model file, and the reference: one uninterrupted process with batch 32, 2 epochs."""
    tmp = tmp_path_factory.mktemp("elastic")
    model = tmp / "stoppable.py"
    model.write_text(STOPPABLE)
    train, _ = digits_packs
    ref = tmp / "ref"
    p = _trainfast(["train", str(train.path), "--model", f"{model}:small", "--epochs", "2", "--no-tune",
                    "--batch-size", "32", "--threads", "1", "--run-dir", str(ref), *COMMON])
    assert p.returncode == 0, p.stderr[-2000:]
    return model, train, _losses(ref)


def _close(a, b):
    return len(a) == len(b) and all(abs(x - y) <= 1e-3 * max(1.0, abs(x)) for x, y in zip(a, b))


@pytest.mark.slow
def test_a_run_interrupted_mid_epoch_resumes_on_more_processes(stoppable, tmp_path):
    """Saved by 1 process at step 20 of epoch 1, resumed by 2 (batch 16 each): the same global
    batches in the same order, so the same loss curve as the uninterrupted run."""
    model, train, ref = stoppable
    run = tmp_path / "run"
    p = _trainfast(["train", str(train.path), "--model", f"{model}:small", "--epochs", "2", "--no-tune",
                    "--batch-size", "32", "--threads", "1", "--run-dir", str(run), *COMMON], env={"TEST_STOP_AT": "20"})
    assert p.returncode == 130 and "interrupted; saved" in p.stderr, p.stderr[-2000:]
    p = _trainfast(["train", "--resume", str(run), "--model", f"{model}:small", "--device", "cpu"], nproc=2)  # no -q: its lines
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming a run of 1 process with 2: batch 16 per process keeps the global batch of 32" in p.stderr
    assert "at epoch 1, batch 20 of" in p.stderr
    assert _close(ref, _losses(run)), (ref, _losses(run))


@pytest.mark.slow
def test_every_rank_stops_at_the_same_step_and_fewer_processes_resume(stoppable, tmp_path):
    """SIGTERM to torchrun (a scheduler's preemption) reaches every rank: they agree on a step,
    rank 0 saves, all exit; the run then resumes on 1 process (batch 32) where it stopped."""
    model, train, ref = stoppable
    run = tmp_path / "run"
    p = _trainfast(["train", str(train.path), "--model", f"{model}:small", "--epochs", "2", "--no-tune",
                    "--batch-size", "16", "--threads", "1", "--run-dir", str(run), *COMMON], nproc=2,
                   env={"TEST_STOP_AT": "12", "TEST_STOP_WHO": "parent"})
    assert p.returncode != 0 and "interrupted; saved" in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr.split("interrupted; saved")[0]
    import torch
    position = torch.load(run / "last.pt", weights_only=True)["state"]["position"]
    assert 12 <= position <= 14  # the step the ranks agreed on, a step or two after the signal
    p = _trainfast(["train", "--resume", str(run), "--model", f"{model}:small", "--device", "cpu", "-q"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming a run of 2 processes with 1: batch 32 per process keeps the global batch of 32" in p.stderr
    assert _close(ref, _losses(run)), (ref, _losses(run))


def test_a_signal_that_lands_while_the_ranks_agree_stops_them_at_the_next_agreement(monkeypatch):
    """The all-reduce of the stop flag waits for the other ranks, so a signal often lands inside it.
    Its result used to be stored over the flag, and the signal was lost (CI saw an orphaned run train on)."""
    import signal
    from trainfast.train.signals import Interrupts as _Interrupts
    interrupts = _Interrupts(False, distributed.World(rank=0, size=2))
    seen = []

    def agree(values, world):  # the other rank has had no signal; ours lands mid-collective on the first call
        seen.append(values[0])
        if len(seen) == 1:
            interrupts._handler(signal.SIGTERM, None)
        return list(values)
    monkeypatch.setattr(distributed, "sum_all", agree)
    with interrupts.step():
        pass
    with pytest.raises(KeyboardInterrupt):
        with interrupts.step():
            pass
    assert seen == [0.0, 1.0]


def test_a_global_batch_that_does_not_split_is_one_line():
    from trainfast.config import Speed
    from trainfast.train.speed import elastic as _elastic
    world = distributed.World(rank=0, size=3)
    with pytest.raises(TrainfastError, match=r"global batch of 32, which 3 processes cannot split evenly; resume "
                                             r"with a number of processes that divides it \(1, 2, 4, 8, 16, 32\)"):
        _elastic(Speed(batch_size=16), 2, world, print)
    assert _elastic(Speed(batch_size=16), 2, distributed.World(size=4), lambda m: None).batch_size == 8


def _two_nodes(args, port, env=None, timeout=180, node_args=None):
    """Two torchrun commands on this machine as two "nodes" (c10d rendezvous on 127.0.0.1, one
    process each, gloo): (returncode, stderr) of each, and the seconds until both ended.
    node_args: per node, arguments that replace `args` there."""
    import os
    import time
    started = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--node_rank", str(r), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
                               "--rdzv_id", f"test{port}", "-m", "trainfast", *(node_args or [args, args])[r]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **(env or {})}) for r in (0, 1)]
    out = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, o[1]) for p, o in zip(procs, out)], time.perf_counter() - started


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_localhost_train_as_one_process(stoppable, tmp_path):
    """torchrun across machines, tried on one: two "nodes" of one process each, batch 16, give the
    loss curve of one process with batch 32, into one run directory (rank 0's); when one node's
    process dies, the other stops within seconds and says so in one line, no hang."""
    model, train, ref = stoppable
    run = tmp_path / "run"
    args = ["train", str(train.path), "--model", f"{model}:small", "--epochs", "2", "--no-tune", "--batch-size", "16",
            "--threads", "1", "--run-dir", str(run), *COMMON]
    results, _ = _two_nodes(args, _free_port())
    assert all(rc == 0 for rc, _ in results), [err[-2000:] for _, err in results]
    assert sum("training " in err for _, err in results) == 1  # rank 0 speaks, wherever c10d put it
    assert _close(ref, _losses(run)), (ref, _losses(run))

    lost = tmp_path / "lost"
    args[args.index("--run-dir") + 1] = str(lost)
    args[args.index("--epochs") + 1] = "30"
    results, seconds = _two_nodes(args, _free_port(), env={"TEST_STOP_AT": "30", "TEST_STOP_WHO": "rank1-dies"})
    assert seconds < 120 and all(rc != 0 for rc, _ in results)
    said = [err for _, err in results if "another process of this run stopped" in err]
    assert len(said) == 1 and f"resume with torchrun … -m trainfast train --resume {lost}" in said[0]
    line = next(l for l in said[0].splitlines() if "another process of this run stopped" in l)
    assert line.startswith("trainfast train: error: ") and "Traceback" not in said[0].split(line)[0][-300:]


@pytest.mark.slow
def test_workers_whose_torchrun_is_killed_save_and_stop(stoppable, tmp_path):
    """SIGKILL of torchrun alone (its workers keep running in their own process group) used to
    leave both ranks training on as orphans: now they notice within a second, agree on a step,
    rank 0 saves, and both exit."""
    import os
    import signal
    import time
    model, train, _ = stoppable
    run = tmp_path / "orphans"
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              "-m", "trainfast", "train", str(train.path), "--model", f"{model}:small", "--epochs", "200",
                              "--no-tune", "--batch-size", "16", "--threads", "1", "--run-dir", str(run), *COMMON],
                             stdout=subprocess.DEVNULL, stderr=open(tmp_path / "stderr", "w"))

    def workers():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if str(run).encode() in cmd and b"torch.distributed.run" not in cmd:
                found.append(int(pid))
        return found
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.csv").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # some steps in
        assert len(workers()) == 2
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 60
        while workers() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not workers(), "the workers trained on as orphans:\n" + (tmp_path / "stderr").read_text()[-3000:]
    finally:  # never leave them running for the tests after this one
        agent.kill()
        for pid in workers():
            os.kill(pid, signal.SIGKILL)
    import torch
    assert torch.load(run / "last.pt", weights_only=True)["state"]["step"] > 0  # rank 0 saved where they stopped


@pytest.mark.slow
def test_resuming_where_one_node_lacks_the_run_directory_is_one_line_on_each(stoppable, tmp_path):
    """The run directory on one node's disk only: the node without it says what each node needs,
    and the other is told too, at once (it used to wait in the process group for it)."""
    model, train, _ = stoppable
    run = tmp_path / "run"
    p = _trainfast(["train", str(train.path), "--model", f"{model}:small", "--epochs", "2", "--no-tune",
                    "--batch-size", "32", "--threads", "1", "--run-dir", str(run), *COMMON], env={"TEST_STOP_AT": "5"})
    assert p.returncode == 130, p.stderr[-2000:]
    resume = ["train", "--resume", str(run), "--model", f"{model}:small", "--device", "cpu", "-q"]
    elsewhere = ["train", "--resume", str(tmp_path / "not-here"), "--model", f"{model}:small", "--device", "cpu", "-q"]
    results, seconds = _two_nodes(None, _free_port(), node_args=[resume, elsewhere])
    assert seconds < 120 and all(rc != 0 for rc, _ in results)
    assert "not-here: not a run directory to resume (no config.json) — under torchrun every node reads the run " \
           "directory" in results[1][1]
    assert "another node has no such run directory to resume" in results[0][1]

import subprocess
import sys

import pytest

from trainfast.cli import ExitStatus, _parser, main
from trainfast.data.format import Pack

SUBCOMMANDS = sorted(_parser()._subparsers._group_actions[0].choices)


def test_pack_in_process(image_folder, tmp_path, capsys):
    assert main(["pack", str(image_folder), str(tmp_path / "p"), "--size", "16x24", "-q"]) == ExitStatus.OK
    assert Pack(tmp_path / "p").shape == (16, 24, 3)
    assert main(["info", str(tmp_path / "p")]) == 0
    assert "24 images 16×24×3 raw" in capsys.readouterr().out


def test_user_error_is_one_line_not_a_traceback(tmp_path, capsys):
    assert main(["pack", str(tmp_path / "missing"), str(tmp_path / "p"), "--size", "8x8"]) == ExitStatus.ERROR
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "missing: no such file" in err and "Traceback" not in err


def test_bad_size_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["pack", "x", "y", "--size", "big"])
    assert e.value.code == ExitStatus.USAGE and "HxW" in capsys.readouterr().err


def test_subprocess_console_entry(image_folder, tmp_path):
    r = subprocess.run([sys.executable, "-m", "trainfast", "pack", str(image_folder), str(tmp_path / "p"),
                        "--size", "8", "--workers", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "packed 24 images (8×8×3 raw" in r.stderr


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: trainfast {command}") and len(out) > 100


def test_public_api_names():
    import trainfast
    assert callable(trainfast.fit) and callable(trainfast.pack)
    assert callable(trainfast.doctor) and callable(trainfast.tune)  # functions, as users spell them
    assert trainfast.doctor.__module__ == "trainfast.diagnose" and trainfast.tune.__module__ == "trainfast.tuning"
    assert trainfast.Pack and trainfast.Loader and trainfast.Augment
    assert "cifar_cnn" in trainfast.models.list()


def test_tune_takes_a_time_bound_and_lists_what_it_left_out(small_net_file, capsys):
    assert main(["tune", "--model", f"{small_net_file}:small", "--device", "cpu", "--max-seconds", "0.5",
                 "--no-compile", "--retune"]) == ExitStatus.OK
    out = capsys.readouterr().out
    assert "not timed, the tune's budget of 0.5 s spent:" in out and "fp32 + batch" in out
    with pytest.raises(SystemExit) as e:
        main(["tune", "--model", "cifar_cnn", "--max-seconds", "0"])
    assert e.value.code == ExitStatus.USAGE and "positive number of seconds" in capsys.readouterr().err


def test_a_reader_that_leaves_early_gets_no_traceback(digits_packs, monkeypatch, capsys):
    """`trainfast info PACK | head -1`: the pipe closes, and the command ends quietly."""
    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass
    train, _ = digits_packs
    monkeypatch.setattr("sys.stdout", Closed())
    assert main(["info", str(train.path)]) == 1
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--steps", "0"], ["--steps", "-3"], ["--batch-size", "2.5"], ["--seconds", "0"]])
def test_doctor_counts_must_be_positive(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--model", "cifar_cnn", "--data", "x.pack", *args])
    assert e.value.code == 2 and args[0] in capsys.readouterr().err  # argparse's one line, naming the option


@pytest.mark.skipif((__import__("os").cpu_count() or 1) < 2, reason="a thread count to lower needs two CPUs")
def test_quiet_train_leaves_out_how_the_run_adapts(digits_packs, small_net_file, tmp_path, monkeypatch, capsys):
    """Issue 50.10: -q printed the threads line (and a resume's position); it prints the plan,
    the epochs, notes and the result."""
    import torch

    from conftest import step_clock
    step_clock(monkeypatch, {2: 0.1, 1: 0.05})  # a neighbour makes the second thread cost time
    train, _ = digits_packs
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for quiet in ([], ["-q"]):
            assert main(["train", str(train.path), "--model", f"{small_net_file}:small", "--epochs", "1", "--no-tune",
                         "--batch-size", "64", "--device", "cpu", "--run-dir", str(tmp_path / f"run{len(quiet)}"),
                         *quiet]) == 0
            err = capsys.readouterr().err
            assert ("threads 2 → 1" in err) is not bool(quiet) and "epoch 1:" in err and "best validation" in err
    finally:
        torch.set_num_threads(before)

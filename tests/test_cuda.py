"""The CUDA paths, run for real on small data (skipped without a CUDA device; `-m cuda` selects them).

Beside these, every test that takes the `device` fixture runs on CUDA too: among them the Loader's
batches, kill-and-resume after SIGKILL (`test_fit.py`), the NaN guard that reads the device
every few steps, the doctor's report naming the GPU, tune through the CLI and the quick demo.
"""

import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import trainfast
from conftest import Signals
from trainfast import Augment, Loader
from trainfast.config import Speed, TrainConfig
from trainfast.diagnose.timing import step_breakdown
from trainfast.train import fit
from trainfast.tuning import tune

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
QUIET = dict(progress=False, log=lambda *a: None)


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    images = np.random.default_rng(0).integers(0, 255, (203, 24, 20, 3), dtype=np.uint8)
    return trainfast.pack((images, np.arange(203) % 5), tmp_path_factory.mktemp("cuda") / "p", size=(24, 20),
                          progress=False)


GEOMETRIC = Augment(crop_pad=3, flip=True)
ALL = Augment(translate=2, flip=True, brightness=0.3, contrast=0.3, cutout=5)


@pytest.mark.parametrize("dtype,augment,atol", [(torch.uint8, None, 0), (torch.uint8, GEOMETRIC, 0),
                                                (torch.float32, None, 1e-5), (torch.float32, ALL, 1e-4),
                                                (torch.bfloat16, ALL, 0.05)])
@pytest.mark.parametrize("resident", [True, False])
def test_loader_batches_on_cuda_are_the_cpu_batches(pack, dtype, augment, atol, resident):
    """Same seed, same order, same augmentations: the device only changes where the work runs,
    whether the pack is kept on the GPU or copied batch by batch on the side stream."""
    kw = dict(batch_size=32, seed=7, dtype=dtype, augment=augment)
    cpu_loader, gpu_loader = Loader(pack, device="cpu", **kw), Loader(pack, device="cuda", resident=resident, **kw)
    assert gpu_loader.resident == resident
    for _ in range(2):  # each pass is the next epoch: a fresh order and fresh augmentations
        cpu, gpu = list(cpu_loader), list(gpu_loader)
        assert len(cpu) == len(gpu) == 6
        for (xc, yc), (xg, yg) in zip(cpu, gpu):
            assert xg.device.type == "cuda" and xg.dtype == dtype and xg.is_contiguous(memory_format=torch.channels_last)
            assert torch.equal(yc, yg.cpu())
            if atol == 0:
                assert torch.equal(xc, xg.cpu())
            else:
                assert torch.allclose(xc.float(), xg.cpu().float(), atol=atol, rtol=0)


def test_step_breakdown_times_each_stage_with_cuda_events(pack):
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(16, 5))
    t = step_breakdown(net, Loader(pack, 32, device="cuda"), device=torch.device("cuda"), steps=4, warmup=2)
    assert t.forward > 0 and t.backward > 0 and t.optimizer > 0 and t.copy >= 0 and math.isfinite(t.loss)
    stages = sum(getattr(t, s) for s in ("data", "copy", "forward", "backward", "optimizer", "other"))
    assert abs(stages - t.step) < 1e-6 and t.images_per_s > 0


def test_tune_on_cuda_times_fp16_with_a_grad_scaler_and_bf16():
    net = trainfast.models.create("cifar_cnn")
    r = tune(net, (3, 32, 32), device="cuda", batch_size=64, try_compile=False, retune=True, log=lambda m: None)
    timed = {t.speed.precision for t in r.rows if t.images_per_s}
    assert {"fp32", "bf16", "fp16"} <= timed, r.table()
    assert r.best.precision in timed and "cuda" in trainfast.hardware.machine_key(torch.device("cuda"))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_fit_trains_in_reduced_precision(digits_packs, tmp_path, precision):
    train, test = digits_packs
    r = fit(Signals(), train, test, config=TrainConfig(epochs=3, optimizer="adamw", lr=3e-3), device="cuda",
            speed=Speed(precision, True, batch_size=64), run_dir=tmp_path / "run", **QUIET)
    losses = [h["train_loss"] for h in r.history]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] and r.best > 0.5, r.history
    ck = torch.load(tmp_path / "run" / "last.pt", map_location="cpu", weights_only=True)
    assert (ck["scaler"] is not None) == (precision == "fp16")
    assert ck["rng"]["device"] == "cuda" and ck["rng"]["cuda"].dtype == torch.uint8


def test_a_cuda_run_resumes_on_the_cpu_and_a_cpu_run_on_cuda(digits_packs, tmp_path):
    train, test = digits_packs
    for saved_on, resumed_on, precision in (("cuda", "cpu", "fp16"), ("cpu", "cuda", "fp32")):
        run = tmp_path / saved_on
        kw = dict(config=TrainConfig(epochs=2, lr_test=False), speed=Speed(precision, batch_size=64), run_dir=run,
                  progress=False)
        with pytest.raises(KeyboardInterrupt):
            fit(Signals(5), train, test, device=saved_on, log=lambda *a: None, **kw)
        notes = []
        r = fit(Signals(), train, test, device=resumed_on, resume=True, log=notes.append,
                **{k: v for k, v in kw.items() if k != "config"})
        assert len(r.history) == 2 and math.isfinite(r.history[-1]["train_loss"])
        assert any(f"saved on {saved_on} and resumes on {resumed_on}" in n for n in notes), notes
        if precision == "fp16":
            assert any(n.startswith("fp16 cannot run on cpu") for n in notes)


def _train_cmd(digits_packs, small_net_file, run_dir):
    train, _ = digits_packs
    return ["-m", "trainfast", "train", str(train.path), "--model", f"{small_net_file}:small", "--epochs", "1",
            "--no-tune", "--batch-size", "32", "--run-dir", str(run_dir), "-q"]


def test_torchrun_one_process_per_gpu(digits_packs, small_net_file, tmp_path):
    n = torch.cuda.device_count()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
                        *_train_cmd(digits_packs, small_net_file, tmp_path / "run")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("training ") == 1 and " on cuda" in r.stderr
    assert (tmp_path / "run" / "last.pt").exists()


def test_torchrun_with_more_processes_than_gpus_ends_with_one_clear_line(digits_packs, small_net_file, tmp_path):
    n = torch.cuda.device_count()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n + 1),
                        *_train_cmd(digits_packs, small_net_file, tmp_path / "run")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    ours = [l for l in r.stderr.splitlines() if l.startswith("trainfast train: error:")]
    assert ours == [f"trainfast train: error: {n + 1} processes on a machine with {n} CUDA device"
                    f"{'s' if n != 1 else ''}: use --nproc_per_node {n}, or --device cpu"], r.stderr[-3000:]
    assert not re.search(r'File ".*/trainfast/', r.stderr)  # no traceback of ours; torchrun's summary quotes the line
    assert not (tmp_path / "run" / "last.pt").exists()


def test_gpu_jpeg_decode_matches_the_cpu_decode_and_is_not_overwritten(tmp_path, image_folder):
    """Batched nvJPEG (torchvision) against the CPU decode of the same bytes; and work queued on
    a batch that is then dropped reads that batch's pixels, not the next decode's (torchvision
    0.28 on an H100 wrote into memory that queued work still read)."""
    from trainfast.data.loader import gpu_jpeg_decoder
    if gpu_jpeg_decoder(torch.device("cuda"), 3) is None:
        pytest.skip("torchvision ≥ 0.20 with CUDA decode is not installed")
    jpg = trainfast.pack(image_folder, tmp_path / "j", size=(32, 32), encoding="jpeg", quality=90, progress=False)
    kw = {"batch_size": 8, "seed": 1, "dtype": torch.uint8, "device": "cuda"}
    gpu, cpu = Loader(jpg, decode="gpu", **kw), Loader(jpg, decode="cpu", **kw)
    assert "nvJPEG" in gpu.describe()
    reference = []
    for (xg, yg), (xc, yc) in zip(gpu, cpu):  # epoch 0, synchronised after each batch
        assert torch.equal(yg, yc)
        diff = (xg.float() - xc.float()).abs()
        assert diff.mean() < 2.0, diff.mean()  # IDCT and chroma upsampling differ slightly
        reference.append(xg.double().sum())
        torch.cuda.synchronize()
    gpu.set_epoch(0)
    queued = []
    a = torch.randn(2048, 2048, device="cuda")
    for x, _ in gpu:  # epoch 0 again, the GPU kept busy: each sum runs after the batch is dropped
        for _ in range(4):
            a = (a @ a).tanh_()
        queued.append(x.double().sum())
        del x
    assert torch.equal(torch.stack(queued), torch.stack(reference))

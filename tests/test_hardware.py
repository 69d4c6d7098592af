"""What this machine is, and how busy other processes keep it."""

import subprocess
import sys
import time

import pytest
import torch

from conftest import other_load
from trainfast import hardware


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_other_load_counts_a_busy_neighbour_and_not_ourselves():
    with hardware.OtherLoad() as own:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.5:  # this process's own work is not "other"
            pass
    assert own.cores is not None and own.cores < 0.3 and own.warning() == ""
    spin = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 1.5: pass"
    neighbour = subprocess.Popen([sys.executable, "-c", spin])
    time.sleep(0.2)  # past its start-up
    with hardware.OtherLoad() as busy:
        time.sleep(1.0)
    neighbour.wait()
    assert busy.cores > 0.7 and "other processes kept" in busy.warning()


def test_fast_precisions_follow_the_cpu_flags(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(hardware, "isa_features", lambda: ["AVX2", "AVX-512", "AVX512-BF16"])
    assert hardware.fast_precisions(cpu) == ("bf16",)
    monkeypatch.setattr(hardware, "isa_features", lambda: ["AVX2"])
    assert hardware.fast_precisions(cpu) == ()  # bf16 would be emulated; fp16 never on a CPU


def test_peaks_measured_on_a_busy_machine_are_used_but_not_cached(monkeypatch):
    cpu = torch.device("cpu")
    fake = {"matmul_flops": {"float32": 1e9}, "copy_bytes": 1e9}
    monkeypatch.setattr(hardware, "measure_peaks", lambda d: dict(fake))
    monkeypatch.setattr(hardware, "machine_key", lambda d: "test-busy-peaks")
    other_load(monkeypatch, 1.3)
    busy = hardware.peaks(cpu)
    assert busy["busy"] and not busy["cached"] and busy["other_cores"] == 1.3
    assert not hardware.peaks(cpu)["cached"]  # measured again: the busy figure was not kept
    other_load(monkeypatch, 0.0)
    quiet = hardware.peaks(cpu)
    assert not quiet["busy"] and not quiet["cached"] and hardware.peaks(cpu)["cached"]
    other_load(monkeypatch, 1.3)  # a busy remeasure keeps the quiet figure
    assert hardware.peaks(cpu, remeasure=True)["cached"]


def test_denormals_are_flushed_in_the_block_and_the_callers_setting_comes_back():
    import torch

    from trainfast.hardware import denormals_flushed as flushed
    from trainfast.hardware import flushed_denormals

    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    with flushed_denormals():
        assert flushed()
        tiny = torch.full((4,), 1e-30) * torch.full((4,), 1e-10)  # 1e-40: a denormal result
        assert (tiny == 0).all()
    assert not flushed()
    torch.set_flush_denormal(True)  # a user who flushes already keeps it
    try:
        with flushed_denormals():
            assert flushed()
        assert flushed()
    finally:
        torch.set_flush_denormal(False)

import torch
import torch.nn as nn

from trainfast import tuning as tune_mod
from trainfast.cli import main
from trainfast.models import rewrite
from trainfast.tuning import Trial, tune


def _net():
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    net.output_shape = (4,)
    return net


def _fake(speeds):
    """A fake clock: images/s as a function of the settings, without running anything."""
    def measure(model, shape, out, speed, device):
        speeds.append(speed)
        rate = 100.0
        rate *= 2.0 if speed.precision == "bf16" else 1.0
        rate *= 1.5 if speed.channels_last else 1.0
        rate *= {32: 0.8, 64: 1.0, 128: 1.2, 256: 1.25, 512: 1.0}.get(speed.batch_size, 1.0)
        rate *= 0.5 if speed.compile else 1.0
        rate *= 1.2 if speed.rewrites else 1.0
        loss = 2.0 if speed.precision != "fp16" else float("nan")
        return Trial(speed, rate, loss)
    return measure


def test_picks_the_fastest_measured_and_caches(monkeypatch):
    monkeypatch.setattr("trainfast.step.supports_bf16", lambda d: True)
    tried = []
    r = tune(_net(), (3, 8, 8), device="cpu", measure=_fake(tried), retune=True, log=lambda m: None)
    assert r.best.precision == "bf16" and r.best.channels_last and r.best.batch_size == 256 and not r.best.compile
    assert r.best.rewrites == rewrite.ALL
    assert any(s.compile for s in tried)  # compile was measured, and lost
    assert "bf16 + channels_last + batch 256 + rewrites" in r.table().splitlines()[1]
    again = []
    r2 = tune(_net(), (3, 8, 8), device="cpu", measure=_fake(again), log=lambda m: None)
    assert r2.cached and again == [] and r2.best == r.best


def test_unsound_candidates_are_rejected(monkeypatch):
    monkeypatch.setattr("trainfast.step.supports_bf16", lambda d: True)

    def measure(model, shape, out, speed, device):
        loss = 9.0 if speed.precision == "bf16" else 2.0  # bf16 'diverges' on the same batch
        return Trial(speed, 1000.0 if speed.precision == "bf16" else 100.0, loss)
    r = tune(_net(), (3, 8, 8), device="cpu", batch_size=64, try_compile=False, measure=measure, retune=True,
             log=lambda m: None)
    assert r.best.precision == "fp32" and "rejected" in r.table()


def test_pinned_batch_is_kept(monkeypatch):
    r = tune(_net(), (3, 8, 8), device="cpu", batch_size=32, measure=_fake([]), try_compile=False, retune=True,
             log=lambda m: None)
    assert r.best.batch_size == 32


def test_real_measurement_and_cli(capsys, device):
    assert main(["tune", "--model", "cifar_cnn", "--batch-size", "16", "--no-compile", "--retune",
                 "--device", device]) == 0
    out = capsys.readouterr().out
    assert "chosen:" in out and "fp32 + batch 16" in out
    t = tune_mod.measure_trial(_net(), (3, 8, 8), (4,), tune_mod.Speed(batch_size=8), torch.device(device))
    assert t.images_per_s > 0 and t.loss > 0


def test_rewrites_can_be_left_out(monkeypatch):
    monkeypatch.setattr("trainfast.step.supports_bf16", lambda d: True)
    tried = []
    r = tune(_net(), (3, 8, 8), device="cpu", measure=_fake(tried), try_rewrites=False, retune=True, log=lambda m: None)
    assert not r.best.rewrites and not any(s.rewrites for s in tried)


def test_rewrites_are_tried_again_at_the_chosen_batch(monkeypatch):
    """A rewrite that does not pay at the starting batch but does at the larger one is found."""
    monkeypatch.setattr("trainfast.step.supports_bf16", lambda d: True)

    def measure(model, shape, out, speed, device):
        rate = {64: 100.0, 128: 120.0, 256: 110.0}.get(speed.batch_size, 50.0)
        if speed.rewrites:
            rate *= 1.0 if speed.batch_size == 64 else 1.2
        return Trial(speed, rate, 2.0)
    r = tune(_net(), (3, 8, 8), device="cpu", try_compile=False, measure=measure, retune=True, log=lambda m: None)
    assert r.best.batch_size == 128 and r.best.rewrites == rewrite.ALL


def test_one_lucky_timing_does_not_decide(monkeypatch):
    """bf16 at batch 64 times fast once, then slow; channels_last is steadily fast: the
    final's further timings of the fastest few make channels_last win."""
    monkeypatch.setattr("trainfast.step.supports_bf16", lambda d: True)
    seen = []

    def measure(model, shape, out, speed, device):
        key = (speed.precision, speed.channels_last, speed.batch_size, speed.rewrites)
        seen.append(key)
        if key == ("bf16", False, 64, ()):
            rate = 300.0 if seen.count(key) == 1 else 100.0
        elif key == ("fp32", True, 64, ()):
            rate = 250.0
        else:
            rate = 50.0
        return Trial(speed, rate, 2.0)
    r = tune(_net(), (3, 8, 8), device="cpu", try_compile=False, measure=measure, retune=True, log=lambda m: None)
    assert (r.best.precision, r.best.channels_last) == ("fp32", True)
    assert "median of 300, 100, 100" in r.table() and r.table().splitlines()[1].split()[1:4] == ["fp32", "+", "channels_last"]


def test_the_final_times_the_winners_untried_neighbours(monkeypatch):
    """The rewrites pay at the starting batch and cost at the larger one the search moves to;
    the search never times that batch without them, the final does, and it wins."""
    seen = []

    def measure(model, shape, out, speed, device):
        seen.append(speed.label())
        rate = {64: 100.0, 128: 150.0}.get(speed.batch_size, 50.0)
        if speed.rewrites:
            rate *= 1.05 if speed.batch_size == 64 else 0.8
        return Trial(speed, rate, 2.0)
    r = tune(_net(), (3, 8, 8), device="cpu", try_compile=False, measure=measure, retune=True, log=lambda m: None)
    assert (r.best.batch_size, r.best.rewrites) == (128, ())
    assert seen.count("fp32 + batch 128") == 3  # untimed before the final: three timings there

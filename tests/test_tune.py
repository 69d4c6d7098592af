from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from conftest import other_load
from trainfast import hardware
from trainfast import tuning as tune_mod
from trainfast.cli import main
from trainfast.config import Speed
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
    t = tune_mod.measure_trial(_net(), (3, 8, 8), (4,), Speed(batch_size=8), torch.device(device))
    assert t.images_per_s > 0 and t.loss > 0


def test_rewrites_can_be_left_out(monkeypatch):
    monkeypatch.setattr("trainfast.step.supports_bf16", lambda d: True)
    tried = []
    r = tune(_net(), (3, 8, 8), device="cpu", measure=_fake(tried), try_rewrites=False, retune=True, log=lambda m: None)
    assert not r.best.rewrites and not any(s.rewrites for s in tried)


def test_on_a_cpu_the_rewrites_come_first_and_are_left_out_where_they_cost(monkeypatch):
    """A CPU search starts with the rewrites in (they save memory passes and dropout's slow
    draws there, so a run too short to search has them too), and times the best precision and
    layout without them: where that is faster, the result has none."""
    monkeypatch.setattr("trainfast.step.supports_bf16", lambda d: False)
    seen = []

    def measure(model, shape, out, speed, device):
        seen.append(speed)
        return Trial(speed, 100.0 * (0.8 if speed.rewrites else 1.0) * (1.2 if speed.channels_last else 1.0), 2.0)
    r = tune(_net(), (3, 8, 8), device="cpu", try_compile=False, try_threads=False, measure=measure, retune=True,
             log=lambda m: None)
    assert seen[0].rewrites == rewrite.ALL and seen[1].rewrites == rewrite.ALL  # the reference, then channels_last
    assert seen[2] == replace(seen[1], rewrites=())
    assert r.best.channels_last and r.best.rewrites == ()


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
    r = tune(_net(), (3, 8, 8), device="cpu", try_compile=False, try_rewrites=False, measure=measure, retune=True,
             log=lambda m: None)
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


def _launch_bound_gpu(tried):
    """A fake GPU clock: each step pays a fixed launch cost (cut tenfold by CUDA graphs) plus a
    cost per image that falls with precision and channels_last; over 4096 images is out of memory."""
    per_image = {"fp32": 10e-6, "tf32": 6e-6, "bf16": 3e-6, "fp16": 3.1e-6}

    def measure(model, shape, out, speed, device):
        tried.append(speed)
        if speed.batch_size > 4096:
            return Trial(speed, None, note="out of memory")
        launch = 0.2e-3 if speed.compile else 2e-3
        step = launch + speed.batch_size * per_image[speed.precision] * (0.7 if speed.channels_last else 1.0)
        return Trial(speed, speed.batch_size / step, 2.0, compile_s=30.0 if speed.compile else 0.0)
    return measure


def _fake_gpu(monkeypatch):
    monkeypatch.setattr("trainfast.hardware.resolve_device", lambda d: torch.device("cuda"))
    monkeypatch.setattr("trainfast.hardware.machine_key", lambda d: "fake launch-bound GPU")
    monkeypatch.setattr("trainfast.hardware.fast_precisions", lambda d: ("tf32", "bf16", "fp16"))
    monkeypatch.setattr("trainfast.step.fast_precisions", lambda d: ("tf32", "bf16", "fp16"))


def test_on_a_launch_bound_gpu_the_search_fills_the_device_before_judging_precision(monkeypatch):
    """At batch 64 every setting is launch-bound (bf16 + channels_last only 1.2× fp32); the
    search first grows the batch until fp32's time per image stops falling, compares the
    precisions there, and ends at the fast corner: bf16 + channels_last, the largest batch
    that fits, CUDA graphs."""
    _fake_gpu(monkeypatch)
    tried = []
    r = tune(_net(), (3, 8, 8), device="cuda", measure=_launch_bound_gpu(tried), retune=True, log=lambda m: None)
    assert (r.best.precision, r.best.channels_last, r.best.batch_size, r.best.compile) == ("bf16", True, 4096, True)
    fill = [s.batch_size for s in tried if s.precision == "fp32" and not s.channels_last][:6]
    assert fill == [64, 128, 256, 512, 1024, 2048]  # 2048 gains < 10% over 1024: filled at 1024
    judged = {(s.precision, s.channels_last) for s in tried if s.batch_size == 1024}
    assert judged >= {("fp32", True), ("tf32", False), ("bf16", True), ("fp16", True)}
    assert not any(s.precision != "fp32" and s.batch_size < 1024 for s in tried)


def test_gpu_search_stays_under_the_callers_max_batch(monkeypatch):
    _fake_gpu(monkeypatch)
    tried = []
    r = tune(_net(), (3, 8, 8), device="cuda", measure=_launch_bound_gpu(tried), max_batch=256, try_compile=False,
             retune=True, log=lambda m: None)
    assert max(s.batch_size for s in tried) == 256 and r.best.batch_size == 256 and r.best.precision == "bf16"


def test_fit_bounds_the_batch_by_the_data_and_takes_compile_only_where_it_pays():
    from trainfast.config import Speed
    from trainfast.train.speed import pays as _pays
    from trainfast.tuning import data_max_batch
    assert (data_max_batch(1294), data_max_batch(20_000), data_max_batch(100)) == (32, 512, 8)
    fast, plain = Speed("bf16", True, compile=True, batch_size=512), Speed("bf16", True, batch_size=512)
    rows = [{"label": fast.label(), "images_per_s": 200.0, "compile_s": 10.0},
            {"label": plain.label(), "images_per_s": 100.0, "compile_s": 0.0}]
    said = []
    assert _pays(fast, rows, 1_000, said.append) == plain  # saves 5 s, compiles in 10
    assert "saves" not in said[0] and "5.0 s" in said[0] and "10.0 s to compile" in said[0]
    assert _pays(fast, rows, 10_000, said.append) == fast  # saves 50 s


def _one_second_trials(monkeypatch):
    """_fake's clock, where each trial also takes one second of the tune's own clock."""
    monkeypatch.setattr("trainfast.step.supports_bf16", lambda d: True)
    now = [0.0]
    monkeypatch.setattr("trainfast.tuning.budget.clock", lambda: now[0])
    fake = _fake([])

    def slow(*args):
        now[0] += 1.0
        return fake(*args)
    return slow


def test_a_budget_bounds_the_tune_and_says_what_it_left_out(monkeypatch):
    """Each fake trial takes 1 s; 10% of a run of 14,400 images leaves 14.4 s after the first
    measurement at its rate (100/s), 4.8 s at bf16 + channels_last's (300/s) and 4 s at the
    fastest (with rewrites, 360/s): the run the tune serves trains at what it finds. The
    search stops there, names what it did not time, and is cached with its budget: reused by
    a tune whose budget is no larger."""
    slow = _one_second_trials(monkeypatch)
    said = []
    r = tune(_net(), (3, 8, 8), device="cpu", batch_size=64, measure=slow, planned_images=14_400, budget_share=0.1,
             retune=True, log=said.append)
    assert r.budget_s == 5.0 and len([t for t in r.rows if t.images_per_s]) == 5 and r.not_timed
    assert r.seconds <= r.budget_s  # a measurement that would end past the bound is not begun
    assert "not timed, the tune's budget of 5.0 s spent:" in r.table() and any("cached with that budget" in m
                                                                               for m in said)
    def again(**bounds):
        return tune(_net(), (3, 8, 8), device="cpu", batch_size=64, measure=slow, log=lambda m: None, **bounds)
    same = again(planned_images=14_400, budget_share=0.1)  # the same budget would time the same: reused
    assert same.cached and same.best == r.best and same.not_timed and "not timed" in same.table()
    assert again(planned_images=15_840, budget_share=0.1).cached  # 5.4 s: within 25%
    assert not again(planned_images=21_600, budget_share=0.1).cached  # 7 s: measures again
    assert not again(max_seconds=60).cached  # a budget 12× larger measures again, completes, is cached whole
    whole = again()
    assert whole.cached and not whole.not_timed and again(planned_images=14_400, budget_share=0.1).cached


def test_a_time_bound_holds_alone_or_with_the_share(monkeypatch):
    slow = _one_second_trials(monkeypatch)
    r = tune(_net(), (3, 8, 8), device="cpu", batch_size=64, measure=slow, max_seconds=3, retune=True,
             log=lambda m: None)
    assert r.budget_s == 3 and len([t for t in r.rows if t.images_per_s]) == 3 and r.not_timed and r.seconds <= 3
    slow = _one_second_trials(monkeypatch)
    r = tune(_net(), (3, 8, 8), device="cpu", batch_size=64, measure=slow, planned_images=14_400, budget_share=0.1,
             max_seconds=30, retune=True, log=lambda m: None)
    assert r.budget_s == 5.0  # the share's 4 s after the first 1 s is the tighter bound


def test_no_measurement_is_begun_that_would_end_past_the_budget(monkeypatch):
    """Measuring takes longer at a larger batch (a fixed number of steps), and a compile adds
    its own time: the tune predicts each from the last measurement and begins none that would
    end past its bound, for every bound in turn."""
    monkeypatch.setattr("trainfast.step.supports_bf16", lambda d: True)
    now = [0.0]
    monkeypatch.setattr("trainfast.tuning.budget.clock", lambda: now[0])
    fake = _fake([])

    def measure(model, shape, out, speed, device):
        now[0] += speed.batch_size / 64 + (10.0 if speed.compile else 0.0)  # 1 s at 64, 2 s at 128, …
        return fake(model, shape, out, speed, device)
    for limit in range(2, 40):
        r = tune(_net(), (3, 8, 8), device="cpu", measure=measure, max_seconds=limit, retune=True,
                 log=lambda m: None)
        timed = [t for t in r.rows if t.images_per_s]
        assert r.seconds <= limit or len(timed) <= 2, (limit, r.seconds)  # the first two are always timed
    r = tune(_net(), (3, 8, 8), device="cpu", measure=measure, max_seconds=1000, retune=True, log=lambda m: None)
    assert not r.not_timed and any(t.speed.compile for t in r.rows)  # a bound that allows all times all


def test_the_first_batch_is_sized_to_the_models_cost_on_a_cpu():
    from trainfast.models import create
    cpu = torch.device("cpu")
    assert tune_mod.start_batch_for(create("cifar_cnn"), (3, 32, 32), cpu, 512) == 64
    big = tune_mod.start_batch_for(create("classifier512"), (3, 512, 512), cpu, 512)
    assert 4 <= big <= 8  # 6 GFLOP per training image: about 13 s per step at batch 64 on 2 cores
    assert tune_mod.start_batch_for(create("cifar_cnn"), (3, 32, 32), cpu, 16) == 16


def test_a_cheap_first_forward_skips_the_probe_and_a_dear_one_does_not():
    """first_forward's time bounds a step's: three times its cost per image over the batch. Where
    that is within the step's allowance no probe runs (the model here would answer 4 if probed);
    where it is not, the probe decides, as without it."""
    import time as _time

    probed = []  # the batches run (the probe runs a copy of the model)

    class Dear(nn.Module):  # a probe finds a step at 8 images or more far too long
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            probed.append(x.shape[0])
            _time.sleep(0.1 * x.shape[0])
            return self.conv(x).mean((2, 3))
    cpu, net = torch.device("cpu"), Dear()
    assert tune_mod.start_batch_for(net, (3, 8, 8), cpu, 32, step_s=0.5, forward_s=4 * 0.5 / (3 * 32)) == 32
    assert probed == []
    assert tune_mod.start_batch_for(net, (3, 8, 8), cpu, 32, step_s=0.5, forward_s=0.1) == 4 and probed


def test_a_budget_spent_during_the_final_keeps_the_best_timed(monkeypatch):
    for spent_after in range(1, 16):  # the budget runs out at every point of the search in turn
        slow = _one_second_trials(monkeypatch)
        r = tune(_net(), (3, 8, 8), device="cpu", measure=slow, planned_images=100 * spent_after * 10,
                 budget_share=0.1, try_compile=False, retune=True, log=lambda m: None)
        timed = [t for t in r.rows if t.images_per_s]
        assert r.best.label() in {t.speed.label() for t in timed}


def test_tune_checks_its_input_and_takes_a_pack(monkeypatch, digits_packs):
    import pytest

    from trainfast.errors import TrainfastError
    with pytest.raises(TrainfastError, match=r"looks like a pack's \(H, W, C\): give \(3, 32, 32\)"):
        tune(_net(), (32, 32, 3), device="cpu", measure=_fake([]), log=lambda m: None)
    with pytest.raises(TrainfastError, match=r"does not take inputs of shape \(1, 8, 8\)"):
        tune(_net(), (1, 8, 8), device="cpu", measure=_fake([]), log=lambda m: None)
    with pytest.raises(TrainfastError, match="tune takes an nn.Module, not a str"):
        tune("cifar_cnn", (3, 8, 8), device="cpu", log=lambda m: None)
    lazy = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4))
    tried = []
    train, _ = digits_packs  # 1,15x images: fit would bound the batch at 32, and so does a tune given the pack
    r = tune(lazy, train, device="cpu", measure=_fake(tried), try_compile=False, retune=True, log=lambda m: None)
    assert max(s.batch_size for s in tried) == 32 and r.best.batch_size <= 32
    assert tuple(lazy[3].weight.shape) == (4, 8 * 32 * 32)  # materialised by the first forward


def test_a_standalone_tune_is_bounded_and_takes_the_data_size(monkeypatch):
    """Without fit's budget, tune stops after STANDALONE_S; given the training images it tries
    only batches that leave fit's 32 steps per epoch (1,000 images: at most 16)."""
    tried = []
    r = tune(_net(), (3, 8, 8), device="cpu", images=1000, measure=_fake(tried), retune=True, log=lambda m: None)
    assert r.budget_s == tune_mod.STANDALONE_S
    assert max(s.batch_size for s in tried) == 16 and r.best.batch_size <= 16
    fits = tune(_net(), (3, 8, 8), device="cpu", planned_images=10_000, budget_share=0.0, measure=_fake([]),
                retune=True, log=lambda m: None)
    assert fits.budget_s is None  # fit's tune with --tune-share 0: no bound, as documented


def test_the_soundness_loss_is_measured_on_the_same_images_at_every_batch():
    """Each batch size used to draw its own random labels: a fast setting at another batch was
    'rejected' for a loss that only differed by its labels (ConvNeXt: 2.4657 vs 2.3192)."""
    from trainfast.config import Speed

    net, cpu = _net(), torch.device("cpu")
    a = tune_mod.measure_trial(net, (3, 8, 8), (4,), Speed(batch_size=8), cpu, steps=1, min_seconds=0)
    b = tune_mod.measure_trial(net, (3, 8, 8), (4,), Speed(batch_size=64), cpu, steps=1, min_seconds=0)
    assert a.loss is not None and a.loss == b.loss


def test_rewrites_that_match_nothing_are_not_timed():
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, 4))
    tried = []
    tune(net, (3, 8, 8), device="cpu", measure=_fake(tried), retune=True, log=lambda m: None)
    assert tried and not any(s.rewrites for s in tried)  # a "+ rewrites" timing would time the same model
    tried.clear()
    tune(_net(), (3, 8, 8), device="cpu", measure=_fake(tried), retune=True, log=lambda m: None)
    assert any(s.rewrites for s in tried)  # _net's ReLU after a convolution can be made in place


@pytest.mark.parametrize("one_thread_gain", [2.0, 0.6])
def test_a_busy_machine_has_fewer_threads_timed_said_and_not_cached(monkeypatch, one_thread_gain):
    """Other processes hold one of two cores: tune times half the threads beside all of them (issue
    51.2: whether they yield their core is not in their CPU share) and keeps what was faster — one
    thread beside a program at equal priority, two beside one at low priority — says so, and the
    next tune measures again instead of reusing it."""
    other_load(monkeypatch, 1.0)
    torch.set_num_threads(2)
    said = []

    def measure(model, shape, out, speed, device):
        gain = one_thread_gain if speed.threads == 1 else 1.0
        return Trial(speed, 100.0 * speed.batch_size ** 0.1 * gain, 2.0)
    r = tune(_net(), (3, 8, 8), device="cpu", measure=measure, try_compile=False, retune=True, log=said.append)
    assert torch.get_num_threads() == 2 and any(t.speed.threads == 1 for t in r.rows)
    assert r.best.threads == (1 if one_thread_gain > 1 else 0)  # 0: torch's own count
    assert r.busy and "the machine was busy: other processes kept 1.0 of its 2 cores" in r.table()
    assert any("1 thread will be timed beside 2" in m for m in said)
    r = tune(_net(), (3, 8, 8), device="cpu", measure=measure, try_compile=False, try_threads=False, retune=True,
             log=lambda m: None)  # fit's tune, where the run times its own threads: no count the run would drop
    assert not any(t.speed.threads for t in r.rows)
    again = []
    r2 = tune(_net(), (3, 8, 8), device="cpu", measure=lambda *a: again.append(1) or measure(*a), try_compile=False,
              log=lambda m: None)
    assert again and not r2.cached
    other_load(monkeypatch, 0.0)  # quiet now: measured, cached, and reused from then on
    r3 = tune(_net(), (3, 8, 8), device="cpu", measure=measure, try_compile=False, log=lambda m: None)
    r4 = tune(_net(), (3, 8, 8), device="cpu", measure=measure, try_compile=False, log=lambda m: None)
    assert not r3.cached and not r3.busy and r4.cached and "busy" not in r3.table()


def test_the_batch_search_does_not_stop_below_64_on_slow_timings_or_while_others_load_the_machine(monkeypatch):
    monkeypatch.setattr("trainfast.tuning.measure.start_batch_for", lambda *a: 8)
    rates = {8: 100.0, 16: 90.0, 32: 80.0, 64: 200.0, 128: 150.0, 256: 140.0, 512: 300.0}
    loud = {"now": False}

    def measure(model, shape, out, speed, device):
        loud["now"] = speed.batch_size in (128, 256)  # a burst of load during those two timings
        return Trial(speed, rates[speed.batch_size], 2.0)
    other_load(monkeypatch, lambda: 1.5 if loud["now"] else 0.0)
    r = tune(_net(), (3, 8, 8), device="cpu", measure=measure, try_compile=False, try_rewrites=False, retune=True,
             log=lambda m: None)
    assert r.best.batch_size == 512  # 16 and 32 slower, but 64 is timed; 128 and 256 slower in a burst, 512 timed


def test_the_first_batch_is_sized_by_a_warm_forward_pass_not_by_the_first_calls(monkeypatch):
    """A model whose first calls are slow (one-time set-up; first_forward's training-mode pass)
    but whose forward pass is cheap once warm: tune sizes the first batch by a warm pass, so no
    probe (a copy and three steps) runs before a short run's first step."""
    import time as _time

    class SlowAtFirst(nn.Module):
        calls = 0

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            SlowAtFirst.calls += 1
            if SlowAtFirst.calls <= 2 or self.training:  # first_forward's two passes; any training step
                _time.sleep(0.2)
            return self.conv(x).mean((2, 3))
    seen = []
    real = tune_mod.start_batch_for

    def spy(*args):
        seen.append(args[-1])  # forward_s
        return real(*args)
    monkeypatch.setattr("trainfast.tuning.measure.start_batch_for", spy)
    monkeypatch.setattr("trainfast.tuning.budget.short_run", lambda *a: None)
    monkeypatch.setattr(tune_mod.CpuSearch, "run", lambda self: Trial(self.first_speed(), 100.0, 2.0))
    r = tune(SlowAtFirst(), (3, 8, 8), device="cpu", max_batch=32, try_compile=False, retune=True,
             log=lambda m: None)
    assert seen and seen[0] < 0.1 and r.best.batch_size == 32  # 0.4 s had read a step at 32 as 4.8 s: a probe


def test_a_slow_probe_does_not_decide_the_first_batch():
    """A model whose step costs the same at any batch (as a busy moment makes a small probe look):
    the probe at batch 4 says 0.1 s per image, the upward check finds batch 64 steps fast."""
    import time as _time

    class Slow(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            _time.sleep(0.05 if x.shape[0] > 4 else 0.4)  # the probe's batch runs slowly, as beside a busy neighbour
            return self.conv(x).mean((2, 3))
    assert tune_mod.start_batch_for(Slow(), (3, 8, 8), torch.device("cpu"), 512) == 64


def test_on_a_busy_machine_a_compile_is_expected_to_take_longer(monkeypatch):
    """A compile's workers share the cores with the other programs: with one of two cores held,
    the tune expects twice COMPILE_GUESS_S, and does not begin a compile that would then end
    past its bound (a standalone tune under load used to run 71 s against its 60)."""
    monkeypatch.setattr("trainfast.step.supports_bf16", lambda d: True)
    now = [0.0]
    monkeypatch.setattr("trainfast.tuning.budget.clock", lambda: now[0])
    fake = _fake([])

    def measure(model, shape, out, speed, device):
        now[0] += 1.0 + (tune_mod.COMPILE_GUESS_S if speed.compile else 0.0)
        return fake(model, shape, out, speed, device)

    def compiled(load, limit):
        other_load(monkeypatch, load)
        now[0] = 0.0
        r = tune(_net(), (3, 8, 8), device="cpu", measure=measure, max_seconds=limit, retune=True, log=lambda m: None)
        before = next((i for i, t in enumerate(r.rows) if t.speed.compile), None)
        return before if any(t.speed.compile and t.images_per_s for t in r.rows) else None
    for load in (0.0, 1.0):
        n = compiled(load, 1000)  # timings before the compile, with no bound
        assert n is not None
        limit = n + 1 + tune_mod.COMPILE_GUESS_S * 1.5  # room for a quiet guess, not for twice it
        assert (compiled(load, limit) is not None) == (load == 0.0), load


def test_a_first_step_slow_enough_to_call_a_run_short_ends_the_quick_timing():
    """The quick timing stops after its warm-up step where that step's rate already says the
    run is too short to search: a first step understates the rate, and at a higher rate the run
    is shorter still (tuning.too_short). Otherwise it times on."""
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    asked = []

    def settled(rate, batch):
        asked.append((rate, batch))
        return True
    speed = Speed(batch_size=8)
    t = tune_mod.measure_trial(net, (3, 8, 8), (3,), speed, torch.device("cpu"), steps=1, warmup=1, min_seconds=0.0,
                               settled=settled)
    assert t.note == "a first step" and len(asked) == 1 and asked[0] == (t.images_per_s, 8) and t.loss is not None
    t = tune_mod.measure_trial(net, (3, 8, 8), (3,), speed, torch.device("cpu"), steps=1, warmup=1, min_seconds=0.0,
                               settled=lambda rate, batch: False)
    assert t.note == "" and t.images_per_s > 0  # timed on

    bench = tune_mod.Bench(net, (3, 8, 8), (3,), torch.device("cpu"), None, print, max_seconds=None,
                            planned_images=7_000, budget_share=0.1)
    rates = [50.0, 100.0, 200.0, 400.0, 800.0, 1600.0]
    short = [tune_mod.too_short(bench, r, 32)[0] for r in rates]
    assert short == sorted(short)  # short at one rate: short at every higher one (False... then True...)
    assert short[0] is False and short[-1] is True  # 14 s of training at 50 images/s pays; 0.4 s at 1,600 does not


def test_a_run_too_short_for_a_search_gets_one_quick_comparison(monkeypatch):
    """fit's tune first times a few steps (the probe): where its share of the planned training
    would not pay for a search's first two measurements, it compares only the likeliest winner
    with that (taken where SHORT_GAIN× faster and sound), says why, and caches nothing (a
    longer run searches). A long enough run searches as before, its budget counted from after
    the probe."""
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    slow = _one_second_trials(monkeypatch)  # each measurement, the probe's too, takes 1 s of the tune's clock
    tried, said = [], []

    def probe(model, shape, out, speed, device):
        tried.append(speed)
        return slow(model, shape, out, speed, device)
    # 10% of 4,000 images at the probe's 120 images/s (with the rewrites) is 3.3 s, against 2 × (0.8 s + 4 steps of
    # 0.53 s) for two timings
    r = tune(net, (3, 8, 8), device="cpu", batch_size=64, measure=slow, probe=probe, planned_images=4_000,
             budget_share=0.1, retune=True, log=said.append)
    # on a CPU the rewrites are in from the first setting (the net's ReLU after a convolution goes in place)
    assert [s.label() for s in tried] == ["fp32 + batch 64 + rewrites", "bf16 + channels_last + batch 64 + rewrites"]
    assert len(r.rows) == 2
    assert r.best == tried[1]  # 3× the first setting's rate (the fake's bf16 × channels_last)
    assert r.short.startswith("no search: ~33 s of training planned") and r.short in r.table()
    assert "one quick comparison instead" in r.short and "a quick timing" in r.table()
    assert not any("no search" in m for m in said)  # said once, by the table (fit says it), not twice
    again = tune(net, (3, 8, 8), device="cpu", batch_size=64, measure=slow, probe=probe, planned_images=4_000,
                 budget_share=0.1, log=lambda m: None)
    assert not again.cached and len(tried) == 4  # not cached: measured again

    def unsound(model, shape, out, speed, device):  # bf16's loss is off: the first setting stays
        t = probe(model, shape, out, speed, device)
        return replace(t, loss=9.0) if speed.precision == "bf16" else t
    r = tune(net, (3, 8, 8), device="cpu", batch_size=64, measure=slow, probe=unsound, planned_images=4_000,
             budget_share=0.1, retune=True, log=lambda m: None)
    assert r.short and r.best.label() == "fp32 + batch 64 + rewrites"

    def no_reference_loss(model, shape, out, speed, device):  # a loss missing on either side: nothing to compare
        t = probe(model, shape, out, speed, device)
        return replace(t, loss=None) if speed.precision == "fp32" else t
    r = tune(net, (3, 8, 8), device="cpu", batch_size=64, measure=slow, probe=no_reference_loss,
             planned_images=4_000, budget_share=0.1, retune=True, log=lambda m: None)
    assert r.short and r.best.label() == "fp32 + batch 64 + rewrites"
    tried.clear()
    r = tune(net, (3, 8, 8), device="cpu", batch_size=64, measure=slow, probe=probe, planned_images=14_400,
             budget_share=0.1, retune=True, log=lambda m: None)
    assert len(tried) == 1 and not r.short and r.budget_s == 5.0  # as without the probe (the budget test above)
    assert len([t for t in r.rows if t.images_per_s]) == 5


def test_tune_times_the_optimizer_the_run_uses(monkeypatch):
    """Each timed step includes the run's update (fused AdamW by default); the choice is cached
    per optimizer."""
    from trainfast import step

    made = []
    real = step.make_optimizer
    monkeypatch.setattr(step, "make_optimizer", lambda name, *a, **k: (made.append(name), real(name, *a, **k))[1])
    t = tune_mod.measure_trial(_net(), (3, 8, 8), (4,), Speed(batch_size=8), torch.device("cpu"),
                               steps=2, min_seconds=0.0, optimizer="rmsprop")
    assert t.images_per_s and made == ["rmsprop"]
    r = tune(_net(), (3, 8, 8), device="cpu", batch_size=64, measure=_fake([]), try_compile=False, retune=True,
             log=lambda m: None)
    other = tune(_net(), (3, 8, 8), device="cpu", batch_size=64, measure=_fake([]), try_compile=False,
                 optimizer="sgd", log=lambda m: None)
    assert not other.cached and other.key != r.key
    import pytest

    from trainfast.errors import TrainfastError
    with pytest.raises(TrainfastError, match="optimizer must be one of sgd, adamw, rmsprop, not 'adam'"):
        tune(_net(), (3, 8, 8), device="cpu", optimizer="adam", log=lambda m: None)


def test_a_setting_that_fails_with_an_empty_message_is_a_row_not_a_crash():
    """A candidate whose step raises an exception without a message is a failed row naming its
    type (the note used to index the message's first line and raised IndexError itself)."""
    from trainfast.config import Speed

    class Silent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3 * 8 * 8, 3)

        def forward(self, x):
            if torch.is_grad_enabled():
                raise RuntimeError()
            return self.fc(x.flatten(1))
    t = tune_mod.measure_trial(Silent(), (3, 8, 8), (3,), Speed("fp32", False, batch_size=4), torch.device("cpu"))
    assert t.images_per_s is None and t.note == "failed: RuntimeError"


@pytest.mark.parametrize("edit", ["batch 10^8", "fp16 on a CPU", "an unknown rewrite", "a string", "a row without speed",
                                  "no best"])
def test_a_cache_entry_that_does_not_validate_is_ignored_and_named(tmp_path, monkeypatch, edit):
    """A hand-edited or stale tune.json entry is ignored (said in one line naming the file) and
    the choice measured again; it never ends the tune."""
    import json

    monkeypatch.setenv("TRAINFAST_CACHE", str(tmp_path))
    first = tune(_net(), (3, 8, 8), device="cpu", measure=_fake([]), retune=True, log=lambda m: None)
    path = tmp_path / "tune.json"
    cache = json.loads(path.read_text())
    entry = cache[first.key]
    if edit == "batch 10^8":
        entry["best"]["batch_size"] = 10**8
    elif edit == "fp16 on a CPU":
        entry["best"]["precision"] = "fp16"
    elif edit == "an unknown rewrite":
        entry["best"]["rewrites"] = ["no_such_rewrite"]
    elif edit == "a string":
        cache[first.key] = "fast"
    elif edit == "a row without speed":
        del entry["rows"][0]["speed"]
    else:
        del entry["best"]
    path.write_text(json.dumps(cache))
    said = []
    again = tune(_net(), (3, 8, 8), device="cpu", measure=_fake([]), log=said.append)
    assert not again.cached and again.best == first.best
    assert any("ignored the cached choice in" in m and str(path) in m for m in said), said


@pytest.mark.parametrize("value", [0, "fast", None, {"float32": 0}, {"float32": "fast"}, {"float32": -1.0},
                                   {"float32": float("inf")}, {}])
def test_a_peaks_entry_that_does_not_validate_is_measured_again(tmp_path, monkeypatch, value):
    """A zero or a string edited into peaks.json is measured again, not divided by."""
    import json

    monkeypatch.setenv("TRAINFAST_CACHE", str(tmp_path))
    fresh = {"matmul_flops": {"float32": 1e11}, "copy_bytes": 1e10}
    monkeypatch.setattr(hardware, "measure_peaks", lambda d: dict(fresh))
    cpu = torch.device("cpu")
    (tmp_path / "peaks.json").write_text(json.dumps({hardware.machine_key(cpu) + "|quiet": {
        "matmul_flops": value, "copy_bytes": 1e10, "other_cores": 0.0}}))
    p = hardware.peaks(cpu)
    assert p["matmul_flops"] == {"float32": 1e11} and not p["cached"]


def test_tune_result_html_keeps_its_columns_in_a_monospace_unwrapped_block():
    """Issue 49.5: in a notebook the table rendered in a proportional font, wrapped; its
    columns did not line up."""
    import html
    import re

    from trainfast.tuning.result import Trial, TuneResult
    best = Speed("bf16", True, batch_size=64)
    r = TuneResult(best, [Trial(best, 1000.0, 1.0), Trial(Speed("fp32", batch_size=64), 700.0, 1.0)])
    page = r._repr_html_()
    style = re.match(r"<pre style='([^']*)'>", page).group(1)
    assert "font-family:monospace" in style and "white-space:pre;" in style and "pre-wrap" not in style
    assert html.unescape(page[page.index(">") + 1: -len("</pre>")]) == repr(r)

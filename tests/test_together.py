"""Settings timed together, their steps in turns (tuning/together.py), and the tune's use of it."""

from dataclasses import replace

import torch
import torch.nn as nn

from trainfast.config import Speed
from trainfast.models import rewrite
from trainfast.tuning import Trial, tune
from trainfast.tuning.measure import measure_trial
from trainfast.tuning.together import MIN_TURNS, measure_together


def _net():
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Dropout(0.2), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(8, 4))
    net.output_shape = (4,)
    return net


class _NotAtThree(nn.Module):
    """Fails on a batch of 3 images: one setting of a group that cannot run."""

    def __init__(self):
        super().__init__()
        self.body = _net()

    def forward(self, x):
        if x.shape[0] == 3:
            raise RuntimeError("three is not allowed")
        return self.body(x)


def test_each_setting_gets_its_own_rate_and_the_soundness_loss_of_a_timing_alone():
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    speeds = [Speed("fp32", False, batch_size=16), Speed("fp32", True, batch_size=16, rewrites=rewrite.ALL),
              Speed("fp32", True, batch_size=32)]
    threads = torch.get_num_threads()
    rows = measure_together(net, (3, 8, 8), (4,), speeds, torch.device("cpu"), min_seconds=0.05)
    assert [r.speed for r in rows] == speeds and all(r.images_per_s > 0 for r in rows)
    alone = measure_trial(net, (3, 8, 8), (4,), speeds[0], torch.device("cpu"), min_seconds=0.05)
    assert abs(rows[0].loss - alone.loss) < 1e-6  # the same images, labels and weights: the same loss
    assert torch.get_num_threads() == threads
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())  # copies trained, not the model


def test_a_setting_that_fails_says_why_and_the_others_are_timed():
    speeds = [Speed("fp32", False, batch_size=4), Speed("fp32", False, batch_size=3), Speed("fp32", True, batch_size=4)]
    rows = measure_together(_NotAtThree(), (3, 8, 8), (4,), speeds, torch.device("cpu"), min_seconds=0.02)
    assert rows[1].images_per_s is None and "three is not allowed" in rows[1].note
    assert rows[0].images_per_s and rows[2].images_per_s


def test_turns_alternate_and_each_gets_at_least_the_least_turns(monkeypatch):
    """The order of the turns rotates (A B C, B C A, ...), and every setting has MIN_TURNS."""
    from trainfast.tuning import together

    order = []
    real = together._Contender.turn

    def turn(self, device, threads):
        order.append(self.speed.batch_size)
        return real(self, device, threads)
    monkeypatch.setattr(together._Contender, "turn", turn)
    speeds = [Speed("fp32", False, batch_size=b) for b in (4, 8, 12)]
    measure_together(_net(), (3, 8, 8), (4,), speeds, torch.device("cpu"), warmup=1, min_seconds=0.0)
    timed = order[3:]  # after one warm-up each
    assert timed[:3] == [4, 8, 12] and timed[3:6] == [8, 12, 4] and len(timed) >= 3 * MIN_TURNS


def _drifting(seen):
    """A fake machine that slows by 30% at every measurement, and a setting (channels_last)
    truly 1.2× faster than the plain layout. Timed one by one, the first setting timed looks
    fastest; timed together, each sees the same machine."""
    def rate_of(speed, slow):
        return 100.0 * (1.2 if speed.channels_last else 1.0) * (1.1 if speed.batch_size == 128 else 1.0) / slow

    def measure(model, shape, out, speed, device):
        seen.append(("alone", speed.label()))
        slow = 1.3 ** len(seen)
        return Trial(speed, rate_of(speed, slow), 2.0)

    def together(model, shape, out, speeds, device):
        seen.append(("together", tuple(s.label() for s in speeds)))
        slow = 1.3 ** len(seen)
        return [Trial(s, rate_of(s, slow), 2.0) for s in speeds]
    measure.together = together
    return measure


def test_a_cpu_tune_times_its_opening_and_final_rounds_together(monkeypatch):
    monkeypatch.setattr("trainfast.step.supports_bf16", lambda d: False)
    seen = []
    r = tune(_net(), (3, 8, 8), device="cpu", try_compile=False, try_threads=False, measure=_drifting(seen),
             retune=True, log=lambda m: None)
    kind, labels = seen[0]
    assert kind == "together" and labels[0] == "fp32 + batch 64 + rewrites"  # the reference, beside its rivals
    assert "fp32 + channels_last + batch 64 + rewrites" in labels and "fp32 + channels_last + batch 64" in labels
    assert "fp32 + channels_last + batch 128 + rewrites" in labels  # and the first doubling of the batch
    assert sum(kind == "together" for kind, _ in seen) >= 3  # the opening and the final's rounds
    assert r.best.channels_last  # the drift that favours what is timed first did not decide


def test_one_by_one_the_same_drift_misleads():
    """The check on the test above: without `together` the drift picks the plain layout."""
    seen = []
    measure = _drifting(seen)
    del measure.together
    r = tune(_net(), (3, 8, 8), device="cpu", batch_size=64, try_compile=False, try_threads=False, try_rewrites=False,
             measure=measure, retune=True, log=lambda m: None)
    assert not r.best.channels_last and all(kind == "alone" for kind, _ in seen)


def test_the_budget_leaves_out_the_last_of_a_group_first(monkeypatch):
    from trainfast.tuning import budget

    now = [0.0]
    monkeypatch.setattr(budget, "clock", lambda: now[0])
    groups = []

    def together(model, shape, out, speeds, device):
        groups.append([s.label() for s in speeds])
        now[0] += len(speeds)  # a second per setting
        return [Trial(s, 100.0, 2.0) for s in speeds]

    def measure(model, shape, out, speed, device):
        now[0] += 1
        return Trial(speed, 100.0, 2.0)
    bench = budget.Bench(_net(), (3, 8, 8), (4,), torch.device("cpu"), measure, lambda m: None, max_seconds=8.5,
                         planned_images=None, budget_share=0.0, together=together)
    first = [Speed("fp32", False, batch_size=64), Speed("fp32", True, batch_size=64), Speed("bf16", True, batch_size=64)]
    monkeypatch.setattr("trainfast.step.supports_bf16", lambda d: False)
    rows = bench.run_many(first)
    assert groups == [["fp32 + batch 64", "fp32 + channels_last + batch 64"]] and "skipped" in rows[2].note
    bench.set_reference(rows[0])
    assert bench.plan["first"] == 1.0  # the reference's share of the group's 2 s: the others' counts as spent
    more = [replace(first[1], batch_size=b) for b in (128, 256, 512)]
    rows = bench.run_many(more)  # 2 s spent, 6.5 left: room for 128 (2 s expected) and 256 (4 s), not 512 (8 s) too
    assert groups[1] == ["fp32 + channels_last + batch 128", "fp32 + channels_last + batch 256"]
    assert rows[2].note.startswith("not timed") and bench.not_timed == ["fp32 + channels_last + batch 512"]

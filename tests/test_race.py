"""The batch raced to a loss (trainfast/train/race.py): which settings race, for how long, who
wins, and that a lap measures what a step costs, not only how fast images go by."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn as nn

from trainfast.config import Speed, TrainConfig, default_lr
from trainfast.data.loader import Loader
from trainfast.train import race


def _s(b, **kw):
    return Speed("bf16", True, batch_size=b, **kw)


def test_only_batches_faster_than_every_smaller_one_race():
    rates = {32: (100.0, _s(32)), 64: (90.0, _s(64)), 128: (150.0, _s(128)), 256: (140.0, _s(256))}
    assert [s.batch_size for _, s in race.contenders(rates)] == [32, 128]  # 64 and 256: slower and larger
    assert race.contenders({32: (100.0, _s(32)), 64: (105.0, _s(64))}) == []  # within RACE_GAIN: more steps win
    assert race.contenders({64: (100.0, _s(64))}) == []
    many = {b: (float(b), _s(b)) for b in (16, 32, 64, 128, 256)}
    assert [s.batch_size for _, s in race.contenders(many)] == [16, 64, 256]  # smallest, middle, fastest


def test_a_run_too_short_for_its_laps_is_not_raced():
    front = [(1000.0, _s(64)), (4000.0, _s(512))]
    seconds = race.lap_seconds(front, planned_images=4_000_000)  # 1,000 s at 4,000/s: 25 s per lap, capped
    assert seconds == race.MAX_LAP_S
    assert race.lap_seconds(front, planned_images=40_000) is None  # 0.25 s: 2 steps of 512


def test_the_lowest_loss_wins_unless_the_rules_choice_ties():
    def lap(b, loss):
        return race.Lap(_s(b), 100.0, 1e-3, 10, 100.0, loss)
    assert race.choose([lap(64, 1.00), lap(256, 0.80)], rule=_s(64)) == _s(256)
    assert race.choose([lap(64, 0.805), lap(256, 0.80)], rule=_s(64)) == _s(64)  # within 1%: the rule stands
    assert race.choose([lap(64, None), lap(256, None)], rule=_s(64)) == _s(64)
    table = race.table([lap(64, 1.0), lap(256, 0.8)], _s(256), 2.0, 512)
    assert "2.0 s" in table and "512 training images" in table and table.splitlines()[-1].endswith("← chosen")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(32 * 8 * 8, 10))


def test_a_lap_measures_what_a_step_costs(digits_packs, device, monkeypatch):
    """On a clock where a step costs the same at any batch (a GPU below its fill), batch 128
    reaches a lower loss than 16 in equal time; on one where time follows images (a CPU where
    rates tie), 16 does. Same weights, same images in the same order."""
    from trainfast.train.optim import optimizer_for as _optimizer
    train, _ = digits_packs
    dev = torch.device(device)
    probe = Loader(train, 256, shuffle=False, drop_last=False, device=dev, subset=np.arange(512))
    cfg = TrainConfig()
    losses = {}
    for clock in ("per step", "per image"):
        for b in (16, 128):
            now = [0.0]

            def tick(b=b, clock=clock, now=now):
                now[0] += 1.0 if clock == "per step" else b / 16
                return now[0]
            monkeypatch.setattr(race, "_clock", tick)
            lap = race.run_lap(_net(), race.Lap(Speed(batch_size=b), 1.0, default_lr("adamw", b)),
                               Loader(train, b, device=dev), probe, lambda p, lr: _optimizer(p, cfg, lr, dev), dev, 30)
            losses[clock, b] = lap.loss
    assert losses["per step", 128] < 0.7 * losses["per step", 16]
    assert losses["per image", 16] < 0.7 * losses["per image", 128]


def test_fit_races_a_faster_larger_batch_and_caches_the_race(digits_packs, tmp_path, monkeypatch):
    """tune (faked) timed batch 32 at 4× batch 16's rate: fit races the two, prints both
    numbers, records the laps in speed.json, and a second run reuses them."""
    import trainfast
    from trainfast import tuning
    from trainfast.tuning import Trial, TuneResult
    train, test = digits_packs

    def fake_tune(model, shape, **kw):
        return TuneResult(Speed("fp32", False, batch_size=32), [
            Trial(Speed("fp32", False, batch_size=16), 100.0, 2.3), Trial(Speed("fp32", False, batch_size=32), 400.0, 2.3)])
    monkeypatch.setattr(tuning, "tune", fake_tune)
    monkeypatch.setattr(race, "RACE_SHARE", 1.0)
    monkeypatch.setattr(race, "MIN_LAP_STEPS", 1)
    monkeypatch.setattr(race, "MAX_LAP_S", 0.3)
    said = []
    r = trainfast.fit(_net(), train, test, epochs=1, device="cpu", run_dir=tmp_path / "a", progress=False,
                      log=said.append)
    text = "\n".join(said)
    assert "raced to a loss" in text and "batch 16" in text and "batch 32" in text and "← chosen" in text
    raced = json.loads((tmp_path / "a" / "speed.json").read_text())["raced"]
    assert [lap["label"] for lap in raced["laps"]] == ["fp32 + batch 16", "fp32 + batch 32"]
    laps = [race.Lap.from_dict(lap) for lap in raced["laps"]]
    assert all(lap.loss > 0 and lap.steps >= 3 for lap in laps)
    assert r.speed == race.choose(laps, rule=Speed("fp32", False, batch_size=32))
    said.clear()
    trainfast.fit(_net(), train, test, epochs=1, device="cpu", run_dir=tmp_path / "b", progress=False,
                  log=said.append)
    assert "raced to a loss (cached)" in "\n".join(said)


def test_a_short_run_keeps_the_rule_and_says_why(digits_packs, tmp_path, monkeypatch):
    import trainfast
    from trainfast import tuning
    from trainfast.tuning import Trial, TuneResult
    train, test = digits_packs

    def fake_tune(model, shape, **kw):
        return TuneResult(Speed("fp32", False, batch_size=32), [
            Trial(Speed("fp32", False, batch_size=16), 100.0, 2.3), Trial(Speed("fp32", False, batch_size=32), 400.0, 2.3)])
    monkeypatch.setattr(tuning, "tune", fake_tune)
    said = []
    r = trainfast.fit(_net(), train, test, epochs=1, device="cpu", run_dir=tmp_path / "a", progress=False,
                      log=said.append, config=TrainConfig(lr=1e-3, epochs=1))
    assert r.speed.batch_size == 32 and any("too short to race" in m for m in said)


def test_a_short_run_at_a_smaller_batch_says_which_setting_trains(digits_packs, tmp_path, monkeypatch):
    """Issue 51.4: tune's "chosen:" is channels_last + rewrites at batch 32; the rule drops to batch 16,
    where the fastest timing had no rewrites. The log says what trains and why, not a silent change."""
    import trainfast
    from trainfast import tuning
    from trainfast.tuning import Trial, TuneResult
    train, test = digits_packs
    best = Speed("fp32", True, batch_size=32, rewrites=("pool_before_relu",))

    def fake_tune(model, shape, **kw):
        return TuneResult(best, [Trial(Speed("fp32", True, batch_size=16), 380.0, 2.3),
                                 Trial(Speed("fp32", True, batch_size=16, rewrites=("pool_before_relu",)), 370.0, 2.3),
                                 Trial(best, 480.0, 2.3)])  # 1.26×: raced if the run were long enough
    monkeypatch.setattr(tuning, "tune", fake_tune)
    said = []
    r = trainfast.fit(_net(), train, test, epochs=1, device="cpu", run_dir=tmp_path / "a", progress=False,
                      log=said.append, config=TrainConfig(lr=1e-3, epochs=1))
    assert r.speed == Speed("fp32", True, batch_size=16, threads=r.speed.threads)
    line = next(m for m in said if "too short to race" in m)
    assert "training with fp32 + channels_last + batch 16, the fastest tune timed at batch 16" in line


@pytest.mark.parametrize("edit", ["a string", "other entrants", "fp16 on a CPU", "a zero rate", "a string loss",
                                  "no speed", "steps of 2.5"])
def test_a_race_cache_entry_that_does_not_validate_is_raced_again_and_named(tmp_path, monkeypatch, edit):
    """Issue 50.8's neighbours: a hand-edited race.json entry is ignored, said in one line naming
    the file, and the laps run again; it never ends the run."""
    monkeypatch.setenv("TRAINFAST_CACHE", str(tmp_path))
    ran = []

    def run_lap(net, lap, *args):
        ran.append(lap.speed.batch_size)
        return replace(lap, steps=20, lap_images_per_s=100.0, loss=1.5)

    monkeypatch.setattr(race, "run_lap", run_lap)
    laps = [race.Lap(Speed("fp32", False, batch_size=b), 100.0 * b, 1e-3) for b in (16, 64)]
    args = (nn.Linear(2, 2), laps, lambda b: None, None, None, torch.device("cpu"), 5.0, "data", "adamw")
    race.race(*args)
    path = tmp_path / "race.json"
    cache = json.loads(path.read_text())
    (key, entry), = cache.items()
    if edit == "a string":
        cache[key] = "fast"
    elif edit == "other entrants":
        entry.pop()
    elif edit == "fp16 on a CPU":
        entry[0]["speed"]["precision"] = "fp16"
    elif edit == "a zero rate":
        entry[1]["images_per_s"] = 0
    elif edit == "a string loss":
        entry[0]["loss"] = "low"
    elif edit == "no speed":
        del entry[0]["speed"]
    else:
        entry[0]["steps"] = 2.5
    path.write_text(json.dumps(cache))
    said = []
    again, cached = race.race(*args, say=said.append)
    assert not cached and ran == [16, 64, 16, 64] and [lap.loss for lap in again] == [1.5, 1.5]
    assert any("ignored the cached race in" in m and str(path) in m for m in said), said
    assert race.race(*args, say=said.append)[1]  # the laps run again are cached anew

"""The account of a fit call's time (train/costs.py)."""

import time

import pytest

from trainfast.train.costs import Costs


def test_nested_phases_count_once_and_the_rest_is_other():
    c = Costs()
    with c.phase("training"):
        time.sleep(0.05)
        with c.phase("checkpoints"):
            time.sleep(0.06)
    with c.phase("training"):  # a phase met again adds up
        time.sleep(0.02)
    time.sleep(0.01)
    d = c.as_dict()
    assert d["checkpoints"] == pytest.approx(0.06, abs=0.02)
    assert d["training"] == pytest.approx(0.07, abs=0.02)  # not the 0.06 of the checkpoint within it
    assert d["other"] >= 0.005
    assert sum(v for k, v in d.items() if k != "total") == pytest.approx(d["total"], rel=1e-6)
    line = c.line()
    assert line.startswith("the call took 0.1") and line.index("training") < line.index("checkpoints")


def test_an_attempt_started_over_folds_into_one_phase():
    c = Costs()
    with c.phase("training"):
        time.sleep(0.03)
    c.fold("attempts started over")
    with c.phase("training"):
        time.sleep(0.02)
    d = c.as_dict()
    assert d["attempts started over"] >= 0.03 and d["training"] == pytest.approx(0.02, abs=0.015)
    assert d["total"] >= 0.05


def test_costs_are_recorded_where_a_killed_start_left_no_speed_json(tmp_path):
    import json

    from trainfast.train.rundir import record_costs, record_decision

    record_costs(tmp_path, {"training": 1.23456, "total": 2.0})  # no speed.json yet: written, not a traceback
    record_decision(tmp_path, {"what": "threads", "chose": 2})
    saved = json.loads((tmp_path / "speed.json").read_text())
    assert saved == {"costs": {"training": 1.235, "total": 2.0}, "decisions": [{"what": "threads", "chose": 2}]}

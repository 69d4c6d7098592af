import json

import pytest

import torch

from trainfast.cli import main


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path, capsys, device):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--train", "500", "--test", "100", "--out", str(out), "--device", device]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert 0 <= s["whole_plate_accuracy"] <= s["per_character_accuracy"] <= 1
    assert s["users_pipeline"]["images_per_s"] > 0 and s["epoch_s"] > 0
    assert s["on_pack"]["data_share"] < s["users_pipeline"]["data_share"]
    page = (out / "report.html").read_text()
    assert page.count("<svg") >= 3 and page.count("data:image/png;base64") == 2
    err = capsys.readouterr().err
    assert "held-out plates:" in err and "VERDICT" in err
    # a smoke run's accuracy near chance is said to be one, not left to look like the result
    assert ("near chance (1 in 36)" in err) == (s["per_character_accuracy"] < 2 / 36)
    e = s["errors"]  # the error analysis is of the held-out plates, and agrees with the headline figures
    assert e["sequences"] == s["config"]["test"] and e["characters"] == 8 * s["config"]["test"]
    assert e["character_accuracy"] == pytest.approx(s["per_character_accuracy"], abs=0.01)
    assert e["sequence_accuracy"] == pytest.approx(s["whole_plate_accuracy"], abs=0.01)
    assert sum(g["sequences"] for g in e["groups"].values()) == s["config"]["test"]
    assert "Where the errors are" in page and "most confused" in err and "read worst" in err
    made = [json.loads((out / f"plates-{split}" / "plates.json").read_text()) for split in ("train", "test")]
    assert [(m["count"], m["seed"]) for m in made] == [(s["config"]["train"], 0), (s["config"]["test"], 1)]


def test_the_demo_writes_only_into_a_folder_of_its_own(tmp_path, capsys):
    mine = tmp_path / "mine"
    (mine / "run").mkdir(parents=True)
    (mine / "run" / "thesis.tex").write_text("years of work")
    assert main(["demo", "--quick", "--out", str(mine), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "is not a folder the demo made" in err and err.count("\n") == 1
    assert (mine / "run" / "thesis.tex").read_text() == "years of work" and sorted(p.name for p in mine.iterdir()) == ["run"]


def test_a_larger_batch_is_taken_only_where_it_is_clearly_faster():
    from trainfast.config import Speed
    from trainfast.models import rewrite
    from trainfast.tuning import Trial, TuneResult, more_steps_unless_faster

    def result(rate_128, rate_256):
        best = Speed("bf16", True, batch_size=256)
        rows = [Trial(Speed("bf16", True, batch_size=64), 1000.0, 1.0), Trial(Speed("fp32", batch_size=32), 700.0, 1.0),
                Trial(Speed("bf16", True, batch_size=128), rate_128, 1.0), Trial(best, rate_256, 1.0)]
        return TuneResult(best, rows)
    speed, why = more_steps_unless_faster(result(1050.0, 1110.0), floor=1)  # 2 CPU cores: 256 is 1.11× 64
    assert speed == Speed("bf16", True, batch_size=64) and "1.11×" in why  # not fp32 at 32: 1.59× slower
    assert more_steps_unless_faster(result(1050.0, 1110.0), floor=128)[0].batch_size == 128  # the recipe's batch
    assert more_steps_unless_faster(result(2000.0, 2400.0), floor=1)[0].batch_size == 128  # 2.4× 64, 1.2× 128
    assert more_steps_unless_faster(result(2000.0, 4000.0), floor=1) == (result(0, 0).best, None)  # a GPU: 2× 128
    # at the smaller batch, its fastest setting: here with the rewrites, which the chosen one lacked
    with_rewrites = Trial(Speed("bf16", True, batch_size=64, rewrites=rewrite.ALL), 1090.0, 1.0)
    rejected = Trial(Speed("fp32", True, batch_size=64), 1100.0, 2.0, note="rejected: first-batch loss")
    r = result(1050.0, 1110.0)
    r.rows += [with_rewrites, rejected]
    assert more_steps_unless_faster(r, floor=1)[0] == with_rewrites.speed


def test_the_demo_fills_its_time_budget_with_epochs():
    import torch

    from trainfast.demo import MAX_EPOCHS, MIN_EPOCHS, DemoConfig, budget_epochs
    cpu = torch.device("cpu")
    # 20,000 plates at 2,000 images/s: 13 s per epoch with the overhead; 300 - 60 - 15 s left
    epochs, why = budget_epochs(DemoConfig(), cpu, elapsed_s=60, images_per_s=2000)
    assert epochs == 17 and "17 epochs" in why and "5 minutes" in why
    assert budget_epochs(DemoConfig(), torch.device("cuda"), 70, 60_000)[0] == MIN_EPOCHS  # a GPU's minute is spent
    assert budget_epochs(DemoConfig(minutes=60), cpu, 60, 2000)[0] == MAX_EPOCHS


def test_the_speed_comparison_is_left_out_when_other_processes_loaded_either_side():
    from trainfast.demo import _speed_lines

    s = {"other_cores": {"users_pipeline": 0.0, "training": 0.1}, "config": {"epochs": 10}, "trained_epochs": 10,
         "planned_epochs": 10, "epoch_s": 20.0, "users_pipeline": {"epoch_s": 170.0}, "trainfast_train_s": 210.0,
         "pack_s": 9.0}
    quiet = _speed_lines(s, "skimage")
    assert "20.0 s with trainfast, 170 s on the users' pipeline" in quiet[0] and "vs 1700 s" in quiet[1]
    s["other_cores"]["training"], s["trained_epochs"] = 2.5, 7
    busy = " ".join(_speed_lines(s, "skimage"))
    assert "cut the run to 7 of the 10 planned epochs" in busy and "training: 2.5 of" in busy
    assert "not compared" in busy and " vs " not in busy


def test_the_demos_training_budget_keeps_the_plan_and_never_runs_past_1_3_times_the_budget():
    from trainfast.demo import DemoConfig, training_minutes

    cfg, cpu = DemoConfig(minutes=5), torch.device("cpu")
    # 100 s spent, 15 s kept: 185 s left; 10 planned epochs of 12 s fit, with room: the rest of the budget
    assert training_minutes(cfg, cpu, 100, 10, 12.0) * 60 == pytest.approx(185)
    # 10 epochs of 17 s (the floor of 10 planned) need 196 s with 15% to spare: allowed, under 1.3 × 300 - 115
    assert training_minutes(cfg, cpu, 100, 10, 17.0) * 60 == pytest.approx(195.5)
    # a busy machine's 10 epochs of 115 s: cut at 1.3 × the budget
    assert training_minutes(cfg, cpu, 262, 10, 115.0) * 60 == pytest.approx(1.3 * 300 - 262 - 15)
    assert training_minutes(cfg, cpu, 400, 10, 115.0) > 0  # spent already: one epoch, then stop

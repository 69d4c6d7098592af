"""The realistic panel's report (benchmarks/bench_panel.py): its medians, its "never" and the
rows of one commit, on rows made here (the panel itself takes hours and is not run by tests)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_panel  # noqa: E402

WHERE = {"cpu": "test", "isa": "avx2", "cores": 2, "beside": None}


def _row(side, run, acc, at, commit, rate=100.0, handed=None):
    row = {"model": "lcnet_050", "side": side, "run": run, "machine": {**WHERE, "commit": commit},
           "beside": None, "epochs": len(acc), "acc": acc, "at": at, "images_per_s": rate}
    if side == "fit":
        row["handed_back"] = acc[-1] if handed is None else handed
    return row


def _write(tmp_path, rows):
    out = tmp_path / "panel.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def test_report_counts_targets_and_a_commit_filter_keeps_one_codes_rows(tmp_path):
    rows = [  # run 0 on old code: fit reaches the plain best (0.60) at 20 s against the plain loop's 10 s
        _row("plain", 0, [0.60, 0.50], [10, 20], "old"), _row("careful", 0, [0.55, 0.58], [8, 16], "old"),
        _row("fit", 0, [0.50, 0.70], [12, 20], "old", rate=150),
        # run 1 on new code: fit never reaches the plain loop's 0.80
        _row("plain", 1, [0.80, 0.70], [10, 20], "new"), _row("careful", 1, [0.60, 0.65], [8, 16], "new"),
        _row("fit", 1, [0.60, 0.75], [12, 20], "new", rate=150, handed=0.65)]
    out = _write(tmp_path, rows)
    text = bench_panel.report(bench_panel._done(out, WHERE))
    assert "lcnet_050" in text and "commits behind these rows: new, old" in text
    assert "≥ the plain loop's best − 1 point: 0 of 1" in text  # handed back 0.70, 0.65: median 0.675 < 0.70 − 0.01
    assert "≥ the careful loop's best − 1: 1 of 1" in text  # careful bests 0.58, 0.65: median 0.615
    assert "equals the user's scoring of the model to 0.1 point: 0 of 1" in text  # run 1: handed back 0.65, reported 0.75
    assert "never reached: 1" in text  # the median of 2.0× and never is never
    assert "images/s ≥ the plain loop's: 1 of 1" in text

    text = bench_panel.report(bench_panel.of_commits(bench_panel._done(out, WHERE), ["old"]))
    assert "commits behind these rows: old" in text and "median over models 2.00×" in text
    assert "≥ the plain loop's best − 1 point: 1 of 1" in text and "to 0.1 point: 1 of 1" in text


def test_rows_of_another_cpu_are_pooled_only_when_asked_and_the_report_names_the_cpus(tmp_path):
    other = {**WHERE, "cpu": "other", "isa": "avx512"}
    rows = [_row(s, 0, [0.6, 0.7], [10, 20], "c") for s in bench_panel.SIDES]
    rows += [{**_row(s, 1, [0.5, 0.6], [10, 20], "c"), "machine": {**other, "commit": "c"}} for s in bench_panel.SIDES]
    out = _write(tmp_path, rows)
    assert {k[2] for k in bench_panel._done(out, WHERE)} == {0}  # this kind of machine only: a rerun redoes run 1
    pooled = bench_panel._done(out, WHERE, any_machine=True)
    assert {k[2] for k in pooled} == {0, 1}
    text = bench_panel.report(pooled)
    assert "CPUs: other (avx512): runs 1; test (avx2): runs 0" in text
    assert bench_panel._done(out, {**WHERE, "cores": 4}, any_machine=True) == {}  # never across core counts

import json

import pytest

from trainfast.cli import main


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path, capsys, device):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--device", device]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert 0 <= s["whole_plate_accuracy"] <= s["per_character_accuracy"] <= 1
    assert s["users_pipeline"]["images_per_s"] > 0 and s["epoch_s"] > 0
    assert s["on_pack"]["data_share"] < s["users_pipeline"]["data_share"]
    page = (out / "report.html").read_text()
    assert page.count("<svg") >= 3 and page.count("data:image/png;base64") == 2
    err = capsys.readouterr().err
    assert "held-out plates:" in err and "VERDICT" in err

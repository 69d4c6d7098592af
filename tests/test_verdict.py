import pytest

from trainfast.diagnose.timing import StepTimes
from trainfast.diagnose.verdict import Roofline, verdict


def _times(data, compute=0.1, batch=64):
    return StepTimes(10, batch, data, 0.0, compute / 2, compute / 2, 0.0, 0.0, data + compute, 1.0)


def _roof(share):
    return Roofline(1e-3, 1e-4, 1e-3, share * 1e12, 1e12, "float32")


@pytest.mark.parametrize("data,kind,degree", [
    (0.03, "input-bound", "highly"),     # 23%
    (0.0251, "input-bound", "highly"),   # 20.1%: at the threshold
    (0.024, "input-bound", "moderately"),  # 19.4%
    (0.006, "input-bound", "moderately"),  # 5.7%
    (0.004, "compute-bound", ""),         # 3.8%
])
def test_thresholds(data, kind, degree):
    v = verdict(_times(data), _roof(0.5))
    assert (v.kind, v.degree) == (kind, degree)


def test_overhead_bound_at_small_batch_far_from_peak():
    assert verdict(_times(0.0, batch=5), _roof(0.02)).kind == "overhead-bound"
    far = verdict(_times(0.0, batch=256), _roof(0.01))  # a large batch far from peak: not the arithmetic
    assert far.kind == "compute-bound" and "only 1.0% of the device's measured peak" in far.sentence
    assert "memory traffic" in far.sentence and "memory traffic" not in verdict(_times(0.0), _roof(0.5)).sentence


def test_interleaved_rounds_rotate_warm_and_give_the_median_and_range():
    """Each side runs once untimed, then the rounds rotate who goes first; the gain is the median
    round's ratio and the range is the rounds' lowest and highest."""
    from trainfast.diagnose.felt import interleaved

    calls = []

    def side(name, times):
        it = iter(times)

        def run():
            calls.append(name)
            return next(it)
        return run

    felt, = interleaved(side("a", [99.0, 2.0, 2.0, 3.0]), side("b", [99.0, 1.0, 0.5, 1.0]), images=8)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm, then rotating rounds
    assert felt.ratios == [2.0, 4.0, 3.0] and felt.gain == 3.0 and felt.spread == (2.0, 4.0)
    assert felt.words().startswith("×2.00–×4.00 over 3 interleaved rounds of 8 images each way")


def test_a_fix_measured_on_top_of_another_is_ranked_right_after_it():
    from trainfast.diagnose.verdict import Recommendation, ranked

    pack = Recommendation("pack", "", 2.0, True)
    on_top = Recommendation("settings", "", 3.0, True, builds_on="pack")
    other = Recommendation("threads", "", 2.5, True)
    assert [r.title for r in ranked([on_top, other, pack])] == ["threads", "pack", "settings"]
    assert ranked([on_top]) == [on_top]  # what it builds on is not there: ranked on its own

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

import time

import numpy as np
import pytest
import torch
import torch.nn as nn

import trainfast
from trainfast.diagnose.timing import step_breakdown, throughput
from trainfast.errors import TrainfastError


def _net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4))


class SlowDecode:
    """A Sequence-like pipeline whose per-item 'decode' sleeps a known time."""

    def __init__(self, per_item=0.002, batch=8, n=40):
        self.per_item, self.batch, self.n = per_item, batch, n

    def __iter__(self):
        for _ in range(self.n):
            items = []
            for _ in range(self.batch):
                time.sleep(self.per_item)
                items.append(torch.rand(3, 16, 16))
            yield torch.stack(items), torch.randint(0, 4, (self.batch,))


def test_input_bound_pipeline_has_true_data_share():
    data = SlowDecode(per_item=0.006)
    t = step_breakdown(_net(), data, device=torch.device("cpu"), steps=12, warmup=2)
    # the true wait is 8 × 6 ms = 48 ms per batch, plus a little for the tensors; the tiny
    # net's step is a few ms (tens on a loaded machine), so data is well over half
    assert 0.046 <= t.data <= 0.080
    assert t.share("data") > 0.5
    assert abs(sum(getattr(t, s) for s in ("data", "copy", "forward", "backward", "optimizer", "other")) - t.step) < 1e-6


def test_in_memory_loader_is_not_input_bound(tmp_path):
    # 16 batches: the timed steps stay inside one epoch (an epoch's first batch is not prefetched)
    images = np.random.default_rng(0).integers(0, 255, (1024, 16, 16, 3), dtype=np.uint8)
    pk = trainfast.pack((images, np.arange(1024) % 4), tmp_path / "p", size=(16, 16), progress=False)
    # NOTE: on a 16-core host a 64-channel version of this net steps in 5.7 ms, and the Loader's
    # 0.33 ms per batch (thread hand-off, conversion) was 5.8% of it; the point is a model with
    # real compute, so it has some.
    net = nn.Sequential(nn.Conv2d(3, 128, 3, padding=1), nn.ReLU(), nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 4))
    t = step_breakdown(net, trainfast.Loader(pk, 64, device="cpu"), device=torch.device("cpu"), steps=12, warmup=2)
    assert t.share("data") < 0.05
    assert t.forward > 0 and t.backward > 0 and np.isfinite(t.loss)


def test_data_too_small_for_steps():
    gen = (b for b in SlowDecode(per_item=0, n=3))
    with pytest.raises(TrainfastError, match="ran out after 3 batches; 12 are needed"):
        step_breakdown(_net(), gen, device=torch.device("cpu"), steps=10, warmup=2)


def test_reiterable_data_is_restarted():
    t = step_breakdown(_net(), SlowDecode(per_item=0, n=3), device=torch.device("cpu"), steps=6, warmup=1)
    assert t.steps == 6


def test_throughput_trains_back_to_back_and_counts_only_the_timed_steps(device):
    """Warm-up steps are not timed; the timed ones are issued with one synchronisation at the end."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2))
    net(torch.zeros(1, 3, 8, 8))
    before = [p.detach().clone() for p in net.parameters()]
    seen = []

    def data():
        for i in range(100):
            seen.append(i)
            yield torch.rand(6, 3, 8, 8), torch.randint(0, 2, (6,))

    ticks = iter([10.0, 12.0])  # the clock is read twice: after the warm-up, and at the end
    rate = throughput(net, data(), device=torch.device(device), steps=5, warmup=2, clock=lambda: next(ticks))
    assert rate == 5 * 6 / 2.0 and len(seen) == 7
    assert any(not torch.equal(a, b.cpu()) for a, b in zip(before, net.parameters()))

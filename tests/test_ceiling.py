"""The kernels' ceiling (issue 48.4): each convolution and matmul of a model timed alone, forward
and backward, in its fastest layout, and what the doctor says with it."""

import json

import pytest
import torch
import torch.nn as nn

from trainfast.diagnose import doctor
from trainfast.diagnose import ceiling as ceiling_mod
from trainfast.diagnose.ceiling import Ceiling, KernelTime, kernel_ceiling
from trainfast.diagnose.cost import layer_costs
from trainfast.diagnose.timing import StepTimes
from trainfast.diagnose.verdict import Roofline, verdict


class Repeated(nn.Module):
    """A stem, then two identical blocks (one configuration, timed once), then a head."""

    input_shape = (3, 16, 16)

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def test_each_configuration_is_timed_once_and_counted_for_every_layer_of_it(device):
    net = Repeated()
    cost = layer_costs(net, net.input_shape)
    timed = []
    real = ceiling_mod._time_layer

    def spy(module, shape, needs_input_grad, *args):
        timed.append((type(module).__name__, shape, needs_input_grad, args[-1]))
        return real(module, shape, needs_input_grad, *args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ceiling_mod, "_time_layer", spy)
        c = kernel_ceiling(net, cost, 4, "fp32", device)
    by_kind = {k.layers[0]: k for k in c.kernels}
    assert by_kind["blocks.0"].layers == ["blocks.0", "blocks.2"]  # one configuration, two layers
    assert set(by_kind) == {"stem", "blocks.0", "head"}
    # the stem reads the images (no input gradient); convolutions in both layouts, the matmul in one
    assert ("Conv2d", (3, 16, 16), False, "plain") in timed and ("Conv2d", (3, 16, 16), False, "channels_last") in timed
    assert ("Conv2d", (8, 16, 16), True, "channels_last") in timed and ("Linear", (8,), True, "plain") in timed
    assert len(timed) == 5
    assert all(k.seconds > 0 for k in c.kernels)
    assert c.step_s == pytest.approx(sum(k.seconds * len(k.layers) for k in c.kernels))
    assert c.per_image_s == pytest.approx(c.step_s / 4)
    # the model's own layers are left as they were: no gradient, no hook, no new layout
    assert all(p.grad is None for p in net.parameters()) and net.stem.weight.is_contiguous()


def test_a_model_without_convolutions_or_matmuls_has_no_ceiling():
    net = nn.Sequential(nn.BatchNorm2d(3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    assert kernel_ceiling(net, layer_costs(net, (3, 8, 8)), 2, "fp32", "cpu") is None


def _times(compute=0.1, batch=64):
    return StepTimes(10, batch, 0.0, 0.0, compute / 2, compute / 2, 0.0, 0.0, compute, 1.0)


def test_the_roofline_and_verdict_say_how_far_the_step_is_from_its_kernels():
    # 1 ms per image measured; the kernels alone 0.25 ms; the FLOPs at peak 0.005 ms
    roof = Roofline(5e-6, 1e-6, 1e-3, 5e-6 / 1e-3 * 1e12, 1e12, "float32", ceiling_s=2.5e-4)
    assert roof.share_of_ceiling == pytest.approx(0.25) and roof.kernels_share_of_peak == pytest.approx(0.02)
    v = verdict(_times(batch=256), roof)
    assert v.kind == "compute-bound" and "alone take 25% of the step's compute" in v.sentence
    assert "reach 2% of the peak" in v.sentence and "memory traffic" not in v.sentence
    assert "25% of what its kernels allow" in roof.ceiling_sentence()
    plain = Roofline(5e-6, 1e-6, 1e-3, 5e-6 / 1e-3 * 1e12, 1e12, "float32")  # not measured: as before
    assert plain.share_of_ceiling is None and plain.ceiling_sentence() == ""
    assert "memory traffic" in verdict(_times(batch=256), plain).sentence
    d = json.loads(json.dumps(roof.to_dict()))
    assert d["share_of_ceiling"] == pytest.approx(0.25) and d["ceiling_s"] == pytest.approx(2.5e-4)


def test_ceiling_to_dict_holds_the_kernels():
    c = Ceiling(8, "fp32", [KernelTime(["a", "b"], "Conv2d", (3, 8, 8), 0.01, "plain")], 1.0)
    d = json.loads(json.dumps(c.to_dict()))
    assert d["step_s"] == pytest.approx(0.02) and d["kernels"][0]["layers"] == ["a", "b"]


def test_the_doctor_reports_the_ceiling_and_can_leave_it_out(noise_pack16, device):
    r = doctor(Repeated(), noise_pack16, batch_size=16, steps=2, warmup=1, try_fixes=False, device=device, progress=False)
    assert r.ceiling is not None and r.ceiling.batch_size == 16 and r.roofline.ceiling_s == r.ceiling.per_image_s
    text = r.text()
    assert "kernels' ceiling" in text and "Kernels alone" in text and "blocks.0 (+1 alike)" in text
    d = json.loads(json.dumps(r.to_dict()))
    assert d["ceiling"]["step_s"] > 0 and d["roofline"]["share_of_ceiling"] > 0
    assert "Kernels' ceiling" in r.html()
    off = doctor(Repeated(), noise_pack16, batch_size=16, steps=2, warmup=1, try_fixes=False, ceiling=False, device=device,
                 progress=False)
    assert off.ceiling is None and "kernels' ceiling" not in off.text() and off.to_dict()["ceiling"] is None


def test_bf16_ceiling_times_bf16_kernels(monkeypatch):
    seen = []
    real = ceiling_mod._time_layer
    monkeypatch.setattr(ceiling_mod, "_time_layer", lambda *a: (seen.append(a[4]), real(*a))[1])
    net = Repeated()
    kernel_ceiling(net, layer_costs(net, net.input_shape), 2, "bf16", "cpu")
    assert seen and set(seen) == {torch.bfloat16}


def test_a_frozen_stem_is_timed_forward_only():
    """Fine-tuning freezes the layers that read the images: they have nothing to backpropagate."""
    net = Repeated()
    net.stem.requires_grad_(False)
    c = kernel_ceiling(net, layer_costs(net, net.input_shape), 4, "fp32", "cpu")
    assert {k.layers[0] for k in c.kernels} == {"stem", "blocks.0", "head"} and all(k.seconds > 0 for k in c.kernels)


def test_a_layer_that_fails_alone_leaves_the_ceiling_out_not_the_report(noise_pack16, monkeypatch):
    def fails(*args):
        raise RuntimeError("this layer will not run alone")
    monkeypatch.setattr(ceiling_mod, "_time_layer", fails)
    said = []
    r = doctor(Repeated(), noise_pack16, batch_size=16, steps=2, warmup=1, try_fixes=False, device="cpu",
               progress=False, log=said.append)
    assert r.ceiling is None and r.roofline.ceiling_s is None and "kernels' ceiling" not in r.text()
    assert any("kernels' ceiling left out" in m and "will not run alone" in m for m in said)

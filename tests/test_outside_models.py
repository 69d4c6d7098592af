"""Models nobody here wrote (torchvision, timm), one per family that has broken: fit trains
each (a few steps) without a raw exception and hands back the same model object, trained; the
doctor's training FLOPs match a per-layer hook count; the measured findings do not call a
fresh batch-norm model frozen. The whole panel, trained for accuracy against a plain loop, is
benchmarks/bench_outside.py.

The PyPI torchvision wheel is a CUDA build whose compiled ops do not load beside the CPU torch;
benchmarks/outside_models.import_libraries works around that (see its note). Skipped where
torchvision or timm is missing."""

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trainfast import TrainfastError, fit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import outside_models  # noqa: E402

tv, timm = outside_models.import_libraries()
pytestmark = pytest.mark.skipif(tv is None or timm is None, reason="needs torchvision and timm")


@pytest.fixture(scope="module")
def small_pack(tmp_path_factory):
    """320 of the digits at 32×32 RGB: 10 steps of 32 per epoch (some held out)."""
    import trainfast
    from trainfast.datasets.digits import load_digits

    x, y, _ = load_digits(32)
    return trainfast.pack((x[:320], y[:320]), tmp_path_factory.mktemp("small") / "digits", size=(32, 32),
                          progress=False)


def _tree(net):
    return [(name, type(m).__name__, m.training) for name, m in net.named_modules()]


@pytest.mark.slow
@pytest.mark.parametrize("name", outside_models.SMALL)
def test_fit_trains_each_family_and_gives_the_same_model_back(name, small_pack, tmp_path):
    torch.manual_seed(0)
    net = outside_models.PANEL[name](10)
    tree, before = _tree(net), copy.deepcopy(net.state_dict())
    said = []
    r = fit(net, small_pack, epochs=1, device="cpu", run_dir=tmp_path / "run", progress=False, log=said.append)
    assert len(r.history) == 1 and np.isfinite(r.history[0]["train_loss"])
    assert r.model is net and _tree(net) == tree  # the same classes, order and modes: rewrites went to a copy
    assert any(not torch.equal(before[k], v) for k, v in net.state_dict().items())  # ... and it is trained
    returns = [m for m in said if m.startswith("the model returns")]
    if name in ("tv_googlenet", "timm_resnet18_dict"):
        assert len(returns) == 1 and ("'logits'" in returns[0])
    else:
        assert returns == []


def test_fit_keeps_the_callers_random_streams_and_trains_an_eval_mode_model_in_training_mode(small_pack, tmp_path):
    net = outside_models.PANEL["tv_resnet18_eval"](10)
    assert not net.training
    seen = []
    net.bn1.register_forward_hook(lambda m, a, o: seen.append(m.training) if torch.is_grad_enabled() else None)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    fit(net, small_pack, epochs=1, tune=False, batch_size=32, device="cpu", run_dir=tmp_path / "r", progress=False,
        log=lambda m: None)
    assert torch.equal(torch.rand(3), expected)  # fit seeded its own streams, and put the caller's back
    assert seen and all(seen)  # every training step ran batch norm in training mode
    assert not net.training  # handed back in the mode it came in


@pytest.mark.parametrize("name", outside_models.SMALL)
def test_training_flops_match_a_per_layer_count(name):
    from trainfast.diagnose.cost import layer_costs

    net = outside_models.PANEL[name](10)
    forward, train = outside_models.hook_flops(copy.deepcopy(net))
    cost = layer_costs(net, (3, 32, 32))
    assert cost.forward_flops == pytest.approx(forward, rel=0.05)
    assert cost.train_flops == pytest.approx(train, rel=0.05)  # grouped convolutions, attention included


@pytest.mark.parametrize("name", ["timm_regnetx_002", "tv_mobilenet_v3_small", "tv_squeezenet1_1"])
def test_fresh_models_are_not_called_frozen(name, small_pack):
    """Zero-initialised batch-norm gammas (RegNet), hard-swish and SE gates (MobileNetV3), Fire
    squeezes (SqueezeNet): at their initial weights no finding says the output is frozen, nor
    that filters shrink."""
    from trainfast.diagnose.cost import layer_costs, measured_findings

    torch.manual_seed(0)
    net = outside_models.PANEL[name](10)
    x = torch.from_numpy(np.stack([small_pack.image(i) for i in range(32)])).permute(0, 3, 1, 2).float() / 255
    found, frozen = measured_findings(net, x)
    assert not frozen and not any("is the same for all" in f for f in found)
    assert not any("filters shrink" in f for f in layer_costs(net, (3, 32, 32)).findings)


def test_what_a_model_returns_and_its_head_are_checked_in_one_line(small_pack, tmp_path):
    quiet = dict(epochs=1, device="cpu", progress=False)
    with pytest.raises(TrainfastError, match=r"has 10 classes; the model predicts 5 per image.*num_classes=10"):
        fit(outside_models.PANEL["tv_resnet18"](5), small_pack, run_dir=tmp_path / "a", log=lambda m: None, **quiet)
    vit64 = timm.create_model("vit_tiny_patch16_224", img_size=64, patch_size=8, num_classes=10)
    with pytest.raises(TrainfastError, match=r"does not take .*3×32×32.*AssertionError"):
        fit(vit64, small_pack, run_dir=tmp_path / "b", log=lambda m: None, **quiet)
    said = []
    fit(outside_models.PANEL["tv_squeezenet1_1"](1000), small_pack, run_dir=tmp_path / "c", tune=False,
        batch_size=32, log=said.append, **quiet)
    assert any("predicts 1000 classes" in m and "has 10" in m and "num_classes=10" in m for m in said)


def test_the_doctor_reads_a_tuple_and_a_dict_output(small_pack):
    import trainfast

    for name in ("tv_googlenet", "timm_resnet18_dict"):
        report = trainfast.doctor(outside_models.PANEL[name](10), small_pack, batch_size=16, steps=2, warmup=1,
                                  device="cpu", progress=False)  # its fix trials too
        assert report.cost.train_flops > 2 * report.cost.forward_flops


@pytest.mark.parametrize("name", outside_models.SMALL)
def test_each_family_reads_plates_through_a_per_position_head(name):
    """The plates panel's models: the backbone's map at stride 8 (timm's features_only,
    torchvision's create_feature_extractor) read as 8 characters of 36, in the panel's form
    (a dict output stays a dict, a model handed over in eval mode stays in eval mode)."""
    from trainfast.step import logits_of

    net = outside_models.plate_reader(name, 8, 36, (32, 64))
    assert net.training == outside_models.PANEL[name](10).training
    out = net.train()(torch.zeros(2, 3, 32, 64))
    assert tuple(logits_of(out).shape) == (2, 8, 36)
    logits_of(out).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())

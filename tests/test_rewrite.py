import copy

import pytest
import torch
import torch.nn as nn

from trainfast import models
from trainfast.cli import main
from trainfast.config import Speed
from trainfast.models import rewrite


def _outputs_and_grads(net, x):
    x = x.clone().requires_grad_(True)
    out = net(x)
    out.float().pow(2).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in net.named_parameters()}


def _no_dropout(net):
    for m in net.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return net


@pytest.mark.parametrize("name", ["plate_cnn", "cifar_cnn", "cifar_resnet", "plate_net"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_exact_passes_keep_outputs_and_gradients(name, layout):
    torch.manual_seed(0)
    ref = _no_dropout(models.create(name)).train()
    new = copy.deepcopy(ref)
    changed = rewrite.apply(new, ("pool_before_relu", "inplace_relu"))
    x = torch.randn(4, *models.entry(name).input_shape)
    if layout == "channels_last":
        ref, new = ref.to(memory_format=torch.channels_last), new.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    o1, gx1, gp1 = _outputs_and_grads(ref, x)
    o2, gx2, gp2 = _outputs_and_grads(new, x)
    assert torch.equal(o1, o2) and torch.equal(gx1, gx2)
    assert gp1.keys() == gp2.keys() and all(torch.equal(gp1[k], gp2[k]) for k in gp1)
    assert ref.state_dict().keys() == new.state_dict().keys()
    if name in ("plate_cnn", "cifar_cnn"):
        assert changed["pool_before_relu"] > 0 and changed["inplace_relu"] > 0


def test_the_users_plate_cnn_is_rewritten_where_expected():
    net = models.create("plate_cnn")
    changed = rewrite.apply(net, rewrite.ALL)
    assert changed == {"pool_before_relu": 4, "inplace_relu": 4, "cheap_dropout": 1}
    kinds = [type(m).__name__ for m in net.features]
    assert kinds[:3] == ["Conv2d", "MaxPool2d", "ReLU"]
    assert isinstance(net.dropout, rewrite.CheapDropout)


def test_applies_says_what_the_passes_would_do_without_changing_the_model():
    """tune asks whether any pass applies before timing a "rewrites" setting: the answer must be
    what the passes do to a copy, and the model must be left as it was."""
    cases = [models.create(n) for n in models.list()] + [
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.AvgPool2d(2)),  # nothing to do
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AvgPool2d(2)),  # an in-place ReLU
        nn.Sequential(nn.Identity(), nn.ReLU(), nn.MaxPool2d(2)),  # a ReLU/MaxPool swap only
        nn.Sequential(nn.Flatten(), nn.Dropout(0.5, inplace=True), nn.Linear(4, 2)),  # in-place dropout: kept
        nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(4, 2)),  # a dropout to replace
    ]
    answers = []
    for net in cases:
        before = repr(net)
        answers.append(rewrite.applies(net))
        assert repr(net) == before
        assert answers[-1] == any(rewrite.apply(copy.deepcopy(net), rewrite.ALL).values()), net
    assert answers[-5:] == [False, True, True, False, True]


def test_inplace_relu_leaves_a_relu_that_reads_a_shared_tensor():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))  # ReLU reads the block's input
            self.after_identity = nn.Sequential(nn.Identity(), nn.ReLU())

        def forward(self, x):
            return self.body(x) + x + self.after_identity(x)

    net = Residual()
    assert rewrite.inplace_relu(net) == 0
    x = torch.randn(2, 4, 5, 5)
    before = net(x)
    assert torch.equal(before, net(x))


def test_pool_before_relu_needs_adjacent_layers():
    net = nn.Sequential(nn.ReLU(), nn.Dropout(0.1), nn.MaxPool2d(2), nn.ReLU(), nn.AvgPool2d(2))
    assert rewrite.pool_before_relu(net) == 0


def test_cheap_dropout_has_dropouts_distribution_and_gradient():
    torch.manual_seed(0)
    d = rewrite.CheapDropout(0.3).train()
    x = torch.ones(64, 16, 20, 20).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    y = d(x)
    kept = (y != 0).float().mean().item()
    assert abs(kept - 0.7) < 0.005
    assert torch.allclose(y[y != 0], torch.tensor(1 / 0.7))
    assert y.is_contiguous(memory_format=torch.channels_last)
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # gradient is the same scaled mask
    m1, m2 = d(x), d(x)
    assert not torch.equal(m1, m2)  # a fresh mask per call
    torch.manual_seed(1); a = d(x)
    torch.manual_seed(1); b = d(x)
    assert torch.equal(a, b)  # follows torch's seed, so resume replays it
    assert torch.equal(d.eval()(x), x)


def test_cheap_dropout_keeps_p_and_bf16():
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Dropout(0.2, inplace=True))
    assert rewrite.cheap_dropout(net) == 1
    assert isinstance(net[1], rewrite.CheapDropout) and net[1].p == 0.5 and type(net[2]) is nn.Dropout
    y = net[1](torch.ones(1000, 100, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and abs((y == 0).float().mean().item() - 0.5) < 0.01


def test_unknown_pass_is_refused():
    with pytest.raises(ValueError, match="unknown rewrite 'fuse_everything'"):
        rewrite.apply(nn.Linear(1, 1), ["fuse_everything"])
    assert "unknown rewrite" in rewrite.check(["x"])
    assert Speed(rewrites=["pool_before_relu"]).rewrites == ("pool_before_relu",)


def test_train_refuses_an_unknown_rewrite_on_the_command_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "x.pack", "--model", "cifar_cnn", "--rewrites", "pool_before_relu,bogus"])
    assert e.value.code == 2 and "unknown rewrite 'bogus'" in capsys.readouterr().err


def test_keep_mask_rates_on_both_paths():
    """p = 0.25 takes the 8-bit path (exact), p = 0.3 the 16-bit one; odd sizes are covered."""
    torch.manual_seed(0)
    for p in (0.25, 0.5, 0.3, 0.1):
        x = torch.ones(1_000_003)
        m = rewrite.keep_mask(x, p)
        assert m.shape == x.shape
        assert abs((m != 0).float().mean().item() - (1 - p)) < 0.003, p
        assert torch.allclose(m[m != 0], torch.tensor(1 / (1 - p)))


def test_keep_mask_values_in_every_float_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        m = rewrite.keep_mask(torch.ones(4096, dtype=dtype), 0.25)
        assert m.dtype == dtype
        assert set(m.unique().tolist()) == {0.0, torch.tensor(1 / 0.75, dtype=dtype).item()}


def test_cheap_dropout_traces_whole_under_torch_compile():
    """Issue 49.5: 1/(1-p)'s bit pattern was worked out with .item() in the step: a graph break
    in every compiled model with dropout, and torch._dynamo's warning from trainfast's code."""
    import torch._dynamo

    m = torch.nn.Sequential(torch.nn.Linear(8, 8), rewrite.CheapDropout(0.3)).train()
    for dtype in (torch.float32, torch.bfloat16):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            assert torch._dynamo.explain(m)(torch.randn(4, 8)).graph_break_count == 0

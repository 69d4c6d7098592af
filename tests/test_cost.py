import torch
import torch.nn as nn

from trainfast.diagnose.cost import layer_costs


def test_conv_linear_pool_counts_by_hand():
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 5 * 5, 10))
    c = layer_costs(net, (3, 12, 12))
    by = {l.name: l for l in c.layers}
    # conv: 10×10 outputs × 8 filters × (3·3·3) multiply-adds × 2
    assert by["0"].params == 3 * 3 * 3 * 8 + 8
    assert by["0"].flops == 2 * 10 * 10 * 8 * 27
    assert by["0"].output_shape == (8, 10, 10)
    # max-pool 2×2: one FLOP per window element, 8×5×5 outputs
    assert by["2"].flops == 8 * 5 * 5 * 4
    # linear: 200 inputs × 10 outputs × 2
    assert by["4"].params == 200 * 10 + 10 and by["4"].flops == 2 * 200 * 10
    assert c.params == 224 + 2010
    assert c.forward_flops == by["0"].flops + by["2"].flops + by["4"].flops
    assert by["0"].activation_bytes == 8 * 10 * 10 * 4


def test_training_flops_are_about_three_times_forward():
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                        nn.Flatten(), nn.Linear(16 * 8 * 8, 4))
    c = layer_costs(net, (3, 8, 8))
    conv_lin = 2 * 64 * 16 * 27 + 2 * 64 * 16 * 144 + 2 * 1024 * 4
    assert c.forward_flops == conv_lin
    # backward = grad wrt weights (1×) + grad wrt inputs (1×), except the first layer's input
    assert c.train_flops == conv_lin + conv_lin + (conv_lin - 2 * 64 * 16 * 27)


def test_whole_small_cnn_per_image_and_findings():
    net = nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 16, 3), nn.ReLU(),
                        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 14 * 14, 512), nn.Linear(512, 1))
    c = layer_costs(net, (3, 64, 64), batch=3)
    assert c.params == sum(p.numel() for p in net.parameters())
    assert c.layers[0].flops == 2 * 62 * 62 * 32 * 27  # per image, not per batch of 3
    text = " ".join(c.findings)
    assert "holds" in text and "7 (Linear)" in text  # the big Dense
    assert "it reads a flattened 16×14×14 map: global average pooling before it removes most of it" in text
    assert "filters shrink from 32 to 16" in text


def test_a_big_head_after_a_global_pool_is_not_told_to_pool():
    """timm's heads follow a global pool on a 1×1 map: pooling again removes nothing."""
    net = nn.Sequential(nn.Conv2d(3, 64, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 2048),
                        nn.ReLU(), nn.Linear(2048, 10))
    text = " ".join(layer_costs(net, (3, 32, 32), batch=2).findings)
    assert "4 (Linear) holds" in text
    assert "dominates memory" in text and "pooling" not in text


def test_failing_model_names_layer_and_shapes():
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(100, 10))
    try:
        layer_costs(net, (3, 32, 32))
    except ValueError as e:
        msg = str(e)
    assert "layer 2 (Linear)" in msg and "(7200,)" in msg and "(3, 32, 32)" in msg


class OneNumberHead(nn.Module):
    """plate_cnn's head in small: each of `positions` outputs read from one ReLU'd number of the
    12 input values, through Linear(1, 5): 5 lines over that number."""

    def __init__(self, positions: int):
        super().__init__()
        self.scalar = nn.Linear(12, positions)
        self.per_position = nn.Linear(1, 5)

    def forward(self, x):
        return self.per_position(torch.relu(self.scalar(x.flatten(1))).unsqueeze(-1))  # (B, positions, 5)


def test_outputs_no_image_changes_are_found_dead():
    """plate_cnn's story: each position read from one ReLU'd number; a position whose number is
    negative for every image is dead (its output constant), and training cannot revive it."""
    import torch

    from trainfast.diagnose.cost import measured_findings

    def constant_outputs(net, x):
        return [f for f in measured_findings(net, x)[0] if "is the same for all" in f]

    torch.manual_seed(0)
    net = OneNumberHead(4).train()
    x = torch.rand(16, 3, 2, 2)
    with torch.no_grad():
        net.scalar.weight.fill_(1.0)
        net.scalar.weight[1:3].fill_(-1.0)  # inputs are ≥ 0: positions 2 and 3 are negative for every image
    found = constant_outputs(net, x)
    assert len(found) == 1 and "at 2 of 4 positions (2, 3)" in found[0] and "16 training images" in found[0]
    assert net.training  # its mode is restored
    with torch.no_grad():
        net.scalar.weight.fill_(1.0)
    assert constant_outputs(net, x) == []
    assert constant_outputs(nn.Sequential(nn.Flatten(), nn.Linear(12, 3)), x) == []  # a classifier that sees its input
    dead = nn.Sequential(nn.Flatten(), nn.Linear(12, 3), nn.ReLU(), nn.Linear(3, 2))
    with torch.no_grad():
        dead[1].bias.fill_(-100.0)
    assert "output  is the same" not in constant_outputs(dead, x)[0]  # no empty "at … positions"
    assert "the model's output is the same for all 16" in constant_outputs(dead, x)[0]
    assert "stopped seeing its input at 2 (ReLU): 100% of its values are the same for every image (100% of them " \
           "zero)" in constant_outputs(dead, x)[0]  # where the collapse starts: the ReLU, not the Linear before it
    assert "stopped seeing" not in found[0]  # some positions still see the images: no single place


def test_lines_on_top_is_the_upper_envelope():
    """The classes a one-number head can name: checked against the argmax on a fine grid."""
    import math

    import torch

    from trainfast.diagnose.cost import lines_on_top

    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        a, b = torch.rand(36, generator=g) * 2 - 1, torch.rand(36, generator=g) * 2 - 1
        for lo, hi in ((0.0, math.inf), (-math.inf, math.inf), (0.1, 0.4), (0.3, 0.3)):
            cross = [((b[i] - b[j]) / (a[j] - a[i])).item() for i in range(36) for j in range(36) if a[i] != a[j]]
            pts = sorted({lo, hi, *(c for c in cross if lo < c < hi)} - {math.inf, -math.inf})
            pts = [min(pts) - 1e3] * math.isinf(lo) + pts + [max(pts) + 1e3] * math.isinf(hi)
            grid = torch.tensor(pts + [(p + q) / 2 for p, q in zip(pts, pts[1:])], dtype=torch.float64).sort().values
            brute = (grid[:, None] * a.double() + b.double()).argmax(1).unique_consecutive().tolist()
            assert lines_on_top(a, b, lo, hi) == brute, (seed, lo, hi)
    assert lines_on_top(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])) == [1]  # parallel: the higher one


def test_one_number_head_reach_is_measured():
    """plate_cnn's head at its own weights: the doctor counts the classes it can name at all."""
    import torch

    from trainfast.diagnose.cost import measured_findings

    net = OneNumberHead(2)
    x = torch.rand(16, 3, 2, 2)
    with torch.no_grad():
        net.scalar.weight.fill_(0.1)
        net.scalar.bias.zero_()  # the numbers lie in 0 … 1.2
        net.per_position.weight.copy_(torch.tensor([[0.0], [1.0], [2.0], [-1.0], [0.5]]))
        net.per_position.bias.copy_(torch.tensor([0.0, -0.5, -3.0, 1.0, -10.0]))
    found, frozen = measured_findings(net, x)
    # above 0: class 4 (index 3) until 0.5, then 2 (index 1) until 2.5, then 3 (index 2); class 5 never
    assert not frozen and len(found) == 1
    assert "only 3 of the 5 are on top anywhere above 0" in found[0] and "3/5 (60%)" in found[0]
    assert found[0].endswith("2 are on top")  # the images' numbers (0.1 … 1.2) reach classes 4 and 2
    with torch.no_grad():
        net.per_position.weight.copy_(torch.arange(5.0)[:, None])
        net.per_position.bias.copy_(-torch.arange(5.0) ** 2 / 2)  # an ordinal code: class k on top from k-½ to k+½
        net.scalar.weight.fill_(0.5)
    x = torch.linspace(0, 1, 16)[:, None, None, None].expand(16, 3, 2, 2)  # numbers 0 … 6 cross every stretch
    assert measured_findings(net, x)[0] == []
    with torch.no_grad():
        net.scalar.weight.fill_(0.1)  # numbers 0 … 1.2: only classes 1 and 2 of the ordinal code
    found = measured_findings(net, x)[0]
    assert len(found) == 1 and "all 5 are on top somewhere above 0" in found[0] and found[0].endswith("2 are on top")
    assert measured_findings(nn.Sequential(nn.Flatten(), nn.Linear(12, 3)), x) == ([], False)

    class Scaled(OneNumberHead):
        def forward(self, x):
            return super().forward(x) * torch.arange(1.0, 6.0)  # the lines are not the logits any more

    scaled = Scaled(2)
    scaled.load_state_dict(net.state_dict())
    with torch.no_grad():
        scaled.scalar.weight.fill_(0.0)  # every image gives the same number: one class on top
    assert not any("lines over its single input" in f for f in measured_findings(scaled, x)[0])


class _FixedSize(nn.Module):
    """Built for one input size, as timm's and torchvision's ViTs and Mixers are: the check is
    the model's own code (an assertion), not a layer's."""

    def __init__(self, check_after_conv: bool = False):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 10)
        self.after = check_after_conv

    def forward(self, x):
        if not self.after:
            assert x.shape[-1] == 224, f"Input width ({x.shape[-1]}) doesn't match model (224)."
        x = self.conv(x)
        if self.after:
            assert x.shape[-1] == 224, "Wrong image width!"
        return self.head(x.mean((2, 3)))


def test_a_model_whose_own_code_refuses_the_input_size_is_one_line_too():
    import pytest
    with pytest.raises(ValueError, match=r"^the model fails on input \(3, 32, 32\) before its first layer: "
                                         r"AssertionError: Input width \(32\) doesn't match model \(224\)\.$"):
        layer_costs(_FixedSize(), (3, 32, 32))
    with pytest.raises(ValueError, match=r"fails on input \(3, 32, 32\) after layer conv: AssertionError: Wrong"):
        layer_costs(_FixedSize(check_after_conv=True), (3, 32, 32))

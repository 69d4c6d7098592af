"""Models nobody here wrote: a panel of torchvision and timm classifiers, built the way their
users build them, for bench_outside.py and the test suite (tests/test_outside_models.py).

    import outside_models
    tv, timm = outside_models.import_libraries()     # None, None where they are not installed
    net = outside_models.PANEL["tv_resnet18"](10)     # a fresh model with a 10-way head

Each entry is a family a user may bring: plain, residual, depthwise + squeeze-excitation,
grouped, channel shuffle, Fire modules, dense connections, attention, auxiliary outputs
(GoogLeNet's named tuple in training), a dict output (as Hugging Face-style wrappers return),
and a model handed over in eval mode. They take 3×32×32 inputs (a ViT is built for that size).
"""

from __future__ import annotations

import sys
import types

import torch.nn as nn


def import_libraries():
    """(torchvision, timm), each None where it is not installed or does not import.

    NOTE: PyPI's torchvision wheels are CUDA builds; beside a CPU-only torch their compiled ops
    (torchvision::nms, roi_align ...) do not load, and `import torchvision` fails registering
    fake kernels for them in torchvision._meta_registrations. The classification models are
    pure Python and need none of those ops, so where a CUDA build of torchvision meets a
    CPU-only torch, that one module is replaced by an empty one before the import. Where
    torchvision matches torch, nothing is replaced."""
    import importlib.util
    from pathlib import Path

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        return None, None
    version = Path(spec.submodule_search_locations[0], "version.py")
    built_for_cuda = "+cu" in (version.read_text() if version.is_file() else "")
    if built_for_cuda and torch.version.cuda is None and "torchvision" not in sys.modules:
        sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    try:
        import torchvision
    except Exception:  # noqa: BLE001 - not installed, or another build that will not import here
        return None, None
    try:
        import timm
    except Exception:  # noqa: BLE001
        timm = None
    return torchvision, timm


class DictOutput(nn.Module):
    """A classifier returning {"logits": ..., "features": ...}, as many wrappers do."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x):
        features = self.body.forward_features(x)
        return {"logits": self.body.forward_head(features), "features": features}


def _tv(name, **kw):
    def make(classes: int) -> nn.Module:
        tv, _ = import_libraries()
        return getattr(tv.models, name)(num_classes=classes, **kw)
    make.library, make.arch, make.kw = "torchvision", name, kw
    return make


def _timm(name, **kw):
    def make(classes: int) -> nn.Module:
        _, timm = import_libraries()
        return timm.create_model(name, num_classes=classes, **kw)
    make.library, make.arch, make.kw = "timm", name, kw
    return make


def _eval_mode(make):
    made = lambda classes: make(classes).eval()  # noqa: E731
    made.base, made.wrap = make, lambda m: m.eval()
    return made


def _dict_output(make):
    made = lambda classes: DictOutput(make(classes))  # noqa: E731
    made.base, made.wrap = make, lambda m: _ReaderDict(m)
    return made


PANEL = {  # name: build(classes) -> nn.Module; family in the comment
    "tv_resnet18": _tv("resnet18"),  # residual, batch norm
    "tv_resnet18_eval": _eval_mode(_tv("resnet18")),  # ... handed to fit in eval mode
    "tv_mobilenet_v3_small": _tv("mobilenet_v3_small"),  # depthwise + squeeze-excitation, hard-swish
    "tv_efficientnet_b0": _tv("efficientnet_b0"),  # depthwise + SE, stochastic depth
    "tv_regnet_x_400mf": _tv("regnet_x_400mf"),  # grouped convolutions
    "tv_shufflenet_v2_x0_5": _tv("shufflenet_v2_x0_5"),  # channel shuffle
    "tv_squeezenet1_1": _tv("squeezenet1_1"),  # Fire modules, no batch norm, conv head
    "tv_densenet121": _tv("densenet121"),  # dense connections
    "tv_googlenet": _tv("googlenet", aux_logits=True, init_weights=True),  # aux outputs in training
    "tv_mnasnet0_5": _tv("mnasnet0_5"),  # depthwise, no SE
    "timm_mobilenetv3_small_050": _timm("mobilenetv3_small_050"),
    "timm_ghostnet_100": _timm("ghostnet_100"),  # ghost modules: cheap depthwise features
    "timm_regnetx_002": _timm("regnetx_002"),  # grouped, zero-initialised last BN gammas
    "timm_convnext_atto": _timm("convnext_atto"),  # depthwise 7×7, LayerNorm, GELU
    "timm_repvgg_a0": _timm("repvgg_a0"),  # plain VGG-style stack (3×3 + 1×1 branches in training)
    "timm_resnext26ts": _timm("resnext26ts"),  # grouped bottlenecks
    "timm_vit_tiny_32": _timm("vit_tiny_patch16_224", img_size=32, patch_size=4),  # attention (SDPA)
    "timm_resnet18_dict": _dict_output(_timm("resnet18")),  # a dict output
}

class PlateReader(nn.Module):
    """A backbone's feature map at a stride where a plate's characters are columns apart (at
    32×64 and stride 8: 4 × 8 positions, one column per character), averaged over its height,
    pooled to `length` columns and read by one 1×1 convolution shared by every position:
    (N, length, classes) logits, the per-position head a user gives a classifier's backbone to
    read plates (a classifier's own head pools the whole map to one vector, and the
    characters' places with it)."""

    def __init__(self, features: nn.Module, channels: int, length: int, classes: int):
        super().__init__()
        self.features, self.length = features, length
        self.head = nn.Conv2d(channels, classes, 1)

    def read(self, x):
        """(logits, the feature map they were read from)."""
        import torch.nn.functional as F

        f = self.features(x)
        f = f[-1] if isinstance(f, (list, tuple)) else next(iter(f.values())) if isinstance(f, dict) else f
        return self.head(F.adaptive_avg_pool2d(f, (1, self.length))).squeeze(2).transpose(1, 2), f

    def forward(self, x):
        return self.read(x)[0]


class _ReaderDict(nn.Module):
    """A plate reader that returns {"logits": ..., "features": ...} (the panel's dict-output family)."""

    def __init__(self, reader: PlateReader):
        super().__init__()
        self.reader = reader

    def forward(self, x):
        logits, features = self.reader.read(x)
        return {"logits": logits, "features": features}


def plate_reader(name: str, length: int, classes: int, size=(32, 64), stride: int = 8) -> nn.Module:
    """PANEL[name]'s backbone as a plate reader (PlateReader), its feature map taken at `stride`
    the library's own way: timm's `features_only`, torchvision's `create_feature_extractor` at
    the last module whose output is that stride's width, ±1 (found by running the classifier once). The
    panel's wrappers (eval mode, a dict output) wrap the reader."""
    import torch

    make = PANEL[name]
    base, wrap = getattr(make, "base", make), getattr(make, "wrap", lambda m: m)
    tv, timm = import_libraries()
    h, w = size
    if base.library == "timm":
        kw = dict(base.kw)
        if "img_size" in kw:
            kw["img_size"] = size
        probe = timm.create_model(base.arch, features_only=True, **kw)
        pick = max(i for i, r in enumerate(probe.feature_info.reduction()) if r <= stride)
        features = timm.create_model(base.arch, features_only=True, out_indices=(pick,), **kw)
        channels = features.feature_info.channels()[-1]
    else:
        from torchvision.models.feature_extraction import create_feature_extractor

        net, found = base(classes).eval(), []
        hooks = [m.register_forward_hook(lambda m, a, o, n=n: found.append((n, o.shape[1]))
                                          if torch.is_tensor(o) and o.dim() == 4 and abs(o.shape[3] - w // stride) <= 1
                                          else None)  # unpadded pooling (SqueezeNet): 7 columns, not 8
                 for n, m in net.named_modules() if n]
        with torch.no_grad():
            net(torch.zeros(1, 3, h, w))
        for k in hooks:
            k.remove()
        where, channels = found[-1]
        features = create_feature_extractor(net.train(), return_nodes={where: "features"})
    return wrap(PlateReader(features, channels, length, classes))


SMALL = ["tv_resnet18_eval", "tv_mobilenet_v3_small", "tv_squeezenet1_1", "tv_googlenet", "timm_regnetx_002",
         "timm_vit_tiny_32", "timm_resnet18_dict", "tv_shufflenet_v2_x0_5"]
"""The panel's members the test suite trains for a few steps: one per family that has broken."""


def hook_flops(model: nn.Module, shape=(3, 32, 32), batch: int = 2) -> tuple[int, int]:
    """(forward, training) FLOPs per image counted layer by layer with forward hooks, as a check
    on the doctor's count: 2 per multiply-add of every convolution (2 · positions · its weight's
    size, which divides by the groups), linear layer and attention's two matrix products
    (timm's Attention: q·kᵀ and its product with v). A backward pass costs each of them twice
    the forward (the input's gradient and the weight's), less what is not needed: no input
    gradient for the first layer (the images need none)."""
    import math

    import torch

    counts: list[tuple[int, bool, bool]] = []  # (forward FLOPs, input needs a gradient, weight does)

    def hook(module, args, out):
        x = args[0]
        if isinstance(module, nn.Conv2d):
            f = 2 * out.shape[0] * math.prod(out.shape[2:]) * module.weight.numel()
        elif isinstance(module, nn.Linear):
            f = 2 * math.prod(x.shape[:-1]) * module.weight.numel()
        else:  # attention: (B, N, C) in; heads × (N × N × d) twice
            b, n, c = x.shape
            f = 2 * 2 * b * n * n * c
            counts.append((f, True, False))
            return
        counts.append((f, x.requires_grad, module.weight.requires_grad))
    kinds = (nn.Conv2d, nn.Linear)
    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, kinds) or type(m).__name__ == "Attention"]
    try:
        model.eval()
        x = torch.zeros(batch, *shape)
        from trainfast.step import logits_of
        logits_of(model(x)).float().sum().backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    forward = sum(f for f, _, _ in counts)
    train = sum(f * (1 + int(gi) + int(gw)) for f, gi, gw in counts)
    return forward // batch, train // batch

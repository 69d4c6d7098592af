"""What a model costs: per-layer output shape, parameters, FLOPs and activation memory,
and the structural findings that follow from them.

FLOPs are counted by torch.utils.flop_counter: 2 per multiply-add of convolutions and
matrix products (FLOPs, not MACs), plus, added here, one per window element of pooling.
Elementwise work (activations, batch-norm, dropout) is not counted: it is memory-bound and
belongs to the memory bound instead.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from trainfast.errors import in_words
from trainfast.step import logits_of


@dataclass
class LayerCost:
    name: str  # module path, e.g. "features.0"
    kind: str  # class name, e.g. "Conv2d"
    input_shape: tuple  # per image, without the batch dimension
    output_shape: tuple
    params: int
    flops: int  # forward FLOPs per image
    activation_bytes: int  # output bytes per image at the dtype measured
    kernel: tuple = ()  # a convolution's kernel size


@dataclass
class ModelCost:
    layers: list[LayerCost]
    params: int
    forward_flops: int  # per image
    train_flops: int  # forward + backward per image, as counted
    activation_bytes: int  # all layers' outputs per image
    param_bytes: int
    input_shape: tuple
    findings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _pool_flops(input_shape, kernel_size, *args, out_shape=None, **kwargs) -> int:
    out = out_shape[0] if isinstance(out_shape[0], (tuple, list, torch.Size)) else out_shape
    k = kernel_size if isinstance(kernel_size, (tuple, list)) else (kernel_size, kernel_size)
    return math.prod(out) * math.prod(k)


def _adaptive_pool_flops(input_shape, output_size, *args, out_shape=None, **kwargs) -> int:
    return math.prod(input_shape)  # every input element is read into exactly one window


def _conv_backward_flops(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                         _output_padding, _groups, output_mask, out_shape=None, **kwargs) -> int:
    """A convolution's backward: the input's gradient and the weight's each cost what the
    forward did, 2 × batch × positions × the weight's size (its (out, in / groups, kh, kw)
    shape already divides by the groups). torch's own formula counts the weight's gradient
    with all input channels, `groups` times too much for grouped and depthwise convolutions."""
    positions = math.prod((x_shape if transposed else grad_out_shape)[2:])
    forward = 2 * x_shape[0] * positions * math.prod(w_shape)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def _sdpa_cpu_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q, k, v)


def _sdpa_cpu_backward_flops(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, q, k, v)


_CUSTOM = {
    torch.ops.aten.convolution_backward: _conv_backward_flops,
    # NOTE: attention on the CPU runs these kernels, which torch's counter does not know (it
    # counts the CUDA ones); the work is the same matrix products.
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flops,
    torch.ops.aten.max_pool2d_with_indices: _pool_flops,
    torch.ops.aten.max_pool2d: _pool_flops,
    torch.ops.aten.avg_pool2d: _pool_flops,
    torch.ops.aten._adaptive_avg_pool2d: _adaptive_pool_flops,
}


def _count(model: nn.Module, x: torch.Tensor, backward: bool) -> dict:
    counter = FlopCounterMode(display=False, custom_mapping=_CUSTOM)
    with counter:
        y = logits_of(model(x))
        if backward:
            y.float().sum().backward()
    return counter.get_flop_counts()


def layer_costs(model: nn.Module, input_shape, batch: int = 2, dtype=torch.float32) -> ModelCost:
    """Cost of `model` per image for inputs of shape (C, H, W).

    Raises ValueError naming the layer and the shapes when the model fails on that input.
    """
    model = model.cpu()
    was_training = model.training
    model.eval()  # dropout off, batch-norm statistics untouched
    x = torch.zeros((batch, *input_shape), dtype=dtype)
    leaves = {n: m for n, m in model.named_modules() if not list(m.children())}
    seen = _LayerShapes(leaves)
    try:
        with seen, torch.no_grad():
            counts = _count(model, x, backward=False)
    except Exception as e:  # noqa: BLE001 - whatever the user's forward raises (timm's size asserts too)
        raise ValueError(f"the model fails on input {tuple(input_shape)} {seen.where_it_failed()}: "
                         f"{in_words(e, 300)}") from None
    shapes, inputs = seen.outputs, seen.inputs
    train_counts = _count(model, x.requires_grad_(False), backward=True)
    model.train(was_training)
    model.zero_grad(set_to_none=True)

    root = type(model).__name__
    per_module = {(k[len(root) + 1:] if k.startswith(root + ".") else k): sum(v.values()) for k, v in counts.items()}
    size = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 1
    layers = []
    for name, mod in leaves.items():
        if name not in shapes:
            continue  # not used in forward
        params = sum(p.numel() for p in mod.parameters(recurse=False))
        layers.append(LayerCost(name, type(mod).__name__, inputs.get(name, ()), shapes[name], params,
                                per_module.get(name, 0) // batch, math.prod(shapes[name]) * size,
                                tuple(mod.kernel_size) if isinstance(mod, nn.Conv2d) else ()))
    params = sum(p.numel() for p in model.parameters())
    cost = ModelCost(
        layers=layers, params=params,
        forward_flops=sum(counts.get("Global", {}).values()) // batch,
        train_flops=sum(train_counts.get("Global", {}).values()) // batch,
        activation_bytes=sum(l.activation_bytes for l in layers),
        param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        input_shape=tuple(input_shape))
    cost.findings = structural_findings(cost)
    return cost


class _LayerShapes:
    """Over one forward, in a with block: each leaf layer's input and output shapes (per
    example), and the layers begun, so that a failing forward can name where it failed."""

    def __init__(self, leaves: dict[str, nn.Module]):
        self.leaves, self.inputs, self.outputs = leaves, {}, {}
        self.begun: list[str] = []
        self.ended: set[str] = set()
        self._handles = []

    def __enter__(self):
        for name, m in self.leaves.items():
            self._handles.append(m.register_forward_pre_hook(lambda mod, args, n=name: self._begin(n, args)))
            self._handles.append(m.register_forward_hook(lambda mod, args, out, n=name: self._end(n, args, out)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()

    def _begin(self, name: str, args) -> None:
        self.begun.append(name)
        if args and isinstance(args[0], torch.Tensor):
            self.inputs[name] = tuple(args[0].shape[1:])

    def _end(self, name: str, args, out) -> None:
        self.ended.add(name)
        if isinstance(out, torch.Tensor):
            self.outputs[name] = tuple(out.shape[1:])
        if args and isinstance(args[0], torch.Tensor):
            self.inputs[name] = tuple(args[0].shape[1:])

    def where_it_failed(self) -> str:
        """A layer that began and did not end failed; else the model's own code between its
        layers did (a size check, a reshape)."""
        if self.begun and self.begun[-1] not in self.ended:
            where = self.begun[-1]
            return (f"at layer {where} ({type(self.leaves[where]).__name__}), which received "
                    f"{self.inputs.get(where, '?')}")
        return f"after layer {self.begun[-1]}" if self.begun else "before its first layer"


def _flattened_map(cost: ModelCost, layer: LayerCost) -> tuple | None:
    """The C×H×W map (H·W > 1) that `layer`'s flat input was made from: the nearest layer before
    it with a 3-D output, where its size matches; None for a layer after a global pool."""
    if len(layer.input_shape) != 1:
        return None
    before = cost.layers[:cost.layers.index(layer)]
    shaped = next((l.output_shape for l in reversed(before) if len(l.output_shape) == 3), None)
    if shaped and math.prod(shaped) == layer.input_shape[0] and shaped[1] * shaped[2] > 1:
        return shaped
    return None


def structural_findings(cost: ModelCost) -> list[str]:
    """Findings about the model's shape, each with its one-line reason: what may keep it from
    learning (learning_findings), then what makes it costly."""
    out = learning_findings(cost)
    if cost.params:
        big = max(cost.layers, key=lambda l: l.params)
        share = big.params / cost.params
        if share >= 0.5 and big.params >= 100_000:
            flop_share = big.flops / max(cost.forward_flops, 1)
            spatial = _flattened_map(cost, big)
            out.append(f"{big.name} ({big.kind}) holds {share:.0%} of the parameters ({big.params:,}) but "
                       f"{flop_share:.1%} of the FLOPs: it dominates memory and overfitting risk, not time"
                       + (f"; it reads a flattened {'×'.join(map(str, spatial))} map: global average pooling "
                          "before it removes most of it" if spatial else ""))
    convs = [l for l in cost.layers if l.kind == "Conv2d" and len(l.output_shape) == 3]
    c, h, w = cost.input_shape
    if convs and h * w >= 256 * 256:
        first = convs[0]
        if first.flops / max(cost.forward_flops, 1) > 0.3:
            out.append(f"the input is {h}×{w}: the first convolution alone costs "
                       f"{first.flops / max(cost.forward_flops, 1):.0%} of the FLOPs; check whether a smaller "
                       "input resolution loses any accuracy")
    return out


def learning_findings(cost: ModelCost) -> list[str]:
    """The structural findings that bear on whether the model can learn (what `fit`'s loss
    watch quotes for a run stuck at chance): a width-1 bottleneck, filters that shrink."""
    out = []
    for l in cost.layers:
        if l.kind == "Linear" and l.input_shape and l.input_shape[-1] == 1:
            if len(l.output_shape) >= 2:
                k = l.output_shape[-1]
                out.append(f"{l.name} predicts each of {l.output_shape[0]} positions from a single number "
                           f"(its input is {l.input_shape}): a width-1 bottleneck. One number tells {k} classes "
                           f"apart only where the {k} lines that layer draws over it take turns on top, a stretch "
                           "per class; from random weights only a few do, so a number that varies with the image "
                           "mostly raises the loss, and training flattens it, the layers upstream included; keep a "
                           "feature vector per position instead")
            else:
                out.append(f"{l.name} sees a single feature (input {l.input_shape}): a width-1 bottleneck")
    # The network's width at each resolution: its widest convolution there. Comparing convolutions
    # one by one would flag every narrowing by design: a squeeze-excitation gate (on a 1×1 map), a
    # Fire module's squeeze or a bottleneck's 1×1 reduction, a dense or inception block's branch.
    widest: dict[tuple, tuple[int, LayerCost]] = {}
    for l in cost.layers:
        if l.kind == "Conv2d" and len(l.output_shape) == 3 and math.prod(l.output_shape[1:]) > 1:
            at = tuple(l.output_shape[1:])
            if at not in widest or l.output_shape[0] > widest[at][0]:
                widest[at] = (l.output_shape[0], l)
    levels = list(widest.values())  # in the order the resolutions first appear
    for (wa, a), (wb, b) in zip(levels, levels[1:]):
        if wb < wa and math.prod(b.output_shape[1:]) < math.prod(a.output_shape[1:]):
            out.append(f"filters shrink from {wa} to {wb} after downsampling ({a.name} → {b.name}, the widest "
                       "at each resolution): usual practice doubles them as resolution halves")
    return out


STILL_SHARE = 0.99  # a layer with this share of its values the same for every image has stopped seeing its input


def _pct(share: float) -> str:
    """A share as a percentage with the digits that tell it from 100%: 0.9999 → '99.99%'."""
    digits = 0
    while digits < 4 and round(share * 100, digits) >= 100 and share < 1:
        digits += 1
    return f"{share * 100:.{digits}f}%"


def _still(t: torch.Tensor) -> torch.Tensor:
    """Per element of one image's output: True where it is the same for every image of the batch."""
    t = t.float()
    return (t - t[:1]).abs().amax(dim=0) <= 1e-5 * (1 + t.abs().amax(dim=0))


def measured_findings(net: nn.Module, x: torch.Tensor, when: str = "") -> tuple[list[str], bool]:
    """Findings measured by running `net` on the batch `x` (images that differ), and whether
    every output is frozen: outputs that are the same for every image (_still_outputs), and a
    width-1 head that can name only some of its classes whatever the image (head_reach).
    Run as training runs it (training mode: batch-norm on the batch's own statistics), on a
    copy, with the random streams put back; `net` is not changed.

    Every output the same is called frozen only where no parameter that ran before the
    place it froze gets a gradient from a loss on these images: then training cannot move
    it (dead ReLUs). A fresh model whose output is flat for another reason, e.g. behind
    zero-initialised batch-norm gammas, gets gradients there and learns."""
    traced = _trace(net, x)
    if traced is None:
        return [], False
    out, layers, moving = traced
    found, frozen = [], False
    still = _still_outputs(out, layers)
    if still is not None and not (still[0].all() and moving(still[2])):
        found.append(still_finding(still[0], still[1], len(x), when))
        frozen = bool(still[0].all())
    reach = head_reach(out, layers, len(x), when)
    return found + ([reach] if reach else []), frozen


def still_finding(still: torch.Tensor, origin: str, images: int, when: str = "") -> str:
    """_still_outputs' measurement in words (the doctor's and the loss watch's finding)."""
    where = (f" at {int(still.sum())} of {len(still)} positions "
             f"({', '.join(str(int(i) + 1) for i in still.nonzero().flatten())})" if len(still) > 1 else "")
    return (f"{when}the model's output{where} is the same for all {images} training images it was shown{origin}: "
            "nothing upstream reaches it, so no learning rate can move it (in a ReLU network, units whose input "
            "is negative for every image are dead and pass no gradient); a normalisation layer before the "
            "activation, or keeping a feature vector per output instead of one number, avoids it")


Layer = tuple[str, nn.Module, torch.Tensor, torch.Tensor]  # name, module, input, output


def _trace(net: nn.Module, x: torch.Tensor):
    """(output, leaf layers in the order they ran, moving) of a copy of `net` on `x` in
    training mode, or None where it will not run or gives no finite (batch, ...) output.
    moving(k) says whether a parameter of the first k layers that ran gets a gradient from a
    cross-entropy loss on the output (every layer but the last for k=None)."""
    from trainfast.step import kept_state, logits_of

    if len(x) < 2:
        return None
    net = copy.deepcopy(net)
    layers: list[Layer] = []

    def record(name):
        def hook(module, args, output):
            if isinstance(output, torch.Tensor) and output.dim() >= 1 and len(output) == len(x):
                first = args[0].detach() if args and isinstance(args[0], torch.Tensor) else None
                layers.append((name, module, first, output.detach()))
        return hook
    handles = [m.register_forward_hook(record(n)) for n, m in net.named_modules() if n and not list(m.children())]
    try:
        with kept_state(net, [x.device] if x.device.type == "cuda" else []):
            raw = logits_of(net(x))
            out = raw.detach().float()
            if out.dim() >= 2 and torch.isfinite(out).all() and raw.requires_grad:
                k = out.shape[-1]  # every class as a label in turn: a loss whose gradient reaches the logits
                target = torch.arange(out[..., 0].numel(), device=out.device).reshape(out.shape[:-1]) % k
                F.cross_entropy(raw.float().reshape(-1, k), target.reshape(-1)).backward()
    except Exception:  # noqa: BLE001 - a finding is a bonus: a model that will not run here gets none
        return None
    finally:
        for h in handles:
            h.remove()
    if out.dim() < 2 or not torch.isfinite(out).all():
        return None

    def moving(upto: int | None) -> bool:
        ran = layers[:upto] if upto is not None else layers[:-1]
        return any(p.grad is not None and bool(p.grad.abs().max() > 0)
                   for _, m, _, _ in ran for p in m.parameters(recurse=False))
    return out, layers, moving


def _still_outputs(out, layers) -> tuple[torch.Tensor, str, int | None] | None:
    """(still, origin, k) from a _trace: per output position (one entry for a plain classifier),
    True where the output is the same for every image; and where all are, in words, the first
    layer where the network stopped seeing its input, which is the k-th to run (None where no
    layer is). None where no output is still."""
    spread = _still(out)
    still = spread.flatten(1).all(1) if out.dim() >= 3 else spread.all().reshape(1)
    if not still.any():
        return None
    origin, upto = "", None
    if still.all():
        first = next(((i, n, m, t, float(_still(t).float().mean())) for i, (n, m, _, t) in enumerate(layers[:-1])
                      if t.dim() >= 2 and _still(t).float().mean() >= STILL_SHARE), None)
        if first is not None:
            i, n, m, t, share = first
            upto = i + 1
            zeros = float((t == 0).float().mean())
            origin = (f"; the network stopped seeing its input at {n} ({type(m).__name__}): "
                      f"{_pct(share)} of its values are the same for every image"
                      + (f" ({_pct(zeros)} of them zero)" if zeros >= 0.01 else ""))
    return still, origin, upto


def lines_on_top(slopes: torch.Tensor, offsets: torch.Tensor, lo: float = -math.inf,
                 hi: float = math.inf) -> list[int]:
    """The lines y_k(s) = slopes[k]·s + offsets[k] that are the highest of all for some s in
    [lo, hi], from left to right (the upper envelope). A layer that maps one number to K
    logits can only ever predict these classes."""
    a, b = slopes.double().tolist(), offsets.double().tolist()
    if math.isinf(lo):  # far left the smallest slope wins (ties: the higher line)
        cur = min(range(len(a)), key=lambda k: (a[k], -b[k]))
    else:  # ties: the steeper line, which stays on top to the right
        cur = max(range(len(a)), key=lambda k: (a[k] * lo + b[k], a[k]))
    s, order = lo, [cur]
    while True:  # walk right: the next line to overtake the current one
        nxt = None
        for k in range(len(a)):
            if a[k] > a[cur]:
                cross = max((b[cur] - b[k]) / (a[k] - a[cur]), s)
                if nxt is None or (cross, -a[k]) < nxt:
                    nxt = (cross, -a[k], k)
        if nxt is None or nxt[0] > hi:
            return order
        s, cur = nxt[0], nxt[2]
        order.append(cur)


def head_reach(out: torch.Tensor, layers, images: int, when: str = "") -> str | None:
    """A measured finding for a model whose last layer maps one number to its K logits
    (Linear(1, K), plate_cnn's head): how many of the K classes it can name at all at its
    current weights (lines on top anywhere in the range its input can take: above 0 where
    every value it was given is ≥ 0, as after a ReLU), and how many the images' own values
    reach. None for any other model, or where every class is reachable from these images."""
    if not layers:
        return None
    name, last, inp, res = layers[-1]
    if not (isinstance(last, nn.Linear) and last.in_features == 1 and inp is not None
            and last.out_features >= 2 and torch.equal(res.float(), out)):  # its output is the model's
        return None
    k = last.out_features
    a, b = last.weight.detach().flatten().float().cpu(), (last.bias.detach().float().cpu() if last.bias is not None
                                                          else torch.zeros(k))
    v = inp.float().cpu().reshape(images, -1)  # the number per image, one column per position
    lo = 0.0 if float(v.min()) >= 0 else -math.inf
    anywhere = lines_on_top(a, b, lo)
    seen = set()
    for col in v.T:
        seen.update(lines_on_top(a, b, float(col.min()), float(col.max())))
    if len(seen) >= k:
        return None
    where = "above 0, where all of its input lies" if lo == 0 else "over the whole line"
    r = len(anywhere)
    lo_v, hi_v = float(v.min()), float(v.max())
    span = f"all {lo_v:.3g}" if lo_v == hi_v else f"{lo_v:.3g} to {hi_v:.3g}"
    reach = (f"only {r} of the {k} are on top anywhere {where}, so whatever the image the model names one of "
             f"{r} classes, and at most {r}/{k} ({r / k:.0%}) of evenly spread labels can be right" if r < k
             else f"all {k} are on top somewhere {where}")
    return (f"{when}{name} draws {k} lines over its single input number, one per class, and predicts the class "
            f"whose line is on top: at these weights {reach}; over the values these {images} training images give "
            f"it ({span}), {len(seen)} {'is' if len(seen) == 1 else 'are'} "
            "on top")

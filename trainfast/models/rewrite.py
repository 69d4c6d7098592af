"""Rewrite passes: changes to a model's modules that keep its results and make its training
step cheaper. Each pass is named, rewrites the model in place, and returns how many places it
changed; the tuner switches them on and off by measurement (Speed.rewrites).

    from trainfast.models import rewrite
    rewrite.apply(net, rewrite.ALL)      # {'pool_before_relu': 4, 'inplace_relu': 4, 'cheap_dropout': 1}

- pool_before_relu: ReLU → MaxPool becomes MaxPool → ReLU. Exact (max and ReLU commute, and
  so do their gradients), and the ReLU and its backward run on a quarter of the elements.
- inplace_relu: ReLU overwrites its input where nothing else can read it (it follows a layer
  that always returns a fresh tensor, inside a Sequential). Exact; saves a pass of memory.
- cheap_dropout: Dropout draws its keep-mask from 8 random bits per element, eight at a time
  from 64-bit draws, when p is a multiple of 1/256 (0.25, as in all the users' models: exact),
  else from 16 bits, four at a time (p rounded to 1/65536), instead of one generator call
  per element (torch's bernoulli_ is ~5 ns an element on CPU, often more than the convolution
  next to it). Same distribution, a different random stream; identical in eval mode.

None of them adds, removes or renames a parameter: state dicts and checkpoints are the same
as the unrewritten model's.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

# Layers whose output is always a new tensor that only the next layer of a Sequential sees.
_FRESH_OUTPUT = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.MaxPool2d, nn.AvgPool2d,
                 nn.BatchNorm1d, nn.BatchNorm2d, nn.AdaptiveAvgPool2d)


def _sequentials(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, nn.Sequential)]


def _last_leaf(m: nn.Module) -> nn.Module:
    while isinstance(m, nn.Sequential) and len(m):
        m = m[-1]
    return m


def _relu_then_pool(seq: nn.Sequential, i: int) -> bool:
    """seq[i] is a ReLU directly followed by a MaxPool2d (pool_before_relu swaps them)."""
    return type(seq[i]) is nn.ReLU and type(seq[i + 1]) is nn.MaxPool2d


def _relu_on_fresh(seq: nn.Sequential, i: int) -> bool:
    """seq[i] is a ReLU, not in-place, whose input is a fresh tensor no one else reads (inplace_relu)."""
    return type(seq[i]) is nn.ReLU and not seq[i].inplace and isinstance(_last_leaf(seq[i - 1]), _FRESH_OUTPUT)


def _plain_dropout(m: nn.Module) -> bool:
    """An nn.Dropout, not a subclass, not in-place (cheap_dropout replaces it)."""
    return type(m) is nn.Dropout and not m.inplace


def pool_before_relu(model: nn.Module) -> int:
    """Swap each ReLU that is directly followed by a MaxPool2d in a Sequential."""
    n = 0
    for seq in _sequentials(model):
        i = 0
        while i < len(seq) - 1:
            if _relu_then_pool(seq, i):
                relu, pool = seq[i], seq[i + 1]
                seq[i], seq[i + 1] = pool, relu
                n += 1
                i += 1
            i += 1
    return n


def inplace_relu(model: nn.Module) -> int:
    """Make a ReLU in-place where its input is a fresh tensor no one else reads."""
    n = 0
    for seq in _sequentials(model):
        for i in range(1, len(seq)):
            if _relu_on_fresh(seq, i):
                seq[i].inplace = True
                n += 1
    return n


_SAME_WIDTH_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def bit_patterns(scale: float) -> dict[torch.dtype, int]:
    """`scale` in each float type, as the integer of the same width with its bits."""
    return {dt: int(torch.tensor(scale, dtype=dt).view(as_int).item()) for dt, as_int in _SAME_WIDTH_INT.items()}


def _scaled(keep: torch.Tensor, dtype: torch.dtype, scale: float, patterns: dict | None = None) -> torch.Tensor:
    """keep (bool) → {0, scale} in dtype. For float types this is an integer multiply by the bit
    pattern of `scale`, viewed as floats: exact, and twice as fast as a bf16 multiply on CPU.
    `patterns` (bit_patterns(scale)), worked out before the step: read in a compiled step, the
    pattern is a constant, where working it out there (a tensor's .item()) broke the graph and
    printed torch._dynamo's warning from trainfast's own code."""
    as_int = _SAME_WIDTH_INT.get(dtype)
    if as_int is None:
        return keep.to(dtype).mul_(scale)
    pattern = (patterns or bit_patterns(scale))[dtype]
    return keep.to(as_int).mul_(pattern).view(dtype)


def keep_mask(like: torch.Tensor, p: float, patterns: dict | None = None) -> torch.Tensor:
    """A {0, 1/(1-p)} tensor of like's shape, dtype and memory layout, each element kept with
    probability 1 - p, from 8 random bits per element when p is a multiple of 1/256 (0.25,
    0.5: exact), else from 16 bits (p to 1/65536)."""
    n = like.numel()
    bits_per = 8 if float(p * 256).is_integer() else 16
    per_draw = 64 // bits_per
    bits = torch.randint(-2**63, 2**63 - 1, ((n + per_draw - 1) // per_draw,), dtype=torch.int64, device=like.device)
    if bits_per == 8:
        keep = bits.view(torch.int8)[:n] >= -128 + round(p * 256)
    else:
        keep = bits.view(torch.int16)[:n] >= -32768 + round(p * 65536)
    mask = _scaled(keep, like.dtype, 1.0 / (1.0 - p), patterns)
    if like.dim() == 4 and not like.is_contiguous() and like.is_contiguous(memory_format=torch.channels_last):
        b, c, h, w = like.shape
        return mask.view(b, h, w, c).permute(0, 3, 1, 2)  # same strides as `like`: no layout conversion
    return mask.view(like.shape)


class CheapDropout(nn.Dropout):
    """nn.Dropout with a keep-mask drawn 16 bits at a time (see keep_mask)."""

    def __init__(self, p: float = 0.5, inplace: bool = False):
        super().__init__(p, inplace)
        self._patterns_p, self._patterns = None, None
        self._patterns_for_p()

    def _patterns_for_p(self) -> dict | None:
        """1 / (1 - p)'s bit patterns, worked out again only where p was changed."""
        if self._patterns_p != self.p:
            self._patterns_p, self._patterns = self.p, bit_patterns(1.0 / (1.0 - self.p)) if 0 < self.p < 1 else None
        return self._patterns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.p >= 1:
            return x * 0
        return x * keep_mask(x, self.p, self._patterns_for_p())


def cheap_dropout(model: nn.Module) -> int:
    """Replace each nn.Dropout (not subclasses, not in-place) by CheapDropout with the same p."""
    n = 0
    for parent in model.modules():
        for name, child in parent.named_children():
            if _plain_dropout(child):
                new = CheapDropout(child.p)
                new.train(child.training)
                setattr(parent, name, new)
                n += 1
    return n


def applies(model: nn.Module) -> bool:
    """Whether any pass would change `model`, read without changing it: what
    any(apply(copy.deepcopy(model), ALL).values()) says, without the copy (deep-copying a module
    tree is slow in Python: 0.1-0.2 s for timm's RepVGG, before a 5-epoch run's first step)."""
    for seq in _sequentials(model):
        if any(_relu_then_pool(seq, i) for i in range(len(seq) - 1)) or \
                any(_relu_on_fresh(seq, i) for i in range(1, len(seq))):
            return True
    return any(_plain_dropout(m) for m in model.modules())


PASSES: dict[str, Callable[[nn.Module], int]] = {
    "pool_before_relu": pool_before_relu,
    "inplace_relu": inplace_relu,  # after pool_before_relu, so it also covers the moved ReLUs
    "cheap_dropout": cheap_dropout,
}
ALL: tuple[str, ...] = tuple(PASSES)


def check(names) -> str | None:
    """None if every name is a known pass, else the reason in words."""
    bad = [n for n in names if n not in PASSES]
    return f"unknown rewrite {', '.join(map(repr, bad))}; known: {', '.join(ALL)}" if bad else None


def apply(model: nn.Module, names) -> dict[str, int]:
    """Run the named passes on `model`, in PASSES order; returns the places each changed."""
    if reason := check(names):
        raise ValueError(reason)
    return {name: PASSES[name](model) for name in ALL if name in names}

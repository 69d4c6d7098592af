"""Layers that make Keras semantics exact in PyTorch."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class KerasSamePad(nn.Module):
    """Zero padding as Keras's padding='same' does it: out = ceil(in / stride), and the odd
    pixel of padding goes to the bottom and right (PyTorch's padding='same' refuses stride > 1).
    """

    def __init__(self, kernel: int, stride: int):
        super().__init__()
        self.kernel, self.stride = kernel, stride

    def _pads(self, n: int) -> tuple[int, int]:
        total = max((math.ceil(n / self.stride) - 1) * self.stride + self.kernel - n, 0)
        return total // 2, total - total // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, bottom = self._pads(x.shape[-2])
        left, right = self._pads(x.shape[-1])
        return F.pad(x, (left, right, top, bottom))


def conv(cin: int, cout: int, k: int = 3, stride: int = 1, padding: str = "valid") -> nn.Module:
    """A Keras Conv2D: 'valid' (no padding) or 'same' (Keras's asymmetric rule for stride > 1)."""
    if padding == "valid":
        return nn.Conv2d(cin, cout, k, stride)
    if stride == 1 and k % 2 == 1:
        return nn.Conv2d(cin, cout, k, 1, padding=k // 2)  # symmetric: same as Keras
    return nn.Sequential(KerasSamePad(k, stride), nn.Conv2d(cin, cout, k, stride))


class KerasFlatten(nn.Module):
    """Flatten in Keras's (H, W, C) order. On channels_last memory this is a free view."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 2, 3, 1).flatten(1)


def conv_bn(cin: int, cout: int, k: int = 3, stride: int = 1) -> nn.Sequential:
    """3×3 conv (same padding, no bias) → batch-norm → ReLU."""
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, padding=k // 2, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

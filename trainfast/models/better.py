"""Better versions of the users' CNNs, following the advice they were given and what the
fastest published recipes do: batch-norm, filters doubling at each downsample from a
narrow start, global pooling instead of a huge Dense after Flatten, and for plates a head
that keeps a feature vector per character position. docs/MODELS.md has their measured cost.
"""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from trainfast.models import register
from trainfast.models.layers import conv_bn


class PlateNet(nn.Module):
    """Plate reader: conv stages 16→32→64 after a strided stem, then a 1-D head along the
    plate's width that keeps a 128-wide feature vector for each of the 8 character positions.
    """

    def __init__(self, positions: int = 8, alphabet: int = 36, width: int = 16, dropout: float = 0.1):
        super().__init__()
        w = width
        self.positions = positions
        self.features = nn.Sequential(
            conv_bn(3, w, stride=2),                      # 32×64: a strided stem, cheap on 3 channels
            conv_bn(w, 2 * w), nn.MaxPool2d(2),           # 16×32
            conv_bn(2 * w, 4 * w), nn.MaxPool2d(2),       # 8×16
            conv_bn(4 * w, 4 * w),                        # 8×16×64
        )
        # The height (8 rows) folds into channels by a learned (8 × 1) convolution, not a mean:
        # where a stroke sits vertically is what tells 8 from B.
        self.collapse = nn.Sequential(nn.Conv2d(4 * w, 8 * w, (8, 1), bias=False), nn.BatchNorm2d(8 * w),
                                      nn.ReLU(inplace=True))
        # Along the width, (B, 8w, 16): two convolutions of 5 columns, so that each position's
        # features see 9 columns (72 pixels) around it. With one (5 columns), the two middle
        # positions held 73% of the held-out errors (likely: their characters' place varies
        # most with the text's width and spacing). Two took whole plates from 69.6% to 88.8%
        # (median of 3 seeds, the demo's data and recipe, 2 CPU cores) for 5% more FLOPs.
        self.sequence = nn.Sequential(
            nn.Conv1d(8 * w, 8 * w, 5, padding=2, bias=False), nn.BatchNorm1d(8 * w), nn.ReLU(inplace=True),
            nn.Conv1d(8 * w, 8 * w, 5, padding=2, bias=False), nn.BatchNorm1d(8 * w), nn.ReLU(inplace=True),
        )
        self.dropout = nn.Dropout(dropout)
        self.classify = nn.Conv1d(8 * w, alphabet, 1)     # the same classifier at each position

    def forward(self, x):
        f = self.collapse(self.features(x)).flatten(2)    # (B, 8w, W/8)
        f = F.adaptive_avg_pool1d(self.sequence(f), self.positions)  # (B, 8w, 8)
        return self.classify(self.dropout(f)).transpose(1, 2)         # (B, 8, 36) logits


class Residual(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.body = nn.Sequential(conv_bn(c, c), conv_bn(c, c))

    def forward(self, x):
        return x + self.body(x)


class CifarResNet(nn.Module):
    """A small residual network for 32×32 inputs in the spirit of the fastest CIFAR-10
    recipes (the DAWNBench ResNet-9 layout at a quarter of its width by default).
    """

    def __init__(self, classes: int = 10, width: int = 32):
        super().__init__()
        w = width
        self.net = nn.Sequential(
            conv_bn(3, w),                                            # 32×32, wide first stage
            conv_bn(w, 2 * w), nn.MaxPool2d(2), Residual(2 * w),      # 16×16
            conv_bn(2 * w, 4 * w), nn.MaxPool2d(2),                   # 8×8
            conv_bn(4 * w, 8 * w), nn.MaxPool2d(2), Residual(8 * w),  # 4×4
            nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        )
        self.fc = nn.Linear(8 * w, classes, bias=False)

    def forward(self, x):
        return self.fc(self.net(x)) * 0.125  # scaled logits, as in the ResNet-9 recipe


class Classifier512Net(nn.Module):
    """512×512 classifier with strided stages 16→32→64→128 and global average pooling:
    the 31.5M-parameter Dense after Flatten is gone, and so are most FLOPs.
    """

    def __init__(self, classes: int = 10, width: int = 16):
        super().__init__()
        w = width
        self.net = nn.Sequential(
            conv_bn(3, w, 3, 2),                                 # 256
            conv_bn(w, 2 * w, 3, 2),                             # 128
            conv_bn(2 * w, 4 * w, 3, 2),                         # 64
            conv_bn(4 * w, 8 * w, 3, 2),                         # 32
            conv_bn(8 * w, 8 * w, 3, 2),                         # 16
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.fc = nn.Linear(8 * w, classes)

    def forward(self, x):
        return self.fc(self.net(x))


@register((3, 64, 128), (8, 36))
def plate_net(**kw) -> nn.Module:
    """Better plate reader: BN, doubling filters, a feature vector per character position."""
    return PlateNet(**kw)


@register((3, 32, 32), (10,))
def cifar_resnet(**kw) -> nn.Module:
    """Small residual net for 32×32 (ResNet-9 layout, quarter width)."""
    return CifarResNet(**kw)


@register((3, 512, 512), (10,))
def classifier512_net(**kw) -> nn.Module:
    """Better 512×512 classifier: strided doubling stages and global average pooling."""
    return Classifier512Net(**kw)

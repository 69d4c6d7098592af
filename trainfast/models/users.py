"""Exact PyTorch ports of the three users' Keras CNNs (same layers, same parameter counts).

Keras semantics: 'valid' padding unless 'same' is given, 'same' with stride 2 padded as
Keras pads it, Flatten in (H, W, C) order, ReLU where the story names no activation.
The models return logits; the loss applies the softmax.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from trainfast.models import register
from trainfast.models.layers import KerasFlatten, conv


class PlateCNN(nn.Module):
    """The license-plate reader: 64×128×3 in, 8 positions × 36 characters out, 264,560 params.

    NOTE: the head squeezes each plate position through one number (Dense 8, then Dense 36
    applied per position): a width-1 bottleneck, kept because the port must be exact.
    The story gives no dropout rate; 0.25 is used.
    """

    def __init__(self, positions: int = 8, alphabet: int = 36, dropout: float = 0.25):
        super().__init__()
        self.features = nn.Sequential(
            conv(3, 32), nn.ReLU(), nn.MaxPool2d(2),     # 62×126×32 → 31×63
            conv(32, 32), nn.ReLU(), nn.MaxPool2d(2),    # 29×61 → 14×30
            conv(32, 64), nn.ReLU(), nn.MaxPool2d(2),    # 12×28×64 → 6×14
            conv(64, 64), nn.ReLU(), nn.MaxPool2d(2),    # 4×12 → 2×6×64
        )
        self.flatten = KerasFlatten()                    # 768
        self.dropout = nn.Dropout(dropout)
        self.dense1 = nn.Linear(768, 256)                # on the (1, 768) reshape
        self.dense2 = nn.Linear(256, positions)          # (1, 8)
        self.per_position = nn.Linear(1, alphabet)       # permuted to (8, 1) → (8, 36)

    def forward(self, x):
        x = self.dropout(self.flatten(self.features(x)))
        x = torch.relu(self.dense2(torch.relu(self.dense1(x))))  # (B, 8)
        return self.per_position(x.unsqueeze(-1))                # (B, 8, 36) logits


class Classifier512(nn.Module):
    """The 512×512 10-class classifier: 32,641,130 params, 31,490,304 of them in one Dense."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            conv(3, 64, 3, 2, "same"), nn.ReLU(), nn.Dropout(0.25),    # 256×256×64
            conv(64, 64, 3, 2, "same"), nn.ReLU(), nn.Dropout(0.25),   # 128×128×64
            conv(64, 32), nn.ReLU(), nn.MaxPool2d(3, 2),               # 126×126×32 → 62×62×32
        )
        self.classifier = nn.Sequential(
            KerasFlatten(),                                            # 123,008
            nn.Linear(123_008, 256), nn.ReLU(),
            nn.Linear(256, 4096), nn.ReLU(),
            nn.Linear(4096, classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


class CifarCNN(nn.Module):
    """The Keras CIFAR-10 example CNN: three conv blocks, Dense 512, 276,138 params."""

    def __init__(self, classes: int = 10, dropout: float = 0.25):
        super().__init__()

        def block(cin, cout):
            return [conv(cin, cout, padding="same"), nn.ReLU(), conv(cout, cout), nn.ReLU(),
                    nn.MaxPool2d(2), nn.Dropout(dropout)]

        self.features = nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 64))  # 32→15→6→2
        self.classifier = nn.Sequential(KerasFlatten(), nn.Linear(256, 512), nn.ReLU(), nn.Dropout(dropout),
                                        nn.Linear(512, classes))

    def forward(self, x):
        return self.classifier(self.features(x))


@register((3, 64, 128), (8, 36))
def plate_cnn(**kw) -> nn.Module:
    """License-plate CNN from the users' story (Keras port, 264,560 params)."""
    return PlateCNN(**kw)


@register((3, 512, 512), (10,))
def classifier512(**kw) -> nn.Module:
    """512×512 classifier from the users' story (Keras port, 32.6M params)."""
    return Classifier512(**kw)


@register((3, 32, 32), (10,))
def cifar_cnn(**kw) -> nn.Module:
    """CIFAR-10 CNN from the users' story (Keras example port, 276,138 params)."""
    return CifarCNN(**kw)

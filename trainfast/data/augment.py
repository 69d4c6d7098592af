"""Batched augmentations on the device: whole-batch tensor ops, no per-sample Python.

Geometric ones (crop with padding, translation, flip) are one gather over the uint8 NHWC
batch, before conversion, so they move a quarter of the bytes float would. Colour ones
(brightness, contrast, cutout) run on the float batch in [0, 1], before normalisation.

The random parameters (a few numbers per image) are drawn from a CPU generator and then moved
to the batch's device, so that a seed gives the same augmentations on every device: CUDA's
generator would draw another stream from the same seed.
"""

from __future__ import annotations

import torch

from trainfast.config import Augment


def _reflect(i: torch.Tensor, n: int) -> torch.Tensor:
    """Reflect indices into [0, n) without repeating the edge (like 'reflect' padding)."""
    if n == 1:
        return torch.zeros_like(i)
    period = 2 * (n - 1)
    i = torch.remainder(i, period)
    return torch.where(i >= n, period - i, i)


def _randint(low: int, high: int, size, gen: torch.Generator, dev) -> torch.Tensor:
    return torch.randint(low, high, size, generator=gen).to(dev, non_blocking=True)


def _rand(size, gen: torch.Generator, dev) -> torch.Tensor:
    return torch.rand(size, generator=gen).to(dev, non_blocking=True)


def geometric(x: torch.Tensor, aug: Augment, gen: torch.Generator) -> torch.Tensor:
    """Random crop-with-padding / translation / horizontal flip of a (B, H, W, C) batch."""
    b, h, w, _ = x.shape
    dev = x.device
    rows = torch.arange(h, device=dev).expand(b, h)
    cols = torch.arange(w, device=dev).expand(b, w)
    valid = None
    shift = aug.crop_pad or aug.translate
    if shift:
        dy = _randint(-shift, shift + 1, (b, 1), gen, dev)
        dx = _randint(-shift, shift + 1, (b, 1), gen, dev)
        rows, cols = rows + dy, cols + dx
        if aug.crop_pad:  # pad-by-reflection then crop: the shifted-in border is a mirror image
            rows, cols = _reflect(rows, h), _reflect(cols, w)
        else:  # translation: what shifts in is black
            valid = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]
            rows, cols = rows.clamp(0, h - 1), cols.clamp(0, w - 1)
    if aug.flip:
        flip = _rand((b, 1), gen, dev) < 0.5
        cols = torch.where(flip, w - 1 - cols, cols)
    batch = torch.arange(b, device=dev)[:, None, None]
    out = x[batch, rows[:, :, None], cols[:, None, :]]  # (B, H, W, C), one gather
    if valid is not None:
        out.mul_(valid[..., None].to(out.dtype))
    return out


def photometric(x: torch.Tensor, aug: Augment, gen: torch.Generator) -> torch.Tensor:
    """Brightness, contrast and cutout on a float (B, C, H, W) batch in [0, 1], in place."""
    b, _, h, w = x.shape
    dev = x.device

    def uniform(r):  # (B, 1, 1, 1) in [1 - r, 1 + r]
        return (1 + (_rand((b, 1, 1, 1), gen, dev) * 2 - 1) * r).to(x.dtype)

    if aug.brightness:
        x.mul_(uniform(aug.brightness))
    if aug.contrast:
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        x.sub_(mean).mul_(uniform(aug.contrast)).add_(mean)
    if aug.brightness or aug.contrast:
        x.clamp_(0, 1)
    if aug.cutout:
        s = aug.cutout
        cy = _randint(0, h, (b, 1), gen, dev)
        cx = _randint(0, w, (b, 1), gen, dev)
        ys = torch.arange(h, device=dev)[None]
        xs = torch.arange(w, device=dev)[None]
        in_y = (ys >= cy - s // 2) & (ys < cy - s // 2 + s)  # (B, H)
        in_x = (xs >= cx - s // 2) & (xs < cx - s // 2 + s)  # (B, W)
        x.masked_fill_((in_y[:, :, None] & in_x[:, None, :])[:, None], 0)
    return x

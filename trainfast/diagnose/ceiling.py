"""The kernels' ceiling: what a model's training step would take if it were only its
convolutions and matrix products, each run alone, forward and backward, in its fastest memory
layout, at the step's batch and precision on this device.

It is a practical ceiling, not a theoretical one: the same library kernels (oneDNN on a CPU,
cuDNN and cuBLAS on a GPU) on the same shapes, without what a step adds around them —
activations, pooling, dropout, normalisation, the optimizer, the framework's own work per
operator, and layout conversions between layers. The step's time over the ceiling says how
much of it is that other work (what fusion, rewrites and a larger batch can win); the ceiling
over the FLOP peak says how well the kernels themselves suit these shapes (what only a
different model or device can change).

Each distinct layer configuration is timed once (a ResNet's repeated blocks share theirs):
one warm-up, then the best of TIMED runs, each a forward and a backward with the gradients of
the weights (where they train) and, except for the layer that reads the images, of its input.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from trainfast.diagnose.cost import ModelCost
from trainfast.step import keep_freed_memory

TIMED = 2  # timed runs per layer and layout after one warm-up; the best counts
KERNEL_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class KernelTime:
    layers: list[str]  # the model's layers of this configuration (module paths)
    kind: str
    input_shape: tuple  # per image
    seconds: float  # one layer's best forward + backward at the batch
    layout: str  # "channels_last" or "plain"

    @property
    def total_s(self) -> float:
        """All the layers of this configuration, per step."""
        return self.seconds * len(self.layers)


@dataclass
class Ceiling:
    batch_size: int
    precision: str
    kernels: list[KernelTime] = field(default_factory=list)
    seconds_to_time: float = 0.0  # how long measuring it took

    @property
    def step_s(self) -> float:
        """The sum over every convolution and matrix product of the model, per step."""
        return sum(k.total_s for k in self.kernels)

    @property
    def per_image_s(self) -> float:
        return self.step_s / max(self.batch_size, 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "step_s": self.step_s, "per_image_s": self.per_image_s}


def kernel_ceiling(model: nn.Module, cost: ModelCost, batch_size: int, precision: str, device,
                   on_layer=None) -> Ceiling | None:
    """The Ceiling of `model` (whose per-layer shapes `cost` holds) at `batch_size` and
    `precision` on `device`; None where the model has no convolution or linear layer the cost
    saw run. `on_layer()` is called after each configuration is timed (a progress bar)."""
    started = time.perf_counter()
    dev = torch.device(device)
    if dev.type == "cpu":
        keep_freed_memory()  # as a training step runs: its blocks reused, not page-faulted in again each call
    dtype = DTYPES[precision]
    found = _configurations(model, cost)
    if not found:
        return None
    kernels = []
    for module, input_shape, needs_input_grad, names in found:
        layouts = ["plain", "channels_last"] if isinstance(module, nn.Conv2d) else ["plain"]
        timed = [(_time_layer(module, input_shape, needs_input_grad, batch_size, dtype, dev, layout), layout)
                 for layout in layouts]
        seconds, layout = min(timed)
        kernels.append(KernelTime(names, type(module).__name__, input_shape, seconds, layout))
        if on_layer:
            on_layer()
    return Ceiling(batch_size, precision, kernels, time.perf_counter() - started)


def count(model: nn.Module, cost: ModelCost) -> int:
    """How many configurations kernel_ceiling would time (a progress bar's total)."""
    return len(_configurations(model, cost))


def _configurations(model: nn.Module, cost: ModelCost) -> list[tuple[nn.Module, tuple, bool, list[str]]]:
    """Each distinct (layer configuration, input shape per image, whether its input needs a
    gradient) once, with one such layer and the names of all of them. The layer that reads the
    images needs no input gradient."""
    found: dict[tuple, tuple] = {}
    for layer in cost.layers:
        try:
            module = model.get_submodule(layer.name)
        except AttributeError:
            continue
        if not isinstance(module, KERNEL_LAYERS) or not layer.input_shape:
            continue
        needs_input_grad = tuple(layer.input_shape) != tuple(cost.input_shape)
        key = (repr(module), tuple(layer.input_shape), needs_input_grad)  # repr: the layer's configuration
        if key not in found:
            found[key] = (module, tuple(layer.input_shape), needs_input_grad, [])
        found[key][3].append(layer.name)
    return list(found.values())


def _detached_copy(module: nn.Module, dev, dtype) -> nn.Module:
    """A copy of the layer's configuration and weights, outside the model, without its hooks."""
    twin = copy.deepcopy(module).to(dev, dtype).train()
    twin._forward_hooks.clear()
    twin._forward_pre_hooks.clear()
    twin._backward_hooks.clear()
    return twin


def _time_layer(module: nn.Module, input_shape: tuple, needs_input_grad: bool, batch: int, dtype, dev,
                layout: str) -> float:
    """One layer's best forward + backward time, in seconds, at `batch`, in `dtype` and `layout`."""
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    layer = _detached_copy(module, dev, dtype)
    x = torch.randn(batch, *input_shape, device=dev, dtype=dtype)
    if x.dim() == 4:
        layer = layer.to(memory_format=fmt)
        x = x.contiguous(memory_format=fmt)
    x.requires_grad_(needs_input_grad)
    # a frozen layer that reads the images (a fine-tuned model's stem) has no backward in training
    trains = needs_input_grad or any(p.requires_grad for p in layer.parameters())
    with torch.no_grad():
        grad = torch.randn_like(layer(x))

    def once() -> float:
        for p in layer.parameters():
            p.grad = None  # as a training step's zero_grad(set_to_none=True) leaves them
        _sync(dev)
        t = time.perf_counter()
        out = layer(x)
        if trains:
            out.backward(grad)
        _sync(dev)
        return time.perf_counter() - t

    once()
    return min(once() for _ in range(TIMED))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)

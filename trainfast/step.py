"""One training step, in stages, for everything that runs or times one (doctor, tune, train).

    model = prepare(model, speed, device)
    x, y = to_device(x, y, speed, device)
    loss = forward_loss(model, x, y, speed, device)
    backward(loss, scaler)
    optimizer_step(optimizer, scaler)

NOTE: imports nothing of ours but config, hardware and models.rewrite; the stages are separate so that the doctor can
put a clock between them, and so that train does exactly what was timed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainfast.config import PRECISIONS, Speed, check_optimizer
from trainfast.errors import TrainfastError, in_words
from trainfast.hardware import fast_precisions
from trainfast.models import rewrite


def supports_bf16(device: torch.device) -> bool:
    """bf16 autocast is fast here: CUDA ≥ sm80, or a CPU with bf16 instructions."""
    return "bf16" in fast_precisions(device)


def check(speed: Speed, device: torch.device) -> str | None:
    """None if `speed` can run on `device`, else the reason in words."""
    if speed.precision not in PRECISIONS:
        return f"precision must be one of {', '.join(PRECISIONS)}, not {speed.precision!r}"
    if speed.precision == "tf32" and "tf32" not in fast_precisions(device):
        return f"tf32 needs a CUDA device of sm80 or newer, not {device}; use fp32"
    if speed.precision == "fp16" and device.type != "cuda":
        return "fp16 training needs a CUDA device (on CPU fp16 kernels are slow and unscaled); use bf16"
    if speed.precision == "fp16" and "fp16" not in fast_precisions(device):
        return f"fp16 is not fast on {device} (it needs tensor cores: sm70 or newer); use fp32"
    if speed.precision == "bf16" and not supports_bf16(device):
        return (f"bf16 is emulated on {device}, slower than fp32 (fast bf16 needs AVX512-BF16/AMX on CPU, "
                f"or sm80+ on CUDA)")
    if speed.batch_size < 1:
        return f"batch size must be ≥ 1, not {speed.batch_size}"
    return rewrite.check(speed.rewrites)


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc mallopt parameters (malloc.h)
_kept = False


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in the process instead of unmapping it.

    PyTorch's CPU allocator is plain malloc, and glibc serves every block over 32 MiB with a
    fresh mmap and unmaps it on free, so each training step page-faults its activations and
    gradients in again, 4 KiB at a time: measured here, that was half the plate CNN's bf16
    step (500 → 1,100 images/s with it off). This turns off mmap for large blocks and
    trimming of the heap. The cost: the process keeps its peak memory until it exits.
    Linux with glibc only (elsewhere a no-op, returns False); TRAINFAST_KEEP_MEMORY=0 opts out.
    """
    global _kept
    if _kept or os.environ.get("TRAINFAST_KEEP_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return _kept
    try:
        libc = ctypes.CDLL("libc.so.6")
        _kept = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc (musl, ...)
        _kept = False
    return _kept


def prepare(model: nn.Module, speed: Speed, device: torch.device) -> nn.Module:
    """Run the rewrite passes of `speed` on the model (in place), move it to `device` in the memory
    format of `speed` (compile is the caller's). On CUDA also set TF32 matmuls as `speed` says
    and cudnn.benchmark (unless deterministic algorithms are on)."""
    if device.type == "cpu":
        keep_freed_memory()
    if speed.threads and device.type == "cpu":
        torch.set_num_threads(speed.threads)
    if device.type == "cuda":
        # NOTE: process-wide switches, set for every run and trial so none leaks into the next.
        # cuDNN convolutions use TF32 by default in torch; tf32 adds the matmuls (Linear layers).
        torch.backends.cuda.matmul.allow_tf32 = speed.precision == "tf32"
        if not torch.are_deterministic_algorithms_enabled():
            torch.backends.cudnn.benchmark = True  # training shapes repeat: pick the fastest kernels once
    rewrite.apply(model, speed.rewrites)
    model = model.to(device)
    if speed.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def compile_model(model: nn.Module, device: torch.device, graphs: bool = True) -> nn.Module:
    """torch.compile for training. On CUDA with CUDA graphs (mode="reduce-overhead") unless
    graphs=False: small CNNs on a big GPU are bound by kernel launches, and a graph replays a
    whole forward or backward as one launch (4.7× for the CIFAR CNN at batch 256 on an H200)."""
    return torch.compile(model, mode="reduce-overhead" if graphs and device.type == "cuda" else None)


def autocast(speed: Speed, device: torch.device):
    if speed.precision in ("fp32", "tf32"):
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if speed.precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def make_scaler(speed: Speed, device: torch.device):
    """A GradScaler for fp16 on CUDA; None otherwise (bf16 needs no scaling)."""
    if speed.precision == "fp16" and device.type == "cuda":
        return torch.amp.GradScaler("cuda")
    return None


def to_device(x: torch.Tensor, y: torch.Tensor, speed: Speed, device: torch.device):
    """Batch to the device; uint8 images become float in [0, 1]; layout as `speed` says."""
    non_blocking = device.type == "cuda"
    x = x.to(device, non_blocking=non_blocking)
    y = y.to(device, non_blocking=non_blocking)
    if x.dtype == torch.uint8:
        x = x.float().div_(255)
    fmt = torch.channels_last if speed.channels_last else torch.contiguous_format
    if x.dim() == 4 and not x.is_contiguous(memory_format=fmt):
        x = x.contiguous(memory_format=fmt)
    return x, y


LOGIT_KEYS = ("logits", "out", "output")  # a dict's (or a named tuple's) entry that holds the logits


def _logits_entry(out) -> tuple[str, torch.Tensor] | None:
    """(which part, the logits) of what a model returns: a tensor as it is; from a dict (or a
    Hugging Face-style output), its "logits" ("out", "output") entry; from a named tuple or an
    object, its `logits` (torchvision's GoogLeNet and Inception in training: logits and aux
    logits); from a plain tuple or list, its first item where every item is a tensor of that
    shape (a main output and its auxiliary copies). None where there is no obvious one."""
    if isinstance(out, torch.Tensor):
        return "the tensor", out
    if isinstance(out, Mapping):
        return next(((f"its {k!r} entry", out[k]) for k in LOGIT_KEYS if isinstance(out.get(k), torch.Tensor)), None)
    if isinstance(getattr(out, "logits", None), torch.Tensor):
        return "its 'logits'", out.logits
    if isinstance(out, (tuple, list)) and out and all(isinstance(t, torch.Tensor) and t.shape == out[0].shape
                                                       for t in out):
        return "its first item", out[0]
    return None


def logits_of(out) -> torch.Tensor | None:
    """The logits in what a model returns (see _logits_entry), or None."""
    if isinstance(out, torch.Tensor):  # the usual case, once per training step: no more than this
        return out
    found = _logits_entry(out)
    return None if found is None else found[1]


def describe_output(out) -> str | None:
    """One line on which part of a model's output trainfast trains on, where it is not a plain
    tensor; None for a tensor. Raises TrainfastError where there is no obvious logits entry."""
    if isinstance(out, torch.Tensor):
        return None
    kind, fields = type(out).__name__, getattr(out, "_fields", None)
    parts = (list(out) if isinstance(out, Mapping) else list(fields) if fields else
             [f"item {i}" for i in range(len(out))] if isinstance(out, (tuple, list)) else [])
    names = ", ".join(map(str, parts[:6])) + (", …" if len(parts) > 6 else "")
    found = _logits_entry(out)
    if found is None:
        raise TrainfastError(f"the model returns a {kind} ({names or 'no tensors'}) with no obvious logits: "
                             f"trainfast trains on one tensor of logits, (N, classes) or (N, positions, "
                             f"characters); return that, or a dict with a 'logits' entry")
    aux = " (auxiliary outputs are left out of the loss)" if len(parts) > 1 else ""
    return f"the model returns a {kind} ({names}) in training: trainfast trains on {found[0]}{aux}"


@contextlib.contextmanager
def kept_state(model: nn.Module, devices=()):
    """Run `model` in training mode and put everything back after: its buffers (batch-norm
    statistics), its mode and the random streams (dropout draws)."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=list(devices)):
            yield model.train()
    finally:
        model.train(was_training)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def first_forward(model: nn.Module, x: torch.Tensor, what: str, say=None) -> torch.Tensor:
    """The model's logits for `x` (eval mode, no gradient, on the model's device; its mode is
    restored), or one TrainfastError line naming `what` and the reason. A second call in
    training mode (statistics and random streams put back) finds what training sees: where
    that is not a plain tensor, `say` is told which part is trained on. This first call also
    materialises lazy modules (nn.LazyLinear), which must happen before their parameters are read."""
    n, c, h, w = x.shape
    ready = [p for p in model.parameters() if not isinstance(p, nn.parameter.UninitializedParameter)]
    x = x.to(ready[0].device if ready else torch.device("cpu"))
    was_training = model.training
    devices = [x.device] if x.device.type == "cuda" else []
    try:
        with torch.no_grad():
            out = model.eval()(x)
            with kept_state(model, devices):
                trained = model(x)
    except Exception as e:  # noqa: BLE001 - whatever the user's forward raises, said in one line
        said = in_words(e, 300)
        hint = "; a pack's channels are set when it is made (channels=1 or 3)" if "channels" in said else ""
        raise TrainfastError(f"the model does not take {what} ({c}×{h}×{w}, as (N, {c}, {h}, {w}) tensors): "
                             f"{said}{hint}") from None
    finally:
        model.train(was_training)
    describe_output(out)  # one line where evaluation gets no logits
    note = describe_output(trained)
    if note and say is not None:
        say(note)
    out = logits_of(out)
    if not out.is_floating_point():
        raise TrainfastError(f"the model returns {out.dtype} values; trainfast trains on floating-point logits")
    return out


def loss_fn(output: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy over classes (B, K) vs (B,), or per position (B, L, K) vs (B, L)."""
    if output.dim() == 3:
        output, target = output.reshape(-1, output.shape[-1]), target.reshape(-1)
    return F.cross_entropy(output.float(), target, label_smoothing=label_smoothing)


def forward_loss(model, x, y, speed: Speed, device: torch.device, label_smoothing: float = 0.0):
    if speed.compile and device.type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs are used up
    with autocast(speed, device):
        out = logits_of(model(x))
    return loss_fn(out, y, label_smoothing), out


def backward(loss: torch.Tensor, scaler=None) -> None:
    (scaler.scale(loss) if scaler is not None else loss).backward()


def make_optimizer(name: str, params, lr: float, device: torch.device, momentum: float = 0.9,
                   weight_decay: float = 5e-4) -> torch.optim.Optimizer:
    """The run's optimizer: "sgd" (Nesterov momentum), "adamw" or "rmsprop". tune times its
    candidates with the same one the run will use (its cost per image is part of a batch's).

    NOTE: SGD and AdamW update all parameters in one fused kernel on CPU and CUDA where the
    parameters are real floating point. torch's default AdamW on a CPU loops over the tensors:
    27 ms a step for ResNet-18's 11M parameters on 2 cores against 4.8 ms fused (the whole
    step at batch 32 takes 60-90 ms). On a GPU, small CNNs are bound by kernel launches, and
    fusing saves a few per tensor. RMSprop has no fused form."""
    check_optimizer(name)
    params = list(params)
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = {"fused": True} if device.type in ("cpu", "cuda") and tensors and all(
        p.dtype.is_floating_point for p in tensors) else {}
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True, weight_decay=weight_decay, **fused)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **fused)
    return torch.optim.RMSprop(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                               foreach=device.type == "cuda")


def optimizer_step(optimizer, scaler=None, clip: float = 0.0, model=None) -> None:
    if clip and model is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)

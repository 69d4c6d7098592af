"""Where a tuned training step's time goes, operator by operator, for the users' CNNs: the
evidence behind "where a target is missed, exactly where the time goes".

    python benchmarks/profile_step.py [--models plate_cnn cifar_cnn classifier512] [--steps 4]
    python benchmarks/profile_step.py --models cifar_cnn --conv-layers

Each model runs with the settings `trainfast tune` chose on this machine (cached, or measured
now without torch.compile), on in-memory batches; the table is the wall time of each ATen
operator (forward and backward), summed over the timed steps, as a share of the step.

The operators are timed by a TorchDispatchMode around each call (CPU operators are
synchronous), not by torch.profiler: under the profiler the plate CNN's bf16 step at batch
512 took 720-1,100 ms instead of 370, most of the difference in page faults charged to
fill_ and max_pool2d (the profiler's event records split the freed blocks that glibc malloc
keeps for the next step, under trainfast's malloc setting). The timer here leaves the step's
time as it is, and the script prints both. --conv-layers also times each
convolution alone (forward + backward, at the tuned batch and its input shape in the model)
in fp32 and bf16, NCHW and channels_last, with its FLOP/s: which layers fall short of the
matmul peak.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainfast import hardware, models
from trainfast import step as _step
from trainfast.diagnose.timing import synthetic_batches
from trainfast.tuning import tune

MAX_BATCH = {"plate_cnn": 512, "cifar_cnn": 512, "classifier512": 32}


class OpTimer(TorchDispatchMode):
    """Wall seconds per ATen operator while active (forward, and backward run in this thread)."""

    def __init__(self):
        super().__init__()
        self.seconds: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds[str(func.overloadpacket)] += time.perf_counter() - t
        return out


def profile_model(name: str, steps: int, top: int) -> None:
    dev = torch.device("cpu")
    net = models.create(name)
    speed = tune(net, net.input_shape, device=dev, max_batch=MAX_BATCH[name], try_compile=False,
                 log=lambda m: None).best
    net = _step.prepare(net, speed, dev).train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    data = synthetic_batches(net.input_shape, net.output_shape, speed.batch_size, dev, n=2)

    def one(i) -> float:
        t = time.perf_counter()
        x, y = _step.to_device(*data[i % 2], speed, dev)
        loss, _ = _step.forward_loss(net, x, y, speed, dev)
        _step.backward(loss)
        _step.optimizer_step(opt)
        float(loss.detach())
        return time.perf_counter() - t

    for i in range(3):
        one(i)
    plain = statistics.median(one(i) for i in range(steps))
    timer = OpTimer()
    with timer:
        wall = statistics.median(one(i) for i in range(steps))
    ops = sum(timer.seconds.values()) / steps
    print(f"\n{name}, {speed.label()}: {wall * 1e3:.1f} ms per step with the operator timer, "
          f"{plain * 1e3:.1f} ms without ({speed.batch_size / plain:,.0f} images/s); operators account "
          f"for {ops * 1e3:.1f} ms")
    for op, sec in sorted(timer.seconds.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {sec / steps / wall:6.1%}  {sec / steps * 1e3:8.1f} ms  {op}")


def _seconds(fn, reps: int = 7) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def conv_layers(name: str) -> None:
    """Each Conv2d of the model alone, forward + backward, at the tuned batch."""
    dev = torch.device("cpu")
    net = models.create(name)
    speed = tune(net, net.input_shape, device=dev, max_batch=MAX_BATCH[name], try_compile=False,
                 log=lambda m: None).best
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append((m, tuple(i[0].shape[1:]), tuple(o.shape[1:]))))
             for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        net.eval()(torch.zeros(1, *net.input_shape))
    for h in hooks:
        h.remove()
    peaks = hardware.peaks(dev)["matmul_flops"]
    kinds = [(torch.float32, False), (torch.float32, True)] + \
        ([(torch.bfloat16, False), (torch.bfloat16, True)] if "bfloat16" in peaks else [])
    print(f"\n{name}: each convolution alone, forward + backward, batch {speed.batch_size} "
          f"(ms; GFLOP/s; share of that precision's matmul peak)")
    print(f"  {'layer':26s} " + " ".join(f"{str(d).replace('torch.', '') + (' CL' if cl else ' NCHW'):>24s}"
                                        for d, cl in kinds))
    total = [0.0] * len(kinds)
    for n, (conv, shape_in, shape_out) in enumerate(seen):
        first = n == 0  # the input image needs no gradient
        macs = shape_out[0] * shape_out[1] * shape_out[2] * shape_in[0] * conv.kernel_size[0] * conv.kernel_size[1]
        flops = 2 * macs * speed.batch_size * (2 if first else 3)
        cells = []
        for k, (dtype, cl) in enumerate(kinds):
            fmt = torch.channels_last if cl else torch.contiguous_format
            c = torch.nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding)
            c = c.to(dtype=dtype, memory_format=fmt)
            x = torch.randn(speed.batch_size, *shape_in, dtype=dtype).contiguous(memory_format=fmt)
            x.requires_grad_(not first)
            g = torch.randn(speed.batch_size, *shape_out, dtype=dtype).contiguous(memory_format=fmt)
            t = _seconds(lambda: c(x).backward(g))
            total[k] += t
            peak = peaks["bfloat16" if dtype == torch.bfloat16 else "float32"]
            cells.append(f"{t * 1e3:7.1f} {flops / t / 1e9:6.0f} {flops / t / peak:5.0%}")
        label = f"{shape_in[0]}→{shape_out[0]} at {shape_in[1]}×{shape_in[2]}"
        print(f"  {label:26s} " + " ".join(f"{c:>24s}" for c in cells))
    print(f"  {'all':26s} " + " ".join(f"{t * 1e3:10.1f} ms{'':12s}" for t in total))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MAX_BATCH), choices=list(MAX_BATCH))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--conv-layers", action="store_true",
                   help="also time each convolution alone (forward + backward, fp32 and bf16, NCHW and channels_last)")
    a = p.parse_args()
    for name in a.models:
        profile_model(name, a.steps, a.top)
        if a.conv_layers:
            conv_layers(name)


if __name__ == "__main__":
    main()

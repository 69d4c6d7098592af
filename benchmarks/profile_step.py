"""Where a tuned training step's time goes, operator by operator (torch.profiler), for the
users' CNNs: the evidence behind "where a target is missed, exactly where the time goes".

    python benchmarks/profile_step.py [--models plate_cnn cifar_cnn classifier512] [--steps 4]
    python benchmarks/profile_step.py --models cifar_cnn --conv-layers

Each model runs with the settings `trainfast tune` chose on this machine (cached, or measured
now without torch.compile), on in-memory batches; the table is self CPU time per operator,
summed over the profiled steps, as a share of the step. --conv-layers also times each
convolution alone (forward + backward, at the tuned batch and its input shape in the model)
in fp32 and bf16, NCHW and channels_last, with its FLOP/s: which layers fall short of the
matmul peak.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from trainfast import hardware, models
from trainfast import step as _step
from trainfast.doctor.timing import synthetic_batches
from trainfast.tune import tune

MAX_BATCH = {"plate_cnn": 512, "cifar_cnn": 512, "classifier512": 32}


def profile_model(name: str, steps: int, top: int) -> None:
    dev = torch.device("cpu")
    net = models.create(name)
    speed = tune(net, net.input_shape, device=dev, max_batch=MAX_BATCH[name], try_compile=False,
                 log=lambda m: None).best
    net = _step.prepare(net, speed, dev).train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    data = synthetic_batches(net.input_shape, net.output_shape, speed.batch_size, dev, n=2)

    def one(i):
        x, y = _step.to_device(*data[i % 2], speed, dev)
        loss, _ = _step.forward_loss(net, x, y, speed, dev)
        _step.backward(loss)
        _step.optimizer_step(opt)

    for i in range(2):
        one(i)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            one(i)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    wall = total / steps / 1e3
    print(f"\n{name}, {speed.label()}: {wall:.1f} ms of operator time per step "
          f"({speed.batch_size * 1e3 / wall:,.0f} images/s if nothing else ran)")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"  {e.self_cpu_time_total / total:6.1%}  {e.self_cpu_time_total / steps / 1e3:8.1f} ms  {e.key}")


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
    p.add_argument("--conv-layers", action="store_true", help="also time each convolution alone (see above)")
    a = p.parse_args()
    for name in a.models:
        profile_model(name, a.steps, a.top)
        if a.conv_layers:
            conv_layers(name)


if __name__ == "__main__":
    main()

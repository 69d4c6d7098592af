"""Where a tuned training step's time goes, operator by operator (torch.profiler), for the
users' CNNs: the evidence behind "where a target is missed, exactly where the time goes".

    python benchmarks/profile_step.py [--models plate_cnn cifar_cnn classifier512] [--steps 4]

Each model runs with the settings `trainfast tune` chose on this machine (cached, or measured
now without torch.compile), on in-memory batches; the table is self CPU time per operator,
summed over the profiled steps, as a share of the step.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from trainfast import models
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MAX_BATCH), choices=list(MAX_BATCH))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args()
    for name in a.models:
        profile_model(name, a.steps, a.top)


if __name__ == "__main__":
    main()

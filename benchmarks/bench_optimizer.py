"""The optimizer's update on a CPU: torch's default AdamW (a loop over the tensors), foreach,
and fused (what trainfast uses, step.make_optimizer), with SGD beside them, per model; then a
whole training step at two batch sizes, the plain loop's AdamW against fit's, side by side.

    python benchmarks/bench_optimizer.py [--models tv_resnet18 timm_convnext_atto] [--repeats 20]

The update's share of a step is what a batch size buys back: it is paid once per step, so its
cost per image halves as the batch doubles. tune times each step with the run's optimizer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import outside_models  # noqa: E402


def update_ms(params, make, repeats: int) -> float:
    opt = make(params)
    for _ in range(3):
        opt.step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def step_rate(net, make, batch: int, steps: int) -> float:
    """Images/s of forward, backward and update on random 32×32 batches (after two warm-up steps)."""
    opt = make(list(net.parameters()))
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    net.train()
    for i in range(steps + 2):
        if i == 2:
            t = time.perf_counter()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return batch * steps / (time.perf_counter() - t)


def main(argv=None) -> None:
    from trainfast.step import make_optimizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=["tv_resnet18", "timm_repvgg_a0", "timm_convnext_atto",
                                                    "tv_shufflenet_v2_x0_5"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10, help="timed training steps per batch size")
    a = ap.parse_args(argv)
    tv, timm = outside_models.import_libraries()
    if tv is None or timm is None:
        raise SystemExit("needs torchvision and timm (pip install torch==2.13.0 timm)")
    cpu = torch.device("cpu")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'model':24s} {'params':>7s} {'AdamW loop':>10s} {'foreach':>8s} {'fused':>6s} {'SGD':>6s}   "
          f"{'batch':>5s} {'plain loop':>10s} {'fit':>6s} {'ratio':>6s}   (update ms; training images/s)")
    for name in a.models:
        torch.manual_seed(0)
        net = outside_models.PANEL[name](10)
        params = list(net.parameters())
        for p in params:
            p.grad = torch.randn_like(p)
        ms = [update_ms(params, lambda ps, kw=kw: torch.optim.AdamW(ps, lr=1e-3, **kw), a.repeats)
              for kw in ({"foreach": False}, {"foreach": True}, {"fused": True})]
        ms.append(update_ms(params, lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9), a.repeats))
        for p in params:
            p.grad = None
        head = (f"{name:24s} {sum(p.numel() for p in params) / 1e6:6.2f}M {ms[0]:10.1f} {ms[1]:8.1f} {ms[2]:6.1f} "
                f"{ms[3]:6.1f}")
        for batch in (32, 64):
            rates = {"plain": [], "fit": []}
            for _ in range(3):  # the two sides alternate: a slow spell falls on both
                rates["plain"].append(step_rate(net, lambda ps: torch.optim.AdamW(ps, lr=1e-3), batch, a.steps))
                rates["fit"].append(step_rate(net, lambda ps: make_optimizer("adamw", ps, 1e-3, cpu), batch, a.steps))
            p, f = statistics.median(rates["plain"]), statistics.median(rates["fit"])
            lead = head if batch == 32 else " " * len(head)
            print(f"{lead}   {batch:5d} {p:10.0f} {f:6.0f} {f / p:5.2f}×", flush=True)


if __name__ == "__main__":
    main()

"""Training-step throughput of the users' three CNNs, side by side in one run: trainfast
(tuned) vs Keras 3 on TensorFlow (float32 and mixed_bfloat16) vs a plain PyTorch loop at
its defaults (eager fp32, NCHW, the users' batch).

    python benchmarks/bench_vs_keras.py [--models plate_cnn cifar_cnn classifier512] [--runs 3]

Each contender runs in a fresh process of its own (so no framework's thread pools, allocator
or settings leak into another's figures), on in-memory random batches, warm-up excluded; each
figure is the median of --runs timed runs. Keras is given the users' batch and trainfast's
tuned batch and keeps its faster one. Needs the benchmark extra: pip install torch==2.13.0 -e ".[bench]".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
USER_BATCH = {"plate_cnn": 128, "cifar_cnn": 256, "classifier512": 5}
MAX_BATCH = {"plate_cnn": 512, "cifar_cnn": 512, "classifier512": 32}


def _child(args: list[str], env: dict | None = None) -> list[dict]:
    """Run this script (or keras_models.py) in a fresh process; its JSON lines are the result."""
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, env={**os.environ, **(env or {})})
    if p.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{p.stderr[-3000:]}")
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def plain_torch(name: str, batch: int, runs: int, steps: int) -> dict:
    """What a hand-written loop gets: model(x), cross-entropy, backward, SGD step; fp32 eager."""
    import time

    import torch
    import torch.nn.functional as F

    from trainfast import models

    torch.manual_seed(0)
    net = models.create(name).train()
    e = models.entry(name)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    x = torch.rand(batch, *e.input_shape)
    y = torch.randint(0, e.output_shape[-1], (batch, *e.output_shape[:-1]))

    def step():
        out = net(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    rates = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(steps):
            step()
        rates.append(steps * batch / (time.perf_counter() - t))
    return {"framework": "torch-plain", "model": name, "batch": batch, "images_per_s": statistics.median(rates),
            "runs": rates, "versions": {"torch": torch.__version__}}


def trainfast_tuned(name: str, runs: int, steps: int) -> dict:
    import torch

    from trainfast import hardware, models
    from trainfast.diagnose.cost import layer_costs
    from trainfast.tuning import measure_trial, tune

    net = models.create(name)
    e = models.entry(name)
    dev = torch.device("cpu")
    best = tune(net, e.input_shape, device=dev, max_batch=MAX_BATCH[name], try_compile=False, retune=True,
                log=lambda m: None).best
    rates = [measure_trial(net, e.input_shape, e.output_shape, best, dev, steps=steps, warmup=2).images_per_s
             for _ in range(runs)]
    rate = statistics.median(rates)
    peaks = hardware.peaks(dev)["matmul_flops"]
    peak = peaks.get("bfloat16" if best.precision == "bf16" else "float32", peaks["float32"])
    flops = layer_costs(models.create(name), e.input_shape, batch=1).train_flops
    return {"framework": "trainfast", "model": name, "batch": best.batch_size, "settings": best.label(),
            "images_per_s": rate, "runs": rates, "roofline_share": rate * flops / peak,
            "versions": {"torch": torch.__version__}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(USER_BATCH), choices=list(USER_BATCH))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--worker", nargs=2, metavar=("KIND", "MODEL"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        kind, name = a.worker
        r = plain_torch(name, USER_BATCH[name], a.runs, a.steps) if kind == "torch-plain" else \
            trainfast_tuned(name, a.runs, a.steps)
        print(json.dumps(r))
        return

    me, common = str(Path(__file__)), ["--runs", str(a.runs), "--steps", str(a.steps)]
    import platform

    import torch

    from trainfast import hardware
    print(f"# {hardware.cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}")
    header = (f"{'model':14s} {'plain torch':>12s} {'keras fp32':>12s} {'keras bf16':>12s} {'trainfast':>10s}  "
              f"{'vs keras bf16':>13s} {'vs plain':>8s} {'roofline':>8s}  trainfast settings")
    rows = []
    for name in a.models:
        plain = _child([me, "--worker", "torch-plain", name, *common], env={"TRAINFAST_KEEP_MEMORY": "0"})[0]
        ours = _child([me, "--worker", "trainfast", name, *common])[0]
        batches = sorted({USER_BATCH[name], ours["batch"]})
        keras = []
        for b in batches:
            keras += _child([str(HERE / "keras_models.py"), "--models", name, "--batch", str(b), *common])
        best = {pol: max((k for k in keras if k["policy"] == pol), key=lambda k: k["images_per_s"])
                for pol in ("float32", "mixed_bfloat16")}
        rows.append({"model": name, "plain": plain, "trainfast": ours, "keras": keras})
        kb = best["mixed_bfloat16"]
        if not rows[1:]:
            print(f"# keras {kb['versions']['keras']} ({kb['versions']['backend']} backend)\n{header}")
        print(f"{name:14s} {plain['images_per_s']:12,.1f} "
              f"{best['float32']['images_per_s']:9,.1f}@{best['float32']['batch']:<3d}"
              f"{kb['images_per_s']:8,.1f}@{kb['batch']:<3d} {ours['images_per_s']:10,.1f}  "
              f"{ours['images_per_s'] / kb['images_per_s']:12.2f}× {ours['images_per_s'] / plain['images_per_s']:7.2f}× "
              f"{ours['roofline_share']:8.0%}  {ours['settings']}", flush=True)
    out = os.environ.get("TRAINFAST_BENCH_JSON")
    if out:
        Path(out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    import sys

    from trainfast.hardware import OtherLoad

    with OtherLoad() as load:  # a busy neighbour makes every figure here low
        main()
    print(load.summary(), file=sys.stderr)  # stderr: a parent benchmark parses this one's stdout

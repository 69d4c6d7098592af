"""The users' three CNNs on one CUDA device, side by side in one run:

1. the users' plain loop: fp32, contiguous memory, their batch, Adam, random data already on
   the device (no data path at all: the most generous baseline);
2. a "PyTorch best practice" loop: the same with bf16 autocast, channels_last, batch 256 (32
   for 512²) and cudnn.benchmark;
3. `trainfast.fit` with its defaults (tune on this device, then train) over real epochs from a
   raw pack of random images: steady-state images/s (median of the epochs after the first,
   which holds torch.compile's time, reported apart), and its model FLOP utilisation (MFU)
   against the doctor's measured matmul peak in that precision (fp32's for tf32, whose
   tensor-core peak is not measured: an overstatement there);
4. tune's choice against an exhaustive sweep (precision × memory format × batch, no compile)
   timed the same way in the same run, within the batch bound fit applies to the data
   (the sweep's best at any batch is reported beside it).

    python benchmarks/bench_gpu.py [--device cuda] [--models plate_cnn,cifar_cnn,classifier512] [--sweep-models ...]
    python benchmarks/bench_gpu.py --device cpu --small      # a dry run of the script on a CPU

One JSON object per model on stdout, a summary table at the end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

import trainfast
from trainfast import hardware, models
from trainfast import step as _step
from trainfast.config import Speed, TrainConfig
from trainfast.data.held import from_arrays
from trainfast.diagnose.cost import layer_costs
from trainfast.tuning import data_max_batch, measure_trial

ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
USERS = {  # model: (the user's batch, the best-practice batch, images in the pack, epochs, compile tried)
    "plate_cnn": (128, 256, 40_000, 4, False),
    "cifar_cnn": (256, 256, 50_000, 6, True),
    "classifier512": (5, 32, 1_536, 4, False),
}
SWEEP_BATCHES = {"classifier512": (32, 64, 128, 256)}
DEFAULT_SWEEP = (256, 1024, 2048, 4096, 8192)


def _labels(out_shape, n, rng):
    if len(out_shape) == 2:
        return rng.integers(0, out_shape[1], (n, out_shape[0]))
    return rng.integers(0, out_shape[0], n)


def plain_loop(name: str, batch: int, dev, *, best: bool, steps: int = 30) -> float:
    """images/s of a hand-written training loop on one random batch already on the device."""
    torch.backends.cudnn.benchmark = best
    torch.manual_seed(0)
    net = models.create(name).to(dev)
    (c, h, w), out = net.input_shape, net.output_shape
    x = torch.rand(batch, c, h, w, device=dev)
    y = torch.from_numpy(_labels(out, batch, np.random.default_rng(0))).to(dev)
    if best:
        net, x = net.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)

    def step():
        with torch.autocast(dev.type, torch.bfloat16, enabled=best):
            o = net(x)
        loss = torch.nn.functional.cross_entropy(o.float().reshape(-1, o.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(5):
        step()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return steps * batch / (time.perf_counter() - t)


def fit_rate(name: str, pk, dev, epochs: int, compile_: bool, out: Path) -> tuple[dict, Speed]:
    """trainfast.fit with its defaults on the pack; steady images/s and what tune chose."""
    t = time.perf_counter()
    r = trainfast.fit(name, pk, config=TrainConfig(epochs=epochs, val_fraction=0.0), device=dev, run_dir=out,
                      pin=None if compile_ else {"compile": False}, progress=False, log=lambda *a: None)
    rates = [h["images_per_s"] for h in r.history]
    return {"speed": r.speed.label(), "steady_images_per_s": statistics.median(rates[1:]),
            "first_epoch_s": r.history[0]["seconds"], "epoch_s": statistics.median(h["seconds"] for h in r.history[1:]),
            "wall_s": time.perf_counter() - t}, r.speed


def sweep(name: str, dev, batches, small: bool) -> list[dict]:
    """Every precision × memory format × batch the device runs, timed like tune's trials."""
    net = models.create(name)
    shape, out = net.input_shape, net.output_shape
    rows, failed = [], set()
    for p, cl, b in itertools.product(("fp32", "tf32", "bf16", "fp16"), (False, True), batches):
        s = Speed(p, cl, batch_size=b)
        if _step.check(s, dev) or (p, cl) in failed:
            continue
        t = measure_trial(net, shape, out, s, dev, min_seconds=0.05 if small else 0.3)
        rows.append({"label": s.label(), "batch": b, "images_per_s": t.images_per_s, "note": t.note})
        if t.images_per_s is None:  # out of memory: larger batches will not fit either
            failed.add((p, cl))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None)
    ap.add_argument("--models", default=",".join(USERS))
    ap.add_argument("--sweep-models", default=",".join(USERS), help="models to run the exhaustive sweep for")
    ap.add_argument("--small", action="store_true", help="tiny sizes: check the script, not the device")
    a = ap.parse_args()
    dev = hardware.resolve_device(a.device)
    peaks = hardware.peaks(dev)["matmul_flops"]
    print(json.dumps({"device": hardware.describe(dev).get("device"), "torch": torch.__version__,
                      "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, "peaks": peaks}), flush=True)
    table = []
    for name in a.models.split(","):
        user_b, best_b, n, epochs, compile_ = USERS[name]
        if a.small:
            user_b, best_b, n, epochs, compile_ = min(user_b, 4), 8, 96, 2, False
        net = models.create(name)
        (c, h, w), out = net.input_shape, net.output_shape
        flops = layer_costs(net, (c, h, w)).train_flops
        row = {"model": name, "train_gflop_per_image": flops / 1e9,
               "users_plain_fp32": plain_loop(name, user_b, dev, best=False, steps=3 if a.small else 30),
               "best_practice": plain_loop(name, best_b, dev, best=True, steps=3 if a.small else 30)}
        rng = np.random.default_rng(0)
        with tempfile.TemporaryDirectory() as tmp:
            labels = _labels(out, n, rng)
            alphabet = ALPHABET[:out[1]] if len(out) == 2 else None
            data = from_arrays(rng.integers(0, 256, (n, h, w, c), dtype=np.uint8), labels, alphabet=alphabet)
            pk = trainfast.pack(data, Path(tmp) / "p", size=(h, w), encoding="raw", progress=False)
            row["fit"], chosen = fit_rate(name, pk, dev, epochs, compile_, Path(tmp) / "run")
        dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(chosen.precision, "float32")
        rate = row["fit"]["steady_images_per_s"]
        row["fit_mfu"] = rate * flops / peaks.get(dtype, peaks["float32"])
        row["fit_vs_plain"] = rate / row["users_plain_fp32"]
        row["fit_vs_best_practice"] = rate / row["best_practice"]
        if name in a.sweep_models.split(","):
            batches = (8, 16) if a.small else SWEEP_BATCHES.get(name, DEFAULT_SWEEP)
            rows = sweep(name, dev, batches, a.small)
            ok = [r for r in rows if r["images_per_s"]]
            top = max(ok, key=lambda r: r["images_per_s"])
            # fit bounds the batch by the data (>= 32 steps per epoch): compare within that bound
            bound = data_max_batch(n)
            top_in = max((r for r in ok if r["batch"] <= bound), key=lambda r: r["images_per_s"], default=top)
            mine = measure_trial(net, (c, h, w), out, replace_compile(chosen), dev,
                                 min_seconds=0.05 if a.small else 0.5).images_per_s
            row["sweep_best"], row["sweep_best_within_data_bound"] = top, top_in
            row["tune_choice_uncompiled"] = {"label": replace_compile(chosen).label(), "images_per_s": mine}
            row["tune_vs_sweep"] = mine / top_in["images_per_s"] if mine else None
        print(json.dumps(row), flush=True)
        table.append(row)
    print(f"\n{'model':14s} {'plain fp32':>11s} {'best practice':>14s} {'trainfast.fit':>14s} {'×plain':>7s} "
          f"{'×best':>6s} {'MFU':>6s} {'tune/sweep':>10s}  fit's settings")
    for r in table:
        ts = f"{r['tune_vs_sweep']:.2f}" if r.get("tune_vs_sweep") else "—"
        print(f"{r['model']:14s} {r['users_plain_fp32']:11,.0f} {r['best_practice']:14,.0f} "
              f"{r['fit']['steady_images_per_s']:14,.0f} {r['fit_vs_plain']:7.2f} {r['fit_vs_best_practice']:6.2f} "
              f"{r['fit_mfu']:6.1%} {ts:>10s}  {r['fit']['speed']}")


def replace_compile(s: Speed) -> Speed:
    return replace(s, compile=False)


if __name__ == "__main__":
    main()

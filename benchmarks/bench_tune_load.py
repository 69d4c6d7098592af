"""tune on a machine other programs load: does its choice hold up when timed on the quiet machine?

    python benchmarks/bench_tune_load.py [--models cifar_cnn plate_cnn ...] [--loads 0 1 3] [--reps 3 2 2]
                                         [--json out.json] [--also-time earlier.json]

To compare with another version of trainfast, run this script with that version first on the path
(PYTHONPATH=/path/to/old/checkout, its own TRAINFAST_CACHE), --json old.json, then with this one
and --also-time old.json: the old run's choices are timed quietly in the same round-robin, so
both versions' ratios are over one quiet best.

For each model, tune runs several times (retune, torch.compile left out) under each load:
0, 1 or 3 other processes spinning on a core each (`python -c "while 1: pass"`, killed
after). Then, on the quiet machine, every distinct setting the tunes chose is timed again,
round-robin three times (tuning.measure_trial, median): a choice's quality is its quiet
rate over the best of them. Reported per model and load: the ratios (min / median), whether
tune said the machine was busy, the tunes' own seconds, and the spread of the quiet tunes'
choices (the target: five quiet tunes within 10% of each other's speed).

Models: the users' three CNNs (plate_cnn 64×128, cifar_cnn 32², classifier512 512²) and two
outside ones at 32² (torchvision ResNet-18, timm MobileNetV3-small-050). Each tune is given a
500,000-image plan at a 10% share and at most 40 s, with the batch bounded as for a 50,000-image
epoch. Nothing else may run while it measures (the loads are the benchmark's own).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainfast import hardware, models  # noqa: E402
from trainfast.config import Speed  # noqa: E402
from trainfast.tuning import measure_trial, tune  # noqa: E402

SHAPES = {"plate_cnn": (3, 64, 128), "cifar_cnn": (3, 32, 32), "classifier512": (3, 512, 512)}
OUTSIDE = {"tv_resnet18": "tv_resnet18", "timm_mobilenetv3_small_050": "timm_mobilenetv3_small_050"}


def build(name: str) -> tuple[torch.nn.Module, tuple, tuple]:
    if name in SHAPES:
        net = models.create(name)
        return net, SHAPES[name], tuple(net.output_shape)
    import outside_models
    return outside_models.PANEL[OUTSIDE[name]](10), (3, 32, 32), (10,)


class Spinners:
    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(self.n)]
        time.sleep(0.5 if self.n else 0)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()
        time.sleep(0.5 if self.n else 0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["cifar_cnn", "plate_cnn", "classifier512", "tv_resnet18",
                                                   "timm_mobilenetv3_small_050"])
    p.add_argument("--loads", nargs="+", type=int, default=[0, 1, 3])
    p.add_argument("--reps", nargs="+", type=int, default=[3, 2, 2], help="tunes per load, in --loads order")
    p.add_argument("--max-seconds", type=float, default=40.0)
    p.add_argument("--json", type=Path)
    p.add_argument("--also-time", type=Path, help="an earlier run's --json: its choices are timed with these")
    a = p.parse_args()
    cpu = torch.device("cpu")
    print(f"{hardware.cpu_model()}, {hardware.physical_cores()} cores, {' '.join(hardware.isa_features())}; "
          f"torch {torch.__version__}", flush=True)
    results = {}
    earlier = json.loads(a.also_time.read_text()) if a.also_time else {}
    for name in a.models:
        net, shape, out = build(name)
        runs = []
        for load, reps in zip(a.loads, a.reps):
            for rep in range(reps):
                with Spinners(load):
                    r = tune(net, shape, device=cpu, images=50_000, planned_images=500_000, budget_share=0.1,
                             max_seconds=a.max_seconds, try_compile=False, retune=True, log=lambda m: None)
                busy = getattr(r, "busy", False)  # an older trainfast says nothing of the load
                runs.append({"load": load, "rep": rep, "choice": r.best.label(), "speed": r.best,
                             "busy_said": busy, "other_cores": getattr(r, "other_cores", None),
                             "threads": getattr(r, "threads", None), "seconds": r.seconds})
                print(f"{name:28s} load {load} #{rep}: {r.best.label():44s} {r.seconds:5.1f} s "
                      f"{'said busy' if busy else ''}", flush=True)
        distinct = {run["choice"]: run["speed"] for run in runs}
        old_runs = earlier.get(name, {}).get("runs", [])
        for run in old_runs:
            distinct.setdefault(run["choice"], Speed(**run["speed"]))
        timed: dict[str, list[float]] = {k: [] for k in distinct}
        for _ in range(3):  # quiet, round-robin
            for label, speed in distinct.items():
                timed[label].append(measure_trial(net, shape, out, speed, cpu).images_per_s or 0.0)
        quiet = {k: statistics.median(v) for k, v in timed.items()}
        best = max(quiet.values())
        for run in runs:
            run["quiet_rate"] = quiet[run["choice"]]
            run["ratio"] = quiet[run["choice"]] / best
            run["speed"] = dataclasses.asdict(run["speed"])
        for run in old_runs:
            run["ratio"] = quiet[run["choice"]] / best
        results[name] = {"runs": runs, "quiet_rates": quiet, "earlier_runs": old_runs}
        for who, rs in (("this", runs), ("earlier", old_runs)):
            for load in a.loads:
                ratios = [run["ratio"] for run in rs if run["load"] == load]
                if not ratios:
                    continue
                said = sum(run["busy_said"] for run in rs if run["load"] == load)
                secs = statistics.median(run["seconds"] for run in rs if run["load"] == load)
                print(f"  {who:7s} {name:28s} load {load}: choice / quiet best min {min(ratios):.2f} median "
                      f"{statistics.median(ratios):.2f}; said busy {said}/{len(ratios)}; tune {secs:.0f} s",
                      flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()

"""Every benchmark of docs/BENCHMARKS.md, one after another, each in its own process, with
its output printed and kept in OUT/NAME.txt.

    pip install torch==2.13.0 -e ".[bench]"
    python benchmarks/run_all.py [--out bench-results] [--only vs_keras plates_e2e]

bench_storage.py is left out: its slow drive is a FUSE mount (libfuse2, root); run it alone.
About two and a half hours on 2 CPU cores. Leave the machine otherwise idle while it runs: every figure is
a throughput, and anything else running shows up in it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITE = {  # name: benchmarks/bench_SCRIPT.py and its arguments
    "pack": ("pack", []),
    "loader": ("loader", ["--runs", "5"]),
    "train": ("train", ["--sweep", "--models", "cifar_cnn", "plate_cnn", "--runs", "5"]),
    "vs_keras": ("vs_keras", []),
    "plates_e2e": ("plates_e2e", []),
    "plates_accuracy": ("plates_e2e", ["--model", "plate_net", "--count", "8000", "--epochs", "8",
                                       "--target", "0.85", "--data", "bench-data/plates-acc"]),
    "plates_to_95": ("plates_e2e", ["--model", "plate_net", "--count", "20000", "--heldout", "1000", "--epochs", "24",
                                    "--translate", "2", "--target", "0.98", "--plate-target", "0.95", "--max-minutes", "15",
                                    "--runs", "1",
                                    "--kinds", "keras-sequence", "keras-tfdata", "trainfast",
                                    "--data", "bench-data/plates-95"]),
    "quality": ("quality", []),
    "defaults": ("defaults", []),
    "race": ("race", []),
    "outside": ("outside", []),  # 18 torchvision/timm models, fit's defaults against a plain loop (~15 min)
    "keras_feed": ("keras_feed", []),  # Keras's feeds per backend: TensorFlow, torch, JAX (~15 min)
}
# Left out for its length: bench_panel.py (issue 51.3's realistic panel, ~80-95 min a round of 14 models on
# 2 cores; `--runs 3 --out panel.jsonl` appends rounds and skips what is done, `--report` prints the table).


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--only", nargs="+", choices=list(SUITE), default=list(SUITE))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in a.only:
        script, args = SUITE[name]
        cmd = [sys.executable, str(HERE / f"bench_{script}.py"), *args]
        print(f"== {' '.join(cmd[1:])}", flush=True)
        t = time.perf_counter()
        with open(a.out / f"{name}.txt", "w") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in proc.stdout:
                print(line, end="", flush=True)
                log.write(line)
        if proc.wait():
            failed.append(name)
        print(f"== {name}: {'failed' if proc.returncode else 'done'} in {time.perf_counter() - t:.0f} s\n", flush=True)
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (see {a.out})")


if __name__ == "__main__":
    main()

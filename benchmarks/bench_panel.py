"""A realistic panel (issue 51): models nobody here wrote, on natural-image patches whose
held-out regions were never seen in training; `trainfast.fit` with its defaults against the
loop a user writes and a careful one, several runs per side, scored the way the model is used.

    python benchmarks/bench_panel.py --runs 3 --out panel.jsonl        # ~80-95 min a round of 14 models on 2 CPU cores
    python benchmarks/bench_panel.py --out panel.jsonl --report         # the table of what is there

Data (photos.natural_patches): 10,000 training and 2,500 held-out 32×32 patches of ten of
scikit-image's photographs, the class being the photograph; the held-out patches come from the
right quarter of each photograph, the training ones from the rest.

  plain    AdamW 1e-3, fp32, batch 64, inputs /255 (bench_outside.plain)
  careful  AdamW 2e-3, weight decay 0.05, batch 128, linear warm-up over the first half epoch
           then cosine to 0, label smoothing 0.1, channels_last, inputs normalised with the
           training mean and std, bf16 autocast where this CPU runs bf16 natively (else fp32)
  fit      trainfast.fit(model, train, held_out, epochs=E, device="cpu", seed=run), an empty cache

Run r (0, 1, 2 ...) builds each model from seed r, the same initial weights on every side; the
plain and careful loops shuffle with seed r. The sides' order rotates from model to model so a
slow spell of a shared machine falls on each. Every side is scored after each epoch on the
held-out patches normalised as it trained (fit: with the training pack's statistics, and the
model it hands back scored again here, independently of fit's own report). Results are appended
to --out as JSON lines (machine and versions in each), so rounds can be added later; a (model,
side, run) already there is skipped. The report gives per model the medians over runs of: the
best and final held-out accuracy of each side, the model fit hands back, the time to the plain
loop's best (from the call; that run's plain best is the target), and images/s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_outside  # noqa: E402
import outside_models  # noqa: E402
import photos  # noqa: E402

MODELS = {  # name: (library, architecture); none of them is in outside_models.PANEL (the digits panel)
    "lcnet_050": ("timm", "lcnet_050"),  # depthwise, hard-swish, a wide 1×1 head
    "cs3darknet_focus_s": ("timm", "cs3darknet_focus_s"),  # cross-stage partial, space-to-depth stem
    "ese_vovnet19b_slim_dw": ("timm", "ese_vovnet19b_slim_dw"),  # one-shot aggregation, effective SE
    "edgenext_xx_small": ("timm", "edgenext_xx_small"),  # conv + transposed attention hybrid
    "dla46_c": ("timm", "dla46_c"),  # deep layer aggregation
    "mobilevit_xxs": ("timm", "mobilevit_xxs"),  # mobile blocks + transformers on unfolded patches
    "tinynet_e": ("timm", "tinynet_e"),  # EfficientNet scaled down: depthwise + SE, swish
    "repghostnet_050": ("timm", "repghostnet_050"),  # re-parameterisable ghost modules
    "inception_next_atto": ("timm", "inception_next_atto"),  # inception depthwise token mixer
    "mobilenetv4_conv_small": ("timm", "mobilenetv4_conv_small"),  # universal inverted bottlenecks
    "hgnetv2_b0": ("timm", "hgnetv2_b0"),  # high-performance GPU net: light blocks, learnable affine
    "tv_regnet_y_400mf": ("torchvision", "regnet_y_400mf"),  # grouped + SE
    "resnet10t": ("timm", "resnet10t"),  # tiered deep stem, average-pool shortcut
    "tv_mobilenet_v2": ("torchvision", "mobilenet_v2"),  # inverted residuals, ReLU6
}
SIDES = ("plain", "careful", "fit")


def build(name: str, seed: int) -> torch.nn.Module:
    tv, timm = outside_models.import_libraries()
    library, arch = MODELS[name]
    torch.manual_seed(seed)
    return timm.create_model(arch, num_classes=10) if library == "timm" else getattr(tv.models, arch)(num_classes=10)


def careful(net, train, test, epochs: int, seed: int) -> dict:
    """AdamW + warm-up/cosine, label smoothing, channels_last, normalised inputs, batch 128, bf16 where native."""
    from trainfast.step import logits_of, supports_bf16

    start = time.perf_counter()
    xtr, ytr = bench_outside._arrays(train)
    xte, yte = bench_outside._arrays(test)
    mean, std = list(train.mean), list(train.std)
    m, s = torch.tensor(mean).view(1, -1, 1, 1), torch.tensor(std).view(1, -1, 1, 1)
    bf16 = supports_bf16(torch.device("cpu"))
    net = net.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0.05)
    per_epoch = len(xtr) // 128
    total, warm = per_epoch * epochs, max(1, per_epoch // 2)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: (k + 1) / warm if k < warm else 0.5 * (1 + math.cos(math.pi * (k - warm) / (total - warm))))

    def step(x, y):
        x = ((x.float() / 255 - m) / s).contiguous(memory_format=torch.channels_last)
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            out = logits_of(net(x))
        loss = torch.nn.functional.cross_entropy(out.float(), y, label_smoothing=0.1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    out = bench_outside.run_epochs(net, xtr, ytr, epochs, 128, seed, step,
                                   lambda: bench_outside._accuracy(net, xte, yte, mean, std), start)
    return {**out, "bf16": bf16}


def run_side(side: str, name: str, seed: int, train, test, epochs: int, tmp: Path) -> dict:
    net = build(name, seed)
    if side == "plain":
        return bench_outside.plain(net, train, test, epochs, seed=seed)
    if side == "careful":
        return careful(net, train, test, epochs, seed)
    from trainfast.config import TrainConfig

    out = bench_outside.with_fit(net, train, test, epochs, tmp / f"cache-{name}-{seed}", config=TrainConfig(seed=seed))
    if "error" not in out:
        xte, yte = bench_outside._arrays(test)
        out["handed_back"] = bench_outside._accuracy(net, xte, yte, list(train.mean), list(train.std))  # the user's own scoring
    return out


def machine() -> dict:
    flags = Path("/proc/cpuinfo").read_text()
    cpu = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")),
               platform.processor())
    isa = "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else \
        "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    tv, timm = outside_models.import_libraries()
    return {"cpu": cpu, "isa": isa, "cores": os.cpu_count(), "torch": torch.__version__,
            "timm": timm.__version__, "torchvision": tv.__version__, "commit": _commit()}


def _commit() -> str | None:
    """The trainfast commit that ran (rounds added in later sessions may run other code), with
    "+" where its files differ from that commit; None outside a git checkout."""
    import trainfast

    src = Path(trainfast.__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty else "")


def _done(path: Path, where: dict, any_machine: bool = False) -> dict:
    """{(model, side, run): row} of the rows already in `path` from this kind of machine (any_machine:
    from every machine with as many cores; a run's sides always ran together, on one machine)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {(r["model"], r["side"], r["run"]): r for r in rows
            if (any_machine or r["machine"]["isa"] == where["isa"]) and r["machine"]["cores"] == where["cores"]
            and r.get("beside") == where.get("beside")}


def of_commits(rows: dict, commits) -> dict:
    """The rows that these trainfast commits ran (a round's code alone)."""
    return {k: r for k, r in rows.items() if r["machine"].get("commit") in commits}


def _med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _spread(values, pct=True) -> str:
    """The median of `values` with their range: a percentage, or a ratio (pct=False; inf: never)."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "—"
    f = (lambda v: f"{100 * v:.1f}") if pct else (lambda v: "never" if math.isinf(v) else f"{v:.2f}×")
    med = statistics.median(values)
    return f(med) + (f" ({f(min(values))}–{f(max(values))})" if len(values) > 1 else "")


def report(rows: dict) -> str:
    """The panel's table from the rows of every run: medians over runs, with the spread."""
    names = [n for n in MODELS if any(k[0] == n for k in rows)]
    lines = [f"{'model':24s} {'runs':>4s} {'plain best':>10s} {'careful best':>12s} {'fit best':>8s} "
             f"{'fit handed back':>15s} {'fit reports':>11s} {'careful to plain best':>21s} "
             f"{'fit to plain best':>17s} {'img/s plain/careful/fit':>24s}"]
    tally = {"models": 0, "fit_vs_plain": 0, "fit_vs_careful": 0, "ratios": [], "same_score": 0, "never": 0,
             "rate_ok": 0}
    for name in names:
        runs = sorted({k[2] for k in rows if k[0] == name and all((name, s, k[2]) in rows for s in SIDES)})
        if not runs:
            continue
        best = {s: [max(rows[(name, s, r)]["acc"] or [float("nan")]) for r in runs] for s in SIDES}
        handed = [rows[(name, "fit", r)].get("handed_back") for r in runs]
        reported = [(rows[(name, "fit", r)]["acc"] or [None])[-1] for r in runs]
        ratio = {s: [] for s in ("careful", "fit")}
        for r in runs:
            p = rows[(name, "plain", r)]
            target, tp = max(p["acc"]), bench_outside.time_to(p, max(p["acc"]))
            for s in ratio:
                t = bench_outside.time_to(rows[(name, s, r)], target)
                ratio[s].append(t / tp if t is not None else math.inf)
        rate = {s: _med([rows[(name, s, r)].get("images_per_s") for r in runs]) for s in SIDES}

        lines.append(f"{name:24s} {len(runs):4d} {_spread(best['plain']):>10s} {_spread(best['careful']):>12s} "
                     f"{_spread(best['fit']):>8s} {_spread(handed):>15s} {_spread(reported):>11s} "
                     f"{_spread(ratio['careful'], False):>21s} {_spread(ratio['fit'], False):>17s} "
                     f"{' / '.join(f'{v:.0f}' if v else '—' for v in rate.values()):>24s}")
        h = _med(handed)
        tally["models"] += 1
        tally["fit_vs_plain"] += h is not None and h >= _med(best["plain"]) - 0.01
        tally["fit_vs_careful"] += h is not None and h >= _med(best["careful"]) - 0.01
        tally["same_score"] += all(a is not None and b is not None and abs(a - b) <= 0.001
                                   for a, b in zip(handed, reported))
        med_ratio = statistics.median(ratio["fit"])
        tally["ratios"].append(med_ratio)
        tally["never"] += math.isinf(med_ratio)
        tally["rate_ok"] += bool(rate["fit"] and rate["plain"] and rate["fit"] >= rate["plain"])
    n = tally["models"]
    commits = sorted({str(r["machine"].get("commit")) for r in rows.values()})
    runs_on: dict[str, set] = {}
    for (_, _, run), r in rows.items():
        runs_on.setdefault(f'{r["machine"]["cpu"]} ({r["machine"]["isa"]})', set()).add(run)
    cpus = [f"{cpu}: runs {','.join(map(str, sorted(runs)))}" for cpu, runs in sorted(runs_on.items())]
    if n:
        finite = [r for r in tally["ratios"] if not math.isinf(r)]
        lines += ["", f"the model fit hands back ≥ the plain loop's best − 1 point: {tally['fit_vs_plain']} of {n}; "
                      f"≥ the careful loop's best − 1: {tally['fit_vs_careful']} of {n}",
                  f"fit's reported final accuracy equals the user's scoring of the model to 0.1 point: "
                  f"{tally['same_score']} of {n}",
                  f"fit's time to the plain loop's best (median of runs): median over models "
                  f"{statistics.median(tally['ratios']):.2f}×"
                  + (f", worst reached {max(finite):.2f}×" if finite else "") + f", never reached: {tally['never']}",
                  f"fit's median training images/s ≥ the plain loop's: {tally['rate_ok']} of {n} "
                  f"(fit's rate excludes its tune and evaluation; both count in the times)",
                  f"trainfast commits behind these rows: {', '.join(commits)} (None: before commits were recorded)",
                  f"CPUs: {'; '.join(cpus)}"]
    return "\n".join(lines)


def _spinner():
    """A low-priority process spinning on one core (the users' background programs)."""
    return subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while 1: pass"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=list(MODELS), help="models to run (default: all)")
    ap.add_argument("--runs", type=int, default=3, help="runs per side (seeds 0 … runs-1)")
    ap.add_argument("--first-run", type=int, default=0,
                    help="start at this run (seed): add runs 1 … runs-1 where run 0 ran elsewhere")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--train", type=int, default=10_000)
    ap.add_argument("--test", type=int, default=2_500)
    ap.add_argument("--out", type=Path, required=True, help="JSON lines: appended to, and read to skip what is done")
    ap.add_argument("--beside-nice", action="store_true",
                    help="run beside a process spinning on one core at nice 19 (recorded as such)")
    ap.add_argument("--report", action="store_true", help="print the table of --out and stop")
    ap.add_argument("--commit", nargs="*", help="with --report: only the rows these trainfast commits ran")
    ap.add_argument("--any-machine", action="store_true",
                    help="with --report: pool the rows of every CPU with this many cores (the CPUs are listed)")
    a = ap.parse_args(argv)
    where = {**machine(), "beside": "nice-19 spinner" if a.beside_nice else None}
    if a.report:
        rows = _done(a.out, where, a.any_machine)
        print(report(of_commits(rows, a.commit) if a.commit else rows))
        return
    names = a.only or list(MODELS)
    done = _done(a.out, where)
    spin = _spinner() if a.beside_nice else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            import trainfast

            (xtr, ytr), (xte, yte) = photos.natural_patches(a.train, a.test)
            train = trainfast.pack((xtr, ytr), tmp / "train", size=(32, 32), progress=False)
            test = trainfast.pack((xte, yte), tmp / "test", size=(32, 32), progress=False)
            print(f"{where}; patches {len(train)} train / {len(test)} held out; {a.epochs} epochs", flush=True)
            for run in range(a.first_run, a.runs):
                for i, name in enumerate(names):
                    for side in SIDES[i % 3:] + SIDES[:i % 3]:
                        if (name, side, run) in done:
                            continue
                        t = time.perf_counter()
                        try:
                            row = run_side(side, name, run, train, test, a.epochs, tmp)
                        except Exception as e:  # noqa: BLE001 - a model that fails on a side: recorded, the next
                            row = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", "acc": [], "at": []}
                        row = {"model": name, "side": side, "run": run, "machine": where, "beside": where["beside"],
                               "epochs": a.epochs, **row}
                        with a.out.open("a") as f:
                            f.write(json.dumps(row) + "\n")
                        accs = " ".join(f"{v:.1%}" for v in row["acc"])
                        print(f"run {run} {name:24s} {side:8s} {time.perf_counter() - t:6.0f}s  {accs}"
                              f"{'  ' + row['error'] if 'error' in row else ''}", flush=True)
    finally:
        if spin:
            spin.kill()
    print(report(_done(a.out, where)))


if __name__ == "__main__":
    main()

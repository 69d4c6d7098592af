"""Models nobody here wrote (torchvision, timm): `trainfast.fit` with its defaults against the
plain loop their users would write, from the same initial weights, side by side in one run.

    python benchmarks/bench_outside.py [--only tv_resnet18 timm_vit_tiny_32] [--epochs 5] [--json out.json]
    python benchmarks/bench_outside.py --data plates [--plates 6000] [--size 32x64]

  fit    trainfast.fit(model, train, test, epochs=N, device="cpu") and nothing else, with an
         empty trainfast cache (its tune is paid as a first run pays it)
  plain  AdamW (lr 1e-3, torch's default weight decay), fp32, batch 64, shuffled, the same
         epochs; model.train() each epoch, held-out accuracy after each

Data: scikit-learn's digits at 32×32 RGB, 80/20 split (1,437 / 360 images); or the demo's
plate photos (`--data plates`: 6,000 to train, 1,500 held out, packed at 32×64; each model's
backbone read by a per-position head at stride 8, outside_models.plate_reader: (N, 8, 36)
logits, 8 characters of 36; accuracy is of the characters, as fit's val_acc). Reported per
model: held-out accuracy at the end on each side; the wall time (from the call, setup and
tuning included, each epoch's evaluation too) until the held-out accuracy first reaches the
plain loop's final one, on each side; median training images/s. The two sides alternate per
model, plain first, so that a slow spell of a shared machine falls on both.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import outside_models  # noqa: E402


def _digits(tmp: Path):
    import trainfast
    from trainfast.datasets.digits import load_digits, split

    x, y, _ = load_digits(32)
    xtr, ytr, xte, yte = split(x, y, 0.2, seed=0)
    return (trainfast.pack((xtr, ytr), tmp / "train", size=(32, 32), progress=False, overwrite=True),
            trainfast.pack((xte, yte), tmp / "test", size=(32, 32), progress=False, overwrite=True))


def _plates(tmp: Path, n: int, size: tuple[int, int]):
    """The demo's plate photos (seed 0 train, 1 held out), packed at `size`: 8 characters of 36."""
    import trainfast
    from trainfast.datasets.plates import make_plates

    packs = []
    for split, count, seed in (("train", n, 0), ("test", max(n // 4, 200), 1)):
        src = make_plates(tmp / f"plates-{split}", count, seed)
        packs.append(trainfast.pack(src / "labels.csv", tmp / split, size=size, label_column="plate",
                                    progress=False, overwrite=True))
    return packs


def _arrays(pk):
    x = torch.from_numpy(np.stack([pk.image(i) for i in range(len(pk))])).permute(0, 3, 1, 2).contiguous()
    return x, torch.from_numpy(np.array(pk.labels, dtype=np.int64))


def _accuracy(net, x, y, mean=(0.0,), std=(1.0,)) -> float:
    """Held-out accuracy, the inputs as (x/255 - mean) / std: of the classes, or of the characters
    where labels are sequences (as fit's val_acc)."""
    from trainfast.step import logits_of

    m, s = torch.tensor(mean).view(1, -1, 1, 1), torch.tensor(std).view(1, -1, 1, 1)
    net.eval()
    with torch.no_grad():
        right = sum(int((logits_of(net((x[i:i + 256].float() / 255 - m) / s)).argmax(-1) == y[i:i + 256]).sum())
                    for i in range(0, len(x), 256))
    net.train()
    return right / y.numel()


def _loss(out, y):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def run_epochs(net, xtr, ytr, epochs: int, batch: int, seed: int, step, score, start: float) -> dict:
    """`epochs` passes over (xtr, ytr) in full batches of `batch`, reshuffled each (seed), step(x, y)
    per batch (x uint8); score() after each: {"acc": per epoch, "at": seconds from `start` per
    epoch, "images_per_s": the median epoch's training rate}."""
    g = torch.Generator().manual_seed(seed)
    accs, at, rates = [], [], []
    for _ in range(epochs):
        net.train()
        t = time.perf_counter()
        order = torch.randperm(len(xtr), generator=g)
        steps = len(xtr) // batch
        for i in range(steps):
            idx = order[i * batch:(i + 1) * batch]
            step(xtr[idx], ytr[idx])
        rates.append(steps * batch / (time.perf_counter() - t))
        accs.append(score())
        at.append(time.perf_counter() - start)
    return {"acc": accs, "at": at, "images_per_s": statistics.median(rates)}


def plain(net, train, test, epochs: int, seed: int = 0) -> dict:
    """The loop a user writes: AdamW 1e-3, fp32, batch 64, reshuffled each epoch."""
    from trainfast.step import logits_of

    start = time.perf_counter()
    xtr, ytr = _arrays(train)
    xte, yte = _arrays(test)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step(x, y):
        loss = _loss(logits_of(net(x.float() / 255)), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return run_epochs(net, xtr, ytr, epochs, 64, seed, step, lambda: _accuracy(net, xte, yte), start)


def with_fit(net, train, test, epochs: int, cache: Path, **kw) -> dict:
    import trainfast

    os.environ["TRAINFAST_CACHE"] = str(cache)  # empty: the tune is paid as a first run pays it
    start, at, lines = time.perf_counter(), [], []

    def log(msg):
        lines.append(str(msg))
        if "Starting over from the first weights" in str(msg):
            at.clear()  # the history is the second attempt's: its epochs' times, counted from the call
        if str(msg).startswith("epoch "):
            at.append(time.perf_counter() - start)
    try:
        r = trainfast.fit(net, train, test, epochs=epochs, device="cpu", run_dir=cache / "run", progress=False,
                          log=log, **kw)
    except trainfast.TrainfastError as e:
        return {"error": str(e), "acc": [], "at": [], "images_per_s": None, "log": lines}
    return {"acc": [row["val_acc"] for row in r.history], "at": at, "log": lines, "speed": r.speed.label(),
            "images_per_s": statistics.median(row["images_per_s"] for row in r.history)}


def time_to(side: dict, target: float) -> float | None:
    return next((t for a, t in zip(side["acc"], side["at"]) if a >= target - 1e-9), None)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="panel members to run (default: all)")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--data", choices=["digits", "plates"], default="digits",
                    help="digits at 32×32 (10 classes), or the demo's plate photos (8 characters of 36; each model "
                         "backbone read at stride 8 by a per-position head: outside_models.plate_reader)")
    ap.add_argument("--plates", type=int, default=6000, help="training plates (held out: a quarter, at least 200)")
    ap.add_argument("--size", default="32x64", help="the plates' packed size, HxW")
    a = ap.parse_args(argv)
    tv, timm = outside_models.import_libraries()
    if tv is None or timm is None:
        raise SystemExit("needs torchvision and timm (pip install torch==2.13.0 timm)")
    names = a.only or list(outside_models.PANEL)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if a.data == "plates":
            h, w = (int(v) for v in a.size.lower().split("x"))
            train, test = _plates(tmp, a.plates, (h, w))
            length, classes = train.sequence_length, len(train.alphabet)

            def build(name):
                return outside_models.plate_reader(name, length, classes, (h, w))
        else:
            train, test = _digits(tmp)

            def build(name):
                return outside_models.PANEL[name](10)
        print(f"torch {torch.__version__}, torchvision {tv.__version__}, timm {timm.__version__}; "
              f"{torch.get_num_threads()} threads; {a.data} {'×'.join(map(str, train.shape))}: {len(train)} train, "
              f"{len(test)} test; {a.epochs} epochs", flush=True)
        head = (f"{'model':28s} {'plain acc':>9s} {'fit acc':>8s} {'plain to it':>11s} {'fit to it':>9s} "
                f"{'time ratio':>10s} {'plain img/s':>11s} {'fit img/s':>9s}  fit chose")
        print(head, flush=True)
        for name in names:
            torch.manual_seed(0)
            first = build(name)
            state = copy.deepcopy(first.state_dict())
            try:
                p = plain(first, train, test, a.epochs)
            except Exception as e:  # noqa: BLE001 - a model that does not take these images: said, and the next
                p = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
            again = build(name)
            again.load_state_dict(state)  # the same initial weights on both sides
            f = with_fit(again, train, test, a.epochs, tmp / f"cache-{name}")
            if "error" in p:
                results[name] = {"plain": p, "fit": f}
                print(f"{name:28s} plain loop: {p['error']}; fit: {f.get('error', 'trained')[:150]}", flush=True)
                continue
            target = p["acc"][-1]
            tp, tf = time_to(p, target), time_to(f, target)
            ratio = f"{tf / tp:.2f}×" if tf and tp else "never" if tp else "—"
            results[name] = {"plain": p, "fit": f, "target": target, "plain_s": tp, "fit_s": tf}
            fit_acc = f"{f['acc'][-1]:.1%}" if f["acc"] else "error"
            rate = f"{f['images_per_s']:.0f}" if f["images_per_s"] else "—"
            print(f"{name:28s} {target:9.1%} {fit_acc:>8s} {tp:10.1f}s {(f'{tf:.1f}s' if tf else '—'):>9s} "
                  f"{ratio:>10s} {p['images_per_s']:11.0f} {rate:>9s}  {f.get('speed', f.get('error', ''))[:90]}",
                  flush=True)
    both = {n: r for n, r in results.items() if "target" in r}  # both sides trained
    ok = [n for n, r in both.items() if r["fit"]["acc"] and r["fit"]["acc"][-1] >= r["target"] - 0.01]
    faster = [n for n, r in both.items() if r["fit_s"] is not None and r["fit_s"] <= r["plain_s"]]
    print(f"fit's held-out accuracy ≥ the plain loop's − 1 point: {len(ok)} of {len(both)}; "
          f"at the plain loop's final accuracy no later than it: {len(faster)} of {len(both)}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

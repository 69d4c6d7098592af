"""Why the plate story's exact CNN (`plate_cnn`) does not learn: its eight per-position
numbers, watched while a plain loop trains it (docs/MODELS.md has the runs).

    python benchmarks/study_plate_cnn.py [--init torch|keras] [--head random|ordinal]
        [--optimizer adam|sgd] [--lr 1e-3] [--epochs 2] [--schedule constant|cosine] [--seed 0]
    python benchmarks/study_plate_cnn.py --lines     # how many of 36 random lines are ever on top

Each position reads its character from one number s (Dense 8 + ReLU), through 36 lines
a_k·s + b_k (Dense 1→36). Every quarter epoch this prints the training loss, the held-out
character accuracy, and per number: the share of held-out images where it is alive (s > 0)
and its spread across them (standard deviation). `--init keras`: Glorot weights, zero biases,
as the story's Keras model started. `--head ordinal`: the 36 lines set to a_k = k, b_k = -k²/2
(class k on top where s is nearest k) and the eight numbers' bias to 17.5, so all start alive:
what one number per position can carry once the head is not random. The data: the demo's
plates, 20,000 to train and 1,000 held out (made under --plates if missing, as
bench_defaults.py makes them). bf16 autocast + channels_last on the CPU; no augmentation.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

ALPHABET = 36


def _lines_on_top(seeds: int = 20) -> list[int]:
    """For PyTorch's initialisation of Linear(1, 36): how many classes are ever on top for s in [0, 50]."""
    import torch
    s = torch.linspace(0, 50, 20001).view(-1, 1)
    out = []
    for seed in range(seeds):
        torch.manual_seed(seed)
        with torch.no_grad():
            out.append(len(set(torch.nn.Linear(1, ALPHABET)(s).argmax(1).tolist())))
    return sorted(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--init", choices=["torch", "keras"], default="torch")
    p.add_argument("--head", choices=["random", "ordinal"], default="random")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--schedule", choices=["constant", "cosine"], default="constant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plates", type=Path, default=Path("bench-data/plates-defaults"),
                   help="folder for the generated plates and their packs (made if missing)")
    p.add_argument("--lines", action="store_true", help="only count the lines on top at initialisation, 20 seeds")
    a = p.parse_args()
    if a.lines:
        counts = _lines_on_top()
        print(f"classes ever on top of Linear(1, 36) at PyTorch's initialisation, s in [0, 50], 20 seeds: {counts}")
        return

    import numpy as np
    import torch
    import torch.nn.functional as F
    from bench_defaults import _packs

    from trainfast.models import create
    train, test = _packs("plate_cnn", a, None)

    def tensors(pk):
        x = torch.from_numpy(np.array(pk.images)).permute(0, 3, 1, 2)  # uint8, channels_last memory
        return x, torch.from_numpy(np.array(pk.labels))
    (x_tr, y_tr), (x_te, y_te) = tensors(train), tensors(test)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) * 255 for v in (train.mean, train.std))

    def norm(x):
        return ((x.float() - mean) / std).contiguous(memory_format=torch.channels_last)

    torch.manual_seed(a.seed)
    net = create("plate_cnn").to(memory_format=torch.channels_last)
    if a.init == "keras":
        for m in net.modules():
            if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
                torch.nn.init.xavier_uniform_(m.weight)
                torch.nn.init.zeros_(m.bias)
    if a.head == "ordinal":
        with torch.no_grad():
            k = torch.arange(float(ALPHABET))
            net.per_position.weight.copy_(k.view(-1, 1))
            net.per_position.bias.copy_(-k * k / 2)
            net.dense2.bias.fill_((ALPHABET - 1) / 2)
    opt = (torch.optim.Adam(net.parameters(), lr=a.lr) if a.optimizer == "adam" else
           torch.optim.SGD(net.parameters(), lr=a.lr, momentum=0.9, nesterov=True))

    def numbers(x):
        """The eight per-position numbers before their ReLU."""
        return net.dense2(torch.relu(net.dense1(net.dropout(net.flatten(net.features(x))))))

    @torch.no_grad()
    def held_out():
        net.eval()
        hits, pre = 0, []
        for i in range(0, len(x_te), 250):
            with torch.autocast("cpu", torch.bfloat16):
                s = numbers(norm(x_te[i:i + 250])).float()
                out = net.per_position(torch.relu(s).unsqueeze(-1)).float()
            hits += int((out.argmax(-1) == y_te[i:i + 250]).sum())
            pre.append(s)
        net.train()
        s = torch.cat(pre)
        return hits / y_te.numel(), (s > 0).float().mean(0).tolist(), torch.relu(s).std(0).tolist()

    def report(step, steps_per_epoch, loss, t0):
        acc, alive, spread = held_out()
        print(f"{time.perf_counter() - t0:6.0f} s  epoch {step / steps_per_epoch:5.2f}  "
              f"loss {'—' if loss is None else f'{loss:.3f}':>6s}  "
              f"held-out {acc:6.2%}  alive {' '.join(f'{v:.2f}' for v in alive)}  "
              f"spread {' '.join(f'{v:.3f}' for v in spread)}", flush=True)

    print(f"# plate_cnn, init {a.init}, head {a.head}, {a.optimizer} lr {a.lr:g} ({a.schedule}), batch {a.batch_size}, "
          f"{a.epochs:g} epochs, seed {a.seed}; {len(x_tr):,} plates, {len(x_te):,} held out")
    steps_per_epoch = len(x_tr) // a.batch_size
    total, step, smooth = int(a.epochs * steps_per_epoch), 0, None
    order = torch.Generator().manual_seed(a.seed)
    t0 = time.perf_counter()
    report(0, steps_per_epoch, None, t0)
    while step < total:
        perm = torch.randperm(len(x_tr), generator=order)
        for j in range(min(steps_per_epoch, total - step)):
            idx = perm[j * a.batch_size:(j + 1) * a.batch_size]
            if a.schedule == "cosine":
                for g in opt.param_groups:
                    g["lr"] = a.lr * 0.5 * (1 + math.cos(math.pi * step / total))
            with torch.autocast("cpu", torch.bfloat16):
                out = net(norm(x_tr[idx]))
            loss = F.cross_entropy(out.float().reshape(-1, ALPHABET), y_tr[idx].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
            step += 1
            if step % max(1, steps_per_epoch // 4) == 0:
                report(step, steps_per_epoch, smooth, t0)


if __name__ == "__main__":
    main()

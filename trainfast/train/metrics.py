"""Accuracy for classes and for sequences (per character and whole sequence), the metrics
CSV, and the PNG curves of loss and accuracy.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import torch

from trainfast import files


def correct(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(correct items, correct whole sequences) as a float64 tensor on the output's device, so
    that summing them never waits for the device; the items are target.numel(). Classes count
    each image once; sequences (B, L, K) count each position, and whole sequences separately."""
    hit = output.argmax(-1) == target
    whole = hit.all(1) if hit.dim() == 2 else hit
    return torch.stack([hit.sum(), whole.sum()]).double()


def sequence_errors(pred, true, alphabet: str, groups=None, top: int = 10) -> dict:
    """Where a sequence reader's errors are, from its predictions `pred` and the labels `true`
    ((N, L) integer arrays over `alphabet`): accuracy per character, per whole sequence and per
    position; the `top` most frequent (true, predicted) character pairs among the errors with
    their share of all errors; each character's error rate (the share of its occurrences read
    wrong, hardest first); and, given a group name per sequence (e.g. the font it was drawn
    in), the same accuracies per group."""
    import numpy as np

    pred, true = np.asarray(pred), np.asarray(true)
    hit = pred == true
    wrong = ~hit
    pairs: dict[tuple[str, str], int] = {}
    for t, p in zip(true[wrong].tolist(), pred[wrong].tolist()):
        pairs[alphabet[t], alphabet[p]] = pairs.get((alphabet[t], alphabet[p]), 0) + 1
    errors = int(wrong.sum())
    out = {"sequences": int(len(true)), "characters": int(hit.size), "errors": errors,
           "character_accuracy": float(hit.mean()), "sequence_accuracy": float(hit.all(1).mean()),
           "per_position": hit.mean(0).tolist(),
           "confusions": [{"true": t, "predicted": p, "count": c, "share_of_errors": c / max(errors, 1)}
                          for (t, p), c in sorted(pairs.items(), key=lambda kv: -kv[1])[:top]],
           "per_character": sorted(({"character": alphabet[k], "count": int((true == k).sum()),
                                     "error_rate": float(wrong[true == k].mean())}
                                    for k in range(len(alphabet)) if (true == k).any()),
                                   key=lambda r: -r["error_rate"])}
    if groups is not None:
        groups = np.asarray(groups)
        out["groups"] = {str(g): {"sequences": int((groups == g).sum()),
                                  "character_accuracy": float(hit[groups == g].mean()),
                                  "sequence_accuracy": float(hit[groups == g].all(1).mean())}
                         for g in sorted(set(groups.tolist()))}
    return out


COLUMNS = ["epoch", "train_loss", "train_acc", "val_loss", "val_acc", "val_seq_acc", "lr", "images_per_s", "seconds",
           "other_cores", "threads"]  # the load other processes put on the CPU during the epoch; torch's threads


class MetricsLog:
    """metrics.csv in the run directory: one row per epoch, rewritten on resume."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.rows: list[dict] = []

    def load(self, upto_epoch: int) -> None:
        """Keep the rows of epochs before `upto_epoch` (a resumed run rewrites the rest)."""
        if self.path.exists():
            with open(self.path, newline="") as f:
                rows = [{k: int(float(v)) if k == "epoch" else float(v) for k, v in r.items() if v != ""}
                        for r in csv.DictReader(f)]
            self.rows = [r for r in rows if r["epoch"] < upto_epoch]
        self._write()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self._write()

    def _write(self) -> None:
        text = io.StringIO(newline="")
        w = csv.DictWriter(text, COLUMNS)
        w.writeheader()
        for r in self.rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})
        files.write_text(self.path, text.getvalue())


def plot_curves(rows: list[dict], path: Path, sequence: bool) -> None:
    from matplotlib.figure import Figure  # NOTE: not pyplot: a notebook's plotting backend stays the user's

    if not rows:
        return
    ep = [r["epoch"] + 1 for r in rows]
    fig = Figure(figsize=(10, 3.5))
    a, b = fig.subplots(1, 2)
    a.plot(ep, [r["train_loss"] for r in rows], "o-", label="train")
    val = all("val_loss" in r for r in rows)  # no validation with val_fraction=0 and no val pack
    if val:
        a.plot(ep, [r["val_loss"] for r in rows], "o-", label="validation")
    a.set_xlabel("epoch"), a.set_ylabel("loss"), a.legend(), a.set_title("loss")
    b.plot(ep, [r["train_acc"] for r in rows], "o-", label="train" + (" (per character)" if sequence else ""))
    if val:
        b.plot(ep, [r["val_acc"] for r in rows], "o-", label="validation" + (" (per character)" if sequence else ""))
    if val and sequence:
        b.plot(ep, [r["val_seq_acc"] for r in rows], "o-", label="validation (whole sequence)")
    b.set_xlabel("epoch"), b.set_ylabel("accuracy"), b.set_ylim(0, 1), b.legend(), b.set_title("accuracy")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    files.write_whole(path, lambda f: f.write(png.getvalue()))

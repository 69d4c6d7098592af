"""`trainfast demo`: the whole story on built-in data, in a few minutes on 2 CPU cores.

1. make synthetic plate photos (train and held-out), as a user of the plate story has them;
2. run the doctor on the pipeline users write — decode + resize every image, every batch,
   in a Python Sequence — with the users' plate CNN: input-bound, with numbers;
3. pack the photos once; run the doctor on the pack: no longer input-bound;
4. tune the better plate model on this machine, train it on the pack, and report per-
   character and whole-plate accuracy on the held-out plates;
5. write an HTML report with the doctor's charts, the training curves and sample plates
   with predictions, and say what the same epochs would have cost on the users' pipeline.
"""

from __future__ import annotations

import base64
import html
import io
import json
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from trainfast import models, units
from trainfast.config import Augment, Speed, TrainConfig, scale_lr
from trainfast.data.format import Pack
from trainfast.data.loader import Loader
from trainfast.data.naive import PerImageBatches
from trainfast.data.pack import pack
from trainfast.data.sources import from_csv
from trainfast.datasets.plates import is_current, make_plates
from trainfast.diagnose import doctor
from trainfast.diagnose.report import REPORT_CSS, advice_html, layer_chart, step_chart
from trainfast.errors import TrainfastError
from trainfast.train import fit
from trainfast.train.distributed import World
from trainfast.train.evaluate import evaluate
from trainfast.tuning import data_max_batch, more_steps_unless_faster, tune

LR, LR_BATCH = 3e-3, 64  # plate_net's AdamW learning rate, measured at batch 64 (docs/MODELS.md)
@dataclass
class DemoConfig:
    out: str = "trainfast-demo"
    """Folder for the photos, packs, run directory and report."""
    train: int = 20000
    """Training plates."""
    test: int = 1000
    """Held-out plates."""
    epochs: int = 0
    """Training epochs for the better model; 0: as many as the time budget allows (MIN_EPOCHS to MAX_EPOCHS)."""
    minutes: float = 0.0
    """The demo's wall-clock budget; 0: BUDGET_MINUTES for the device."""
    doctor_steps: int = 10
    """Timed steps per doctor run."""
    device: str | None = None
    seed: int = 0


QUICK = dict(train=1500, test=300, epochs=2, doctor_steps=3)
BUDGET_MINUTES = {"cpu": 5.0, "cuda": 1.0}  # the whole demo, on this kind of device
MIN_EPOCHS, MAX_EPOCHS = 10, 40
EPOCH_OVERHEAD = 1.3  # an epoch's wall time over images / tune's rate (validation, augmentation, the Loader)
RESERVE_S = 15.0  # kept for the final evaluation and the report
TUNE_SHARE = 0.25  # of the demo's budget, at most, for tune (on an H200 an unbounded tune took 47 s of 60)


def budget_minutes(cfg: "DemoConfig", device: torch.device) -> float:
    return cfg.minutes or BUDGET_MINUTES.get(device.type, BUDGET_MINUTES["cpu"])


def budget_epochs(cfg: "DemoConfig", device: torch.device, elapsed_s: float, images_per_s: float) -> tuple[int, str]:
    """Epochs that fit the rest of the demo's budget at tune's measured rate; and why, in words.

    On 2 cores the plate reader gained from more epochs: 98.4% / 88.8% of held-out characters /
    whole plates after 10 (median of 3 seeds), 99.0% / 92.2% after 16 (seed 0)."""
    minutes = budget_minutes(cfg, device)
    epoch_s = cfg.train / images_per_s * EPOCH_OVERHEAD
    left = minutes * 60 - elapsed_s - RESERVE_S
    epochs = int(min(MAX_EPOCHS, max(MIN_EPOCHS, left // epoch_s)))
    return epochs, (f"{epochs} epochs: about {epoch_s:.1f} s each at the tuned rate, {max(left, 0):.0f} s left of "
                    f"the demo's {minutes:g} minutes (at least {MIN_EPOCHS}, at most {MAX_EPOCHS})")


OVERRUN = 1.3  # the most the demo may run over its budget: the planned epochs' floor (MIN_EPOCHS) included


def training_minutes(cfg: "DemoConfig", device: torch.device, elapsed_s: float, epochs: int, epoch_s: float) -> float:
    """fit's time budget for the demo's training: the planned epochs at the planned rate, with
    15% to spare, or the rest of the demo's budget if that is longer; never past OVERRUN × the
    budget. Epochs slower than planned (other programs took cores) shorten the run rather
    than the demo's promise of a few minutes."""
    budget_s = 60 * budget_minutes(cfg, device)
    left = budget_s - elapsed_s - RESERVE_S
    cap = OVERRUN * budget_s - elapsed_s - RESERVE_S
    return max(min(max(left, 1.15 * epochs * epoch_s), cap), 0.0) / 60 or 1e-3  # spent: one epoch, then stop


def _reader() -> str:
    """The story's own reader (skimage) when installed (`pip install torch==2.13.0 -e ".[demo]"`), else Pillow."""
    import importlib.util

    return "skimage" if importlib.util.find_spec("skimage") else "pil"


_MARK = ".trainfast-demo"  # in a folder the demo made: it may replace what it wrote there


def _demo_folder(out: Path) -> Path:
    """OUT, created with the demo's mark; an existing folder only if it is empty or a demo's."""
    ours = (out / _MARK).is_file() or (out / "plates-train" / "labels.csv").is_file()  # or an older demo's
    if out.exists() and not ours and (not out.is_dir() or any(out.iterdir())):
        raise TrainfastError(f"{out}: exists and is not a folder the demo made; the demo writes and replaces files "
                             "in its --out folder, so give it a new or empty one")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / _MARK).write_text("made by trainfast demo; it may replace what it wrote here\n")
    except OSError as e:
        raise TrainfastError(f"{out}: cannot write here ({e.strerror or e})") from None
    return out


def run_demo(cfg: DemoConfig, log=print) -> dict:
    """Run the demo; returns the summary (also written to OUT/summary.json)."""
    out = _demo_folder(Path(cfg.out))
    stages: dict[str, float] = {}
    started = time.perf_counter()

    @contextmanager
    def stage(name):
        log(f"\n== {name}")
        t = time.perf_counter()
        yield
        stages[name] = time.perf_counter() - t
        log(f"   ({stages[name]:.1f} s)")

    with stage("make plate photos"):
        for split, n, seed in (("train", cfg.train, cfg.seed), ("test", cfg.test, cfg.seed + 1)):
            if not is_current(out / f"plates-{split}", n, seed):  # else made by an earlier run, as asked now
                make_plates(out / f"plates-{split}", n, seed, progress=True)
        log(f"   {cfg.train} training and {cfg.test} held-out photos in {out}/plates-*/")

    reader = _reader()
    src = from_csv(out / "plates-train" / "labels.csv", label_column="plate")
    with stage("doctor: the users' pipeline (decode + resize per image, every batch) with plate_cnn"):
        users = PerImageBatches(src, (64, 128), 128, reader=reader)
        before = doctor("plate_cnn", users, batch_size=128, steps=cfg.doctor_steps, warmup=1, device=cfg.device,
                        ceiling=False, log=lambda m: log("   " + m))  # the data's story: kept short
        log(before.text())

    with stage("pack the photos once"):
        train_pk = pack(out / "plates-train" / "labels.csv", out / "train.pack", size=(64, 128),
                        label_column="plate", label_kind="sequence", log=log)
        test_pk = pack(out / "plates-test" / "labels.csv", out / "test.pack", size=(64, 128),
                       label_column="plate", label_kind="sequence", log=log)

    with stage("doctor: the same model on the pack"):
        after = doctor("plate_cnn", train_pk, batch_size=128, steps=cfg.doctor_steps, warmup=1, device=cfg.device,
                       try_fixes=False, ceiling=False, log=lambda m: log("   " + m))
        log(f"   VERDICT {after.verdict.sentence}")
        log(f"   data wait {units.ms(after.times.data)} ms per step (was {units.ms(before.times.data)} ms); "
            f"{units.rate(after.times.images_per_s)} images/s (was {units.rate(before.times.images_per_s)})")

    with stage("tune plate_net on this machine (torch.compile left out to keep the demo short)"):
        tuned, speed, lr, cfg, minutes, planned_epoch_s = _plan(cfg, before, started, log)
    planned = cfg.epochs

    with stage(f"train plate_net for {cfg.epochs} epochs"):
        run_dir = out / "run"
        if run_dir.exists():
            import shutil
            shutil.rmtree(run_dir)
        result = fit("plate_net", train_pk, test_pk, speed=speed, run_dir=run_dir,
                     config=TrainConfig(epochs=cfg.epochs, optimizer="adamw", lr=lr, seed=cfg.seed, minutes=minutes),
                     augment=Augment(translate=2), device=cfg.device, log=lambda m: log("   " + m))

    net = models.create("plate_net")
    net.load_state_dict(torch.load(run_dir / "best.pt", map_location="cpu", weights_only=True)["model"])
    dev = before.system["device"]
    final = evaluate(net.to(dev), Loader(test_pk, 100, shuffle=False, device=dev, normalize=train_pk), speed,
                     torch.device(dev), World(device=torch.device(dev)))
    errors = held_out_errors(net, test_pk, train_pk, speed, torch.device(dev), out / "plates-test" / "labels.csv")
    summary = _summary(cfg, stages, reader, before, after, speed, result, final, errors, planned, planned_epoch_s)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "report.html").write_text(_html(summary, before, after, tuned, speed, result, test_pk, net, dev))
    _say_result(cfg, summary, final, errors, test_pk, reader, log)
    log(f"   report: {out / 'report.html'}")
    return summary


def _plan(cfg: DemoConfig, before, started: float, log):
    """plate_net tuned here, and the run planned from it: (the tune result, the speed, the
    learning rate for its batch, the config with its epochs, fit's minutes, the planned epoch's
    seconds)."""
    tuned = tune(models.create("plate_net"), (3, 64, 128), device=cfg.device, max_batch=data_max_batch(cfg.train),
                 max_seconds=TUNE_SHARE * 60 * budget_minutes(cfg, torch.device(before.system["device"])),
                 try_compile=False, log=lambda m: log("   " + m))
    log(tuned.table())
    speed, why = more_steps_unless_faster(tuned, floor=LR_BATCH)
    if why:
        log(f"   {why}")
    lr = scale_lr("adamw", LR, LR_BATCH, speed.batch_size)
    if speed.batch_size != LR_BATCH:
        log(f"   batch {LR_BATCH} → {speed.batch_size}: AdamW's learning rate {LR:g} → {lr:.2g} "
            f"(× the square root of the batch ratio)")
    minutes, planned_epoch_s = 0.0, None  # fit's own budget: the epochs follow the rate they train at
    if not cfg.epochs:
        timed = [r.images_per_s for r in tuned.rows if r.images_per_s]
        rate = statistics.median([r.images_per_s for r in tuned.rows
                                  if r.images_per_s and r.speed.label() == speed.label()] or timed)
        device = torch.device(before.system["device"])
        epochs, why = budget_epochs(cfg, device, time.perf_counter() - started, rate)
        cfg = replace(cfg, epochs=epochs)
        log(f"   {why}")
        planned_epoch_s = cfg.train / rate * EPOCH_OVERHEAD
        minutes = training_minutes(cfg, device, time.perf_counter() - started, epochs, planned_epoch_s)
    return tuned, speed, lr, cfg, minutes, planned_epoch_s


def _summary(cfg, stages, reader, before, after, speed, result, final, errors, planned, planned_epoch_s) -> dict:
    """What the demo measured, as summary.json holds it."""
    epoch_s = statistics.median(r["seconds"] for r in result.history)  # one slow spell of a shared machine is not the rate
    users_epoch_s = cfg.train / before.times.images_per_s
    loads = [r["other_cores"] for r in result.history if r.get("other_cores") is not None]
    train_load = statistics.median(loads) if loads else None
    trained_epochs = len(result.history)
    return {
        "per_character_accuracy": final["acc"], "whole_plate_accuracy": final["seq_acc"],
        "stages_s": stages, "reader": reader,
        "users_pipeline": {"verdict": before.verdict.sentence, "images_per_s": before.times.images_per_s,
                           "data_share": before.times.share("data"), "epoch_s": users_epoch_s},
        "on_pack": {"verdict": after.verdict.sentence, "images_per_s": after.times.images_per_s,
                    "data_share": after.times.share("data")},
        "tuned": asdict(speed), "epoch_s": epoch_s,
        "pack_s": stages["pack the photos once"],
        "same_epochs_on_users_pipeline_s": users_epoch_s * trained_epochs,
        "trainfast_train_s": stages[f"train plate_net for {cfg.epochs} epochs"],
        "config": asdict(cfg), "errors": errors, "planned_epochs": planned, "trained_epochs": trained_epochs,
        "other_cores": {"users_pipeline": before.other_load, "training": train_load},
        "planned_epoch_s": planned_epoch_s,
    }


def _say_result(cfg: DemoConfig, summary: dict, final: dict, errors, test_pk, reader, log):
    """The result in words: the held-out accuracy (and whether it is near chance), the errors, the speed."""
    log("\n== result")
    log(f"   held-out plates: {final['acc']:.1%} of characters, {final['seq_acc']:.1%} of whole plates right")
    if final["acc"] < 2 / len(test_pk.alphabet):  # still near chance: say so rather than let the number stand alone
        log(f"   that is near chance (1 in {len(test_pk.alphabet)}): {cfg.epochs} epochs of {cfg.train:,} plates are too "
            "few to learn them" + (" (--quick checks the pipeline, not the result; `trainfast demo` without it "
                                   "trains for its time budget)" if cfg.train < DemoConfig.train else ""))
    for line in _error_lines(errors):
        log("   " + line)
    for line in _speed_lines(summary, reader):
        log("   " + line)


def _speed_html(s: dict) -> str:
    lines = _speed_lines(s, s["reader"])
    if s["trained_epochs"] == s["planned_epochs"] and len(lines) == 2:  # both sides on a quiet machine
        return (f"One epoch of {s['config']['train']} plates took <b>{s['epoch_s']:.1f} s</b> with trainfast "
                f"({html.escape(Speed(**s['tuned']).label())}); the users' pipeline (per-image {s['reader']} decode + "
                f"resize, plate CNN, fp32) runs at {units.rate(s['users_pipeline']['images_per_s'])} images/s, i.e. "
                f"<b>{s['users_pipeline']['epoch_s']:.0f} s</b> per epoch. {s['trained_epochs']} epochs: "
                f"{s['trainfast_train_s']:.0f} s, plus {s['pack_s']:.0f} s to pack once, vs "
                f"{s['same_epochs_on_users_pipeline_s']:.0f} s.")
    return "<br>".join(html.escape(line[0].upper() + line[1:]) for line in lines)


def _speed_lines(s: dict, reader: str) -> list[str]:
    """The demo's speed comparison, in words: side by side where both sides ran on a quiet
    machine; each with the load it saw, and no comparison, where other processes held cores
    during either (measured minutes apart, at different loads, they would not compare)."""
    from trainfast.hardware import is_busy, usable_cores

    users, ours = s["other_cores"]["users_pipeline"], s["other_cores"]["training"]
    trained = s["trained_epochs"]
    lines = []
    if trained < s["planned_epochs"]:
        plan = s.get("planned_epoch_s")
        why = (f"they trained slower than planned ({s['epoch_s']:.1f} s each against {plan:.1f} s)"
               if plan and s["epoch_s"] > 1.1 * plan else
               f"at least {s['planned_epochs']} were planned for the result, and no more fit the demo's budget at "
               f"{s['epoch_s']:.1f} s each")
        lines.append(f"the time budget cut the run to {trained} of the {s['planned_epochs']} planned epochs: {why}")
    if not (is_busy(users) or is_busy(ours)):
        return lines + [
            f"one epoch (median): {s['epoch_s']:.1f} s with trainfast, {s['users_pipeline']['epoch_s']:.0f} s on the "
            f"users' pipeline and model ({reader} per image, fp32)",
            f"{trained} epochs: {s['trainfast_train_s']:.0f} s + {s['pack_s']:.0f} s to pack once, vs "
            f"{s['users_pipeline']['epoch_s'] * trained:.0f} s"]

    def load(c):
        return "not measurable here" if c is None else f"{c:.1f} of {usable_cores()} cores"
    return lines + [
        f"other processes kept cores busy during this demo (the users' pipeline: {load(users)}; training: "
        f"{load(ours)}): its timings are low, and the two sides are not compared",
        f"one epoch (median): {s['epoch_s']:.1f} s with trainfast; {s['users_pipeline']['epoch_s']:.0f} s on the "
        f"users' pipeline and model ({reader} per image, fp32), measured at another moment",
        "run it again on a quiet machine for the comparison"]


def held_out_errors(net, test_pk: Pack, train_pk: Pack, speed: Speed, dev: torch.device, labels_csv: Path) -> dict:
    """Where the reader's errors are on the held-out plates (trainfast.train.metrics.sequence_errors),
    by font where the plates' labels.csv records it."""
    import csv

    import numpy as np

    from trainfast import step as _step
    from trainfast.train.metrics import sequence_errors

    preds = []
    net.eval()
    with torch.no_grad(), _step.autocast(speed, dev):
        for x, _ in Loader(test_pk, 100, shuffle=False, drop_last=False, device=dev, normalize=train_pk):
            preds.append(net(x).argmax(-1).cpu())
    fonts = None
    if labels_csv.is_file():
        with open(labels_csv, newline="") as f:
            by_path = {row["path"]: row.get("font") for row in csv.DictReader(f)}
        fonts = [by_path.get(k) for k in test_pk.inputs]
        fonts = None if None in fonts else [Path(f).stem for f in fonts]
    return sequence_errors(torch.cat(preds).numpy(), np.asarray(test_pk.labels), test_pk.alphabet, fonts)


def _error_lines(e: dict) -> list[str]:
    lines = [f"errors on the {e['sequences']:,} held-out plates: {e['errors']:,} of {e['characters']:,} characters; "
             "right by position " + " ".join(f"{a:.1%}" for a in e["per_position"])]
    if e["confusions"]:
        lines.append("most confused (true → read, share of all errors): " + ", ".join(
            f"{c['true']}→{c['predicted']} {c['share_of_errors']:.0%}" for c in e["confusions"][:8]))
    hardest = [c for c in e.get("per_character", []) if c["error_rate"]][:6]
    if hardest:
        others = [c for c in e["per_character"] if c not in hardest]
        rest = sum(c["error_rate"] * c["count"] for c in others) / max(sum(c["count"] for c in others), 1)
        lines.append("read worst (share of each character's occurrences misread): " + ", ".join(
            f"{c['character']} {c['error_rate']:.1%}" for c in hardest) + f"; all others {rest:.1%}")
    for font, g in e.get("groups", {}).items():
        lines.append(f"  {font:24s} {g['sequences']:5d} plates: {g['character_accuracy']:.1%} of characters, "
                     f"{g['sequence_accuracy']:.1%} of plates")
    return lines


def _png(im) -> str:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _samples(pk: Pack, net, dev, n: int = 12):
    """A grid of held-out plates, each with its true and predicted text (red where wrong)."""
    from PIL import Image, ImageDraw, ImageFont

    from trainfast.datasets.plates import font_paths

    font = ImageFont.truetype(font_paths()[1], 15)
    x, y = next(iter(Loader(pk, n, shuffle=False, device=dev)))
    with torch.no_grad():
        pred = net.eval()(x).argmax(-1).cpu()
    tile_w, tile_h = 256, 128 + 44
    grid = Image.new("RGB", (tile_w * 4, tile_h * ((n + 3) // 4)), "white")
    draw = ImageDraw.Draw(grid)
    for i in range(n):
        gx, gy = (i % 4) * tile_w, (i // 4) * tile_h
        grid.paste(Image.fromarray(pk.image(i)).resize((256, 128)), (gx, gy))
        truth, guess = pk.label_text(y[i].cpu()), pk.label_text(pred[i])
        draw.text((gx + 4, gy + 130), f"true {truth}", fill="black", font=font)
        for j, ch in enumerate(guess):
            draw.text((gx + 4 + 50 + j * 10, gy + 150), ch, font=font,
                      fill="green" if ch == truth[j] else "red")
        draw.text((gx + 4, gy + 150), "pred", fill="black", font=font)
    return grid


def _html(s, before, after, tuned, speed, result, test_pk, net, dev) -> str:
    curves = base64.b64encode((result.run_dir / "curves.png").read_bytes()).decode()
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.1f} s</td></tr>" for k, v in s["stages_s"].items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>trainfast demo</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1050px;margin:2em auto;padding:0 1em}}
pre{{background:#f6f6f6;padding:1em;white-space:pre-wrap;overflow-wrap:anywhere;font-size:12px}} td{{padding:2px 10px}}
img,svg{{max-width:100%;height:auto}} .big{{font-size:1.3em}}</style></head><body>
<h1>trainfast demo: license plates</h1>
<p class="big">Held-out plates: <b>{s['per_character_accuracy']:.1%}</b> of characters and
<b>{s['whole_plate_accuracy']:.1%}</b> of whole plates read right.</p>
<p>{_speed_html(s)}</p>
<h2>1. The users' pipeline: {html.escape(before.verdict.sentence)}</h2>
<div class="tf-report"><style>{REPORT_CSS}</style>{advice_html(before)}</div>
<div>{step_chart(before)}</div><div>{layer_chart(before)}</div>
<h2>2. On the pack: {html.escape(after.verdict.sentence)}</h2>
<div>{step_chart(after)}</div>
<h2>3. Tuned settings</h2><pre>{html.escape(tuned.table())}</pre>
<h2>4. Training curves</h2><img alt="training curves" src="data:image/png;base64,{curves}">
<h2>5. Held-out plates and predictions</h2>
<img alt="sample plates" src="data:image/png;base64,{_png(_samples(test_pk, net, dev))}">
<h2>6. Where the errors are (the held-out plates)</h2><pre>{html.escape(chr(10).join(_error_lines(s['errors'])))}</pre>
<h2>Time per stage</h2><table>{rows}</table>
<details><summary>The doctor's full report on the users' pipeline</summary><pre>{html.escape(before.text())}</pre></details>
</body></html>
"""

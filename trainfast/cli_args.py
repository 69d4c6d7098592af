"""The `trainfast` command line's declarations: the commands, their options and help, and the
argument types that check a value where it is typed (cli.py runs the commands)."""

from __future__ import annotations

import argparse

from trainfast import __version__
from trainfast.config import OPTIMIZERS, PRECISIONS


def _dims(text: str, n: int, example: str) -> tuple[int, ...]:
    """'64x128' → (64, 128): n positive integers joined by x (or ×)."""
    try:
        values = tuple(int(p) for p in text.lower().replace("×", "x").split("x"))
    except ValueError:
        values = ()
    if n == 2 and len(values) == 1:
        values *= 2  # '32' is a square
    if len(values) != n or min(values) < 1:
        form = "HxW" if n == 2 else "CxHxW"
        raise argparse.ArgumentTypeError(f"{text!r} is not {form}, e.g. {example}")
    return values


def _csv_options(p: argparse.ArgumentParser) -> None:
    """The options of a CSV source, the same for `pack` and `doctor`."""
    p.add_argument("--path-column", default="path", help="CSV column of image paths (default: path)")
    p.add_argument("--label-column", default="label", help="CSV column of labels (default: label)")
    p.add_argument("--labels", choices=("auto", "class", "sequence"), default="auto", dest="label_kind",
                   help="CSV labels as class names or fixed-length sequences such as plates; auto decides "
                        "from the labels (default: auto)")
    p.add_argument("--alphabet", default="0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ",
                   help="characters of sequence labels (default: 0-9A-Z)")


def csv_values(a) -> dict:
    """The CSV options of pack and doctor, as the keyword arguments of open_source."""
    return {"path_column": a.path_column, "label_column": a.label_column, "label_kind": a.label_kind,
            "alphabet": a.alphabet}


def _size(text: str) -> tuple[int, int]:
    """'64x128' (height × width) or '32' (square) → (64, 128)."""
    return _dims(text, 2, "64x128")


def _size3(text: str) -> tuple[int, int, int]:
    return _dims(text, 3, "3x32x32")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ≥ 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _rewrites(text: str) -> tuple[str, ...]:
    """'all', 'none' or 'pool_before_relu,inplace_relu' → the pass names."""
    from trainfast.models import rewrite

    names = rewrite.ALL if text == "all" else () if text == "none" else tuple(n for n in text.split(",") if n)
    if reason := rewrite.check(names):
        raise argparse.ArgumentTypeError(reason)
    return names


def parser() -> argparse.ArgumentParser:
    """The `trainfast` command line: one builder per command below."""
    p = argparse.ArgumentParser(
        prog="trainfast",
        description="Fast image-CNN training, and numbers that say why yours was slow.",
        epilog="Run `trainfast COMMAND --help` for each command's options.")
    p.add_argument("--version", action="version", version=f"trainfast {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (_pack, _info, _doctor, _models, _tune, _train, _demo, _make_plates):
        add(sub)
    return p


def _pack(sub) -> None:
    pk = sub.add_parser(
        "pack", help="decode and resize a dataset once into a pack",
        description="Decode and resize every image once, in parallel, into a pack: plain .npy files "
                    "that trainfast.Loader (or numpy alone) streams at memory speed. Killed and rerun "
                    "with the same command, the build resumes where it stopped.",
        epilog="SOURCE kinds: an image folder with one subfolder per class; a CSV with a path and a label "
               "column (paths relative to the CSV's folder); a .npz with images and labels; a CIFAR-10/100 "
               "python tarball. Example: trainfast pack plates/train.csv plates.pack --size 64x128 "
               "--label-column plate")
    pk.add_argument("source", metavar="SOURCE", help="image folder, .csv, .npz or CIFAR .tar.gz")
    pk.add_argument("out", metavar="OUT", help="the pack's directory (created)")
    pk.add_argument("--size", type=_size, metavar="HxW",
                    help="target height x width, e.g. 64x128; needed for image files (a .npz or CIFAR keeps its own)")
    pk.add_argument("--resize", choices=("stretch", "fit", "crop"), default="stretch",
                    help="stretch ignores aspect; fit pads with black; crop centre-crops (default: stretch)")
    pk.add_argument("--channels", type=int, choices=(1, 3), default=3, help="3 = RGB, 1 = grayscale (default: 3)")
    pk.add_argument("--encoding", choices=("auto", "raw", "jpeg"), default="auto",
                    help="raw uint8 (fastest to read) or jpeg (small); auto: jpeg above 256x256 (default: auto)")
    pk.add_argument("--quality", type=int, default=90, help="JPEG quality with --encoding jpeg (default: 90)")
    pk.add_argument("--workers", type=int, default=0, help="decoding processes (default: all cores)")
    pk.add_argument("--on-error", choices=("skip", "fail"), default="skip",
                    help="skip bad inputs and list them, or stop and write nothing (default: skip)")
    pk.add_argument("--limit", type=int, default=0, metavar="N", help="pack only N inputs (a seeded random subset)")
    pk.add_argument("--seed", type=int, default=0, help="seed of the stored order (default: 0)")
    pk.add_argument("--overwrite", action="store_true",
                    help="replace a trainfast pack already at OUT (never anything else, nor a folder holding the source)")
    _csv_options(pk)
    pk.add_argument("--split", choices=("train", "test"), default="train", help="CIFAR split (default: train)")
    pk.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")


def _info(sub) -> None:
    info = sub.add_parser("info", help="describe a pack", description="Print what a pack holds.")
    info.add_argument("pack", metavar="PACK")


def _doctor(sub) -> None:
    dr = sub.add_parser(
        "doctor", help="find where the training time goes, and what to do",
        description="Time real training steps of MODEL on DATA, stage by stage (data wait, host→device copy, "
                    "forward, backward, optimizer), compare with what this machine can do, give a verdict "
                    "(input-, compute- or overhead-bound), and measure the candidate fixes on the spot.",
        epilog="MODEL: a built-in name (see `trainfast models`) or path/to/file.py:function_or_class returning "
               "an nn.Module. DATA: a pack, or an image folder / CSV, timed as the per-image pipeline users "
               "write. Example: trainfast doctor --model plate_cnn --data plates/labels.csv --label-column plate "
               "--batch-size 128\n\n"
               "Your own script, unedited: trainfast doctor [--steps N] [--seconds S] -- python train.py [ARGS]\n"
               "(or -- python -m package.module). It runs here with probes on the DataLoader, backward, the\n"
               "optimizer step and Keras fit, is stopped after N steps, and the report names the functions\n"
               "the data time goes to.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    dr.add_argument("--model", help="built-in name or file.py:function")
    dr.add_argument("--data", help="a pack, an image folder or a CSV")
    dr.add_argument("--batch-size", type=_positive_int, default=64, help="images per step (default: 64)")
    dr.add_argument("--steps", type=_positive_int, default=None,
                    help="timed steps after warm-up (default: 20; 50 for a script)")
    dr.add_argument("--seconds", type=_positive_float, default=120.0,
                    help="script mode: stop the script after this long at most (default: 120)")
    dr.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    dr.add_argument("--precision", choices=PRECISIONS, default="fp32",
                    help="settings to diagnose (default: fp32, PyTorch's default)")
    dr.add_argument("--channels-last", action="store_true", help="diagnose with channels_last memory")
    dr.add_argument("--no-fixes", action="store_true", help="skip measuring the candidate fixes")
    dr.add_argument("--no-ceiling", action="store_true",
                    help="skip timing each convolution and matmul alone (the kernels' ceiling the step is held to)")
    dr.add_argument("--remeasure", action="store_true", help="measure this machine's peaks again")
    _csv_options(dr)
    dr.add_argument("--json", metavar="FILE", help="also write the report as JSON (- for stdout)")
    dr.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report with charts")


def _models(sub) -> None:
    md = sub.add_parser("models", help="list the built-in models",
                        description="List the registered models with input and output shapes, parameters "
                                    "and forward FLOPs per image (counted with torch.utils.flop_counter).")
    md.add_argument("--names", action="store_true", help="names only")


def _tune(sub) -> None:
    tu = sub.add_parser(
        "tune", help="measure which speed settings are fastest here",
        description="Time a few training steps for each candidate setting — precision (fp32, bf16; tf32 and fp16 "
                    "on CUDA), channels_last, the exact model rewrites, batch size, CPU threads, torch.compile (with "
                    "CUDA graphs on CUDA) — and keep the fastest whose loss matches fp32's. Steps are timed back to "
                    "back, as training runs them. On CUDA the batch first grows until the time per image stops "
                    "falling, so that precisions are compared where the GPU is full, not where every setting waits "
                    "on kernel launches. The search is pruned; its leaders and the "
                    "winner's neighbours are timed again, round-robin, and the best median wins, so that one "
                    "lucky timing on a busy machine does not. The choice is cached per model, input shape, "
                    "device and torch version.",
        epilog="Example: trainfast tune --model cifar_cnn   or   trainfast tune --model plate_cnn --pack plates.pack")
    tu.add_argument("--model", required=True, help="built-in name or file.py:function")
    tu.add_argument("--pack", help="tune for this pack: its input shape, and a batch its images allow (as train bounds it)")
    tu.add_argument("--images", type=int, default=None, metavar="N",
                    help="training images per epoch: bounds the batch as train does (≥ 32 steps per epoch)")
    tu.add_argument("--input-shape", type=_size3, metavar="CxHxW", help="input shape, e.g. 3x32x32")
    tu.add_argument("--batch-size", type=int, help="pin the batch size (default: search powers of two)")
    tu.add_argument("--max-batch", type=int, default=None,
                    help="largest batch tried (default: 512 on a CPU, 8192 on CUDA, or until memory runs out)")
    tu.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    tu.add_argument("--no-compile", action="store_true", help="do not try torch.compile (slow to compile on CPU)")
    tu.add_argument("--no-rewrites", action="store_true", help="do not try the exact model rewrites "
                    "(pool_before_relu, inplace_relu, cheap_dropout; see docs/MODELS.md)")
    tu.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                    help="the optimizer the training will use: each timed step includes its update, whose cost per "
                         "image falls as the batch grows (default: adamw, as train's)")
    tu.add_argument("--retune", action="store_true", help="measure again instead of using the cached choice")
    tu.add_argument("--max-seconds", type=_positive_float, default=None, metavar="S",
                    help="stop timing new settings after S seconds and keep the fastest timed so far; what was "
                         "left out is listed under the table, and the choice is cached with its budget "
                         "(default: 60)")


def _train(sub) -> None:
    tr = sub.add_parser(
        "train", help="train a model on a pack with the fastest measured settings",
        description="Train MODEL on PACK with the settings `trainfast tune` measures fastest here (unless "
                    "--no-tune or pinned); where a larger batch runs clearly faster, the candidate batches first "
                    "train copies of the model for a few seconds each and the one at the lowest loss wins (at most "
                    "5% of the planned time). Without --lr the rate is the optimizer's default for the batch, lowered "
                    "where a short range test on your data shows it too high. Validates each "
                    "epoch, with a run directory holding the config, "
                    "metrics.csv, curves.png, speed.json and last/best checkpoints. Ctrl-C saves; --resume "
                    "continues, even after a kill. Under torchrun it trains with DDP.",
        epilog="Examples: trainfast train plates.pack --model plate_net --epochs 10\n"
               "torchrun --nproc_per_node 2 -m trainfast train cifar.pack --model cifar_resnet")
    tr.add_argument("pack", metavar="PACK", nargs="?", help="the training pack (omit with --resume)")
    tr.add_argument("--model", help="built-in name (see `trainfast models`)")
    tr.add_argument("--val", metavar="PACK", help="validation pack (default: hold out --val-fraction)")
    tr.add_argument("--run-dir", help="where outputs go (default: runs/MODEL-TIME)")
    tr.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    tr.add_argument("--epochs", type=_positive_int, default=None, help="(default: 10)")
    tr.add_argument("--batch-size", type=int, default=None, help="pin the batch size (default: tuned)")
    tr.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                    help="(default: adamw, which also trains networks without normalisation; sgd is Nesterov)")
    tr.add_argument("--lr", type=float, default=0.0,
                    help="peak learning rate (default: the optimizer's default for the batch)")
    tr.add_argument("--lr-test", action=argparse.BooleanOptionalAction, default=False,
                    help="without --lr, lower the optimizer's default where a tenth of the rate at a short range "
                         "test's lowest loss is lower (default: off; on 18 outside models it cost accuracy)")
    tr.add_argument("--weight-decay", type=float, default=5e-4, help="(default: 5e-4)")
    tr.add_argument("--schedule", choices=("onecycle", "cosine", "constant"), default="onecycle", help="(default: onecycle)")
    tr.add_argument("--warmup", type=float, default=0.2, help="warm-up share of all steps (default: 0.2)")
    tr.add_argument("--label-smoothing", type=float, default=0.0, help="(default: 0)")
    tr.add_argument("--clip", type=float, default=0.0, help="clip the gradient norm (default: off)")
    tr.add_argument("--val-fraction", type=float, default=0.1, help="held out when no --val (default: 0.1)")
    tr.add_argument("--patience", type=int, default=0, help="early stop after N epochs without improvement")
    tr.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps")
    tr.add_argument("--seed", type=int, default=0, help="seed of the weights, order and augmentations (default: 0)")
    tr.add_argument("--deterministic", action="store_true",
                    help="deterministic kernels: the same seed gives the same weights on the same device (can be slower)")
    tr.add_argument("--tune-share", type=float, default=0.1,
                    help="the most of the planned training time tuning may take (default: 0.1; 0: no bound). A run "
                         "too short for a search to fit in it gets a quick timing, and its first steps compare the "
                         "likeliest winner with it")
    tr.add_argument("--minutes", type=float, default=0.0,
                    help="a wall-clock budget for the epochs: where the epochs so far say the rest will not fit, "
                         "the run is shortened to those that do, its learning rate annealed over them (default: none)")
    tr.add_argument("--no-loss-watch", action="store_true",
                    help="train on, without a word, when the loss stays at chance (ln K) after max(2, 30%%) of the "
                         "epochs with every output frozen, or diverges (default: at the default learning rate, start "
                         "over once from the first weights at half of it; then stop, and say why)")
    tr.add_argument("--device", default=None,
                    help="cpu, cuda or cuda:N (default: cuda if available; under torchrun, cuda:LOCAL_RANK)")
    tr.add_argument("--no-tune", action="store_true", help="do not tune; use fp32 defaults or what is pinned")
    tr.add_argument("--precision", choices=PRECISIONS, help="pin the precision")
    tr.add_argument("--channels-last", action="store_true", default=None, help="pin channels_last on")
    tr.add_argument("--compile", action="store_true", default=None, help="pin torch.compile on")
    tr.add_argument("--threads", type=int, default=0, help="pin CPU threads")
    tr.add_argument("--rewrites", type=_rewrites, default=None, metavar="NAMES",
                    help="pin the model rewrites: all, none, or names joined by commas (default: tuned)")
    tr.add_argument("--translate", type=int, default=0, help="augment: random shift up to N pixels")
    tr.add_argument("--crop-pad", type=int, default=0, help="augment: random crop after reflect-padding N")
    tr.add_argument("--flip", action="store_true", help="augment: horizontal flip (not for text)")
    tr.add_argument("--brightness", type=float, default=0.0, help="augment: brightness jitter")
    tr.add_argument("--contrast", type=float, default=0.0, help="augment: contrast jitter")
    tr.add_argument("--cutout", type=int, default=0, help="augment: cutout square side")
    tr.add_argument("-q", "--quiet", action="store_true",
                    help="no progress bars, and no lines on how the run adapts (threads, where a resume starts): "
                         "the plan, the epochs, notes and the result")


def _demo(sub) -> None:
    dm = sub.add_parser(
        "demo", help="the whole story on built-in plates: diagnose, pack, tune, train",
        description="Make synthetic license-plate photos, diagnose the per-image pipeline users write "
                    "(input-bound, with numbers), pack the photos once, diagnose again, tune and train a better "
                    "plate model, and report accuracy on held-out plates and the time each stage took, with an "
                    "HTML report. A few minutes on 2 CPU cores; --quick for a smoke run of about a minute.")
    dm.add_argument("--out", default="trainfast-demo", help="output folder (default: trainfast-demo)")
    dm.add_argument("--quick", action="store_true", help="small and short: a smoke run")
    dm.add_argument("--train", type=int, help="training plates (default: 20000; quick: 1500)")
    dm.add_argument("--test", type=int, help="held-out plates the accuracy is measured on (default: 1000; quick: 300)")
    dm.add_argument("--epochs", type=int,
                    help="training epochs (default: as many as the time budget allows, 10 to 40; quick: 2)")
    dm.add_argument("--minutes", type=float,
                    help="the demo's time budget, from which the epochs follow (default: 5 on a CPU, 1 on a GPU)")
    dm.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    dm.add_argument("--seed", type=int, default=0,
                    help="seed of the plates (training: SEED, held-out: SEED+1) and of the training (default: 0); "
                         "run a few to see the spread")


def _make_plates(sub) -> None:
    mp = sub.add_parser(
        "make-plates", help="generate synthetic license-plate photos",
        description="Write OUT/images/*.jpg and OUT/labels.csv (path,plate,font): photo-like plates with 8 "
                    "characters from 0-9A-Z in several fonts, backgrounds, perspective, blur and noise. "
                    "Deterministic for a seed.")
    mp.add_argument("out", metavar="OUT")
    mp.add_argument("--count", type=int, default=1000, help="number of photos (default: 1000)")
    mp.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    mp.add_argument("--workers", type=int, default=0, help="processes (default: all cores)")

"""The `trainfast` command: argument declarations, and one small function per subcommand.

Parsing is declarations only; each `_cmd_*` calls the API and prints. A TrainfastError
(a user's mistake) becomes one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from enum import IntEnum

from trainfast import __version__
from trainfast.errors import TrainfastError


class ExitStatus(IntEnum):
    OK = 0
    ERROR = 1  # the input or the run failed; the message says why
    USAGE = 2  # the command line itself is wrong (argparse's own code)
    INTERRUPTED = 130


def _size(text: str) -> tuple[int, int]:
    """'64x128' (height × width) or '32' (square) → (64, 128)."""
    parts = text.lower().replace("×", "x").split("x")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not HxW, e.g. 64x128") from None
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not HxW, e.g. 64x128")
    return values[0], values[1]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainfast",
        description="Fast image-CNN training, and numbers that say why yours was slow.",
        epilog="Run `trainfast COMMAND --help` for each command's options.")
    p.add_argument("--version", action="version", version=f"trainfast {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

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
    pk.add_argument("--size", type=_size, required=True, metavar="HxW", help="target height x width, e.g. 64x128")
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
    pk.add_argument("--overwrite", action="store_true", help="replace what is at OUT")
    pk.add_argument("--path-column", default="path", help="CSV column of image paths (default: path)")
    pk.add_argument("--label-column", default="label", help="CSV column of labels (default: label)")
    pk.add_argument("--labels", choices=("auto", "class", "sequence"), default="auto", dest="label_kind",
                    help="CSV labels as class names or fixed-length sequences such as plates; auto decides "
                         "from the labels (default: auto)")
    pk.add_argument("--alphabet", default="0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ",
                    help="characters of sequence labels (default: 0-9A-Z)")
    pk.add_argument("--split", choices=("train", "test"), default="train", help="CIFAR split (default: train)")
    pk.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")

    info = sub.add_parser("info", help="describe a pack", description="Print what a pack holds.")
    info.add_argument("pack", metavar="PACK")
    return p


def _cmd_pack(a) -> ExitStatus:
    from trainfast.data.pack import pack

    pack(a.source, a.out, size=a.size, resize=a.resize, channels=a.channels, encoding=a.encoding,
         quality=a.quality, workers=a.workers, on_error=a.on_error, limit=a.limit, seed=a.seed,
         overwrite=a.overwrite, progress=not a.quiet, path_column=a.path_column,
         label_column=a.label_column, label_kind=a.label_kind, alphabet=a.alphabet, split=a.split)
    return ExitStatus.OK


def _cmd_info(a) -> ExitStatus:
    from trainfast.data.format import Pack

    pk = Pack(a.pack)
    print(pk)
    print(f"  mean {pk.mean}  std {pk.std}")
    print(f"  source: {pk.meta['source']['kind']} {pk.meta['source']['path']}; skipped {len(pk.skipped)}")
    return ExitStatus.OK


def main(argv: list[str] | None = None) -> int:
    """Entry point of `trainfast`; returns the exit status (tests call it in-process)."""
    args = _parser().parse_args(argv)
    try:
        return int(globals()[f"_cmd_{args.command.replace('-', '_')}"](args))
    except TrainfastError as e:
        print(f"trainfast {args.command}: error: {e}", file=sys.stderr)
        return int(ExitStatus.ERROR)
    except KeyboardInterrupt:
        print(f"trainfast {args.command}: interrupted", file=sys.stderr)
        return int(ExitStatus.INTERRUPTED)

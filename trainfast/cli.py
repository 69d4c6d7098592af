"""The `trainfast` command: one small function per subcommand (the arguments are declared in
cli_args.py).

Each `_cmd_*` calls the API and prints. A TrainfastError
(a user's mistake) becomes one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import os
import sys
from enum import IntEnum

from trainfast.cli_args import csv_values
from trainfast.cli_args import parser as _parser
from trainfast.errors import TrainfastError
from trainfast.units import shell_arg


class ExitStatus(IntEnum):
    OK = 0
    ERROR = 1  # the input or the run failed; the message says why
    USAGE = 2  # the command line itself is wrong (argparse's own code)
    INTERRUPTED = 130


def _cmd_pack(a) -> ExitStatus:
    from trainfast.data.pack import pack

    pack(a.source, a.out, log=lambda msg: print(msg, file=sys.stderr), size=a.size, resize=a.resize,
         channels=a.channels, encoding=a.encoding, quality=a.quality, workers=a.workers, on_error=a.on_error, limit=a.limit, seed=a.seed,
         overwrite=a.overwrite, progress=not a.quiet, split=a.split, **csv_values(a))
    return ExitStatus.OK


def _cmd_info(a) -> ExitStatus:
    from trainfast.data.format import Pack

    pk = Pack(a.pack)
    print(pk)
    print(f"  mean {pk.mean}  std {pk.std}")
    source = pk.meta.get("source")
    source = (f"{source.get('kind', '?')} {source.get('path', '?')}" if isinstance(source, dict)
              else f"not recorded ({pk.path / 'meta.json'} has none)")
    try:
        skipped = str(len(pk.skipped))
    except (OSError, ValueError, TypeError):
        skipped = f"not known ({pk.path / 'skipped.json'} is missing or unreadable)"
    print(f"  source: {source}; skipped {skipped}")
    return ExitStatus.OK


def _cmd_doctor(a) -> ExitStatus:
    from trainfast.config import Speed
    from trainfast.diagnose import doctor

    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    if a.script is not None:
        from trainfast.diagnose.script import doctor_script
        if a.model or a.data:
            raise TrainfastError("give either --model and --data, or a script after --, not both")
        for name in ("json", "html"):  # where the command line meant: the script may change directory
            if getattr(a, name) not in (None, "-"):
                setattr(a, name, os.path.abspath(getattr(a, name)))

        def overrun(report):  # the script ignored the stop: what was measured (then the process ends)
            _doctor_output(a, report, log)
        report = doctor_script(a.script, steps=a.steps or 50, seconds=a.seconds, fixes=not a.no_fixes, log=log,
                               quiet_stdout=a.json == "-", on_overrun=overrun)
        if report.error:
            print(report.error, file=sys.stderr, end="" if report.error.endswith("\n") else "\n")
    elif not (a.model and a.data):
        raise TrainfastError("give --model and --data, or your training script after --, e.g. "
                             "trainfast doctor -- python train.py")
    else:
        report = doctor(a.model, a.data, batch_size=a.batch_size, steps=a.steps or 20, device=a.device,
                        speed=Speed(precision=a.precision, channels_last=a.channels_last),
                        try_fixes=not a.no_fixes, ceiling=not a.no_ceiling, remeasure=a.remeasure,
                        source_options=csv_values(a), log=log)
    _doctor_output(a, report, log)
    if a.script is not None:
        a.cut_short = not report.stopped.startswith("the script finished")
        if report.error or not report.steps:
            return ExitStatus.ERROR  # the script failed, or never trained: nothing was diagnosed in full
    return ExitStatus.OK


def _doctor_output(a, report, log) -> None:
    """The report as the command line asked: text or JSON on stdout, and the files."""
    import json

    if a.json == "-":
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.text())
        if a.json:
            _write(a.json, json.dumps(report.to_dict(), indent=1))
    if a.html:
        _write(a.html, report.html())
        log(f"HTML report: {a.html}")


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise TrainfastError(f"{path}: cannot write ({e.strerror or e})") from None


def _cmd_models(a) -> ExitStatus:
    from trainfast import models
    from trainfast.diagnose.cost import layer_costs

    if a.names:
        print("\n".join(models.list()))
        return ExitStatus.OK
    print(f"{'name':20s} {'input':>11s} {'output':>8s} {'params':>12s} {'fwd FLOPs':>10s}  summary")
    for name in models.list():
        e = models.entry(name)
        cost = layer_costs(models.create(name), e.input_shape, batch=1)
        print(f"{name:20s} {'×'.join(map(str, e.input_shape)):>11s} {'×'.join(map(str, e.output_shape)):>8s} "
              f"{cost.params:>12,} {cost.forward_flops / 1e6:>8.1f} M  {e.summary}")
    return ExitStatus.OK


def _cmd_tune(a) -> ExitStatus:
    from trainfast.diagnose import load_model
    from trainfast.tuning import tune

    model, _ = load_model(a.model)
    shape = a.pack or a.input_shape or getattr(model, "input_shape", None)  # a pack: its shape and image count
    if shape is None:
        raise TrainfastError("give --input-shape CxHxW or --pack for a model without .input_shape")
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    result = tune(model, shape, device=a.device, batch_size=a.batch_size, max_batch=a.max_batch, images=a.images,
                  max_seconds=a.max_seconds, try_compile=not a.no_compile, try_rewrites=not a.no_rewrites,
                  optimizer=a.optimizer, retune=a.retune, log=log)
    print(result.table())
    return ExitStatus.OK


def _cmd_train(a) -> ExitStatus:
    from trainfast.config import Augment, TrainConfig
    from trainfast.errors import Detail
    from trainfast.train import fit

    def log(msg):
        if not (a.quiet and isinstance(msg, Detail)):  # -q: what the run found, not how it adapts
            print(msg, file=sys.stderr)
    if a.resume:
        saved = _resumable(a)
        packs = [p["path"] if isinstance(p, dict) else p for p in (saved["train_pack"], saved.get("val_pack"))]
        result = fit(a.model or saved["model"], packs[0], packs[1], device=a.device, run_dir=a.resume,
                     resume=True, progress=not a.quiet, log=log)
    else:
        if not a.pack or not a.model:
            raise TrainfastError("give a PACK and --model (or --resume RUN_DIR)")
        cfg = TrainConfig(epochs=a.epochs or TrainConfig.epochs, optimizer=a.optimizer, lr=a.lr,
                          weight_decay=a.weight_decay, schedule=a.schedule, warmup=a.warmup,
                          label_smoothing=a.label_smoothing, clip=a.clip,
                          val_fraction=a.val_fraction, patience=a.patience, save_every=a.save_every, seed=a.seed,
                          deterministic=a.deterministic, loss_watch=not a.no_loss_watch, tune_share=a.tune_share,
                          lr_test=a.lr_test, minutes=a.minutes)
        aug = Augment(crop_pad=a.crop_pad, translate=a.translate, flip=a.flip, brightness=a.brightness,
                      contrast=a.contrast, cutout=a.cutout)
        pinned = {k: v for k, v in (("precision", a.precision), ("channels_last", a.channels_last),
                                    ("compile", a.compile), ("batch_size", a.batch_size),
                                    ("threads", a.threads or None), ("rewrites", a.rewrites)) if v is not None}
        result = fit(a.model, a.pack, a.val, config=cfg, pin=pinned, tune=not a.no_tune, augment=aug,
                     device=a.device, run_dir=a.run_dir, progress=not a.quiet, log=log)
    if _rank0():  # under torchrun, rank 0 speaks for all
        log(f"best validation accuracy {result.best:.2%} ({result.stopped}); outputs in {result.run_dir}")
    return ExitStatus.OK


_RESUME_TAKES = {"command", "resume", "model", "device", "quiet"}


def _resumable(a) -> dict:
    """The run's config.json, after two checks. Options that would change the run are refused
    (it continues as configured). And a model from a file runs only when the user names it
    on this command line: a run directory is data, and data must not run code."""
    from trainfast import models
    from trainfast.train.rundir import read_run_config

    defaults = vars(_parser().parse_args(["train"]))
    saved = read_run_config(a.resume, a.device)
    changed = [("PACK" if k == "pack" else "--" + k.replace("_", "-")) for k, v in vars(a).items()
               if k not in _RESUME_TAKES and v != defaults.get(k)
               and not (k == "epochs" and v == saved["train"].get("epochs"))]  # the run's own count: no change
    if changed:
        raise TrainfastError(f"--resume continues the run as its config.json says ({saved['train'].get('epochs')} "
                             f"epochs); {', '.join(changed)} would change it (start a new run for that)")
    spec = saved["model"]
    if spec in models.list():
        if a.model and a.model != spec:
            raise TrainfastError(f"--model {a.model}: the run in {a.resume} trained {spec}")
    elif not a.model:
        raise TrainfastError(f"{a.resume}/config.json names the model {spec!r}, code in a file, and trainfast runs no "
                             f"code that a run directory names. If you trust that file, name it yourself: "
                             f"trainfast train --resume {shell_arg(a.resume, path=True)} --model {shell_arg(spec)}")
    return saved


def _cmd_demo(a) -> ExitStatus:
    from dataclasses import replace

    from trainfast.demo import QUICK, DemoConfig, run_demo

    cfg = DemoConfig(out=a.out, device=a.device, seed=a.seed)
    if a.quick:
        cfg = replace(cfg, **QUICK)
    cfg = replace(cfg, **{k: v for k, v in (("train", a.train), ("test", a.test), ("epochs", a.epochs),
                                                 ("minutes", a.minutes)) if v})
    run_demo(cfg, log=lambda msg: print(msg, file=sys.stderr))
    return ExitStatus.OK


def _cmd_make_plates(a) -> ExitStatus:
    from trainfast.datasets.plates import make_plates

    if a.count < 1:
        raise TrainfastError(f"--count must be ≥ 1, not {a.count}")
    out = make_plates(a.out, a.count, a.seed, a.workers, progress=True)
    print(f"wrote {a.count} plate photos and {out / 'labels.csv'}", file=sys.stderr)
    return ExitStatus.OK


def _say_error(line: str) -> None:
    """One line on stderr. Under torchrun every process meets the same error, and torchrun
    kills the others when the first one exits: so the first to fail on this machine says it
    (rank 0 where torchrun gives no error file), and each process leaves it in its error file,
    so that torchrun's failure summary shows the reason instead of a pointer to its docs."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if _first_to_fail(path):
        print(line, file=sys.stderr)
    if path:
        import json
        import time
        try:
            with open(path, "w") as f:
                json.dump({"message": line, "timestamp": str(int(time.time()))}, f)
        except OSError:
            pass


def _rank0() -> bool:
    """This process is rank 0 of torchrun's, or there is no torchrun."""
    return os.environ.get("RANK", "0") == "0"


def _first_to_fail(error_file: str | None) -> bool:
    """Not under torchrun: True. Under it: whether this process is the first of this machine's
    to fail, by an exclusive marker in the folder of this attempt's error files
    (<log_dir>/attempt_N/<local_rank>/error.json)."""
    if not error_file:
        return _rank0()
    from pathlib import Path
    try:
        os.close(os.open(Path(error_file).parent.parent / "trainfast-error-said", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:
        return _rank0()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `trainfast`; returns the exit status (tests call it in-process)."""
    argv_is_the_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    script = None
    if argv[:1] == ["doctor"] and "--" in argv:  # trainfast doctor [options] -- python train.py ...
        cut = argv.index("--")
        argv, script = argv[:cut], argv[cut + 1:]
    args = _parser().parse_args(argv)
    if args.command == "doctor":
        args.script = script
    try:
        code = int(globals()[f"_cmd_{args.command.replace('-', '_')}"](args))
        if argv_is_the_command_line and getattr(args, "cut_short", False):
            # The user's script was stopped mid-run (or failed). Threads it started can then block
            # the interpreter's exit for ever: TensorFlow's prefetch iterator, for one, waits in its
            # destructor for a generator that will never be called again. The report is out;
            # leave without waiting for them.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    except TrainfastError as e:
        _say_error(f"trainfast {args.command}: error: {e}")
        return int(ExitStatus.ERROR)
    except KeyboardInterrupt:
        print(f"trainfast {args.command}: interrupted", file=sys.stderr)
        return int(ExitStatus.INTERRUPTED)
    except BrokenPipeError:  # `trainfast info … | head -1`: the reader left; nothing more to say to it
        if argv_is_the_command_line:  # and Python's own flush at exit must not find the broken pipe either
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return int(ExitStatus.ERROR)

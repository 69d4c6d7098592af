"""A run directory: owning it (one run at a time, nothing written through a link), naming the
packs it trained on, reading its config.json to resume, and recording the run's settings."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path

from trainfast import files, hardware
from trainfast.config import Augment, Speed, TrainConfig
from trainfast.data.format import Pack
from trainfast.errors import TrainfastError
from trainfast.train import distributed
from trainfast.train.inputs import check_config


def pack_record(pk: Pack) -> dict:
    """How a run directory names a pack: its absolute path, and an identity from its metadata
    (size, shape, per-channel statistics, what it was built from), so that another pack at that
    path, or a relative path read from another working directory, is noticed."""
    m = pk.meta
    ident = json.dumps([m.get("count"), m.get("shape"), m.get("encoding"), m.get("mean"), m.get("std"), m.get("build")],
                       sort_keys=True)
    return {"path": str(pk.path.resolve()), "count": len(pk), "id": hashlib.sha1(ident.encode()).hexdigest()[:16]}


def read_run_config(run_dir, device=None) -> dict:
    """A run directory's config.json, checked against what resuming reads from it: one line
    naming the file and what is wrong, never a traceback. Nothing in it runs: the model is a
    name, and a model from a file is the caller's to name again.

    Under torchrun a process that finds no run directory joins the process group (on `device`,
    as the others will) only to tell them, so that none waits there for it (see _fit)."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        shared = ""
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            shared = (" — under torchrun every node reads the run directory (config.json, last.pt): put it on a file "
                      "system all nodes share, or copy it to each")
            with contextlib.suppress(Exception):  # telling the others is a courtesy; the line below is the error
                distributed.sum_all([1.0], distributed.setup(hardware.resolve_device(device)))
        raise TrainfastError(f"{run_dir}: not a run directory to resume (no config.json){shared}")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TrainfastError(f"{path}: unreadable ({e})") from None
    try:
        if not isinstance(saved, dict):
            raise TypeError("not a JSON object")
        for key, kind in (("model", str), ("train", dict), ("speed", dict), ("augment", dict),
                          ("train_pack", (str, dict)), ("user_batch_size", int)):
            if not isinstance(saved[key], kind):
                raise TypeError(f"{key!r} is {type(saved[key]).__name__}")
        check_config(TrainConfig(**saved["train"]))
        Speed(**saved["speed"])
        Augment(**saved["augment"])
    except KeyError as e:
        raise TrainfastError(f"{path}: no {e.args[0]!r} (not written by trainfast, or damaged)") from None
    except (TypeError, ValueError, TrainfastError) as e:
        raise TrainfastError(f"{path}: not a run configuration trainfast can resume ({e})") from None
    return saved


def same_pack(pk: Pack, recorded, what: str) -> None:
    """Refuse to resume on a pack other than the one the run recorded."""
    if isinstance(recorded, dict) and recorded.get("id") != pack_record(pk)["id"]:
        raise TrainfastError(f"{pk.path}: not the {what} pack this run trained on (it recorded {recorded['path']}, "
                             f"{recorded['count']} images); resume with that pack")


RUN_FILES = ("config.json", "speed.json", "metrics.csv", "curves.png", "last.pt", "best.pt")  # what a run writes
RUN_LOCK = ".trainfast-lock"


def own_run_dir(run_dir: Path, resume: bool, stack: contextlib.ExitStack) -> None:
    """Hold the run directory for this run (a second run into it, new or resumed, is told at
    once), then check it: a new run's must be empty; a resumed one's must hold no link where
    the run writes (nothing is written through a link), and loses the temporary files of a
    save that was killed."""
    busy = (f"{run_dir}: another trainfast run is using this run directory now; wait for it, or choose another "
            "--run-dir")
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainfastError(f"{run_dir}: a file, not a run directory; choose another --run-dir")
    if not resume and run_dir.exists() and any(p.name != RUN_LOCK for p in run_dir.iterdir()):
        raise TrainfastError(f"{run_dir}: exists and is not empty; choose another --run-dir or --resume it")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TrainfastError(f"{run_dir}: cannot write the run directory ({e.strerror or e})") from None
    stack.enter_context(files.only_one(run_dir / RUN_LOCK, busy))
    if not resume:
        if any(p.name != RUN_LOCK for p in run_dir.iterdir()):  # filled between the look and the lock
            raise TrainfastError(f"{run_dir}: exists and is not empty; choose another --run-dir or --resume it")
        return
    linked = files.links(run_dir, RUN_FILES)
    if linked:
        raise TrainfastError(f"{run_dir}: {', '.join(linked)} {'is a link' if len(linked) == 1 else 'are links'}; "
                             "trainfast writes nothing through a link in a run directory: remove "
                             f"{'it' if len(linked) == 1 else 'them'} (or copy the file in), then resume")
    for tmp in files.stale_temporaries(run_dir, RUN_FILES):
        tmp.unlink()


def write_start(run_dir: Path, config: dict, speed: dict) -> None:
    """A new run's config.json (all a resume reads) and speed.json (what tune tried, the race)."""
    files.write_text(run_dir / "config.json", json.dumps(config, indent=1))
    files.write_text(run_dir / "speed.json", json.dumps(speed, indent=1))


def record_speed(run_dir: Path, speed: Speed, tried: list[dict] | None = None) -> None:
    """config.json's setting is `speed` now (a resume goes on with it); speed.json adds `tried`."""
    changes = {"config.json": {}, **({"speed.json": {"tried": tried}} if tried is not None else {})}
    for name, extra in changes.items():
        saved = json.loads((run_dir / name).read_text())
        files.write_text(run_dir / name, json.dumps({**saved, "speed": speed.to_dict(), **extra}, indent=1))


def record_decision(run_dir: Path, decision: dict) -> None:
    """Add one decision the run made by timing (its threads, a first-steps comparison, a re-tune)
    to speed.json's `decisions`, in order: two runs of the same call can be compared by them."""
    saved = _speed_json(run_dir)
    _write_speed(run_dir, {**saved, "decisions": [*saved.get("decisions", []), decision]})


def record_costs(run_dir: Path, costs: dict) -> None:
    """speed.json's `costs`: the seconds of each phase of the call that ran (train/costs.py)."""
    _write_speed(run_dir, {**_speed_json(run_dir), "costs": {k: round(v, 3) for k, v in costs.items()}})


def _speed_json(run_dir: Path) -> dict:
    """speed.json as written so far; {} where a run killed as it started left none (resumed, it
    must not end in a traceback over a record)."""
    try:
        return json.loads((run_dir / "speed.json").read_text())
    except FileNotFoundError:
        return {}


def _write_speed(run_dir: Path, saved: dict) -> None:
    files.write_text(run_dir / "speed.json", json.dumps(saved, indent=1))


def empty(run_dir: Path) -> None:
    """Remove what a run wrote in `run_dir` (a start-over's: the directory was empty or new when
    the run began), and the temporaries of a save that was cut short."""
    for name in RUN_FILES:
        with contextlib.suppress(FileNotFoundError):
            (run_dir / name).unlink()
    for tmp in files.stale_temporaries(run_dir, RUN_FILES):
        tmp.unlink()


def dir_name(model_name: str) -> str:
    """A model's name as one plain folder name: 'nets/plate.py:build' → 'plate.build' (no
    slash to nest folders, no colon that some file systems and tools refuse)."""
    if ":" in model_name:
        file, _, attr = model_name.rpartition(":")
        model_name = f"{Path(file).stem}.{attr}"
    return re.sub(r"[^\w.-]+", "-", model_name).strip("-.") or "model"

"""Checkpoints: written atomically, loaded with weights_only=True (no code runs from a file).

A checkpoint holds plain state: the model's, optimizer's, scheduler's and scaler's state
dicts, the epoch and step, the loader's position, the random streams and the best score. It
also records the model's name and parameter shapes, and a checkpoint of another model or
shape is refused with both named.

Every tensor in it is saved and loaded on the CPU (`map_location="cpu"`); the caller moves
state to its device (load_state_dict does), so a run saved on CUDA resumes on a CPU-only
machine and the reverse.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainfast import files
from trainfast.errors import TrainfastError, in_words

FORMAT = "trainfast-checkpoint"
VERSION = 1


def signature(model: torch.nn.Module) -> list[list]:
    return [[name, list(t.shape)] for name, t in model.state_dict().items()]


def rng_state(device: torch.device) -> dict:
    """The random streams a run on `device` draws from: the CPU's, and the CUDA device's.

    The data order and augmentations are pure functions of (seed, epoch, batch), not streams;
    what draws from these is the model itself (dropout) and any torch random call in user code.
    Under DDP every rank draws the same sequence from the same seed on its own device, so rank
    0's device stream stands for all of them.
    """
    return {"cpu": torch.get_rng_state(), "device": device.type,
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(saved, device: torch.device) -> str | None:
    """Restore what rng_state() saved, each stream on its own device. Returns None when every
    stream the run draws from was restored, else a sentence saying which was not."""
    if isinstance(saved, torch.Tensor):  # checkpoints from before CUDA streams were kept
        saved = {"cpu": saved, "device": "cpu", "cuda": None}
    torch.set_rng_state(saved["cpu"].cpu())
    if device.type == "cuda" and saved.get("cuda") is not None:
        torch.cuda.set_rng_state(saved["cuda"].cpu(), device)
        return None
    if device.type == saved.get("device", "cpu"):
        return None
    return (f"the run was saved on {saved.get('device')} and resumes on {device.type}: the random streams of the "
            f"model (dropout) differ from the uninterrupted run's from here on; the data order and augmentations "
            f"do not")


def save(path: Path, state: dict) -> None:
    """torch.save whole or not at all, never through a link (files.write_whole): a reader never
    sees half a file, a full disk leaves the last checkpoint as it was and says so."""
    files.write_whole(Path(path), lambda f: torch.save({"format": FORMAT, "version": VERSION, **state}, f))


def _damage(state: dict) -> str:
    """What is missing or wrong in a checkpoint's bookkeeping (what resuming reads), or ''."""
    for key in ("model", "optimizer", "scheduler", "loader", "state", "rng"):
        if key == "rng" and isinstance(state.get(key), torch.Tensor):  # the first release kept the CPU stream bare
            continue
        if not isinstance(state.get(key), dict):
            return f"no {key!r}" if key not in state else f"{key!r} is {type(state[key]).__name__}"
    if bad := _bad_streams(state["rng"]):
        return bad
    threads = state.get("threads", 1)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        return f"threads is {threads!r}, not a whole number ≥ 1"
    for part, keys in (("loader", ("epoch", "position")), ("state", ("epoch", "step", "position"))):
        for key in keys:
            default = 0 if (part, key) == ("state", "position") else None  # older checkpoints kept no state position
            value = state[part].get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                return f"{part} {key} is {value!r}, not a whole number ≥ 0"
    return ""


def _bad_streams(rng) -> str:
    """What is wrong with a checkpoint's random streams (set_rng_state would raise on it), or ''."""
    if isinstance(rng, torch.Tensor):
        rng = {"cpu": rng, "cuda": None}
    cpu, cuda, size = rng.get("cpu"), rng.get("cuda"), torch.get_rng_state().numel()
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8 or cpu.numel() != size:
        what = f"{cpu.numel()} {cpu.dtype} values" if isinstance(cpu, torch.Tensor) else type(cpu).__name__
        return f"the CPU random stream is {what}, not {size} bytes"
    if cuda is not None and (not isinstance(cuda, torch.Tensor) or cuda.dtype != torch.uint8):
        return f"the CUDA random stream is {type(cuda).__name__}, not bytes"
    return ""


def load(path: Path, model_name: str, model: torch.nn.Module) -> dict:
    """The checkpoint at `path`, every tensor on the CPU, checked to be `model_name`'s."""
    path = Path(path)
    if not path.is_file():
        raise TrainfastError(f"{path}: no checkpoint there to resume from")
    if path.stat().st_size == 0:
        raise TrainfastError(f"{path}: an empty file, not a checkpoint (a save that was cut off?)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read is the file's fault
        raise TrainfastError(f"{path}: not a readable checkpoint ({in_words(e, 300)})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise TrainfastError(f"{path}: not a trainfast checkpoint")
    damage = _damage(state)
    if damage:
        raise TrainfastError(f"{path}: a damaged checkpoint ({damage}); resume from another copy, or start over")
    if state.get("model_name") != model_name or state.get("signature") != signature(model):
        theirs = state.get("model_name")
        diff = next((f"{a[0]} {a[1]} vs {b[0]} {b[1]}" for a, b in zip(state.get("signature", []), signature(model))
                     if a != b), "a different number of tensors")
        raise TrainfastError(f"{path}: a checkpoint of model {theirs!r}, which does not fit {model_name!r} "
                             f"({diff})")
    return state

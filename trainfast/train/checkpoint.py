"""Checkpoints: written atomically, loaded with weights_only=True (no code runs from a file).

A checkpoint holds plain state: the model's, optimizer's, scheduler's and scaler's state
dicts, the epoch and step, the loader's position, the RNG state and the best score. It
also records the model's name and parameter shapes, and a checkpoint of another model or
shape is refused with both named.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from trainfast.errors import TrainfastError

FORMAT = "trainfast-checkpoint"
VERSION = 1


def signature(model: torch.nn.Module) -> list[list]:
    return [[name, list(t.shape)] for name, t in model.state_dict().items()]


def save(path: Path, state: dict) -> None:
    """torch.save to a temporary sibling, then rename: a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({"format": FORMAT, "version": VERSION, **state}, tmp)
    os.replace(tmp, path)


def load(path: Path, model_name: str, model: torch.nn.Module, map_location=None) -> dict:
    path = Path(path)
    if not path.is_file():
        raise TrainfastError(f"{path}: no checkpoint there to resume from")
    try:
        state = torch.load(path, map_location=map_location or "cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read is the file's fault
        raise TrainfastError(f"{path}: not a readable checkpoint ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise TrainfastError(f"{path}: not a trainfast checkpoint")
    if state.get("model_name") != model_name or state.get("signature") != signature(model):
        theirs = state.get("model_name")
        diff = next((f"{a[0]} {a[1]} vs {b[0]} {b[1]}" for a, b in zip(state.get("signature", []), signature(model))
                     if a != b), "a different number of tensors")
        raise TrainfastError(f"{path}: a checkpoint of model {theirs!r}, which does not fit {model_name!r} "
                             f"({diff})")
    return state

"""The model registry: `@register` a factory, `create(name)`, `list()`.

    from trainfast import models
    models.list()                        # ['cifar_cnn', 'cifar_resnet', ...]
    net = models.create("plate_cnn")     # an nn.Module with .input_shape = (3, 64, 128)

NOTE: models import nothing else of ours (DESIGN.md); a bad name raises ValueError with
the known names, and callers turn it into a user-facing error.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import Callable

import torch.nn as nn


@dataclass(frozen=True)
class ModelEntry:
    name: str
    factory: Callable[..., nn.Module]
    input_shape: tuple[int, int, int]  # (C, H, W)
    output_shape: tuple[int, ...]  # (classes,) or (positions, alphabet)
    summary: str


_REGISTRY: dict[str, ModelEntry] = {}


def register(input_shape, output_shape, summary: str = ""):
    """Decorator: register a factory `fn(**kw) -> nn.Module` under its function name."""

    def wrap(fn):
        doc = summary or (fn.__doc__ or "").strip().splitlines()[0]
        _REGISTRY[fn.__name__] = ModelEntry(fn.__name__, fn, tuple(input_shape), tuple(output_shape), doc)
        return fn

    return wrap


def list() -> builtins.list[str]:  # noqa: A001 - the registry's verb, as in timm
    """Names of every registered model, sorted."""
    return sorted(_REGISTRY)


def entry(name: str) -> ModelEntry:
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(list())}")
    return _REGISTRY[name]


def create(name: str, **kwargs) -> nn.Module:
    """Build a registered model; its `.input_shape` (C, H, W) and `.output_shape` are set."""
    e = entry(name)
    model = e.factory(**kwargs)
    model.input_shape = getattr(model, "input_shape", e.input_shape)
    model.output_shape = getattr(model, "output_shape", e.output_shape)
    model.registry_name = name
    return model


def load(spec) -> tuple[nn.Module, str]:
    """A model from a registered name, 'path/to/file.py:function_or_class', or an nn.Module.

    Returns (model, name). The file is the user's own model code and is run on purpose.
    Raises ValueError with the reason for a name or file that gives no model.
    """
    import importlib.util
    from pathlib import Path

    if isinstance(spec, nn.Module):
        return spec, getattr(spec, "registry_name", type(spec).__name__)
    spec = str(spec)
    if ":" not in spec or not spec.rsplit(":", 1)[0].endswith(".py"):
        return create(spec), spec
    path, name = spec.rsplit(":", 1)
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such file")
    mod_spec = importlib.util.spec_from_file_location(f"_trainfast_user_{p.stem}", p)
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file failed to import: say how
        raise ValueError(f"{path}: importing it failed ({type(e).__name__}: {e})") from None
    fn = getattr(module, name, None)
    if fn is None:
        found = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise ValueError(f"{path} has no {name!r}; it defines {', '.join(found) or 'nothing callable'}")
    try:
        model = fn()
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{spec}() failed ({type(e).__name__}: {e})") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec}() returned {type(model).__name__}, not a torch.nn.Module")
    model.registry_name = spec
    return model, spec


from trainfast.models import better, users  # noqa: E402,F401  (registration side effects)

"""The doctor's check-up of a model on its data (`trainfast.doctor`): where the training time goes, why, and what to do — with numbers.

    report = trainfast.doctor("plate_cnn", "plates/labels.csv", batch_size=128,
                              source_options={"label_column": "plate"})
    print(report.text())

The doctor measures the machine (cached), counts the model's cost per layer, times real
training steps on the user's own data pipeline, gives a verdict, then re-runs a few steps
with each candidate fix to measure what it buys.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn as nn

from trainfast import hardware, models, units
from trainfast import step as _step
from trainfast.config import Speed
from trainfast.data.format import Pack, is_pack
from trainfast.data.loader import GoesOnWarning, Loader
from trainfast.data.naive import PerImageBatches
from trainfast.data.arrays import pack_arrays
from trainfast.data.pack import is_arrays
from trainfast.data.sources import Source, open_source
from trainfast.diagnose import remedies
from trainfast.diagnose.ceiling import Ceiling, kernel_ceiling
from trainfast.diagnose.ceiling import count as kernel_configurations
from trainfast.diagnose.cost import ModelCost, layer_costs, measured_findings
from trainfast.diagnose.storage import read_throughput, storage_sentence
from trainfast.diagnose.timing import StepTimes, step_breakdown, throughput
from trainfast.diagnose.verdict import Recommendation, Roofline, Verdict, cores_sentence, roofline, verdict
from trainfast.errors import TrainfastError, in_words

SCHEMA_VERSION = 1


@dataclass
class Report:
    """Everything the doctor found; `.text()`, `.to_dict()` (JSON) and `.html()` render it."""

    model: str
    data: str
    system: dict
    peaks: dict
    cost: ModelCost
    speed: Speed
    times: StepTimes
    roofline: Roofline
    verdict: Verdict
    recommendations: list[Recommendation] = field(default_factory=list)
    seconds: float = 0.0
    other_load: float | None = None  # cores other processes kept busy while the doctor measured
    load_warning: str = ""
    storage: dict | None = None  # files read apart from decoding (StorageRead.to_dict + sentence, bound)
    fixes_note: str = ""  # "no fix measured ≥ 5% faster (tried: …)" when the trials found none
    data_side: str = ""  # what prepares the batches: "2 gather threads", "the training process itself, …"
    ceiling: Ceiling | None = None  # the kernels' ceiling (diagnose.ceiling), where measured

    def to_dict(self) -> dict:
        return {"schema": SCHEMA_VERSION, "model": self.model, "data": self.data, "system": self.system,
                "peaks": self.peaks, "cost": self.cost.to_dict(), "speed": self.speed.to_dict(),
                "steps": self.times.to_dict(), "roofline": self.roofline.to_dict(),
                "verdict": self.verdict.to_dict(),
                "recommendations": [r.to_dict() for r in self.recommendations], "seconds": self.seconds,
                "other_load_cores": self.other_load, "load_warning": self.load_warning, "storage": self.storage,
                "fixes_note": self.fixes_note, "cores": cores_sentence(self),
                "ceiling": self.ceiling.to_dict() if self.ceiling else None}

    def text(self) -> str:
        from trainfast.diagnose.report import render_text
        return render_text(self)

    def html(self) -> str:
        from trainfast.diagnose.report import render_html
        return render_html(self)

    def _repr_html_(self) -> str:  # a notebook shows the advice and the charts, not the dataclass
        from trainfast.diagnose.report import render_fragment
        return render_fragment(self)

    def __repr__(self) -> str:
        fixes = f"{len(self.recommendations)} fixes" if self.recommendations else (self.fixes_note or "no fixes tried")
        return (f"<doctor report: {self.model}, batch {self.times.batch_size}: {self.verdict.sentence} "
                f"{units.rate(self.times.images_per_s)} images/s; {fixes}; print(report.text()) for all of it>")


def load_model(spec) -> tuple[nn.Module, str]:
    """A model from a registry name, `path/to/file.py:function_or_class`, or an nn.Module."""
    try:
        return models.load(spec)
    except ValueError as e:
        raise TrainfastError(str(e)) from None


def _input_shape(model: nn.Module, data) -> tuple[tuple, int | None]:
    """(C, H, W) the model is fed, and the batch size its iterable of batches brings."""
    shape = getattr(model, "input_shape", None)
    if isinstance(data, Loader):
        h, w, c = data.pack.shape
        return tuple(shape or (c, h, w)), data.batch_size
    if shape is not None and getattr(data, "batch_size", None):
        return tuple(shape), int(data.batch_size)
    try:
        x, _ = next(iter(data))
    except (TypeError, ValueError, StopIteration) as e:
        raise TrainfastError(f"data must yield (images, labels) batches; its first item could not be read as one "
                             f"({type(e).__name__}: {e})") from None
    batch = getattr(data, "batch_size", None) or len(x)
    return tuple(shape or x.shape[1:]), int(batch)


def _resolve_data(data, model, batch_size: int, device, seed: int, source_options: dict | None = None):
    """(iterable of batches, description, Source of files or None, Pack or None)."""
    if isinstance(data, (str, Path)):
        data = Pack(data) if is_pack(Path(data)) else open_source(data, **(source_options or {}))
    if is_arrays(data):  # (x, y) arrays: packed once into the cache, then read as the pack
        data = pack_arrays(*data)[0]
    if isinstance(data, Source):
        if data.files is None:
            raise TrainfastError(f"{data.origin}: pack it first (`{data.pack_command('OUT', 'HxW')}`), then "
                                 "run the doctor on the pack")
        shape = getattr(model, "input_shape", None)
        if shape is None:
            raise TrainfastError("a model without .input_shape needs a pack or an iterable of batches, not raw files")
        if len(data) < batch_size:
            raise TrainfastError(f"{data.origin}: {len(data)} images, fewer than one batch of {batch_size}; give "
                                 f"--batch-size {max(len(data), 1)} or fewer")
        return (PerImageBatches(data, shape[1:], batch_size, seed=seed),
                f"{data.kind} {data.origin} ({len(data)} files, decoded per image per batch)", data, None)
    if isinstance(data, Pack):
        loader = Loader(data, batch_size, device=device, seed=seed)
        return loader, f"pack {data.path} ({loader.describe()})", None, data
    if isinstance(data, Loader):  # the user's own Loader: its batch, its pack for the fixes
        return data, f"pack {data.pack.path} ({data.describe()})", None, data.pack
    if isinstance(data, PerImageBatches):
        return data, (f"{data.source.kind} {data.source.origin} ({len(data.source)} files, decoded per image "
                      f"per batch with {data.reader})"), data.source, None
    if hasattr(data, "__iter__"):
        return data, type(data).__name__, None, None
    raise TrainfastError(f"data must be a pack, an image folder, a CSV, or an iterable of (images, labels); got {type(data).__name__}")


def doctor(model, data, *, batch_size: int = 64, steps: int = 20, warmup: int = 3, device=None,
           speed: Speed | None = None, try_fixes: bool = True, ceiling: bool = True, remeasure: bool = False,
           seed: int = 0, source_options: dict | None = None, progress: bool = True, log=None) -> Report:
    """Diagnose training `model` on `data`: measure, explain, and try the fixes.

    Args:
        model: a registered name, 'file.py:function', or an nn.Module.
        data: a pack, an image folder or CSV (timed as the per-image pipeline users write),
            or any iterable of (images, labels) — a DataLoader, a generator, a Sequence.
        batch_size: for packs and files; an iterable brings its own.
        steps, warmup: timed steps, and steps run first and not timed.
        device: 'cpu', 'cuda', or None for cuda when available.
        speed: the settings to diagnose (default: fp32, no channels_last: PyTorch's defaults).
        try_fixes: re-run a few steps with each candidate fix to measure its gain.
        ceiling: time each convolution and matrix product alone (diagnose.ceiling), so the
            report can say how far the step is from what its kernels allow.
        source_options: for a CSV given by its path: path_column, label_column, label_kind
            and alphabet, as `trainfast.pack` takes them (e.g. {"label_column": "plate"}).
        progress: progress bars (steps timed, with an estimate of the time left) and a line
            per phase on `log` (default: print; silent with progress=False).
    """
    started = time.perf_counter()
    log = log or (print if progress else (lambda msg: None))
    try:
        dev = hardware.resolve_device(device)
    except ValueError as e:
        raise TrainfastError(str(e)) from None
    net, name = load_model(model)
    reason = _step.check(replace(speed or Speed(), batch_size=batch_size), dev)
    if reason:
        raise TrainfastError(reason)
    batches, described, src, pk = _resolve_data(data, net, batch_size, dev, seed, source_options)
    shape, own_batch = _input_shape(net, batches)
    batch_size = own_batch or batch_size  # an iterable of batches brings its own: the header and fixes use it
    speed = replace(speed or Speed(), batch_size=batch_size)
    if pk is not None and tuple(shape) != (pk.shape[2], pk.shape[0], pk.shape[1]):
        h, w, c = pk.shape
        raise TrainfastError(f"the pack holds {c}×{h}×{w} images but the model takes {'×'.join(map(str, shape))}")

    log("measuring this machine's peaks (cached once measured on a quiet machine)…")
    peaks = hardware.peaks(dev, remeasure=remeasure)
    if peaks.get("busy"):
        log(f"   other processes kept {peaks['other_cores']:.1f} cores busy while the peaks were measured: used for "
            "this report only, not cached (a later run on a quieter machine measures them again)")
    log("counting the model's cost per layer…")
    cost = _cost(net, shape, batches, pk)
    log(f"timing {steps} training steps on {described}…")
    with hardware.OtherLoad() as load:
        times = _timed_steps(net, batches, dev, speed, steps, warmup, progress)
        kernels = _ceiling(net, cost, times.batch_size, speed.precision, dev, progress, log) if ceiling else None
        roof = roofline(cost, times, peaks, speed.precision, kernels)
        found = verdict(times, roof)
        report = Report(name, described, hardware.describe(dev), peaks, cost, speed, times, roof, found,
                        data_side=_data_side(batches), ceiling=kernels)
        if src is not None and src.files:
            log("reading a sample of the files apart from decoding (storage throughput)…")
            report.storage = _storage(src, times)
        if try_fixes:
            report.other_load = load.so_far()  # what the fixes' titles say; the whole run's replaces it below
            log("trying the fixes on the spot…")
            with _bar(progress, remedies.TRIAL_STEPS, "trying fixes") as bar:
                report.recommendations = remedies.recommendations(net, report, dev, src, pk, log, bar)
    report.other_load, report.load_warning = load.cores, load.warning()
    report.seconds = time.perf_counter() - started
    return report


def _cost(net, shape, batches, pk):
    """The model's cost per layer, with what one real batch shows about it (for data that can be
    read twice: one batch taken and the loop left, the timing goes on from there)."""
    try:
        cost = layer_costs(copy.deepcopy(net), shape)
    except ValueError as e:
        raise TrainfastError(str(e)) from None
    if pk is not None or isinstance(batches, PerImageBatches):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GoesOnWarning)
            x = next(iter(batches))[0]
        cost.findings = measured_findings(copy.deepcopy(net).cpu().float(), x.cpu().float())[0] + cost.findings
    return cost


def _ceiling(net, cost, batch: int, precision: str, dev, progress: bool, log) -> Ceiling | None:
    """The kernels' ceiling at the step's batch and precision, with a progress bar."""
    n = kernel_configurations(net, cost)
    if not n:
        return None
    log(f"timing the model's {n} distinct convolution and matrix-product layers alone (the kernels' ceiling)…")
    try:
        with _bar(progress, n, "timing kernels", unit="layer") as bar:
            return kernel_ceiling(net, cost, batch, precision, dev, on_layer=lambda: bar.update())
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # a layer that will not run alone: no ceiling, no lost report
        log(f"   kernels' ceiling left out: a layer failed when timed alone ({in_words(e, 120)})")
        return None


def _timed_steps(net, batches, dev, speed: Speed, steps: int, warmup: int, progress: bool):
    """The step timed in its stages; on a GPU also unsynchronised (per-step synchronisation hides
    the overlap training has), where the data can be read again."""
    with _bar(progress, warmup + steps + (steps + 2 if dev.type == "cuda" else 0), "timing steps") as bar:
        times = step_breakdown(copy.deepcopy(net), batches, device=dev, speed=speed, steps=steps, warmup=warmup,
                               on_step=bar.update)
        if dev.type == "cuda":
            try:
                times.steady = throughput(copy.deepcopy(net), batches, device=dev, speed=speed, steps=steps,
                                          warmup=2, on_step=bar.update)
            except TrainfastError:  # one-shot data, used up by the breakdown
                pass
    return times


def _storage(src, times) -> dict | None:
    """How fast a sample of the files reads apart from decoding, and whether that bounds the step."""
    read = read_throughput(src.files)
    if read is None:
        return None
    sentence, bound = storage_sentence(read, times.data / max(times.batch_size, 1))
    return {**read.to_dict(), "sentence": sentence, "storage_bound": bound}


def _data_side(batches) -> str:
    """What prepares the batches, in words, for the cores sentence."""
    if isinstance(batches, Loader):
        what = "decode" if batches.pack.encoding == "jpeg" and not batches.decodes_on_device else "gather"
        return f"{batches.workers} {what} threads (a pack)" + (", resident on the device" if batches.resident else "")
    if isinstance(batches, PerImageBatches):
        return "the training process itself, one image at a time (decode + resize per image, every batch)"
    workers = getattr(batches, "num_workers", None)  # a torch DataLoader
    if workers:
        return f"{workers} DataLoader worker processes"
    if workers == 0:
        return "the training process itself (DataLoader num_workers=0)"
    return f"the training process itself, as far as the doctor can see (a {type(batches).__name__})"


def _bar(progress: bool, total: int, desc: str, unit: str = "step"):
    """A progress bar (a widget in a notebook, a line on stderr in a terminal) that vanishes when done."""
    from trainfast.progress import tqdm
    return tqdm(total=total, desc=desc, unit=unit, disable=not progress, leave=False)

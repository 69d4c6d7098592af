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

from trainfast import files, hardware, models, units
from trainfast import step as _step
from trainfast.config import Speed
from trainfast.data.format import Pack, is_pack
from trainfast.data.loader import GoesOnWarning, Loader
from trainfast.data.naive import PerImageBatches
from trainfast.data.arrays import pack_arrays
from trainfast.data.pack import is_arrays
from trainfast.data.sources import Source, open_source
from trainfast.diagnose.cost import ModelCost, layer_costs, measured_findings
from trainfast.diagnose.storage import read_throughput, storage_sentence
from trainfast.diagnose.timing import StepTimes, step_breakdown, synthetic_batches, throughput
from trainfast.diagnose.verdict import Recommendation, Roofline, Verdict, cores_sentence, roofline, verdict
from trainfast.errors import TrainfastError
from trainfast.units import shell_arg

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

    def to_dict(self) -> dict:
        return {"schema": SCHEMA_VERSION, "model": self.model, "data": self.data, "system": self.system,
                "peaks": self.peaks, "cost": self.cost.to_dict(), "speed": self.speed.to_dict(),
                "steps": self.times.to_dict(), "roofline": self.roofline.to_dict(),
                "verdict": self.verdict.to_dict(),
                "recommendations": [r.to_dict() for r in self.recommendations], "seconds": self.seconds,
                "other_load_cores": self.other_load, "load_warning": self.load_warning, "storage": self.storage,
                "fixes_note": self.fixes_note, "cores": cores_sentence(self)}

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
           speed: Speed | None = None, try_fixes: bool = True, remeasure: bool = False,
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
    try:
        cost = layer_costs(copy.deepcopy(net), shape)
    except ValueError as e:
        raise TrainfastError(str(e)) from None
    if pk is not None or isinstance(batches, PerImageBatches):  # data that can be read twice
        with warnings.catch_warnings():  # one batch taken and the loop left: the timing goes on from there
            warnings.simplefilter("ignore", GoesOnWarning)
            x = next(iter(batches))[0]
        cost.findings = measured_findings(copy.deepcopy(net).cpu().float(), x.cpu().float())[0] + cost.findings
    log(f"timing {steps} training steps on {described}…")
    with hardware.OtherLoad() as load:
        with _bar(progress, warmup + steps + (steps + 2 if dev.type == "cuda" else 0), "timing steps") as bar:
            times = step_breakdown(copy.deepcopy(net), batches, device=dev, speed=speed, steps=steps, warmup=warmup,
                                   on_step=bar.update)
            if dev.type == "cuda":  # per-step synchronisation hides the overlap training has
                try:
                    times.steady = throughput(copy.deepcopy(net), batches, device=dev, speed=speed, steps=steps,
                                              warmup=2, on_step=bar.update)
                except TrainfastError:  # one-shot data, used up by the breakdown
                    pass
        roof = roofline(cost, times, peaks, speed.precision)
        found = verdict(times, roof)
        report = Report(name, described, hardware.describe(dev), peaks, cost, speed, times, roof, found,
                        data_side=_data_side(batches))
        if src is not None and src.files:
            log("reading a sample of the files apart from decoding (storage throughput)…")
            read = read_throughput(src.files)
            if read is not None:
                sentence, bound = storage_sentence(read, times.data / max(times.batch_size, 1))
                report.storage = {**read.to_dict(), "sentence": sentence, "storage_bound": bound}
        if try_fixes:
            report.other_load = load.so_far()  # what the fixes' titles say; the whole run's replaces it below
            log("trying the fixes on the spot…")
            with _bar(progress, _TRIAL_STEPS, "trying fixes") as bar:
                report.recommendations = _recommendations(net, report, dev, src, pk, log, bar)
    report.other_load, report.load_warning = load.cores, load.warning()
    report.seconds = time.perf_counter() - started
    return report


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


# --- recommendations: try each fix for a few steps ---------------------------------------------

_TRIAL_STEPS = 8  # steps of each fix's trial: 2 warm-up, 6 timed


def _bar(progress: bool, total: int, desc: str):
    """A progress bar (a widget in a notebook, a line on stderr in a terminal) that vanishes when done."""
    from trainfast.progress import tqdm
    return tqdm(total=total, desc=desc, unit="step", disable=not progress, leave=False)


def _compute_rate(net, shape, out_shape, speed: Speed, dev, on_step=None) -> float | None:
    """images/s of the compute side alone (batches already on the device), or None on failure."""
    data = synthetic_batches(shape, out_shape, speed.batch_size, dev)
    try:
        return throughput(copy.deepcopy(net), data, device=dev, speed=speed, steps=_TRIAL_STEPS - 2, warmup=2,
                          on_step=on_step)
    except (RuntimeError, torch.cuda.OutOfMemoryError):
        return None


def _output_shape(net, shape, dev) -> tuple:
    out = getattr(net, "output_shape", None)
    if out is not None:
        return tuple(out)
    return tuple(_step.first_forward(copy.deepcopy(net), torch.zeros((2, *shape)), f"inputs of shape {shape}").shape[1:])


def _recommendations(net, report: Report, dev, src, pk, log, bar) -> list[Recommendation]:
    recs: list[Recommendation] = []
    t, speed = report.times, report.speed
    shape = report.cost.input_shape
    out_shape = _output_shape(net, shape, dev)
    compute_step = t.step - t.data  # what a step would cost with no data wait
    cmd_model = report.model

    # 1. the input side
    if t.share("data") >= 0.05:
        if src is not None:
            per_batch = _loader_seconds_per_batch(src, shape, t.batch_size, dev)
            new = compute_step + per_batch
            storage = report.storage or {}
            recs.append(Recommendation(
                "Pack the images once onto a local disk, then stream the pack" if storage.get("storage_bound")
                else "Pack the images once, then stream the pack",
                f"{src.pack_command('DATA.pack', f'{shape[1]}x{shape[2]}')}\n"
                f"trainfast train DATA.pack --model {shell_arg(cmd_model)}",
                t.step / new, True,
                f"a pack of a sample of your files loads a batch in {units.ms(per_batch)} ms; your pipeline "
                f"took {units.ms(t.data)} ms" + (f"; {storage['sentence']}" if storage else "")))
        elif pk is not None:
            recs += _loader_fixes(pk, t, compute_step, dev, log)
        else:
            recs.append(Recommendation(
                "Take the data wait off the step: pack the data, or prepare batches in parallel",
                "trainfast pack SOURCE DATA.pack --size HxW   (then trainfast.Loader(DATA.pack, ...))\n"
                "or: DataLoader(..., num_workers=<cores>, pin_memory=True, persistent_workers=True)",
                t.step / max(compute_step, 1e-9), False,
                f"estimate: the step without its {units.ms(t.data)} ms data wait"))

    # 2. the compute side: precision, memory format, batch size, threads
    base = _compute_rate(net, shape, out_shape, speed, dev, bar.update)
    if base:
        candidates = []
        if _step.supports_bf16(dev) and speed.precision == "fp32":
            candidates.append((replace(speed, precision="bf16"), "bf16 autocast",
                               "with torch.autocast(device_type, dtype=torch.bfloat16): out = model(x)"))
        if "fp16" in hardware.fast_precisions(dev) and speed.precision == "fp32":
            candidates.append((replace(speed, precision="fp16"), "fp16 autocast + GradScaler",
                               "torch.autocast('cuda', dtype=torch.float16) and torch.amp.GradScaler('cuda')"))
        if not speed.channels_last:
            candidates.append((replace(speed, channels_last=True), "channels_last memory format",
                               "model.to(memory_format=torch.channels_last); x = x.contiguous(memory_format=torch.channels_last)"))
            if _step.supports_bf16(dev) and speed.precision == "fp32":
                candidates.append((replace(speed, precision="bf16", channels_last=True), "bf16 autocast + channels_last",
                                   "model.to(memory_format=torch.channels_last) and "
                                   "torch.autocast(device_type, dtype=torch.bfloat16) around the forward"))
        if speed.batch_size < 64:
            bigger = min(speed.batch_size * 4, 128)
            candidates.append((replace(speed, batch_size=bigger), f"batch size {bigger}",
                               f"--batch-size {bigger} (scale the learning rate with it)"))
        cores, threads = hardware.physical_cores(), torch.get_num_threads()
        if dev.type == "cpu" and threads < cores:
            candidates.append((replace(speed, threads=cores), f"{cores} intra-op threads",
                               f"torch.set_num_threads({cores})"))
        elif dev.type == "cpu" and threads >= 2:  # timed, not inferred from the others' CPU use: a program
            half = threads // 2  # at low priority yields its core; one at equal priority holds up a thread
            busy = " while other programs keep cores busy (Cores, below)" if hardware.is_busy(report.other_load) else ""
            candidates.append((replace(speed, threads=half), f"{half} intra-op thread{'s' * (half != 1)}{busy}",
                               f"torch.set_num_threads({half})   (trainfast train times its threads itself, "
                               "as it runs)"))
        bar.total += _TRIAL_STEPS * len(candidates)
        bar.refresh()
        for cand, title, action in candidates:
            log(f"  trying {title}…")
            rate = _compute_rate(net, shape, out_shape, cand, dev, bar.update)
            if rate is None:
                continue
            gain = rate / base
            new_step = t.data + compute_step / gain
            # fewer threads for the load: trainfast train follows it by itself (a pinned --threads would stop that)
            train = "" if cand.threads and cand.threads < threads else f"\ntrainfast train … {_train_flags(cand)}"
            recs.append(Recommendation(title, action + train, t.step / new_step, True,
                                       f"compute side {units.rate(base)} → {units.rate(rate)} images/s"))
        torch.set_num_threads(report.system["torch_threads"])

    # 3. the device itself
    info = report.system
    if dev.type == "cpu" and info["cuda_available"]:
        recs.append(Recommendation("Train on the GPU", "--device cuda", 0.0, False,
                                   "a CUDA GPU is present and unused"))
    elif dev.type == "cpu" and info["nvidia_gpu_present"] and info["torch_cuda_build"] is None:
        recs.append(Recommendation("Install a CUDA build of torch", "pip install torch (a CUDA build)", 0.0, False,
                                   "an NVIDIA GPU is present, but this torch is a CPU-only build"))
    kept = [r for r in recs if r.speedup == 0.0 or r.speedup >= 1.05]
    if not any(r.measured for r in kept):
        tried = ", ".join(f"{r.title} ×{r.speedup:.2f}" for r in recs if r.measured)
        report.fixes_note = "no fix measured ≥ 5% faster" + (f" (tried: {tried})" if tried else "")
    return sorted(kept, key=lambda r: -r.speedup)


def _train_flags(s: Speed) -> str:
    flags = [f"--precision {s.precision}"] + (["--channels-last"] if s.channels_last else []) + [f"--batch-size {s.batch_size}"]
    return " ".join(flags) + (f" --threads {s.threads}" if s.threads else "")


def seconds_per_batch(loader: Loader) -> float:
    """The Loader alone, after a warm-up epoch: seconds per batch over at least 3 epochs and 0.3 s."""
    for _ in loader:
        pass
    sync = torch.cuda.synchronize if loader.device.type == "cuda" else (lambda: None)
    sync()
    t, count = time.perf_counter(), 0
    while count < 3 * len(loader) or time.perf_counter() - t < 0.3:
        for _ in loader:
            count += 1
    sync()
    return (time.perf_counter() - t) / count


def _loader_fixes(pk: Pack, t: StepTimes, compute_step: float, dev, log) -> list[Recommendation]:
    """Loader settings that measurably feed batches faster than the doctor's own Loader did: more
    threads, the pack kept on the GPU, JPEG decoded on the GPU. Each timed on the Loader alone;
    with batches prepared ahead, a step then waits max(0, per batch - compute) for data."""
    def make(**kw):
        return Loader(pk, t.batch_size, device=dev, drop_last=True, **kw)
    now = make()
    base = seconds_per_batch(now)
    tries = [(f"Give the Loader {w} threads", f"trainfast.Loader(pack, ..., workers={w})", {"workers": w})
             for w in (now.workers * 2, now.workers * 4) if w <= 4 * hardware.usable_cores()]
    if dev.type == "cuda" and pk.encoding == "raw" and not now.resident:
        tries.append(("Keep the pack on the GPU", "trainfast.Loader(pack, ..., resident=True)", {"resident": True}))
    if pk.encoding == "jpeg" and not now.decodes_on_device:
        tries.append(("Decode the JPEG pack on the GPU", "pip install 'trainfast[gpu]'; "
                      "trainfast.Loader(pack, ..., decode='gpu')", {"decode": "gpu"}))
    recs = []
    for title, action, kw in tries:
        log(f"  trying {title.lower()}…")
        try:
            per_batch = seconds_per_batch(make(**kw))
        except (TrainfastError, RuntimeError):  # does not fit, or no GPU decoder here
            continue
        if per_batch < base * 0.9:
            new = compute_step + max(0.0, per_batch - compute_step)
            recs.append(Recommendation(title, action, t.step / max(new, 1e-9), True,
                                       f"data side, the Loader alone: {units.ms(base)} → {units.ms(per_batch)} ms per batch "
                                       f"({now.describe()} now)"))
    return recs


def _loader_seconds_per_batch(src: Source, shape, batch_size: int, dev) -> float:
    """Pack a sample of the files, then time the Loader's batches on it (seconds per batch)."""
    from trainfast.diagnose.recipe import sample_pack

    with files.scratch("doctor") as tmp:
        pk = sample_pack(src, tuple(shape[1:]), shape[0], batch_size, tmp)
        return seconds_per_batch(Loader(pk, min(batch_size, len(pk)), device=dev, drop_last=True))

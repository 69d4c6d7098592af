"""The doctor's fixes, tried on the spot (`trainfast.doctor`, try_fixes): each candidate is timed
for a few steps against the step's own setting and kept where it gains 5% or more: the data wait
taken off (a pack of a sample of the files, the Loader's settings), the compute side's settings
(precision, memory format, batch size, threads, on a CPU trainfast's rewrites), and the device itself."""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import torch

from trainfast import files, hardware, units
from trainfast import step as _step
from trainfast.config import Speed
from trainfast.data.format import Pack
from trainfast.data.loader import Loader
from trainfast.data.sources import Source
from trainfast.diagnose.timing import StepTimes, synthetic_batches, throughput
from trainfast.diagnose.verdict import Recommendation
from trainfast.errors import TrainfastError
from trainfast.models import rewrite
from trainfast.units import shell_arg

TRIAL_STEPS = 8  # steps of each fix's trial: 2 warm-up, 6 timed


def _compute_rate(net, shape, out_shape, speed: Speed, dev, on_step=None) -> float | None:
    """images/s of the compute side alone (batches already on the device), or None on failure."""
    data = synthetic_batches(shape, out_shape, speed.batch_size, dev)
    try:
        return throughput(copy.deepcopy(net), data, device=dev, speed=speed, steps=TRIAL_STEPS - 2, warmup=2,
                          on_step=on_step)
    except (RuntimeError, torch.cuda.OutOfMemoryError):
        return None


def _output_shape(net, shape, dev) -> tuple:
    out = getattr(net, "output_shape", None)
    if out is not None:
        return tuple(out)
    return tuple(_step.first_forward(copy.deepcopy(net), torch.zeros((2, *shape)), f"inputs of shape {shape}").shape[1:])


def recommendations(net, report, dev, src, pk, log, bar) -> list[Recommendation]:
    """What would make the step faster, each measured where it can be: the input side, the
    compute side (precision, memory format, batch size, threads), the device itself; those
    under 5% dropped (said in report.fixes_note where none is left), the largest gain first."""
    t = report.times
    compute_step = t.step - t.data  # what a step would cost with no data wait
    recs = _input_fixes(report, src, pk, compute_step, dev, log) if t.share("data") >= 0.05 else []
    recs += _compute_fixes(net, report, compute_step, dev, log, bar)
    recs += _device_fixes(report.system, dev)
    kept = [r for r in recs if r.speedup == 0.0 or r.speedup >= 1.05]
    if not any(r.measured for r in kept):
        tried = ", ".join(f"{r.title} ×{r.speedup:.2f}" for r in recs if r.measured)
        report.fixes_note = "no fix measured ≥ 5% faster" + (f" (tried: {tried})" if tried else "")
    return sorted(kept, key=lambda r: -r.speedup)


def _input_fixes(report, src, pk, compute_step: float, dev, log) -> list[Recommendation]:
    """The data wait taken off the step: a pack of the source (a sample of it packed and timed),
    the Loader's own settings for a pack, or an estimate where neither is known."""
    t, shape = report.times, report.cost.input_shape
    if src is not None:
        per_batch = _loader_seconds_per_batch(src, shape, t.batch_size, dev)
        storage = report.storage or {}
        return [Recommendation(
            "Pack the images once onto a local disk, then stream the pack" if storage.get("storage_bound")
            else "Pack the images once, then stream the pack",
            f"{src.pack_command('DATA.pack', f'{shape[1]}x{shape[2]}')}\n"
            f"trainfast train DATA.pack --model {shell_arg(report.model)}",
            t.step / (compute_step + per_batch), True,
            f"a pack of a sample of your files loads a batch in {units.ms(per_batch)} ms; your pipeline "
            f"took {units.ms(t.data)} ms" + (f"; {storage['sentence']}" if storage else ""))]
    if pk is not None:
        return _loader_fixes(pk, t, compute_step, dev, log)
    return [Recommendation(
        "Take the data wait off the step: pack the data, or prepare batches in parallel",
        "trainfast pack SOURCE DATA.pack --size HxW   (then trainfast.Loader(DATA.pack, ...))\n"
        "or: DataLoader(..., num_workers=<cores>, pin_memory=True, persistent_workers=True)",
        t.step / max(compute_step, 1e-9), False,
        f"estimate: the step without its {units.ms(t.data)} ms data wait")]


def _compute_candidates(speed: Speed, dev, other_load, net=None) -> list[tuple[Speed, str, str]]:
    """The settings worth timing against the step's own: (setting, title, what to write)."""
    candidates = []
    if dev.type == "cpu" and net is not None and not speed.rewrites and rewrite.applies(net):
        # on a CPU torch's dropout draws its mask one element at a time (27% of the 512² classifier's step)
        candidates.append((replace(speed, rewrites=rewrite.ALL), "trainfast's rewrites (cheaper dropout masks, "
                           "pooling before ReLU, ReLU in place)",
                           "from trainfast.models import rewrite; rewrite.apply(model, rewrite.ALL)   "
                           "(trainfast train applies them where they pay)"))
    bf16 = _step.supports_bf16(dev) and speed.precision == "fp32"
    if bf16:
        candidates.append((replace(speed, precision="bf16"), "bf16 autocast",
                           "with torch.autocast(device_type, dtype=torch.bfloat16): out = model(x)"))
    if "fp16" in hardware.fast_precisions(dev) and speed.precision == "fp32":
        candidates.append((replace(speed, precision="fp16"), "fp16 autocast + GradScaler",
                           "torch.autocast('cuda', dtype=torch.float16) and torch.amp.GradScaler('cuda')"))
    if not speed.channels_last:
        candidates.append((replace(speed, channels_last=True), "channels_last memory format",
                           "model.to(memory_format=torch.channels_last); x = x.contiguous(memory_format=torch.channels_last)"))
        if bf16:
            candidates.append((replace(speed, precision="bf16", channels_last=True), "bf16 autocast + channels_last",
                               "model.to(memory_format=torch.channels_last) and "
                               "torch.autocast(device_type, dtype=torch.bfloat16) around the forward"))
    if speed.batch_size < 64:
        bigger = min(speed.batch_size * 4, 128)
        candidates.append((replace(speed, batch_size=bigger), f"batch size {bigger}",
                           f"--batch-size {bigger} (scale the learning rate with it)"))
    cores, threads = hardware.physical_cores(), torch.get_num_threads()
    if dev.type == "cpu" and threads < cores:
        candidates.append((replace(speed, threads=cores), f"{cores} intra-op threads", f"torch.set_num_threads({cores})"))
    elif dev.type == "cpu" and threads >= 2:  # timed, not inferred from the others' CPU use: a program
        half = threads // 2  # at low priority yields its core; one at equal priority holds up a thread
        busy = " while other programs keep cores busy (Cores, below)" if hardware.is_busy(other_load) else ""
        candidates.append((replace(speed, threads=half), f"{half} intra-op thread{'s' * (half != 1)}{busy}",
                           f"torch.set_num_threads({half})   (trainfast train times its threads itself, as it runs)"))
    return candidates


def _compute_fixes(net, report, compute_step: float, dev, log, bar) -> list[Recommendation]:
    """Each candidate setting timed on the compute side, its gain on the whole step."""
    t, speed, shape = report.times, report.speed, report.cost.input_shape
    out_shape = _output_shape(net, shape, dev)
    base = _compute_rate(net, shape, out_shape, speed, dev, bar.update)
    if not base:
        return []
    candidates = _compute_candidates(speed, dev, report.other_load, net)
    bar.total += TRIAL_STEPS * len(candidates)
    bar.refresh()
    threads, recs = torch.get_num_threads(), []
    for cand, title, action in candidates:
        log(f"  trying {title}…")
        rate = _compute_rate(net, shape, out_shape, cand, dev, bar.update)
        if rate is None:
            continue
        new_step = t.data + compute_step * base / rate
        # fewer threads for the load: trainfast train follows it by itself (a pinned --threads would stop that)
        train = "" if cand.threads and cand.threads < threads else f"\ntrainfast train … {_train_flags(cand)}"
        recs.append(Recommendation(title, action + train, t.step / new_step, True,
                                   f"compute side {units.rate(base)} → {units.rate(rate)} images/s"))
    torch.set_num_threads(report.system["torch_threads"])
    return recs


def _device_fixes(info: dict, dev) -> list[Recommendation]:
    """A GPU present and unused, or present with a CPU-only torch."""
    if dev.type == "cpu" and info["cuda_available"]:
        return [Recommendation("Train on the GPU", "--device cuda", 0.0, False, "a CUDA GPU is present and unused")]
    if dev.type == "cpu" and info["nvidia_gpu_present"] and info["torch_cuda_build"] is None:
        return [Recommendation("Install a CUDA build of torch", "pip install torch (a CUDA build)", 0.0, False,
                               "an NVIDIA GPU is present, but this torch is a CPU-only build")]
    return []


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

"""`trainfast doctor -- python train.py`: diagnose a user's own training script, unedited.

The script runs in this process (runpy, as `python` would run it) with probes installed
around the places every training loop passes through:

- PyTorch: each DataLoader iterator's `__next__` (data wait), `torch.autograd.backward`
  (backward), the optimizer step (global pre/post hooks; a step is one training step), and
  the outermost module call (the model, its input shape and device).
- Keras 3 (any backend): `Model.fit` gets a callback (one training step per batch) and its
  data is wrapped: a PyDataset/Sequence's `__getitem__` or a generator's `next` is timed.
- A sampling thread reads the Python stack of every thread that is inside the data pipeline
  every few milliseconds, so the report can name the functions the data time goes to.

After the warm-up steps it measures `steps` steps (or until `seconds` run out), then stops
the script by raising an exception that `except Exception` does not catch, and reports.
"""

from __future__ import annotations

import html
import importlib.abc
import importlib.util
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainfast import hardware, units
from trainfast.diagnose.probes import (
    _OURS,
    WARMUP,
    Step,
    StopScript,
    _install_torch,
    _keras_layers,
    _KerasWatcher,
    _patch_keras,
    _Probe,
    _torch_layers,
)
from trainfast.diagnose.verdict import HIGHLY_INPUT_BOUND, MODERATELY_INPUT_BOUND
from trainfast.errors import TrainfastError

SCHEMA_VERSION = 1


@dataclass
class ScriptReport:
    """What `doctor_script` measured; `.text()`, `.to_dict()` and `.html()` render it."""

    command: list[str]
    framework: str  # "pytorch", "keras" or "none" (it never trained)
    stopped: str  # why the run ended
    steps: list[Step]
    warmup: int
    system: dict
    data_source: dict = field(default_factory=dict)  # kind, num_workers, pin_memory, batch_size ...
    devices: dict = field(default_factory=dict)  # "model": [...], "batches": [...]
    batches_drawn: int = 0
    generator_s_per_batch: float | None = None
    data_functions: list[tuple[str, float]] = field(default_factory=list)  # (name, share of data samples)
    busy_functions: list[tuple[str, float]] = field(default_factory=list)  # whole-run samples (never trained)
    layers: list[dict] = field(default_factory=list)
    model: dict = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)
    error: str = ""  # the script's own traceback, when it failed
    seconds: float = 0.0

    @property
    def timed(self) -> list[Step]:
        return self.steps[self.warmup:] if len(self.steps) > self.warmup else self.steps[1:]

    def mean(self, stage: str) -> float:
        t = self.timed
        if stage == "data" and self.fetched_ahead:
            return sum(min(s.generator, s.seconds) for s in t) / len(t)
        return sum(getattr(s, stage) for s in t) / len(t) if t else 0.0

    @property
    def fetched_ahead(self) -> bool:
        """Keras ran the data source on another thread: its time stands in for the wait (an upper bound)."""
        t = self.timed
        return bool(t) and self.framework == "keras" and sum(s.data for s in t) == 0 and sum(s.generator for s in t) > 0

    @property
    def data_share(self) -> float:
        step = self.mean("seconds")
        return min(self.mean("data") / step, 1.0) if step else 0.0

    @property
    def verdict(self) -> str:
        if not self.timed:
            return ("never trained: no training step completed" if not self.steps else
                    "too few steps to judge: only the warm-up step completed")
        d = self.data_share
        if d >= HIGHLY_INPUT_BOUND:
            return f"highly input-bound: {d:.0%} of each step waits for data (≥ {HIGHLY_INPUT_BOUND:.0%})"
        if d >= MODERATELY_INPUT_BOUND:
            return f"moderately input-bound: {d:.0%} of each step waits for data"
        return f"not input-bound: data wait is {d:.0%} of the step; the model's own work sets the pace"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(schema=SCHEMA_VERSION, verdict=self.verdict, data_share=self.data_share,
                 mean={s: self.mean(s) for s in ("seconds", "data", "backward", "optimizer")})
        return d

    def text(self) -> str:
        return render_text(self)

    def html(self) -> str:
        return render_html(self)


# -- running --------------------------------------------------------------------------------

def _target(command: list[str]) -> tuple[str, str, list[str]]:
    """('path', script, argv) or ('module', name, argv) from `python [-m mod | script] args...`."""
    cmd = list(command)
    if cmd and (Path(cmd[0]).name.startswith("python") or cmd[0] == sys.executable):
        cmd = cmd[1:]
    if not cmd:
        raise TrainfastError("give the command after --, e.g. trainfast doctor -- python train.py")
    if cmd[0] == "-m":
        if len(cmd) < 2:
            raise TrainfastError("-m needs a module name, e.g. trainfast doctor -- python -m mypkg.train")
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the current directory comes first
        try:
            found = importlib.util.find_spec(cmd[1]) is not None
        except ImportError:  # a parent package that is missing
            found = False
        finally:
            sys.path.remove(os.getcwd())
        if not found:
            raise TrainfastError(f"no module named {cmd[1]!r} (is it importable from {os.getcwd()}?)")
        return "module", cmd[1], [cmd[1], *cmd[2:]]
    if cmd[0].startswith("-"):
        raise TrainfastError(f"python option {cmd[0]!r} is not supported here; give a script or -m module")
    script = Path(cmd[0])
    if not script.is_file():
        raise TrainfastError(f"{script}: no such script")
    return "path", str(script), [str(script), *cmd[1:]]


def _script_traceback(exc: BaseException) -> str:
    """The traceback as the script's own: frames from trainfast and runpy left out."""
    tb = exc.__traceback__
    frames = [f for f in traceback.extract_tb(tb) if not any(m in f.filename for m in ("runpy.py", "<frozen runpy>", _OURS))]
    return "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) + \
        "".join(traceback.format_exception_only(type(exc), exc))


def doctor_script(command: list[str], *, steps: int = 50, seconds: float = 120.0, warmup: int = WARMUP,
                  log=print) -> ScriptReport:
    """Run `command` (python SCRIPT args / python -m MODULE args) here, instrumented, and report."""
    if steps < 1:
        raise TrainfastError(f"--steps must be ≥ 1, not {steps}")
    if seconds <= 0:
        raise TrainfastError(f"--seconds must be > 0, not {seconds}")
    kind, target, argv = _target(command)
    probe = _Probe(steps, seconds, warmup)
    undo: list = []
    watcher = _KerasWatcher(probe, undo)
    if "keras" in sys.modules:
        _patch_keras(sys.modules["keras"], probe, undo)
        watcher.done = True
    sys.meta_path.insert(0, watcher)
    undo.append(lambda: sys.meta_path.remove(watcher))
    _install_torch(probe, undo)
    stop = threading.Event()
    sampler = threading.Thread(target=probe.sample_forever, args=(stop,), daemon=True, name="trainfast-sampler")
    old_argv, old_path = sys.argv, list(sys.path)
    old_alarm = None
    if hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread():
        def on_alarm(signum, frame):
            raise StopScript("time limit reached")
        old_alarm = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds + 1.0)
    stopped, error = "the script finished", ""
    log(f"trainfast doctor: running {' '.join(command)} for up to {steps} steps after {warmup} warm-up, "
        f"or {seconds:.0f} s")
    sys.argv = argv
    sys.path.insert(0, str(Path(target).resolve().parent) if kind == "path" else os.getcwd())
    sampler.start()
    try:
        if kind == "path":
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except StopScript as e:
        stopped = e.reason
    except SystemExit as e:
        stopped = f"the script exited (status {e.code})" if e.code not in (None, 0) else "the script finished"
        if e.code not in (None, 0):
            error = f"SystemExit: {e.code}"
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - the script's failure is reported as its own
        stopped, error = f"the script failed: {type(e).__name__}: {e}", _script_traceback(e)
    finally:
        if old_alarm is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_alarm)
        stop.set()
        sampler.join()
        sys.argv, sys.path[:] = old_argv, old_path
        for u in reversed(undo):
            u()
    return _report(command, probe, stopped, error)


def _report(command, probe: _Probe, stopped: str, error: str) -> ScriptReport:
    import torch

    dev = "cuda" if probe.cuda else "cpu"
    system = {"device": dev, "cpu": hardware.cpu_model(), "physical_cores": hardware.physical_cores(),
              "usable_cores": hardware.usable_cores(), "torch_threads": torch.get_num_threads(),
              "cuda_available": torch.cuda.is_available(), "torch": torch.__version__}
    r = ScriptReport(command=list(command), framework=probe.framework, stopped=stopped, steps=probe.steps,
                     warmup=min(probe.warmup, max(len(probe.steps) - 1, 0)), system=system,
                     data_source=probe.data_source,
                     devices={k: sorted(v) for k, v in probe.devices.items()}, batches_drawn=probe.batches,
                     data_functions=probe.top("data"), error=error, seconds=time.perf_counter() - probe.started)
    if probe.generator_times:
        g = sorted(probe.generator_times[probe.warmup:] or probe.generator_times)
        r.generator_s_per_batch = g[len(g) // 2]
    if not probe.steps:
        r.busy_functions = probe.top("all")
    if probe.framework == "keras" and probe.keras_model is not None:
        r.layers, r.model = _keras_layers(probe.keras_model)
        keras = sys.modules.get("keras")
        r.devices["model"] = [f"keras {keras.backend.backend()} backend"] if keras else []
    elif probe.model_ref is not None:
        r.layers, r.model, model_findings = _torch_layers(probe)
        r.findings += model_findings
    r.findings += _findings(r)
    r.findings += _storage_findings(r)
    return r


def _storage_findings(r: ScriptReport, max_files: int = 4096) -> list[str]:
    """Where a data-bound script's files live: for each image folder (or a CSV's folder) named
    on its command line, the files read alone, cold, against the data time per image."""
    batch = sorted(s.batch_size for s in r.timed if s.batch_size)
    if not (r.timed and r.data_share >= MODERATELY_INPUT_BOUND and batch):
        return []
    from trainfast.data.sources import IMAGE_EXTENSIONS
    from trainfast.diagnose.storage import read_throughput, storage_sentence

    out = []
    for arg in dict.fromkeys(r.command[1:]):  # each once, in order
        root = (os.path.dirname(arg) or ".") if arg.lower().endswith(".csv") and os.path.isfile(arg) else arg
        if not os.path.isdir(root):
            continue
        files, until = [], time.perf_counter() + 1.0  # a large tree named for another reason: a second at most
        for dirpath, dirnames, names in os.walk(root):
            dirnames.sort()
            files += [os.path.join(dirpath, n) for n in sorted(names) if n.lower().endswith(IMAGE_EXTENSIONS)]
            if len(files) >= max_files or time.perf_counter() > until:
                break
        read = read_throughput(files[:max_files]) if files else None
        if read is not None:
            sentence, _ = storage_sentence(read, r.mean("data") / batch[len(batch) // 2])
            out.append(f"the images under {arg} (named on the command line): {sentence}")
    return out


def _findings(r: ScriptReport) -> list[str]:
    out = []
    src, s = r.data_source, r.system
    if r.timed and r.data_share >= MODERATELY_INPUT_BOUND and src.get("reads") == "a trainfast pack":
        out.append(f"the batches already come from a trainfast pack, whose reader needs about a millisecond per "
                   f"batch on its own; the {r.data_share:.0%} counted as data wait is mostly that reader waiting for "
                   f"the {s['usable_cores']} cores the train step is using. The train step itself is what is left "
                   "to speed up (mixed precision, a larger batch; `trainfast tune` measures which wins)")
    elif r.timed and r.data_share >= MODERATELY_INPUT_BOUND:
        culprit = _culprit(r.data_functions)
        culprit = f" — most of it in {culprit}" if culprit else ""
        out.append(f"the data pipeline holds back training ({r.data_share:.0%} of each step{culprit}). If it "
                   "decodes or resizes files per batch, do that once with `trainfast pack` and read the pack with "
                   "trainfast.Loader (PyTorch) or trainfast.keras.PackDataset (Keras)")
        if src.get("num_workers") == 0:
            out.append("the DataLoader has num_workers=0: every batch is prepared in the training loop itself")
    if r.fetched_ahead:
        out.append("Keras ran the data source on a worker thread; its time per step is counted as data wait "
                   "(an upper bound: some of it may overlap the step)")
    if (src.get("num_workers") or 0) > 0 and not r.data_functions:
        out.append(f"the DataLoader's {src['num_workers']} worker processes prepare the batches; the doctor cannot "
                   "sample inside them: rerun with num_workers=0 to have the slow functions named")
    if "cuda" in " ".join(r.devices.get("model", [])) and src.get("pin_memory") is False:
        out.append("the model is on CUDA but the DataLoader does not pin memory: pin_memory=True lets the copies "
                   "run asynchronously")
    if s["cuda_available"] and r.devices.get("model") and not any("cuda" in d for d in r.devices["model"]):
        out.append("a CUDA GPU is available but the model is on the CPU")
    if s["torch_threads"] < s["usable_cores"] and r.framework == "pytorch":
        out.append(f"torch uses {s['torch_threads']} threads on {s['usable_cores']} usable cores "
                   "(torch.set_num_threads)")
    return out


def _culprit(functions: list[tuple[str, float]]) -> str:
    """The library function to blame: the busiest one not in the script itself (its own
    __getitem__ contains everything), else the busiest one; none below a fifth of the time."""
    lib = [(n, s) for n, s in functions if ".py:" not in n]
    if not (lib or functions):
        return ""
    name, share = (lib or functions)[0]
    return f"{name} ({share:.0%} of the data time)" if share >= 0.2 else ""


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} "


def stage_parts(r: ScriptReport) -> list[tuple[str, float]]:
    """(stage, mean seconds per step) as far as the script's framework lets them be told apart."""
    parts = [("data wait", r.mean("data"))]
    if r.framework == "pytorch":
        parts += [("backward", r.mean("backward")), ("optimizer", r.mean("optimizer"))]
    rest = "forward+rest" if r.framework == "pytorch" else "train step"
    return parts + [(rest, max(r.mean("seconds") - sum(v for _, v in parts), 0.0))]


def render_html(r: ScriptReport) -> str:
    """The verdict and findings as HTML text, the step chart, then the full text report."""
    from trainfast.diagnose.report import page, stages_chart
    e = html.escape
    body = [f'<p class="verdict">{e(r.verdict)}</p>']
    if r.findings:
        body.append("<h2>What to do</h2><ul>" + "".join(f"<li>{e(f)}</li>" for f in r.findings) + "</ul>")
    if r.data_functions:
        body.append("<h2>Where the data time goes</h2><ul>"
                    + "".join(f"<li>{share:.0%} {e(name)}</li>" for name, share in r.data_functions) + "</ul>")
    if r.timed:
        body.append(f'<h2>Step-time breakdown</h2><div id="step-breakdown">'
                    f'{stages_chart([(n, v * 1e3) for n, v in stage_parts(r)])}</div>')
    body.append(f"<details><summary>Full report (text)</summary><pre>{e(render_text(r))}</pre></details>")
    return page(f"trainfast doctor — {' '.join(r.command)}", "".join(body))


def render_text(r: ScriptReport) -> str:
    lines = [f"trainfast doctor — {' '.join(r.command)}",
             f"{r.framework if r.framework != 'none' else 'no training steps seen'}; {r.stopped}; "
             f"{len(r.timed)} timed steps after {r.warmup} warm-up; device {r.system['device']}", "",
             f"VERDICT  {r.verdict}"]
    if r.timed:
        step = r.mean("seconds")
        bs = Counter(s.batch_size for s in r.timed).most_common(1)[0][0]  # not the epoch's short last batch
        rate = f"; {units.rate(bs / step)} images/s at batch {bs}" if bs else ""
        lines.append(f"         {units.ms(step)} ms per step{rate}")
        lines += ["", "Where the time goes (mean per step)"]
        for name, v in stage_parts(r):
            share = v / step if step else 0.0
            lines.append(f"  {name:12s} {'█' * round(share * 40):40s} {units.ms(v):>9s} ms {share:5.0%}")
    if r.data_source or r.batches_drawn:
        lines += ["", "Data pipeline"]
        if r.data_source:
            lines.append("  " + ", ".join(f"{k} {v}" for k, v in r.data_source.items()))
        lines.append(f"  batches drawn: {r.batches_drawn}" + (f"; the generator takes {units.ms(r.generator_s_per_batch)} "
                                                               "ms per batch" if r.generator_s_per_batch else ""))
        if r.data_functions:
            lines.append("  where the data time goes (share of sampled time inside the data pipeline):")
            lines += [f"    {share:5.0%}  {name}" for name, share in r.data_functions]
    if r.busy_functions:
        lines += ["", "What the script did instead (share of sampled time)"]
        lines += [f"    {share:5.0%}  {name}" for name, share in r.busy_functions]
    if r.findings:
        lines += ["", "Findings"] + [f"  - {f}" for f in r.findings]
    s = r.system
    lines += ["", "System",
              f"  CPU {s['cpu']}: {s['physical_cores']} physical cores ({s['usable_cores']} usable), torch "
              f"{s['torch_threads']} threads; CUDA {'available' if s['cuda_available'] else 'not available'}; "
              f"torch {s['torch']}"]
    if r.devices.get("model") or r.devices.get("batches"):
        lines.append(f"  model on {', '.join(r.devices.get('model') or ['?'])}; batches drawn on "
                     f"{', '.join(r.devices.get('batches') or ['?'])}")
    if r.layers:
        m = r.model
        lines += ["", f"Model{' ' + m['class'] if m.get('class') else ''}: {m['params']:,} parameters, "
                      f"{_si(m['forward_flops'])}FLOP forward per image"]
        for l in r.layers:
            ps = l["params"] / max(m["params"], 1)
            fs = l["flops"] / max(m["forward_flops"], 1)
            lines.append(f"  {l['name'][:22]:22s} {l['kind'][:14]:14s} {'×'.join(map(str, l['output'])):>14s} "
                         f"{l['params']:>11,} {ps:4.0%} {_si(l['flops']):>9s} {fs:4.0%}")
    lines += ["", f"({r.seconds:.0f} s)"]
    return "\n".join(lines)

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

import contextlib
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
    _install_open_watch,
    _install_torch,
    keras_layers,
    _KerasWatcher,
    _patch_keras,
    _Probe,
    _tensors,
    _torch_layers,
)
from trainfast.diagnose.verdict import HIGHLY_INPUT_BOUND, MODERATELY_INPUT_BOUND, Recommendation
from trainfast.errors import TrainfastError

SCHEMA_VERSION = 1
OVERRUN_S = 10.0  # how long past its time limit a script that ignores the stop may run before the watchdog ends it


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
    recommendations: list[Recommendation] = field(default_factory=list)  # measured fixes, best first
    load_warning: str = ""  # other programs kept cores busy while the script ran
    other_cores: float | None = None
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
                  fixes: bool = True, log=print, quiet_stdout: bool = False, on_overrun=None) -> ScriptReport:
    """Run `command` (python SCRIPT args / python -m MODULE args) here, instrumented, and report.

    With fixes (the default) the report's fixes are measured after the script stopped: its images
    packed (a sample) and fed to its own model, and, for Keras, Keras's own speed settings timed
    on a copy of its model (`trainfast.keras.tune`, up to keras.doctor.KERAS_TUNE_S seconds).

    quiet_stdout sends what the script prints to standard output to standard error instead (the
    report goes to standard output, as JSON). on_overrun(report) is called from a watchdog thread
    with what was measured when the script has not stopped OVERRUN_S after the time limit (it
    ignored the stop: a bare `except:`, SIGALRM caught), then the process exits (status 1): with
    on_overrun the time limit holds whatever the script catches.
    Whatever the script does, one report comes out: os._exit in the script stops it like the end
    of a step, and a process the script forks never reports."""
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
    _install_open_watch(probe, undo)
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
    pid, real_exit = os.getpid(), os._exit

    def script_exit(code=0):  # the script's os._exit: the end of the run, reported, not of this process
        if os.getpid() != pid:
            real_exit(code)  # a forked child (multiprocessing ends its workers so)
        raise StopScript(f"the script called os._exit({code})")
    os._exit = script_exit
    undo.append(lambda: setattr(os, "_exit", real_exit))
    saved_stdout = None
    if quiet_stdout:
        sys.stdout.flush()
        saved_stdout = os.dup(1)
        os.dup2(2, 1)

    def give_stdout_back():
        nonlocal saved_stdout
        if saved_stdout is not None:
            sys.stdout.flush()
            os.dup2(saved_stdout, 1)
            os.close(saved_stdout)
            saved_stdout = None
    watchdog = None
    if on_overrun is not None:
        def overrun():
            give_stdout_back()
            try:
                on_overrun(_report(command, probe, f"the script ignored the doctor's stop for {OVERRUN_S:.0f} s "
                                                   f"past the {seconds:.0f} s limit; the doctor ended it", "",
                                   fixes=False))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                real_exit(1)  # the script holds the main thread: nothing else would end this process
        watchdog = threading.Timer(seconds + 1.0 + OVERRUN_S, overrun)
        watchdog.daemon = True
        watchdog.start()
    sampler.start()
    load = hardware.OtherLoad().__enter__()
    cwd = os.getcwd()  # a script may change directory; the report's paths are for where the user ran it
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
        if os.getpid() != pid:  # a child the script forked came back here: it has no report to give
            real_exit(0)
        if watchdog is not None:
            watchdog.cancel()
        give_stdout_back()
        load.__exit__(None, None, None)
        if old_alarm is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_alarm)
        stop.set()
        sampler.join()
        sys.argv, sys.path[:] = old_argv, old_path
        with contextlib.suppress(OSError):
            os.chdir(cwd)
        for u in reversed(undo):
            u()
    report = _report(command, probe, stopped, error, log, fixes)
    report.other_cores, report.load_warning = load.cores, load.warning()
    return report


def _report(command, probe: _Probe, stopped: str, error: str, log=print, fixes: bool = True) -> ScriptReport:
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
    if probe.tf_dataset is not None and r.timed:
        _time_dataset_alone(probe, len(r.timed))
    if probe.generator_times:
        g = sorted(probe.generator_times[probe.warmup:] or probe.generator_times)
        r.generator_s_per_batch = g[len(g) // 2]
        if probe.tf_dataset is not None:
            for s in r.timed:  # tf.data prepares batches ahead on its own threads: its time stands in for the wait
                s.generator = r.generator_s_per_batch
    if not probe.steps:
        r.busy_functions = probe.top("all")
    if probe.framework == "keras" and probe.keras_model is not None:
        r.layers, r.model = keras_layers(probe.keras_model)
        keras = sys.modules.get("keras")
        r.devices["model"] = [f"keras {keras.backend.backend()} backend"] if keras else []
    elif probe.model_ref is not None:
        r.layers, r.model, model_findings = _torch_layers(probe)
        r.findings += model_findings
    from trainfast.diagnose.recipe import batch_images
    first = batch_images(probe.first_batch, r.framework) if probe.first_batch is not None else None
    recipe, why_not = None, ""
    if r.timed and r.data_share >= MODERATELY_INPUT_BOUND and r.data_source.get("reads") != "a trainfast pack":
        recipe, why_not = _recipe(r, probe, first, log, fixes)
    if fixes and r.timed and r.framework == "keras" and probe.keras_model is not None:
        side = framework_side("keras")
        r.findings += (side.settings(r, probe.keras_model, first, log) if side is not None else
                       ["Keras's own settings were not timed: trainfast.keras is not installed here"])
    r.findings += _findings(r, recipe is not None, why_not)
    r.findings += _storage_findings(r, _files_read(probe, recipe))
    r.recommendations.sort(key=lambda rec: -rec.speedup)
    return r


def _time_dataset_alone(probe: _Probe, batches: int, max_seconds: float = 10.0):
    """A tf.data pipeline's time per batch, iterated on its own (it runs in C++ threads, out of
    the probes' sight during fit): the first batch is kept for the recipe, the rest are timed."""
    try:
        it = iter(probe.tf_dataset.take(batches + 1))
        probe.first_batch = next(it)
        first = next(_tensors(probe.first_batch), None)
        for s in probe.steps:
            s.batch_size = s.batch_size or (int(first.shape[0]) if first is not None else 0)
        end = time.perf_counter() + max_seconds
        t0 = time.perf_counter()
        for _ in it:
            now = time.perf_counter()
            probe.generator_times.append(now - t0)
            t0 = now
            if now > end:
                break
    except Exception:  # noqa: BLE001 - a dataset that cannot be iterated again (a one-shot generator)
        return


def _files_read(probe: _Probe, recipe) -> list[str]:
    """The image files the script read in its data pipeline (or, for image_dataset_from_directory,
    whose reads happen in C++, the files of its folder)."""
    read = [p for p, in_data in probe.files_read.items() if in_data]
    if not read and probe.from_directory.get("directory") and recipe is not None:
        read = list(recipe.source.files or [])
    return read


def framework_side(framework: str):
    """What a framework's bridge measures for the script doctor (its own speed settings, the pack
    recipe fed to its model), or None. The Keras side lives in trainfast.keras, which imports
    diagnose: it is found through the installed package's entry points (group
    "trainfast.doctor_sides" in pyproject.toml), so that diagnose never imports it by name."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="trainfast.doctor_sides"):
        if ep.name == framework:
            try:
                return ep.load()()
            except ImportError:  # the framework or its bridge is not installed here
                return None
    return None


def _recipe(r: ScriptReport, probe: _Probe, first, log, measure: bool = True):
    """The pack that replaces what the script reads, with its gain measured on the spot."""
    from trainfast.diagnose import recipe as rc

    try:
        found, why_not = rc.find_recipe(probe, first)
    except (OSError, TrainfastError) as e:
        return None, str(e)
    if found is None:
        return None, why_not
    bs = Counter(s.batch_size for s in r.timed).most_common(1)[0][0] or 1
    data_name = _data_name(r, probe)
    if not measure:
        r.recommendations.append(Recommendation("Pack the images once, then read the pack", found.command, 0.0,
                                                False, f"the script reads {found.reads} (not measured: --no-fixes)"))
        return found, ""
    log(f"trainfast doctor: packing a sample of {found.reads} to measure the fix")
    try:
        x, y, _ = first  # a recipe was found: the first batch held images
        side = framework_side("keras") if r.framework == "keras" and probe.keras_model is not None else None
        if side is not None:
            rec = side.recommendation(found, probe.keras_model, r.mean("seconds"), bs, data_name, x, y)
        else:
            rec = rc.torch_recommendation(found, r.mean("seconds"), r.mean("data"), bs, data_name,
                                          (r.devices.get("model") or ["cpu"])[0], x)
    except StopScript:
        raise
    except Exception as e:  # noqa: BLE001 - the measurement is a bonus; the command stands without it
        rec = Recommendation("Pack the images once, then read the pack", found.command, 0.0, False,
                             f"(the gain could not be measured here: {type(e).__name__}: {e})")
    r.recommendations.append(rec)
    return found, ""


def _data_name(r: ScriptReport, probe: _Probe) -> str:
    if probe.from_directory.get("directory"):
        return "keras.utils.image_dataset_from_directory(...)"
    kind = r.data_source.get("kind", "")
    if "(" in kind and kind.endswith(")"):  # "keras PyDataset (Plates)"
        return kind[kind.rindex("(") + 1:-1] + "(...)"
    return r.data_source.get("dataset", "") + " in a DataLoader" if r.data_source.get("dataset") else \
        "your data pipeline"


def _storage_findings(r: ScriptReport, files: list[str], max_files: int = 4096) -> list[str]:
    """Where a data-bound script's files live: the image files it read (none: nothing to say,
    such as after it moved to a pack), read again alone and cold, against the data time per image."""
    batch = sorted(s.batch_size for s in r.timed if s.batch_size)
    if not (r.timed and r.data_share >= MODERATELY_INPUT_BOUND and batch and files):
        return []
    from trainfast.diagnose.storage import read_throughput, storage_sentence

    read = read_throughput(files[:max_files])
    if read is None:
        return []
    sentence, _ = storage_sentence(read, r.mean("data") / batch[len(batch) // 2])
    where = os.path.commonpath(files) if len(files) > 1 else os.path.dirname(files[0])
    return [f"the images the script reads (under {where}): {sentence}"]


def _findings(r: ScriptReport, recipe: bool = False, why_no_recipe: str = "") -> list[str]:
    out = []
    src, s = r.data_source, r.system
    if r.timed and r.data_share >= MODERATELY_INPUT_BOUND and src.get("reads") == "a trainfast pack":
        tune = ("`trainfast.keras.tune(model, data)` measures Keras's own settings (precision policy, "
                "jit_compile, steps_per_execution, batch)" if r.framework == "keras" else
                "`trainfast tune` measures which wins")
        out.append(f"the batches already come from a trainfast pack, whose reader needs about a millisecond per "
                   f"batch on its own; the {r.data_share:.0%} counted as data wait is mostly that reader waiting for "
                   f"the {s['usable_cores']} cores the train step is using. The train step itself is what is left "
                   f"to speed up: {tune}")
    elif r.timed and r.data_share >= MODERATELY_INPUT_BOUND:
        culprit = _culprit(r.data_functions)
        culprit = f" — most of it in {culprit}" if culprit else ""
        if recipe:
            out.append(f"the data pipeline holds back training ({r.data_share:.0%} of each step{culprit}): "
                       "What to do has the pack that replaces it, measured")
        else:
            out.append(f"the data pipeline holds back training ({r.data_share:.0%} of each step{culprit}). If it "
                       "decodes or resizes files per batch, do that once with `trainfast pack` and read the pack with "
                       "trainfast.Loader (PyTorch) or trainfast.keras.PackDataset (Keras)"
                       + (f" (no exact command: {why_no_recipe})" if why_no_recipe else ""))
        if src.get("num_workers") == 0:
            out.append("the DataLoader has num_workers=0: every batch is prepared in the training loop itself")
    if r.fetched_ahead and src.get("kind") == "tf.data Dataset":
        out.append("tf.data prepares batches on its own threads, out of the doctor's sight during fit; the dataset "
                   "was timed alone after the run, and that time per batch is counted as data wait (an upper "
                   "bound: some of it overlaps the step)")
    elif r.fetched_ahead:
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
    """As the data doctor's page: the verdict, a busy machine, What to do (the measured fixes with
    their commands, then the findings), where the data time goes, the step and per-layer charts,
    then the full text report."""
    from trainfast.diagnose.report import layers_chart, page, recommendations_html, stages_chart
    e = html.escape
    body = [f'<p class="verdict">{e(r.verdict)}</p>']
    if r.load_warning:
        body.append(f'<p class="warning"><b>Busy machine:</b> {e(r.load_warning)}</p>')
    if r.recommendations or r.findings:
        body.append("<h2>What to do</h2>")
    if r.recommendations:
        body.append(recommendations_html(r.recommendations))
    if r.findings:
        body.append("<ul>" + "".join(f"<li>{e(f)}</li>" for f in r.findings) + "</ul>")
    if r.data_functions:
        body.append("<h2>Where the data time goes</h2><ul>"
                    + "".join(f"<li>{share:.0%} {e(name)}</li>" for name, share in r.data_functions) + "</ul>")
    if r.timed:
        body.append(f'<h2>Step-time breakdown</h2><div id="step-breakdown">'
                    f'{stages_chart([(n, v * 1e3) for n, v in stage_parts(r)])}</div>')
    rows = [(l["name"], l["kind"], l["flops"], l["params"]) for l in r.layers if l["params"] or l["flops"]]
    if rows:
        body.append(f'<h2>Per-layer cost</h2><div id="layer-cost">{layers_chart(rows)}</div>')
    body.append(f"<details><summary>Full report (text)</summary><pre>{e(render_text(r))}</pre></details>")
    return page(f"trainfast doctor — {' '.join(r.command)}", "".join(body))


def render_text(r: ScriptReport) -> str:
    lines = [f"trainfast doctor — {' '.join(r.command)}",
             f"{r.framework if r.framework != 'none' else 'no training steps seen'}; {r.stopped}; "
             f"{len(r.timed)} timed steps after {r.warmup} warm-up; device {r.system['device']}", "",
             f"VERDICT  {r.verdict}"]
    if r.load_warning:
        lines.append(f"WARNING  {r.load_warning}")
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
        alone = r.data_source.get("kind") == "tf.data Dataset"
        lines.append((f"  batches drawn: {r.batches_drawn}" if not alone else "  timed alone after the run")
                     + (f"; the {'dataset' if alone else 'generator'} takes {units.ms(r.generator_s_per_batch)} "
                        "ms per batch" if r.generator_s_per_batch else ""))
        if r.data_functions:
            lines.append("  where the data time goes (share of sampled time inside the data pipeline):")
            lines += [f"    {share:5.0%}  {name}" for name, share in r.data_functions]
    if r.busy_functions:
        lines += ["", "What the script did instead (share of sampled time)"]
        lines += [f"    {share:5.0%}  {name}" for name, share in r.busy_functions]
    if r.recommendations:
        from trainfast.diagnose.report import recommendation_lines
        lines += ["", "What to do, ranked by expected gain"] + recommendation_lines(r.recommendations)
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

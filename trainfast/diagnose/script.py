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
import importlib.abc
import importlib.util
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from trainfast import hardware
from trainfast.diagnose.probes import (
    _OURS,
    WARMUP,
    Step,  # noqa: F401 - part of what this module gives (ScriptReport.steps)
    StopScript,
    _install_open_watch,
    _install_torch,
    _Probe,
    _tensors,
    _torch_layers,
)
from trainfast.diagnose.keras_probes import _KerasWatcher, _patch_keras, keras_layers
from trainfast.diagnose.script_report import (  # noqa: F401 - the public names
    SCHEMA_VERSION,
    ScriptReport,
    pace_findings,
    stage_parts,
)
from trainfast.errors import TrainfastError

OVERRUN_S = 10.0  # how long past its time limit a script that ignores the stop may run before the watchdog ends it



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
    log(f"trainfast doctor: running {' '.join(command)} for up to {steps} steps after {warmup} warm-up, "
        f"or {seconds:.0f} s")
    pid, real_exit = os.getpid(), os._exit
    undo = _instrument(probe, pid, real_exit)
    out = _Stdout(quiet_stdout)
    watchdog = None
    if on_overrun is not None:
        def overrun():
            out.give_back()
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
    stop = threading.Event()
    sampler = threading.Thread(target=probe.sample_forever, args=(stop,), daemon=True, name="trainfast-sampler")
    sampler.start()
    old_argv, old_path = sys.argv, list(sys.path)
    cwd = os.getcwd()  # a script may change directory; the report's paths are for where the user ran it
    sys.argv = argv
    sys.path.insert(0, str(Path(target).resolve().parent) if kind == "path" else os.getcwd())
    load = hardware.OtherLoad().__enter__()
    try:
        with _time_limit(seconds):
            stopped, error = _run(kind, target)
    finally:
        if os.getpid() != pid:  # a child the script forked came back here: it has no report to give
            real_exit(0)
        if watchdog is not None:
            watchdog.cancel()
        out.give_back()
        load.__exit__(None, None, None)
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


def _instrument(probe: _Probe, pid: int, real_exit) -> list:
    """The probes installed (Keras's now or when it is imported, PyTorch's, the file watch) and
    os._exit made the end of the run; returns what undoes them, in order."""
    undo: list = []
    watcher = _KerasWatcher(probe, undo)
    if "keras" in sys.modules:
        _patch_keras(sys.modules["keras"], probe, undo)
        watcher.done = True
    sys.meta_path.insert(0, watcher)
    undo.append(lambda: sys.meta_path.remove(watcher))
    _install_torch(probe, undo)
    _install_open_watch(probe, undo)

    def script_exit(code=0):  # the script's os._exit: the end of the run, reported, not of this process
        if os.getpid() != pid:
            real_exit(code)  # a forked child (multiprocessing ends its workers so)
        raise StopScript(f"the script called os._exit({code})")
    os._exit = script_exit
    undo.append(lambda: setattr(os, "_exit", real_exit))
    return undo


class _Stdout:
    """With `quiet`, what the script prints to standard output goes to standard error until
    give_back() (the report goes to standard output, as JSON)."""

    def __init__(self, quiet: bool):
        self.saved = None
        if quiet:
            sys.stdout.flush()
            self.saved = os.dup(1)
            os.dup2(2, 1)

    def give_back(self):
        if self.saved is not None:
            sys.stdout.flush()
            os.dup2(self.saved, 1)
            os.close(self.saved)
            self.saved = None


@contextlib.contextmanager
def _time_limit(seconds: float):
    """StopScript raised in the main thread a second past `seconds` (SIGALRM, where there is one)."""
    if not (hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()):
        yield
        return

    def on_alarm(signum, frame):
        raise StopScript("time limit reached")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds + 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _run(kind: str, target: str) -> tuple[str, str]:
    """Run the script to its end or its stop: (why it ended, its traceback where it failed)."""
    try:
        if kind == "path":
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except StopScript as e:
        return e.reason, ""
    except SystemExit as e:
        if e.code not in (None, 0):
            return f"the script exited (status {e.code})", f"SystemExit: {e.code}"
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - the script's failure is reported as its own
        return f"the script failed: {type(e).__name__}: {e}", _script_traceback(e)
    return "the script finished", ""


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
                     data_functions=probe.top("data"), error=error, seconds=time.perf_counter() - probe.started,
                     steps_per_epoch=probe.steps_per_epoch, epochs=_epochs(probe))
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
    from trainfast.diagnose.fixes import measure
    from trainfast.diagnose.recipe import batch_images
    first = batch_images(probe.first_batch, r.framework) if probe.first_batch is not None else None
    measure(r, probe, first, log, fixes)
    r.findings += pace_findings(r)
    return r


def _epochs(probe: _Probe) -> list[tuple[float, int]]:
    """(seconds, steps) of each whole training epoch the run saw that began after the warm-up."""
    return [(t1 - t0, s1 - s0) for (t0, s0), (t1, s1) in zip(probe.epoch_starts, probe.epoch_starts[1:])
            if s0 >= probe.warmup and s1 - s0 >= 2]


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



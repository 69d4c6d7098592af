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

import importlib.abc
import importlib.util
import os
import runpy
import signal
import sys
import sysconfig
import threading
import time
import traceback
import types
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainfast import hardware
from trainfast.diagnose.verdict import HIGHLY_INPUT_BOUND, MODERATELY_INPUT_BOUND
from trainfast.errors import TrainfastError

SCHEMA_VERSION = 1
WARMUP = 2  # steps not counted: first-step allocation, tracing, XLA compiles
SAMPLE_EVERY_S = 0.005
_OURS = str(Path(__file__).resolve().parents[1]) + os.sep  # the trainfast package
# Frames of the machinery around the user's data code, left out of the named culprits.
_MACHINERY = (_OURS, "runpy.py", "<frozen ", "threading.py", "concurrent" + os.sep,
              os.path.join("torch", "utils"), os.path.join("torch", "autograd"), os.path.join("torch", "_ops.py"),
              os.path.join("keras", "src"), "tensorflow" + os.sep)


class StopScript(BaseException):
    """Raised inside the script to stop it; a BaseException so `except Exception` passes it on."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Step:
    seconds: float
    data: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0
    batch_size: int = 0
    generator: float = 0.0  # time inside the data source, on any thread (Keras may fetch ahead)


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
        import html
        return (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>trainfast doctor — "
                f"{html.escape(' '.join(self.command))}</title></head><body style=\"font-family:system-ui;"
                f"max-width:1000px;margin:2em auto\"><h1>trainfast doctor</h1><p><b>{html.escape(self.verdict)}"
                f"</b></p><pre>{html.escape(self.text())}</pre></body></html>\n")


class _Probe:
    """The measurements of one script run; the hooks below feed it."""

    def __init__(self, steps: int, seconds: float, warmup: int):
        self.max_steps, self.deadline, self.warmup = steps + warmup, time.perf_counter() + seconds, warmup
        self.started = self.last = time.perf_counter()
        self.cur = Step(0.0)
        self.steps: list[Step] = []
        self.framework = "none"
        self.data_source: dict = {}
        self.devices: dict = {"model": set(), "batches": set()}
        self.batches = 0
        self.generator_times: list[float] = []
        self.data_threads: dict[int, int] = {}  # thread id → depth inside the data pipeline
        self.samples: dict[str, Counter] = {"data": Counter(), "all": Counter()}
        self.sample_count = Counter()
        self.model_ref = None
        self.model_input = None
        self.keras_model = None
        self.module_depth = 0
        self.cuda = False
        self.lock = threading.Lock()

    # -- time accounting ----------------------------------------------------------------------

    def sync(self):
        if self.cuda:
            import torch
            torch.cuda.synchronize()

    def boundary(self, batch_size: int = 0):
        """One training step ended (an optimizer step, a Keras batch)."""
        self.sync()
        now = time.perf_counter()
        self.cur.seconds, self.cur.batch_size = now - self.last, batch_size or self.cur.batch_size
        self.steps.append(self.cur)
        self.cur, self.last = Step(0.0), now
        if len(self.steps) >= self.max_steps:
            raise StopScript("stopped after the requested steps")
        self.check_time()

    def check_time(self):
        if time.perf_counter() > self.deadline:
            raise StopScript("time limit reached")

    def enter_data(self):
        tid = threading.get_ident()
        with self.lock:
            self.data_threads[tid] = self.data_threads.get(tid, 0) + 1
        return time.perf_counter()

    def leave_data(self, t0: float, waited: bool = True):
        dt = time.perf_counter() - t0
        tid = threading.get_ident()
        with self.lock:
            self.data_threads[tid] -= 1
            outermost = not self.data_threads[tid]
            if outermost:
                del self.data_threads[tid]
        if outermost:  # a probe inside another (Keras's torch backend wraps a PyDataset in a DataLoader)
            self.cur.generator += dt
            if waited and tid == threading.main_thread().ident:
                self.cur.data += dt
        return dt

    def note_batch(self, batch):
        self.batches += 1
        for t in _tensors(batch):
            self.devices["batches"].add(str(getattr(t, "device", "cpu")))
            if not self.cur.batch_size and getattr(t, "shape", None) is not None and len(t.shape):
                self.cur.batch_size = int(t.shape[0])

    # -- sampling -----------------------------------------------------------------------------

    def sample_forever(self, stop: threading.Event):
        main = threading.main_thread().ident
        while not stop.wait(SAMPLE_EVERY_S):
            frames = sys._current_frames()
            with self.lock:
                data_tids = list(self.data_threads)
            for tid in data_tids:
                if tid in frames:
                    self._count("data", frames[tid], below_probe=True)
            if main in frames:
                self._count("all", frames[main])

    def _count(self, bucket: str, frame, below_probe: bool = False):
        """Count each function on the stack once; with below_probe, only the frames the data
        probe called (the pipeline), not the training loop above it."""
        stack = []
        while frame is not None:
            if frame.f_code.co_filename == __file__ and (below_probe or frame.f_code.co_name == "doctor_script"):
                break  # above this: the training loop (below_probe), or whoever called the doctor
            if not any(m in frame.f_code.co_filename for m in _MACHINERY):
                stack.append(frame)
            frame = frame.f_back
        seen = set()
        for f in reversed(stack):  # outermost first: the user's functions, then the library call they make
            library = _is_library(f.f_code.co_filename)
            if library and "<locals>" in getattr(f.f_code, "co_qualname", ""):
                continue  # a decorator's wrapper (skimage wraps imread so): name the function it wraps
            seen.add(_func_name(f))
            if library:
                break  # what runs inside skimage.transform.resize is resize's business
        self.samples[bucket].update(seen)
        self.sample_count[bucket] += 1

    def top(self, bucket: str, n: int = 8) -> list[tuple[str, float]]:
        total = self.sample_count[bucket]
        items = [(_public_name(*k), v / total) for k, v in self.samples[bucket].most_common()
                 if not k[1].endswith(">")]  # not <module>, <listcomp>, <genexpr>
        return items[:n] if total else []


_STDLIB = sysconfig.get_paths()["stdlib"]


def _is_library(filename: str) -> bool:
    return "site-packages" in filename or "dist-packages" in filename or filename.startswith(_STDLIB)


def _func_name(frame) -> tuple[str, str, str]:
    code = frame.f_code
    return frame.f_globals.get("__name__", ""), getattr(code, "co_qualname", code.co_name), code.co_filename


def _public_name(module: str, qual: str, filename: str) -> str:
    """skimage.transform._warps.resize → skimage.transform.resize: the shortest package path that
    exports the function, as users write it; a script's own functions as file.py:function."""
    if module in ("__main__", "__mp_main__") or not module:
        return f"{Path(filename).name}:{qual}"
    parts = module.split(".")
    if "." not in qual:
        for i in range(1, len(parts)):
            obj = getattr(sys.modules.get(".".join(parts[:i])), qual, None)
            code = getattr(getattr(obj, "__wrapped__", obj), "__code__", None)
            if code is not None and code.co_filename == filename:
                return f"{'.'.join(parts[:i])}.{qual}"
    return f"{module}.{qual}"


def _tensors(batch):
    if isinstance(batch, (list, tuple)):
        for b in batch:
            yield from _tensors(b)
    elif isinstance(batch, dict):
        for b in batch.values():
            yield from _tensors(b)
    elif hasattr(batch, "shape"):
        yield batch


# -- PyTorch probes ---------------------------------------------------------------------------

class _TimedIterator:
    def __init__(self, it, probe: _Probe):
        self._it, self._probe = it, probe

    def __iter__(self):
        return self

    def __next__(self):
        self._probe.check_time()
        t0 = self._probe.enter_data()
        try:
            batch = next(self._it)
        finally:
            self._probe.leave_data(t0)
        self._probe.note_batch(batch)
        return batch

    def __len__(self):
        return len(self._it)

    def __getattr__(self, name):
        return getattr(self._it, name)


def _install_torch(probe: _Probe, undo: list):
    import torch
    import torch.utils.data as tud
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_mod

    original_iter = tud.DataLoader.__iter__

    def dataloader_iter(self):
        if probe.framework == "keras":  # Keras's own DataLoader around the user's data: keep Keras's view
            return _TimedIterator(original_iter(self), probe)
        probe.data_source = {"kind": "torch DataLoader", "num_workers": self.num_workers,
                             "pin_memory": self.pin_memory, "batch_size": self.batch_size,
                             "dataset": type(self.dataset).__name__}
        return _TimedIterator(original_iter(self), probe)

    tud.DataLoader.__iter__ = dataloader_iter
    undo.append(lambda: setattr(tud.DataLoader, "__iter__", original_iter))

    original_backward = torch.autograd.backward

    def backward(*args, **kwargs):
        probe.sync()
        t0 = time.perf_counter()
        try:
            return original_backward(*args, **kwargs)
        finally:
            probe.sync()
            probe.cur.backward += time.perf_counter() - t0

    torch.autograd.backward = backward
    undo.append(lambda: setattr(torch.autograd, "backward", original_backward))

    opt_t0 = [0.0]

    def pre(optimizer, args, kwargs):
        probe.sync()
        opt_t0[0] = time.perf_counter()

    def post(optimizer, args, kwargs):
        probe.sync()
        probe.cur.optimizer += time.perf_counter() - opt_t0[0]
        if probe.framework == "none":
            probe.framework = "pytorch"
        for g in optimizer.param_groups:
            for p in g["params"][:1]:
                probe.devices["model"].add(str(p.device))
                probe.cuda = probe.cuda or p.device.type == "cuda"
        if probe.framework == "pytorch":
            probe.boundary()

    h1 = optim_mod.register_optimizer_step_pre_hook(pre)
    h2 = optim_mod.register_optimizer_step_post_hook(post)
    undo += [h1.remove, h2.remove]

    def fwd_pre(module, args):
        if probe.module_depth == 0 and probe.model_ref is None and probe.keras_model is None:
            x = next(_tensors(args), None)
            if x is not None and getattr(x, "dim", lambda: 0)() == 4:
                probe.model_ref, probe.model_input = module, tuple(x.shape[1:])
        probe.module_depth += 1

    def fwd_post(module, args, out):
        probe.module_depth -= 1

    h3 = nn_module.register_module_forward_pre_hook(fwd_pre)
    h4 = nn_module.register_module_forward_hook(fwd_post, always_call=True)
    undo += [h3.remove, h4.remove]


# -- Keras probes -----------------------------------------------------------------------------

def _patch_keras(keras, probe: _Probe, undo: list):
    Model = keras.Model
    original_fit = Model.fit

    class _Doctor(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            probe.boundary(probe.cur.batch_size)

    def fit(self, x=None, *args, **kwargs):
        probe.framework = "keras"
        probe.keras_model = self
        callbacks = list(kwargs.pop("callbacks", None) or [])
        kwargs["callbacks"] = callbacks + [_Doctor()]
        return original_fit(self, _wrap_keras_data(keras, x, probe), *args, **kwargs)

    Model.fit = fit
    undo.append(lambda: setattr(Model, "fit", original_fit))


def _timed_getitem(cls, probe: _Probe):
    original = cls.__getitem__

    def __getitem__(self, i):
        t0 = probe.enter_data()
        try:
            batch = original(self, i)
        finally:
            probe.generator_times.append(probe.leave_data(t0))
        probe.note_batch(batch)
        return batch

    return type(cls.__name__, (cls,), {"__getitem__": __getitem__, "__module__": cls.__module__})


def _wrap_keras_data(keras, x, probe: _Probe):
    if isinstance(x, keras.utils.PyDataset):
        probe.data_source = {"kind": f"keras PyDataset ({type(x).__name__})",
                             "workers": getattr(x, "workers", 1),
                             "use_multiprocessing": getattr(x, "use_multiprocessing", False)}
        if type(x).__module__.startswith("trainfast."):
            probe.data_source["reads"] = "a trainfast pack"
        x.__class__ = _timed_getitem(type(x), probe)
        return x
    if isinstance(x, types.GeneratorType) or (hasattr(x, "__next__") and hasattr(x, "__iter__")):
        probe.data_source = {"kind": "Python generator"}

        def timed():
            while True:
                t0 = probe.enter_data()
                try:
                    batch = next(x)
                except StopIteration:
                    probe.leave_data(t0)
                    return
                except BaseException:
                    probe.leave_data(t0)
                    raise
                probe.generator_times.append(probe.leave_data(t0))
                probe.note_batch(batch)
                yield batch

        return timed()
    kind = type(x).__module__.split(".")[0]
    probe.data_source = {"kind": "in-memory arrays" if kind == "numpy" else f"{type(x).__name__} ({kind})"}
    return x


class _KerasWatcher(importlib.abc.MetaPathFinder):
    """Patch Keras as soon as the script imports it (importing it ourselves would cost seconds)."""

    def __init__(self, probe: _Probe, undo: list):
        self.probe, self.undo, self.done = probe, undo, False

    def find_spec(self, name, path=None, target=None):
        if name != "keras" or self.done:
            return None
        self.done = True
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return None
        loader, watcher = spec.loader, self

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                loader.exec_module(module)
                _patch_keras(module, watcher.probe, watcher.undo)

        spec.loader = _Loader()
        return spec


def _keras_layers(model) -> tuple[list[dict], dict]:
    """Per-layer parameters and forward FLOPs per image, from each layer's config and output shape."""
    rows = []
    for layer in getattr(model, "layers", []):
        try:
            params = int(layer.count_params())
            out = tuple(d for d in layer.output.shape[1:])
        except Exception:  # noqa: BLE001 - an unbuilt or exotic layer: show what is known
            continue
        flops = 0
        kernel = getattr(layer, "kernel", None)
        if kernel is not None and None not in out:
            k = tuple(kernel.shape)
            positions = 1
            for d in out[:-1]:
                positions *= d
            fan_in = 1
            for d in k[:-1]:
                fan_in *= d
            flops = 2 * positions * fan_in * k[-1]
        rows.append({"name": layer.name, "kind": type(layer).__name__, "output": list(out), "params": params,
                     "flops": flops})
    total = {"params": sum(r["params"] for r in rows), "forward_flops": sum(r["flops"] for r in rows)}
    return rows, total


def _torch_layers(probe: _Probe) -> tuple[list[dict], dict, list[str]]:
    from trainfast.diagnose.cost import layer_costs
    import copy

    try:
        c = layer_costs(copy.deepcopy(probe.model_ref), probe.model_input)
    except Exception:  # noqa: BLE001 - the cost table is a bonus; the timing stands without it
        return [], {}, []
    rows = [{"name": l.name, "kind": l.kind, "output": list(l.output_shape or ()), "params": l.params,
             "flops": l.flops} for l in c.layers if l.params or l.flops]
    return rows, {"params": c.params, "forward_flops": c.forward_flops, "class": type(probe.model_ref).__name__,
                  "input_shape": list(probe.model_input)}, list(c.findings)


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
    return r


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


def render_text(r: ScriptReport) -> str:
    lines = [f"trainfast doctor — {' '.join(r.command)}",
             f"{r.framework if r.framework != 'none' else 'no training steps seen'}; {r.stopped}; "
             f"{len(r.timed)} timed steps after {r.warmup} warm-up; device {r.system['device']}", "",
             f"VERDICT  {r.verdict}"]
    if r.timed:
        step = r.mean("seconds")
        bs = Counter(s.batch_size for s in r.timed).most_common(1)[0][0]  # not the epoch's short last batch
        rate = f"; {bs / step:,.0f} images/s at batch {bs}" if bs else ""
        lines.append(f"         {step * 1e3:,.1f} ms per step{rate}")
        lines += ["", "Where the time goes (mean per step)"]
        parts = [("data wait", r.mean("data"))]
        if r.framework == "pytorch":
            parts += [("backward", r.mean("backward")), ("optimizer", r.mean("optimizer"))]
            rest = "forward+rest"
        else:
            rest = "train step"
        parts.append((rest, max(step - sum(v for _, v in parts), 0.0)))
        for name, v in parts:
            share = v / step if step else 0.0
            lines.append(f"  {name:12s} {'█' * round(share * 40):40s} {v * 1e3:9.1f} ms {share:5.0%}")
    if r.data_source or r.batches_drawn:
        lines += ["", "Data pipeline"]
        if r.data_source:
            lines.append("  " + ", ".join(f"{k} {v}" for k, v in r.data_source.items()))
        lines.append(f"  batches drawn: {r.batches_drawn}" + (f"; the generator takes {r.generator_s_per_batch * 1e3:,.1f} "
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

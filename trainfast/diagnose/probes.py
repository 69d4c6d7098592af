"""The probes of `trainfast doctor -- python train.py`: what they measure in a user's script.

One `_Probe` holds the measurements of a run: the steps (data wait, the train step's parts),
the data source, the devices, and the stack samples of the data pipeline. The hooks feed it:

- PyTorch: each DataLoader iterator's `__next__`, `torch.autograd.backward`, the optimizer's
  global step hooks, the outermost module call.
- Keras 3 (any backend): `Model.fit` gets a callback and its data is wrapped, once keras is
  imported (a meta-path watcher patches it then): keras_probes.py.

script.py runs the script with these installed, stops it, and reports.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from trainfast.data.sources import IMAGE_EXTENSIONS

WARMUP = 2  # steps not counted: first-step allocation, tracing, XLA compiles
MAX_FILES_NOTED = 200_000  # the images a script read that the recipe looks at (their paths only)
SAMPLE_EVERY_S = 0.005
_OURS = str(Path(__file__).resolve().parents[1]) + os.sep  # the trainfast package
_RUNNER = os.path.join(os.path.dirname(__file__), "script.py")  # where doctor_script runs the script
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
        self.files_read: dict[str, bool] = {}  # image file → read inside the data pipeline (see _on_open)
        self.csvs_read: list[str] = []  # CSV files the script opened, in order
        self.from_directory: dict = {}  # keras.utils.image_dataset_from_directory's arguments, when called
        self.tf_dataset = None  # a tf.data.Dataset given to Model.fit (timed on its own after the run)
        self.first_batch = None  # the first batch the data source gave (its shapes: the recipe's size and labels)
        self.data_origin = None  # recipe.Origin: where the script made its data source, and the name it holds
        self.torch_loader = None  # the first DataLoader the script iterated (the doctor draws from it again)
        self.keras_fit = None  # (x, y, batch_size) as the script gave them to Keras's fit
        self.epoch_starts: list[tuple[float, int]] = []  # (time, steps so far) as each training epoch began
        self.steps_per_epoch: int | None = None

    def note_file(self, path: str):
        """The script opened `path` for reading (an image or a CSV): what it reads, for the recipe."""
        path = os.path.abspath(path)
        if path.lower().endswith(".csv"):
            if path not in self.csvs_read:
                self.csvs_read.append(path)
        elif len(self.files_read) < MAX_FILES_NOTED:
            self.files_read[path] = self.files_read.get(path, False) or threading.get_ident() in self.data_threads

    # -- time accounting ----------------------------------------------------------------------

    def sync(self):
        if self.cuda:
            import torch
            torch.cuda.synchronize()

    def boundary(self, batch_size: int = 0):
        """One training step ended (an optimizer step, a Keras batch)."""
        self.sync()
        now = time.perf_counter()
        if len(self.steps) >= self.max_steps:  # a script that caught the stop trains on: measured enough
            raise StopScript("stopped after the requested steps")
        self.cur.seconds, self.cur.batch_size = now - self.last, batch_size or self.cur.batch_size
        self.steps.append(self.cur)
        self.cur, self.last = Step(0.0), now
        if len(self.steps) >= self.max_steps:
            raise StopScript("stopped after the requested steps")
        self.check_time()

    def epoch_start(self, steps_per_epoch: int | None = None):
        """A training epoch begins (a Keras epoch, the training DataLoader iterated again)."""
        self.epoch_starts.append((time.perf_counter(), len(self.steps)))
        self.steps_per_epoch = self.steps_per_epoch or steps_per_epoch

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
        if self.first_batch is None:
            self.first_batch = batch
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
            code = frame.f_code
            if (below_probe and code.co_filename == __file__) or \
                    (code.co_name == "doctor_script" and code.co_filename == _RUNNER):
                break  # above this: the training loop (below_probe: a probe here), or whoever called the doctor
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
        if probe.torch_loader is None:
            probe.torch_loader = self
        if _same_data(self, probe.torch_loader):  # the training data again: an epoch begins
            probe.epoch_start(_length(self))
        _note_origin(probe, self, sys._getframe(1))
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


# -- the files a script reads ----------------------------------------------------------------

_WATCHED = (*IMAGE_EXTENSIONS, ".csv")
_OPEN_PROBE: list = [None]  # the probe the audit hook reports to (audit hooks cannot be removed)


def _on_open(event: str, args: tuple):
    """An audit hook: each `open` of an image or a CSV for reading goes to the probe. Runs for
    every audited event in the process, so it returns at once unless a probe is listening."""
    if event != "open" or _OPEN_PROBE[0] is None:
        return
    try:
        path, mode, flags = args
        if isinstance(path, int) or path is None:
            return
        if mode is not None and any(c in mode for c in "wax+"):
            return
        if mode is None and flags & (os.O_WRONLY | os.O_RDWR):
            return
        path = os.fsdecode(path)
        if path.lower().endswith(_WATCHED):
            _OPEN_PROBE[0].note_file(path)
    except Exception:  # noqa: BLE001 - an audit hook must never break the script's open()
        pass


_HOOKED = [False]


def _install_open_watch(probe: _Probe, undo: list):
    if not _HOOKED[0]:
        sys.addaudithook(_on_open)
        _HOOKED[0] = True
    _OPEN_PROBE[0] = probe
    undo.append(lambda: _OPEN_PROBE.__setitem__(0, None))


# -- shared by the PyTorch and Keras probes ---------------------------------------------------

def _same_data(loader, first) -> bool:
    """The training DataLoader again, or one made anew each epoch over the same kind and number
    of examples (a validation set differs in one or the other, as a rule)."""
    a, b = loader.dataset, first.dataset
    return a is b or (type(a) is type(b) and _length(a) == _length(b) and _length(loader) == _length(first))


def _length(obj) -> int | None:
    try:
        return len(obj) or None
    except TypeError:  # an iterable dataset, a generator: no length
        return None


def _note_origin(probe: _Probe, data, frame):
    """Where the script's own code handed its data over (the recipe's line to change)."""
    if probe.data_origin is not None:
        return
    own = os.path.dirname(os.path.dirname(__file__))  # trainfast's own files
    while frame is not None and (_is_library(frame.f_code.co_filename) or frame.f_code.co_filename.startswith(own)):
        frame = frame.f_back
    if frame is not None and not frame.f_code.co_filename.startswith("<"):
        from trainfast.diagnose.origin import origin_of
        probe.data_origin = origin_of(data, frame)


def _torch_layers(probe: _Probe) -> tuple[list[dict], dict, list[str]]:
    import copy

    from trainfast.diagnose.cost import layer_costs

    try:
        c = layer_costs(copy.deepcopy(probe.model_ref), probe.model_input)
    except Exception:  # noqa: BLE001 - the cost table is a bonus; the timing stands without it
        return [], {}, []
    rows = [{"name": l.name, "kind": l.kind, "output": list(l.output_shape or ()), "params": l.params,
             "flops": l.flops} for l in c.layers if l.params or l.flops]
    return rows, {"params": c.params, "forward_flops": c.forward_flops, "class": type(probe.model_ref).__name__,
                  "input_shape": list(probe.model_input)}, list(c.findings)


"""Keras's own speed settings, measured on a copy of the user's model: the dtype policy,
jit_compile, steps_per_execution and the batch (`trainfast.keras.tune`)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace

import keras
import numpy as np
import torch

from trainfast import hardware, units
from trainfast.errors import TrainfastError, in_words
from trainfast.keras import threads as backend_threads
from trainfast.keras.data import PackDataset

LOSS_TOLERANCE = 0.05  # a policy's loss on a fixed batch, relative to float32's (as trainfast tune)
BETTER = 1.05  # a candidate must beat the best so far by 5% to replace it (timings on a laptop wobble)


@dataclass(frozen=True)
class KerasSetting:
    """What `model.compile` / `model.fit` are given: the dtype policy, jit_compile, steps_per_execution,
    batch; and the backend's CPU threads (None: as the script has them)."""

    policy: str = "float32"
    jit_compile: bool | str = "auto"
    steps_per_execution: int = 1
    batch_size: int = 32
    threads: int | None = None

    def label(self) -> str:
        jit = {True: "jit", False: "no jit"}.get(self.jit_compile, "jit auto")
        return f"{self.policy}, {jit}, {self.steps_per_execution} step/exec, batch {self.batch_size}" + \
            (f", {self.threads} thread{'s' * (self.threads != 1)}" if self.threads else "")


@dataclass
class KerasTrial:
    setting: KerasSetting
    images_per_s: float | None = None
    loss: float | None = None  # on a fixed batch, before any training step
    note: str = ""
    other_cores: float | None = None


@dataclass
class KerasTuneResult:
    """What `tune` measured: each trial, the model's own setting (`base`) and the winner (`best`)."""

    backend: str
    device: str
    base: KerasTrial
    best: KerasTrial
    trials: list[KerasTrial] = field(default_factory=list)
    not_tried: list[str] = field(default_factory=list)
    load_warning: str = ""
    threads: int | None = None  # the backend's CPU threads as the model trains now (None: unknown)

    @property
    def speedup(self) -> float:
        return (self.best.images_per_s or 0.0) / max(self.base.images_per_s or 0.0, 1e-9)

    def code(self) -> str:
        """The lines that give a model the winning setting."""
        b, w = self.base.setting, self.best.setting
        lines = []
        if w.policy != b.policy:
            lines.append(f'keras.config.set_dtype_policy("{w.policy}")   # before building the model; '
                         'give the last layer dtype="float32"')
        kw = []
        if w.jit_compile != b.jit_compile:
            kw.append(f"jit_compile={w.jit_compile}")
        if w.steps_per_execution != b.steps_per_execution:
            kw.append(f"steps_per_execution={w.steps_per_execution}")
        if kw:
            lines.append(f"model.compile(..., {', '.join(kw)})")
        if w.threads != b.threads:
            lines.append(backend_threads.code(w.threads))
        if w.batch_size != b.batch_size:
            lines.append(f"batch_size={w.batch_size}   # in fit or your data; a larger batch may want a larger "
                         "learning rate")
        return "\n".join(lines) or "# keep what you have: nothing measured faster"

    def table(self) -> str:
        rows = [f"trainfast.keras.tune — Keras on {self.backend}, {self.device}"]
        if self.load_warning:
            rows.append(f"WARNING  {self.load_warning}")
        for t in self.trials:
            rate = f"{units.rate(t.images_per_s)} images/s" if t.images_per_s else "—"
            mark = "*" if t is self.best else ("=" if t is self.base else " ")
            rows.append(f" {mark} {t.setting.label():50s} {rate:>18s}  {t.note}")
        rows += [f"   not tried: {n}" for n in self.not_tried]
        rows.append(f"best: {self.best.setting.label()}, ×{self.speedup:.2f} against the model's own "
                    f"({self.base.setting.label()})")
        return "\n".join(rows)

    def __repr__(self) -> str:
        return f"{self.table()}\n{self.code()}"


def tune(model, data, *, batch_sizes=None, max_seconds: float = 60.0, try_torch_compile: bool = False,
         log=print) -> KerasTuneResult:
    """Time Keras's own speed settings for `model`'s training step on this machine, each on a
    copy of the model (`keras.models.clone_model`, same weights): the precision policies the
    device runs fast (mixed_bfloat16 on a CPU with AVX512-BF16 or AMX, mixed_float16 and
    mixed_bfloat16 on a GPU that has them), jit_compile (XLA; on the torch backend torch.compile
    only with try_torch_compile, its compile takes minutes on few cores), steps_per_execution,
    larger batches, and on a CPU half the threads (the torch backend; where other programs hold
    cores, fewer threads can be faster). A policy whose loss on a fixed batch strays from
    float32's is rejected.

    Args:
        model: a compiled Sequential or Functional Keras model (a subclassed one cannot be copied).
        data: one batch `(x, y)` of numpy arrays, a PackDataset, a keras PyDataset or a tf.data
            Dataset (one batch is taken from it), or a pack's path.
        batch_sizes: the batches to try; default the data's batch, then twice and four times it
            while that keeps paying.
        max_seconds: the budget; what did not fit is listed in `not_tried`.

    Returns:
        a KerasTuneResult: `print` it for the table and the lines to paste (`.code()`).

    Example:
        r = trainfast.keras.tune(model, PackDataset("plates.pack", batch_size=64))
        print(r)
    """
    if not isinstance(model, keras.Model):
        raise TrainfastError(f"tune needs a Keras model, not {type(model).__name__}")
    if getattr(model, "optimizer", None) is None or getattr(model, "loss", None) is None:
        raise TrainfastError("tune needs a compiled model: call model.compile(optimizer=..., loss=...) first")
    x, y = _one_batch(data)
    base = KerasSetting(policy=_policy_name(model), jit_compile=getattr(model, "jit_compile", "auto"),
                        steps_per_execution=int(getattr(model, "steps_per_execution", 1) or 1),
                        batch_size=len(x))
    backend, device = keras.backend.backend(), backend_device()
    search = _Search(model, x, y, max_seconds, log)
    with hardware.OtherLoad() as load:
        base_trial = search.start(base)
        for policy in _policies(device):
            if policy != base.policy:
                search.consider(replace(search.best.setting, policy=policy))
        threads = backend_threads.current()
        if device == "cpu" and threads and threads >= 2:
            if backend_threads.can_time():
                search.consider(replace(search.best.setting, threads=threads // 2))
            else:
                search.not_tried.append(f"{threads // 2} threads ({backend} sets its thread pools when it starts: "
                                        "a line at the top of the script changes them)")
        if backend == "tensorflow" or (backend == "torch" and try_torch_compile):
            search.consider(replace(search.best.setting, jit_compile=not _resolved_jit(search.best.setting, model)))
        elif backend == "torch":
            search.not_tried.append("jit_compile=True (torch.compile: minutes of compiling on a CPU; "
                                    "try_torch_compile=True)")
        if backend != "torch":
            spe = search.best.setting.steps_per_execution
            search.consider(replace(search.best.setting, steps_per_execution=8 if spe == 1 else 1))
        for b in batch_sizes or (2 * base.batch_size, 4 * base.batch_size):
            before = search.best
            search.consider(replace(search.best.setting, batch_size=int(b)))
            if search.best is before and batch_sizes is None:
                break
    result = KerasTuneResult(backend, device, base_trial, search.best, search.trials, search.not_tried,
                             load.warning(), threads)
    for line in result.table().splitlines():
        log(line)
    return result


class _Search:
    """The trials of one tune within its budget: each setting timed on a copy of the model, the
    best so far (a candidate must beat it by BETTER), and a policy whose loss strays from
    float32's rejected."""

    def __init__(self, model, x, y, max_seconds: float, log):
        self.model, self.x, self.y, self.max_seconds, self.log = model, x, y, max_seconds, log
        self.deadline = time.perf_counter() + max_seconds
        self.trials: list[KerasTrial] = []
        self.not_tried: list[str] = []
        self.losses: dict[str, float | None] = {}
        self.best: KerasTrial | None = None
        self.ref: float | None = None

    def start(self, base: KerasSetting) -> KerasTrial:
        """Time the model's own setting; the float32 loss every other policy is checked against."""
        self.best = trial = self.run(base)
        if trial.images_per_s is None:
            raise TrainfastError(f"the model does not train as it is: {trial.note}")
        self.ref = self.losses.get("float32")
        if self.ref is None and base.policy != "float32":  # the reference loss of a model built mixed
            self.losses["float32"] = self.ref = _loss(self.model, "float32", self.x, self.y)
        return trial

    def run(self, setting: KerasSetting) -> KerasTrial:
        left = self.deadline - time.perf_counter()
        known = self.best.images_per_s if self.trials else None  # a trial's cost: ~6 executions at the best rate
        if left <= 0 or (known and 6 * setting.steps_per_execution * setting.batch_size / known > left):
            self.not_tried.append(f"{setting.label()} (out of the {self.max_seconds:.0f} s budget)")
            return KerasTrial(setting, note="not timed")
        self.log(f"trainfast.keras.tune: timing {setting.label()}")
        t = _trial(self.model, setting, self.x, self.y, self.losses, self.deadline)
        self.trials.append(t)
        return t

    def consider(self, setting: KerasSetting):
        t, ref = self.run(setting), self.ref
        if t.images_per_s and ref is not None and t.loss is not None and \
                abs(t.loss - ref) > LOSS_TOLERANCE * max(1.0, abs(ref)):
            t.note, t.images_per_s = f"rejected: loss {t.loss:.4f} vs float32 {ref:.4f}", None
        if t.images_per_s and t.images_per_s > BETTER * (self.best.images_per_s or 0):
            self.best = t


def _one_batch(data):
    """(x, y) numpy arrays: one batch of the data."""
    if isinstance(data, (str, bytes)) or hasattr(data, "__fspath__") or type(data).__name__ == "Pack":
        data = PackDataset(data, batch_size=32)
    if isinstance(data, (tuple, list)) and len(data) == 2:
        x, y = data
    elif isinstance(data, keras.utils.PyDataset):
        x, y = data[0][:2]
    elif hasattr(data, "take") and hasattr(data, "element_spec"):  # tf.data
        x, y = next(iter(data.take(1)))[:2]
    else:
        raise TrainfastError(f"tune's data must be a batch (x, y), a PyDataset, a tf.data Dataset or a pack, "
                             f"not {type(data).__name__}")
    x, y = np.asarray(x), np.asarray(y)
    if len(x) != len(y) or len(x) < 2:
        raise TrainfastError(f"tune's batch needs as many labels as images and at least 2: {len(x)} images, "
                             f"{len(y)} labels")
    return x, y


def _policy_name(model) -> str:
    policy = getattr(model, "dtype_policy", None)
    return getattr(policy, "name", None) or keras.config.dtype_policy().name


def backend_device() -> str:
    """'cpu', or 'gpu sm80' etc.: where this backend trains."""
    backend = keras.backend.backend()
    if backend == "torch":
        return f"gpu sm{''.join(map(str, torch.cuda.get_device_capability()))}" if torch.cuda.is_available() else "cpu"
    if backend == "tensorflow":
        import tensorflow as tf
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            cc = tf.config.experimental.get_device_details(gpus[0]).get("compute_capability") or (0, 0)
            return f"gpu sm{cc[0]}{cc[1]}"
        return "cpu"
    if backend == "jax":
        import jax
        d = jax.devices()[0]
        if d.platform == "gpu":
            return f"gpu sm{str(getattr(d, 'compute_capability', '00')).replace('.', '')}"
        return "cpu"
    return "cpu"


def _policies(device: str) -> list[str]:
    """The policies worth timing here: float32, and the mixed ones the device runs fast."""
    if device.startswith("gpu"):
        cc = int(device[6:] or 0)
        return ["float32"] + ["mixed_float16"] * (cc >= 70) + ["mixed_bfloat16"] * (cc >= 80)
    return ["float32"] + ["mixed_bfloat16"] * hardware.cpu_has_bf16()


def _resolved_jit(setting: KerasSetting, model) -> bool:
    if setting.jit_compile != "auto":
        return bool(setting.jit_compile)
    from keras.src.trainers.trainer import model_supports_jit
    return keras.backend.backend() != "torch" and model_supports_jit(model)


def _copy(model, policy: str):
    """The model rebuilt under `policy` with the same weights (the last layer keeps float32, as
    Keras's mixed-precision guide has it)."""
    last = model.layers[-1].name if model.layers else None

    def layer_copy(layer):
        config = layer.get_config()
        if layer.name != last and not isinstance(layer, keras.layers.InputLayer):
            config["dtype"] = policy
        return layer.__class__.from_config(config)

    try:
        copy = keras.models.clone_model(model, clone_function=layer_copy)
    except Exception as e:  # noqa: BLE001 - Keras says why in its own words
        raise TrainfastError(f"tune copies the model with keras.models.clone_model, which failed "
                             f"({type(e).__name__}: {e}); a subclassed model cannot be copied so") from None
    copy.set_weights(model.get_weights())
    return copy


def copy_with(model, setting: KerasSetting):
    """A copy of `model` (same weights, optimizer and loss) compiled with `setting`."""
    copy = _copy(model, setting.policy)
    copy.compile(optimizer=model.optimizer.__class__.from_config(model.optimizer.get_config()), loss=model.loss,
                 jit_compile=setting.jit_compile, steps_per_execution=setting.steps_per_execution)
    return copy


def _loss(model, policy: str, x, y) -> float:
    return _batch_loss(copy_with(model, KerasSetting(policy=policy)), x, y)


def _batch_loss(model, x, y) -> float:
    """The loss on the first 8 images, before any step: what tune's soundness check compares."""
    out = model.test_on_batch(x[:8], y[:8])
    return float(out[0] if isinstance(out, (list, tuple)) else out)


def batch_ends(model, batch, n: int, workers: int = 1) -> list[float]:
    """`model.fit` over `n` batches `batch(i)` for one epoch (made on `workers` threads); the time
    each execution ended (a step, or steps_per_execution of them): their differences are the
    step times."""
    ends: list[float] = []

    class Ends(keras.callbacks.Callback):
        def on_train_batch_end(self, i, logs=None):
            ends.append(time.perf_counter())

    class Feed(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=workers)

        def __len__(self):
            return n

        def __getitem__(self, i):
            return batch(i)

    model.fit(Feed(), epochs=1, verbose=0, callbacks=[Ends()])
    return ends


def _trial(model, setting: KerasSetting, x, y, losses: dict, deadline: float, min_seconds: float = 1.0) -> KerasTrial:
    """Time one setting: a warm-up fit (tracing, compiling), then a fit long enough to time."""
    trial = KerasTrial(setting)
    with backend_threads.using(setting.threads):
        return _timed(trial, model, setting, x, y, losses, deadline, min_seconds)


def _timed(trial: KerasTrial, model, setting: KerasSetting, x, y, losses: dict, deadline: float,
           min_seconds: float) -> KerasTrial:
    try:
        copy = copy_with(model, setting)
        if setting.policy not in losses:
            losses[setting.policy] = _batch_loss(copy, x, y)
        trial.loss = losses[setting.policy]
        if not np.isfinite(trial.loss):
            trial.note = f"rejected: loss {trial.loss} before any step"
            return trial
        b, spe = setting.batch_size, setting.steps_per_execution
        idx = np.arange(b) % len(x)
        same = (x[idx], y[idx])  # one batch of the size, fed again and again: the step is what is timed
        ends = batch_ends(copy, lambda i: same, spe * 2)  # tracing and compiling
        per_execution = max(ends[-1] - ends[-2], 1e-4) if len(ends) >= 2 else 1.0
        left = deadline - time.perf_counter()
        executions = int(min(50, max(3, min(min_seconds, left) / per_execution)))
        with hardware.OtherLoad() as load:
            ends = batch_ends(copy, lambda i: same, spe * (executions + 1))
        trial.other_cores = load.cores
        gaps = np.diff(ends)  # the first execution's end is the start of the timed ones
        trial.images_per_s = b * spe / statistics.median(gaps) if len(gaps) else None
    except TrainfastError:
        raise
    except Exception as e:  # noqa: BLE001 - a setting this model or backend cannot run is a result, not a crash
        trial.note = f"failed: {in_words(e)}"
    return trial

"""The Keras side of the doctor: SpeedDoctor (a callback that reports where a `fit`'s time
goes), and what the script doctor asks of Keras when a user's script trains a Keras model:
Keras's own settings timed on a copy of the model, and the pack recipe measured by feeding that
model from a pack. The script doctor finds this side through the package's entry points
(group "trainfast.doctor_sides"); diagnose never imports trainfast.keras.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import keras
import numpy as np
import torch

from trainfast import files, hardware, units
from trainfast.diagnose.probes import keras_layers
from trainfast.diagnose.recipe import Recipe, sample_pack
from trainfast.diagnose.script import ScriptReport, Step
from trainfast.diagnose.verdict import MODERATELY_INPUT_BOUND, Recommendation
from trainfast.errors import TrainfastError
from trainfast.keras.data import PackDataset
from trainfast.keras.settings import backend_device, batch_ends, tune
from trainfast.keras.threads import code as threads_code

KERAS_TUNE_S = 30.0  # the script doctor's budget for timing Keras's own settings


class SpeedDoctor(keras.callbacks.Callback):
    """Print where the time of `fit` goes after `batches` training batches (default: at the end
    of the first epoch): the wait for the next batch vs the train step, the verdict, and the
    model's per-layer parameters and FLOPs.

    The wait is the time between one batch's end and the next one's start. Keras's torch and
    jax backends fetch the batch there; on TensorFlow the fetch runs inside the compiled step,
    so use `trainfast doctor -- python train.py` there to separate the two.
    """

    def __init__(self, batches: int | None = None, warmup: int = 2, print_fn=print):
        super().__init__()
        self.batches, self.warmup, self.print_fn = batches, warmup, print_fn
        self.report = None
        self._steps, self._end, self._begin, self._done = [], None, None, False

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if self._done or self._begin is None:
            return
        wait = self._begin - self._end if self._end is not None else 0.0
        self._steps.append(Step(seconds=now - (self._end if self._end is not None else self._begin), data=wait))
        self._end = now
        if self.batches and len(self._steps) >= self.batches + self.warmup:
            self._finish("after the requested batches")

    def on_epoch_end(self, epoch, logs=None):
        if not self._done and self._steps:
            self._finish("at the end of the first epoch")

    def _finish(self, when: str):
        self._done = True
        layers, model = keras_layers(self.model)
        backend, device = keras.backend.backend(), backend_device()
        system = {"device": device, "cpu": hardware.cpu_model(),
                  "physical_cores": hardware.physical_cores(), "usable_cores": hardware.usable_cores(),
                  "torch_threads": torch.get_num_threads(), "cuda_available": torch.cuda.is_available(),
                  "torch": torch.__version__}
        r = ScriptReport(command=["keras", "fit"], framework="keras", stopped=when, steps=self._steps,
                         warmup=min(self.warmup, len(self._steps) - 1), system=system, layers=layers, model=model,
                         devices={"model": [f"keras {backend} backend, {device}"],
                                  "batches": [f"the host (Keras moves each to the {device} in its step)"
                                              if device != "cpu" else "cpu"]})
        input_bound = r.data_share >= MODERATELY_INPUT_BOUND
        r.findings = [
            "the batches hold back training: `trainfast doctor -- python your_script.py` names the functions the "
            "data time goes to and measures the pack that replaces them" if input_bound else
            "the train step sets the pace: `trainfast.keras.tune(model, data)` times Keras's own settings (precision "
            "policy, jit_compile, steps_per_execution, batch, threads) on a copy of the model and prints the lines"]
        self.report = r
        self.print_fn(r.text())


def _cores(result, usable: int) -> list[str]:
    """The cores answer for a Keras script: the threads its backend trains with, and what a copy
    of the model did with fewer (timed on the torch backend; TensorFlow's are set at start)."""
    n = result.threads
    if not n or result.device != "cpu":
        return []
    line = (f"cores: Keras on {result.backend} trains with {n} CPU thread{'s' * (n != 1)} on {usable} usable "
            f"core{'s' * (usable != 1)}" + (" (all of them)" if n >= usable else ""))
    fewer = next((t for t in result.trials if t.setting.threads and t.images_per_s), None)
    if fewer is not None:
        same = next((t for t in result.trials if t.setting == replace(fewer.setting, threads=None)), result.base)
        line += (f"; a copy of the model with {fewer.setting.threads}: {units.rate(fewer.images_per_s)} images/s "
                 f"against {units.rate(same.images_per_s or 0)} with {n}")
        line += (": fewer threads are faster here, while other programs hold cores (the line is in What to do)"
                 if result.best.setting.threads else ": keep them all")
    elif n < usable or result.backend != "torch":
        code = "; ".join(c.split("   #")[0] for c in threads_code(max(1, n)).splitlines())
        line += f"; to set them, at the top of the script: {code}"
    return [line]


class KerasSide:
    """What the script doctor asks of Keras (diagnose.script.framework_side)."""

    def settings(self, r: ScriptReport, model, first, log) -> list[str]:
        """Keras's own speed settings timed on a copy of the script's model with its first batch
        (`first`, from recipe.batch_images): a recommendation when one wins, else a finding that
        says what was tried."""
        if first is None or first[1] is None:
            return []
        try:
            log(f"trainfast doctor: timing Keras's own settings on a copy of the model (up to {KERAS_TUNE_S:.0f} s)")
            result = tune(model, (first[0], first[1]), max_seconds=KERAS_TUNE_S, log=lambda m: None)
        except TrainfastError as e:
            return [f"Keras's own settings were not timed: {e}"]
        cores = _cores(result, r.system["usable_cores"])
        left_out = f"; not tried: {', '.join(result.not_tried)}" if result.not_tried else ""
        if result.best is result.base:
            return [f"Keras's own settings, timed on a copy of the model: none beat {result.base.setting.label()} "
                    f"by 5% (" + "; ".join(f"{t.setting.label()}: {units.rate(t.images_per_s)} images/s"
                                           for t in result.trials if t.images_per_s) + f"){left_out}"] + cores
        f = result.speedup
        data, step = r.mean("data"), r.mean("seconds")
        r.recommendations.append(Recommendation(
            f"Keras's own settings: {result.best.setting.label()}", result.code(),
            step / (data + max(step - data, 0.0) / f), True,
            f"the train step alone, on a copy of your model with your batch: ×{f:.2f} "
            f"({units.rate(result.base.images_per_s)} → {units.rate(result.best.images_per_s)} images/s)"
            + ("; the whole step gains that once it no longer waits for data (the pack above)"
               if r.recommendations else "") + left_out))
        return cores

    def recommendation(self, recipe: Recipe, model, script_step_s: float, batch_size: int, data_name: str,
                       x, y, max_seconds: float = 20.0) -> Recommendation:
        """Feed the script's own Keras model from a pack of a sample of its files, with the pack's
        own labels in the form the printed line gives them, for a few steps, and compare the step
        time with the script's own (data wait included). Labels the model would not take are a
        finding, not a gain."""
        title = "Pack the images once, then feed Keras from the pack"
        args = [repr(recipe.out), f"batch_size={batch_size}"] + ["one_hot=True"] * recipe.one_hot + \
            [f"scale={recipe.scale:g}"] * (recipe.scale != 1.0)
        call = f"PackDataset({', '.join(args)})"
        code = f"from trainfast.keras import PackDataset\n{recipe.assign(call, data_name)}"
        action = f"{recipe.command}\n# then in the script:\n{code}" + "".join(f"\n# {n}" for n in recipe.notes)
        with files.scratch("doctor") as tmp:
            pk = sample_pack(recipe.source, recipe.size, recipe.channels, batch_size, tmp)
            n = len(pk)
            feed = PackDataset(pk, batch_size=min(batch_size, len(pk)), drop_last=True, one_hot=recipe.one_hot,
                               scale=recipe.scale)
            given = feed[0][1]
            if y is not None and given.shape[1:] != y.shape[1:]:
                return Recommendation(title, action, 0.0, False,
                                      f"not measured: the pack's labels come as {given.shape[1:]} per image where the "
                                      f"script gave {y.shape[1:]}; your model would not take them as they are")
            steps = int(min(10, max(4, max_seconds / max(script_step_s, 1e-3)))) + 2
            ends = batch_ends(model, lambda i: feed[i % len(feed)], steps)
            step = statistics.median(np.diff(ends[1:])) if len(ends) > 3 else float("nan")
        return Recommendation(
            title, action, script_step_s / step, True,
            f"your model fed from a pack of {n} of your files, with its labels: {units.ms(step)} ms per step, "
            f"against {units.ms(script_step_s)} ms with {data_name}; the script reads {recipe.reads}")

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
from trainfast.diagnose.fixes import not_measured
from trainfast.diagnose.keras_probes import keras_layers
from trainfast.diagnose.probes import StopScript
from trainfast.diagnose.recipe import Recipe, sample_pack
from trainfast.diagnose.script import ScriptReport, Step
from trainfast.diagnose.verdict import HIGHLY_INPUT_BOUND, MODERATELY_INPUT_BOUND, Recommendation
from trainfast.errors import TrainfastError, in_words
from trainfast.keras.data import PackDataset
from trainfast.keras.feel import felt_gains, pack_feed, script_feed
from trainfast.keras.settings import backend_device, batch_ends, tune
from trainfast.keras.threads import code as threads_code

KERAS_TUNE_S = 30.0  # the script doctor's budget for timing Keras's own settings
FELT_S = 20.0  # and for feeding the script's model its own data and the fixes, in turns
PACK_KERAS = "Pack the images once, then feed Keras from the pack"


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
        data = ("the batches hold back training: `trainfast doctor -- python your_script.py` names the functions "
                "the data time goes to and measures the pack that replaces them")
        step = ("the train step sets the pace: `trainfast.keras.tune(model, data)` times Keras's own settings "
                "(precision policy, jit_compile, steps_per_execution, batch, threads) on a copy of the model and "
                "prints the lines")
        if r.data_share >= HIGHLY_INPUT_BOUND:
            r.findings = [data]
        else:
            r.findings = [step] + ([f"{r.data_share:.0%} of each step waits for the next batch: " + data.split(": ", 1)[1]]
                                   if r.data_share >= MODERATELY_INPUT_BOUND else [])
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
    """What the script doctor asks of Keras (diagnose.fixes.framework_side)."""

    def measure(self, r: ScriptReport, probe, first, recipe: Recipe | None, data_name: str, log) -> list[str]:
        """Keras's own settings timed on a copy of the script's model with its first batch, then
        the fixes (the pack of `recipe`, the settings that won) measured as the user will feel
        them: the script's model fed from its own data and from the pack, and a copy with the
        settings, in turns. Recommendations go into `r`; the findings are returned."""
        model, bs, step = probe.keras_model, r.batch or 1, r.mean("seconds")
        result, findings = self._tune(r, model, first, log)
        better = result.best.setting if result is not None and result.best is not result.base else None
        with files.scratch("doctor") as tmp:
            pack, pack_rec = None, None
            if recipe is not None:
                log(f"trainfast doctor: packing a sample of {recipe.reads} to measure the fix")
                try:
                    pack, pack_rec = self._pack(recipe, tmp, bs, first, data_name)
                except StopScript:
                    raise
                except Exception as e:  # noqa: BLE001 - the measurement is a bonus; the command stands without it
                    pack_rec = not_measured(recipe, e, PACK_KERAS)
            felt, why = {}, ""
            source = script_feed(probe.keras_fit, probe.batches, bs)
            if (pack is not None or better is not None) and source is not None:
                log("trainfast doctor: feeding your model its own data and the fixes, in turns")
                try:
                    felt = felt_gains(model, source, pack, better, step, FELT_S)
                except StopScript:
                    raise
                except Exception as e:  # noqa: BLE001 - fall back to the script's own step time
                    why = f"the fixes could not be run in turns with your data ({in_words(e)})"
            elif pack is not None or better is not None:
                why = "your data could not be drawn again after the script stopped"
            if pack_rec is not None:
                if pack is not None:
                    self._pack_gain(pack_rec, felt.get("pack"), model, pack(bs), step, data_name, recipe)
                r.recommendations.append(pack_rec)
        if better is not None:
            r.recommendations.append(_settings_rec(r, result, felt.get("settings"), pack_rec if pack else None))
        if why:
            findings.append(f"{why}: the gains printed compare with the steps timed while the script ran, at "
                            "another moment, so they may move with the machine's load")
        return findings

    @staticmethod
    def _tune(r: ScriptReport, model, first, log):
        """Keras's own settings timed on a copy of the model with the script's first batch (`first`,
        from recipe.batch_images): the result (None: not timed) and the findings."""
        if first is None or first[1] is None:
            return None, []
        try:
            log(f"trainfast doctor: timing Keras's own settings on a copy of the model (up to {KERAS_TUNE_S:.0f} s)")
            result = tune(model, (first[0], first[1]), max_seconds=KERAS_TUNE_S, log=lambda m: None)
        except TrainfastError as e:
            return None, [f"Keras's own settings were not timed: {e}"]
        findings = _cores(result, r.system["usable_cores"])
        if result.best is result.base:
            left_out = f"; not tried: {', '.join(result.not_tried)}" if result.not_tried else ""
            findings.insert(0, f"Keras's own settings, timed on a copy of the model: none beat "
                               f"{result.base.setting.label()} by 5% ("
                            + "; ".join(f"{t.setting.label()}: {units.rate(t.images_per_s)} images/s"
                                        for t in result.trials if t.images_per_s) + f"){left_out}")
        return result, findings

    @staticmethod
    def _pack(recipe: Recipe, tmp, bs: int, first, data_name: str):
        """A pack of a sample of the script's files: (its batches as a function of the batch size,
        or None where its labels would not fit the model; the recommendation, gain to come)."""
        args = [repr(recipe.out), f"batch_size={bs}"] + ["one_hot=True"] * recipe.one_hot + \
            [f"scale={recipe.scale:g}"] * (recipe.scale != 1.0)
        call = f"PackDataset({', '.join(args)})"
        code = f"from trainfast.keras import PackDataset\n{recipe.assign(call, data_name)}"
        action = f"{recipe.command}\n# then in the script:\n{code}" + "".join(f"\n# {n}" for n in recipe.notes)
        pk = sample_pack(recipe.source, recipe.size, recipe.channels, bs, tmp)

        def batches(size: int):
            size = min(size, len(pk))
            return pack_feed(PackDataset(pk, batch_size=size, drop_last=True, one_hot=recipe.one_hot,
                                         scale=recipe.scale), size)
        given, y = batches(bs).next()[1], (first[1] if first is not None else None)
        if y is not None and given.shape[1:] != y.shape[1:]:
            return None, Recommendation(PACK_KERAS, action, 0.0, False,
                                        f"not measured: the pack's labels come as {given.shape[1:]} per image where "
                                        f"the script gave {y.shape[1:]}; your model would not take them as they are")
        return batches, Recommendation(PACK_KERAS, action, 0.0, True, f"a pack of {len(pk)} of your files")

    @staticmethod
    def _pack_gain(rec: Recommendation, felt, model, feed, step_s: float, data_name: str, recipe: Recipe):
        """The pack's gain into `rec`: as felt in turns with the script's data, else its steps
        against the script's own (timed while the script ran)."""
        if felt is not None:
            cur, new = (statistics.median(v) * feed.batch_size for v in (felt.current, felt.new))
            rec.speedup, rec.spread = felt.gain, felt.spread
            rec.evidence = (f"your model fed from {rec.evidence}, with its labels: {units.ms(new)} "
                            f"ms per step, against {units.ms(cur)} ms fed by {data_name} ({felt.words()}); "
                            f"the script reads {recipe.reads}")
            return
        steps = int(min(10, max(4, 20.0 / max(step_s, 1e-3)))) + 2
        ends = batch_ends(model, lambda i: feed.next(), steps)
        step = statistics.median(np.diff(ends[1:])) if len(ends) > 3 else float("nan")
        rec.speedup = step_s / step
        rec.evidence = (f"your model fed from {rec.evidence}, with its labels: {units.ms(step)} ms "
                        f"per step, against {units.ms(step_s)} ms with {data_name} as the script ran; "
                        f"the script reads {recipe.reads}")


def _settings_rec(r: ScriptReport, result, felt, pack: Recommendation | None) -> Recommendation:
    """The settings tune chose: their gain as felt (on top of the pack, where there is one), else
    the step's share that is not data wait sped up by tune's factor."""
    f = result.speedup
    left_out = f"; not tried: {', '.join(result.not_tried)}" if result.not_tried else ""
    alone = (f"the train step alone, on a copy of your model with your batch: ×{f:.2f} "
             f"({units.rate(result.base.images_per_s)} → {units.rate(result.best.images_per_s)} images/s)")
    title = f"Keras's own settings: {result.best.setting.label()}"
    if felt is not None:
        on = "fed from the pack above, " if pack is not None else ""
        return Recommendation(
            title + (", on top of the pack" if pack is not None else ""), result.code(), felt.gain, True,
            f"a copy of your model with these settings, {on}against your model fed by your data as it is: "
            f"{felt.words()}; {alone}{left_out}", spread=felt.spread, builds_on=pack.title if pack else "")
    data, step = r.mean("data"), r.mean("seconds")
    return Recommendation(title, result.code(), step / (data + max(step - data, 0.0) / f), True,
                          alone + ("; the whole step gains that once it no longer waits for data (the pack above)"
                                   if pack is not None else "") + left_out)

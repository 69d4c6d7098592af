"""The fixes the script doctor measures after the script stopped: the pack that replaces what
it reads (its gain measured as the user will feel it), the framework's own settings (through
its bridge), and where the files it read live; and the findings that go with them."""

from __future__ import annotations

import os

from trainfast.diagnose.probes import StopScript, _Probe
from trainfast.diagnose.script_report import ScriptReport
from trainfast.diagnose.verdict import MODERATELY_INPUT_BOUND, Recommendation, ranked
from trainfast.errors import TrainfastError


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


PACK_TITLE = "Pack the images once, then read the pack"


def measure(r: ScriptReport, probe: _Probe, first, log, fixes: bool = True):
    """The fixes for what `r` found, into r.recommendations (ranked) and r.findings: the pack
    that replaces what an input-bound script reads and, for a Keras model, Keras's own settings;
    with `fixes`, measured here after the script stopped."""
    recipe, why_not = None, ""
    if r.timed and r.data_share >= MODERATELY_INPUT_BOUND and r.data_source.get("reads") != "a trainfast pack":
        recipe, why_not = _find_recipe(probe, first)
    keras = r.framework == "keras" and probe.keras_model is not None
    side = framework_side("keras") if fixes and r.timed and keras else None
    if recipe is not None and (not fixes or side is None and keras):
        why = "--no-fixes" if not fixes else "trainfast.keras is not installed here"
        r.recommendations.append(Recommendation(PACK_TITLE, recipe.command, 0.0, False,
                                                f"the script reads {recipe.reads} (not measured: {why})"))
    if fixes and r.timed and keras:
        r.findings += (side.measure(r, probe, first, recipe, _data_name(r, probe), log) if side is not None else
                       ["Keras's own settings were not timed: trainfast.keras is not installed here"])
    elif fixes and recipe is not None:
        log(f"trainfast doctor: packing a sample of {recipe.reads} to measure the fix")
        r.recommendations.append(_torch_pack(r, probe, recipe, first))
    r.findings += _findings(r, recipe is not None, why_not)
    r.findings += _storage_findings(r, _files_read(probe, recipe))
    r.recommendations[:] = ranked(r.recommendations)


def _find_recipe(probe: _Probe, first):
    from trainfast.diagnose import recipe as rc

    try:
        return rc.find_recipe(probe, first)
    except (OSError, TrainfastError) as e:
        return None, str(e)


def _torch_pack(r: ScriptReport, probe: _Probe, recipe, first) -> Recommendation:
    from trainfast.diagnose.recipe import torch_recommendation

    try:
        return torch_recommendation(recipe, r.mean("seconds"), r.mean("data"), r.batch or 1, _data_name(r, probe),
                                    (r.devices.get("model") or ["cpu"])[0], first[0], loader=probe.torch_loader)
    except StopScript:
        raise
    except Exception as e:  # noqa: BLE001 - the measurement is a bonus; the command stands without it
        return not_measured(recipe, e)


def not_measured(recipe, e: BaseException, title: str = PACK_TITLE) -> Recommendation:
    """The recipe's command, when measuring its gain failed: the command stands without it."""
    return Recommendation(title, recipe.command, 0.0, False,
                          f"(the gain could not be measured here: {type(e).__name__}: {e})")


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



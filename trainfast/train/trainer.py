"""`trainfast.fit`: train a model on a pack with measured speed settings, and a run
directory that survives being killed.

The loop is plain single-device code; DDP (under torchrun) is a wrapper around the model
and a shard of the Loader, and only rank 0 prints, logs and writes.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import re
import shlex
import signal
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch

from trainfast import files, hardware, models, units
from trainfast import step as _step
from trainfast.config import SCHEDULES, Augment, Speed, TrainConfig, check_optimizer, default_lr, scale_lr
from trainfast.data.format import Pack, as_pack
from trainfast.data.loader import Loader
from trainfast.data.pack import is_arrays, pack_arrays
from trainfast.errors import TrainfastError, in_words
from trainfast.train import checkpoint, distributed, lr_range
from trainfast.train.metrics import MetricsLog, correct, plot_curves
from trainfast.tuning import MIN_STEPS_PER_EPOCH, data_max_batch  # noqa: F401 - fit's data bound, kept importable here


# Steps between reads of the loss off the device (see _Watch). On a CPU a read costs nothing.
READ_EVERY = {"cpu": 1, "cuda": 25}


@dataclass
class FitResult:
    run_dir: Path
    history: list[dict]
    best: float  # best validation accuracy (per character for sequences)
    speed: Speed
    stopped: str  # "finished", "early-stopped", "out-of-time" (TrainConfig.minutes)
    model: torch.nn.Module | None = field(default=None, repr=False)  # the model given (or built by name), trained

    def __repr__(self) -> str:  # what a notebook cell shows: the outcome, not every epoch's dict
        last = self.history[-1] if self.history else {}
        acc = f", best held-out accuracy {self.best:.1%}" if self.best >= 0 else ""
        tail = (f"; last epoch: train loss {last['train_loss']:.4g}, {units.rate(last['images_per_s'])} images/s"
                if last else "")
        return (f"FitResult({len(self.history)} epochs, {self.stopped}{acc}{tail}; {self.speed.label()}; "
                f"run dir {self.run_dir})")


def _model_and_name(model) -> tuple[torch.nn.Module, str]:
    try:
        return models.load(model)
    except ValueError as e:
        raise TrainfastError(str(e)) from None


def check_fits(model: torch.nn.Module, pk: Pack, say=None, out: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
    """The pack's images and labels must be what the model takes and predicts: checked with one
    forward pass of two of the pack's images (on the model's device, in eval mode, no gradient), which also
    materialises lazy modules (nn.LazyLinear) before an optimizer needs their parameters. `say`
    is told which part of the output is trained on where the model returns more than logits,
    and of a head wider than the pack's classes. `out`: the model's output for images of this
    shape where it is known (no forward pass then). Returns the classes per prediction that the
    data has (the loss watch's chance level is ln of this), and the output."""
    h, w, c = pk.shape
    want = getattr(model, "input_shape", None)
    if want is not None and tuple(want) != (c, h, w):
        raise TrainfastError(f"{pk.path} holds {c}×{h}×{w} images; the model takes {'×'.join(map(str, want))}")
    out = model_output(model, pk, say) if out is None else out
    need = pk.sequence_length
    classes = len(pk.alphabet) if need else len(pk.classes or [])
    if need:
        if out.dim() != 3 or out.shape[1] != need or out.shape[2] < classes:
            raise TrainfastError(f"{pk.path} has sequence labels ({need} × {classes} characters); the model "
                                 f"predicts {'×'.join(map(str, out.shape[1:]))} per image: it needs "
                                 f"(N, {need}, {classes}) logits")
    elif out.dim() != 2 or out.shape[1] < classes:
        raise TrainfastError(f"{pk.path} has {classes} classes; the model predicts "
                             f"{'×'.join(map(str, out.shape[1:]))} per image: it needs (N, {classes}) "
                             "logits (the last layer's width, e.g. num_classes=" + str(classes) + ")")
    if out.shape[-1] > classes and say is not None:
        say(f"note: the model predicts {out.shape[-1]} classes and {pk.path} has {classes}: the other "
            f"{out.shape[-1] - classes} outputs are trained toward never; a head of {classes} "
            f"(num_classes={classes}) is the usual fit")
    return classes or int(out.shape[-1]), out


def model_output(model: torch.nn.Module, pk: Pack, say=None) -> torch.Tensor:
    """The model's logits for two of the pack's images, or one line saying why there are none."""
    x = torch.from_numpy(np.stack([pk.image(i) for i in range(min(2, len(pk)))])).permute(0, 3, 1, 2).float() / 255
    return _step.first_forward(model, x, f"{pk.path}'s images", say)


def _optimizer(params, cfg: TrainConfig, lr: float, device: torch.device):
    return _step.make_optimizer(cfg.optimizer, params, lr, device, cfg.momentum, cfg.weight_decay)


def lr_factor(cfg: TrainConfig, step: int, total: int) -> float:
    """The share of the peak learning rate at `step` of `total` for the constant and cosine
    schedules (cosine: a linear warm-up over cfg.warmup of the steps, then a half cosine to 0)."""
    if cfg.schedule == "constant":
        return 1.0
    warm = max(1, int(cfg.warmup * total))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


def _scheduler(opt, cfg: TrainConfig, total: int, lr: float):
    if cfg.schedule == "onecycle":
        # NOTE: one step more than the run takes: the scheduler also steps after the last update,
        # and at total_steps OneCycleLR extrapolates its last line below zero (a negative rate
        # logged for the last epoch).
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total + 1, pct_start=cfg.warmup,
                                                   anneal_strategy="linear", div_factor=10, final_div_factor=100)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(cfg, step, total))


def _tail_scheduler(opt, lrs: list[float], steps: int):
    """The learning rate of a shortened run (TrainConfig.minutes): from `lrs`, where the run
    stands, linearly down to a thousandth of them over the `steps` left, whatever the schedule
    was: a run cut short still ends annealed rather than at its peak."""
    for g, lr in zip(opt.param_groups, lrs):
        g["initial_lr"] = lr
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 - 0.999 * min(1.0, k / max(1, steps)))


class _Threads:
    """torch's intra-op threads, following other processes' load on a CPU run: at the start
    from a quick sample, then after each epoch from the load measured during it
    (hardware.free_threads); said in the log when they change. Off where the threads are
    pinned (Speed.threads), on a GPU, under torchrun (each rank's neighbours are its peers), and
    for a deterministic run (the threads change the order of a CPU kernel's sums). Never more
    than the threads torch had when the run began; fit puts those back at its end."""

    def __init__(self, active: bool, say, since: hardware.OtherLoad | None = None):
        self.active, self.say, self.cap = active, say, torch.get_num_threads()
        self.load: hardware.OtherLoad | None = None
        # measured over the run's set-up where `since` began it; fit's tune reuses this sample
        self.at_start = hardware.other_cores_now(since=since) if active else None
        if active:
            self.set(self.at_start, "at the start")

    def set(self, other: float | None, when: str) -> None:
        want, now = hardware.free_threads(other, self.cap), torch.get_num_threads()
        if want != now:
            torch.set_num_threads(want)
            why = (f"other processes kept {other:.1f} of {hardware.usable_cores()} cores busy {when}" if want < now
                   else f"the machine is quieter {when} ({other or 0:.1f} cores busy)")
            self.say(f"threads {now} → {want}: {why}")

    def __enter__(self):
        self.load = hardware.OtherLoad().__enter__()
        return self

    def __exit__(self, *exc):
        self.load.__exit__(*exc)
        if self.active and exc[0] is None:
            self.set(self.load.cores, "during that epoch")
        return False


class _Interrupts:
    """Ctrl-C and SIGTERM land between training steps, so that a checkpoint's weights and its
    count of steps agree (one landing mid-step used to save the next batch as done).

    Inside `step()` a first signal is held until the step ends; a second one raises at once
    (and `torn` tells the caller not to save). Anywhere else, e.g. during validation, they
    raise KeyboardInterrupt at once. Only the main thread of a process can take signals.

    Under torchrun every rank takes them (torchrun passes a SIGTERM on to all; rank 1 used to
    die at once and leave rank 0 in a broken collective): a first signal is always held, and the
    ranks agree after a step (every `agree_every` steps: an all-reduce of the flag) to stop at
    the same one, so that rank 0 saves one consistent checkpoint and all of them exit.
    """

    def __init__(self, active: bool, world=None, agree_every: int = 1):
        self.active = active and threading.current_thread() is threading.main_thread()
        self.world = world if world is not None and world.distributed else None
        self.agree_every, self.steps = agree_every, 0
        self.holding = self.pending = self.torn = False
        self.previous = {}

    def _handler(self, signum, frame):
        if (self.holding or self.world is not None) and not self.pending:
            self.pending = True  # distributed: held wherever it lands, until the ranks agree
            return
        self.torn = self.holding
        raise KeyboardInterrupt

    def __enter__(self):
        if self.active:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    @contextlib.contextmanager
    def step(self):
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.world is None:
            if self.pending:
                raise KeyboardInterrupt
            return
        self.steps += 1  # the ranks stop together, at a step where they agree: one rank's signal stops all
        if self.steps % self.agree_every == 0 and distributed.sum_all([float(self.pending)], self.world)[0] > 0:
            raise KeyboardInterrupt
        # `pending` is only ever set by the handler, never written here: a signal that lands while the
        # ranks agree (they wait for each other in the all-reduce) counts at the next agreement. Storing
        # the agreement's result in it used to lose such a signal, and an orphaned run trained on.


def _check_config(cfg: TrainConfig) -> None:
    for name in ("epochs", "seed", "patience", "save_every"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TrainfastError(f"{name} must be a whole number ≥ 0, not {value!r}")
    check_optimizer(cfg.optimizer)
    if cfg.schedule not in SCHEDULES:
        raise TrainfastError(f"schedule must be one of {', '.join(SCHEDULES)}, not {cfg.schedule!r}")
    if cfg.epochs < 1:
        raise TrainfastError(f"epochs must be ≥ 1, not {cfg.epochs}")
    if not 0 <= cfg.val_fraction < 1:
        raise TrainfastError(f"val_fraction must be in [0, 1), not {cfg.val_fraction}")
    for name, low, high in (("lr", 0, None), ("momentum", 0, 1), ("weight_decay", 0, None), ("warmup", 0, 1),
                            ("label_smoothing", 0, 1), ("clip", 0, None), ("tune_share", 0, 1),
                            ("patience", 0, None), ("save_every", 0, None), ("minutes", 0, None)):
        value = getattr(cfg, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= low
                and (high is None or value <= high)):
            span = f"in [{low}, {high}]" if high is not None else f"≥ {low}"
            raise TrainfastError(f"{name} must be {span}, not {value!r}")


def pack_record(pk: Pack) -> dict:
    """How a run directory names a pack: its absolute path, and an identity from its metadata
    (size, shape, per-channel statistics, what it was built from), so that another pack at that
    path, or a relative path read from another working directory, is noticed."""
    m = pk.meta
    ident = json.dumps([m.get("count"), m.get("shape"), m.get("encoding"), m.get("mean"), m.get("std"), m.get("build")],
                       sort_keys=True)
    return {"path": str(pk.path.resolve()), "count": len(pk), "id": hashlib.sha1(ident.encode()).hexdigest()[:16]}


def read_run_config(run_dir, device=None) -> dict:
    """A run directory's config.json, checked against what resuming reads from it: one line
    naming the file and what is wrong, never a traceback. Nothing in it runs: the model is a
    name, and a model from a file is the caller's to name again.

    Under torchrun a process that finds no run directory joins the process group (on `device`,
    as the others will) only to tell them, so that none waits there for it (see _fit)."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        shared = ""
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            shared = (" — under torchrun every node reads the run directory (config.json, last.pt): put it on a file "
                      "system all nodes share, or copy it to each")
            with contextlib.suppress(Exception):  # telling the others is a courtesy; the line below is the error
                distributed.sum_all([1.0], distributed.setup(hardware.resolve_device(device)))
        raise TrainfastError(f"{run_dir}: not a run directory to resume (no config.json){shared}")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TrainfastError(f"{path}: unreadable ({e})") from None
    try:
        if not isinstance(saved, dict):
            raise TypeError("not a JSON object")
        for key, kind in (("model", str), ("train", dict), ("speed", dict), ("augment", dict),
                          ("train_pack", (str, dict)), ("user_batch_size", int)):
            if not isinstance(saved[key], kind):
                raise TypeError(f"{key!r} is {type(saved[key]).__name__}")
        _check_config(TrainConfig(**saved["train"]))
        Speed(**saved["speed"])
        Augment(**saved["augment"])
    except KeyError as e:
        raise TrainfastError(f"{path}: no {e.args[0]!r} (not written by trainfast, or damaged)") from None
    except (TypeError, ValueError, TrainfastError) as e:
        raise TrainfastError(f"{path}: not a run configuration trainfast can resume ({e})") from None
    return saved


def _same_pack(pk: Pack, recorded, what: str) -> None:
    """Refuse to resume on a pack other than the one the run recorded."""
    if isinstance(recorded, dict) and recorded.get("id") != pack_record(pk)["id"]:
        raise TrainfastError(f"{pk.path}: not the {what} pack this run trained on (it recorded {recorded['path']}, "
                             f"{recorded['count']} images); resume with that pack")


RUN_FILES = ("config.json", "speed.json", "metrics.csv", "curves.png", "last.pt", "best.pt")  # what a run writes
RUN_LOCK = ".trainfast-lock"


def _own_run_dir(run_dir: Path, resume: bool, stack: contextlib.ExitStack) -> None:
    """Hold the run directory for this run (a second run into it, new or resumed, is told at
    once), then check it: a new run's must be empty; a resumed one's must hold no link where
    the run writes (nothing is written through a link), and loses the temporary files of a
    save that was killed."""
    busy = (f"{run_dir}: another trainfast run is using this run directory now; wait for it, or choose another "
            "--run-dir")
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainfastError(f"{run_dir}: a file, not a run directory; choose another --run-dir")
    if not resume and run_dir.exists() and any(p.name != RUN_LOCK for p in run_dir.iterdir()):
        raise TrainfastError(f"{run_dir}: exists and is not empty; choose another --run-dir or --resume it")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TrainfastError(f"{run_dir}: cannot write the run directory ({e.strerror or e})") from None
    stack.enter_context(files.only_one(run_dir / RUN_LOCK, busy))
    if not resume:
        if any(p.name != RUN_LOCK for p in run_dir.iterdir()):  # filled between the look and the lock
            raise TrainfastError(f"{run_dir}: exists and is not empty; choose another --run-dir or --resume it")
        return
    linked = files.links(run_dir, RUN_FILES)
    if linked:
        raise TrainfastError(f"{run_dir}: {', '.join(linked)} {'is a link' if len(linked) == 1 else 'are links'}; "
                             "trainfast writes nothing through a link in a run directory: remove "
                             f"{'it' if len(linked) == 1 else 'them'} (or copy the file in), then resume")
    for tmp in files.stale_temporaries(run_dir, RUN_FILES):
        tmp.unlink()


def evaluate(model, loader: Loader, speed: Speed, device, world) -> dict:
    """Loss and accuracy over `loader` (summed over ranks under DDP); one wait for the device, at the end."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss·images, correct items, correct sequences
    items = images = 0
    with torch.no_grad():
        for x, y in loader:
            loss, out = _step.forward_loss(model, x, y, speed, device)
            sums += torch.cat([(loss.double() * len(x)).reshape(1), correct(out, y)])
            items, images = items + y.numel(), images + len(x)
    loss_n, c, cs, n, imgs = distributed.sum_all(sums.tolist() + [items, images], world)
    model.train()
    return {"loss": loss_n / max(imgs, 1), "acc": c / max(n, 1), "seq_acc": cs / max(imgs, 1)}


class _Watch:
    """The epoch's running sums and the NaN/Inf guard, kept on the device.

    Reading a number off a GPU makes the host wait until the device has caught up, which
    empties the queue of launched work that small models live on. So the loss and accuracy
    are summed on the device and read every `every` steps, before each checkpoint and at the
    end of an epoch; the guard records the global step of the first non-finite loss, so it is
    named exactly however late it is read. Every rank reads at the same steps (a collective).
    """

    def __init__(self, device: torch.device, partial: list[float], every: int):
        self.partial = list(partial)  # loss·images, correct items, items, images: as read last
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)  # since the last read
        self.items = self.images = 0
        self.bad = torch.tensor([-1.0, 0.0], dtype=torch.float64, device=device)  # first bad (global step, loss)
        self.every = every

    def add(self, loss: torch.Tensor, out: torch.Tensor, y: torch.Tensor, step: int) -> None:
        with torch.no_grad():
            loss = loss.detach()
            self.sums += torch.stack([loss.double() * len(y), correct(out.detach(), y)[0]])
            first = (self.bad[0] < 0) & ~torch.isfinite(loss)
            self.bad = torch.where(first, torch.stack([torch.full_like(self.bad[0], step), loss.double()]), self.bad)
        self.items, self.images = self.items + y.numel(), self.images + len(y)

    def read(self, world) -> tuple[int, float] | None:
        """Fold the device sums into `partial`; the first bad (global step, loss) on any rank
        (step -1 when it was another rank's), or None."""
        loss_n, c, bad, value = torch.cat([self.sums, self.bad]).tolist()  # one wait for the device
        bad = int(bad)
        p = self.partial
        self.partial = [p[0] + loss_n, p[1] + c, p[2] + self.items, p[3] + self.images]
        self.sums.zero_()
        self.items = self.images = 0
        anywhere = distributed.sum_all([1.0 if bad >= 0 else 0.0], world)[0]
        return None if not anywhere else (bad, value) if bad >= 0 else (-1, math.nan)

    @property
    def loss(self) -> float:
        return self.partial[0] / max(self.partial[3], 1)


PLOT_EVERY_S = 20.0  # curves.png is redrawn at most this often (a draw takes 0.1-0.4 s: 5-20% of a 2 s epoch)
SAVE_EVERY_S = 60.0
"""An epoch's end writes last.pt where the last checkpoint is at least this old, and always at the
run's last epoch, an early stop, Ctrl-C or a stop for a hopeless loss: ResNet-18's model and AdamW
state (135 MB) took 0.12 s to write, 4% of a 3 s epoch on 2 CPU cores. A run killed outright loses
at most this much of its training; an epoch longer than this saves at each end, as before. An
improving epoch not saved at once is kept in memory as best.pt, and written with the next save."""


def _copied(tree):
    """A checkpoint's contents with every tensor and list copied, tensors to the CPU: a snapshot
    training cannot change, which takes no device memory (checkpoints load on the CPU anyway)."""
    if torch.is_tensor(tree):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _copied(v) for k, v in tree.items()}
    if type(tree) in (list, tuple):
        return type(tree)(_copied(v) for v in tree)
    return tree


@dataclass
class _Run:
    """A training run's moving parts, and what is done with them: an epoch of steps, the end
    of an epoch (validation, metrics, checkpoint), reading the device (the NaN guard), saving."""

    name: str
    net: torch.nn.Module  # the model whose state is saved
    trained: torch.nn.Module  # what the steps call: the model, compiled and/or wrapped in DDP
    opt: torch.optim.Optimizer
    sched: object
    scaler: object
    loader: Loader
    val_loader: Loader | None
    cfg: TrainConfig
    speed: Speed
    dev: torch.device
    world: distributed.World
    run_dir: Path
    say: object
    state: dict  # epoch, step, position, best, bad_epochs, partial: all a checkpoint needs to go on
    watch: _Watch
    log_csv: MetricsLog
    sequence: bool
    plotted: tuple[int, float]  # rows drawn in curves.png, and when (at the start: the rows resumed, now)
    saved: tuple[int, float] = (-1, 0.0)  # the step of the last checkpoint written, and when (set at the start)
    best_step: int = -1  # the step at which the best epoch ended
    best_ck: dict | None = None  # that epoch's checkpoint, where it is not yet written (SAVE_EVERY_S)
    first_steps: _FirstSteps | None = None  # a short run's comparison on its first steps, until it is made

    def plot(self, force: bool = False) -> None:
        """Redraw curves.png with the rows so far: at most every PLOT_EVERY_S, and when `force`d
        (the run's end, however it ends)."""
        rows, (drawn, at) = self.log_csv.rows, self.plotted
        if not self.world.is_main or len(rows) == drawn:
            return
        if force or time.perf_counter() - at >= PLOT_EVERY_S:
            plot_curves(rows, self.run_dir / "curves.png", self.sequence)
            self.plotted = (len(rows), time.perf_counter())

    def train_epoch(self, epoch: int, interrupts: _Interrupts, progress: bool) -> dict:
        """The steps of `epoch` from where the loader stands; the epoch's training row."""
        from tqdm.auto import tqdm

        state, loader, cfg = self.state, self.loader, self.cfg
        self.trained.train()  # a model handed over in eval mode trains in training mode (batch norm, dropout)
        if loader.position == 0:
            loader.set_epoch(epoch)
        started, done_before, steps = time.perf_counter(), loader.position, len(loader)
        bar = tqdm(total=steps, initial=loader.position, desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="step",
                   disable=not (progress and self.world.is_main), dynamic_ncols=True, leave=True)
        waited, ready, said = 0.0, time.perf_counter(), ""
        for x, y in loader:
            waited += time.perf_counter() - ready
            with interrupts.step():
                loss, out = self.forward_backward(x, y)
                _step.optimizer_step(self.opt, self.scaler, cfg.clip, self.net)
                self.sched.step()
                state.update(step=state["step"] + 1, position=state["position"] + 1)
                self.watch.add(loss, out, y, state["step"])
                if self.first_steps is not None and self.first_steps.after_step(self):
                    said, self.first_steps = self.first_steps.line, None
            bar.update(1)
            if cfg.save_every and state["step"] % cfg.save_every == 0:
                self.save(epoch)
            elif state["step"] % self.watch.every == 0:
                self.check(epoch)
            if state["step"] % self.watch.every == 0 or bar.n == steps:
                rate = (bar.n - done_before) * loader.batch_size * self.world.size / (time.perf_counter() - started)
                bar.set_postfix_str(f"loss {self.watch.loss:.3f}, {units.rate(rate)} img/s", refresh=False)
            ready = time.perf_counter()
        self.check(epoch)
        bar.close()
        if said:
            self.say(said)
        images = (steps - done_before) * loader.batch_size * self.world.size
        row = _epoch_row(epoch, state["partial"], self.sched, time.perf_counter() - started, images, self.world)
        return {**row, "waited": waited}  # seconds the steps waited for batches (not a metrics.csv column)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's loss and output, its gradients computed. Where the setting the first steps
        try fails (an operation without a bf16 backward), it is left out and the batch done again."""
        try:
            loss, out = _step.forward_loss(self.trained, x, y, self.speed, self.dev, self.cfg.label_smoothing)
            _step.backward(loss, self.scaler)
        except Exception as e:  # noqa: BLE001 - only the first steps' candidate is caught; the rest is raised
            if self.first_steps is None or not self.first_steps.trying(self):
                raise
            self.first_steps.failed(self, e)
            return self.forward_backward(x, y)
        return loss, out

    def end_epoch(self, epoch: int, row: dict) -> bool:
        """Validate, log, checkpoint; True when early stopping says to stop."""
        state = self.state
        _measure_batch_norm(self.net, self.loader, epoch, self.speed, self.dev, self.world)
        if self.val_loader is not None:
            v = evaluate(self.net, self.val_loader, self.speed, self.dev, self.world)
            row.update(val_loss=v["loss"], val_acc=v["acc"], val_seq_acc=v["seq_acc"])
        score = row.get("val_acc", row["train_acc"])
        improved = score > state["best"]
        state.update(epoch=epoch + 1, position=0, partial=[0.0, 0.0, 0.0, 0.0],
                     best=max(state["best"], score), bad_epochs=0 if improved else state["bad_epochs"] + 1)
        state.setdefault("losses", []).append(row["train_loss"])  # the same on every process: for the loss watch
        state["last_acc"] = row["train_acc"]
        self.watch.partial = state["partial"]
        if self.world.is_main:
            self.log_csv.add(row)
        self.plot()
        stop = bool(self.cfg.patience and state["bad_epochs"] >= self.cfg.patience)
        if improved:
            self.best_step = state["step"]
        # NOTE: under torchrun every epoch saves: a save is collective, and the ranks' clocks differ.
        if (self.world.distributed or stop or state["epoch"] >= self.cfg.epochs
                or time.perf_counter() - self.saved[1] >= SAVE_EVERY_S):
            self.save(epoch)
        elif improved:
            self.best_ck = _copied(self._checkpoint(self.watch.partial))
        self.say(_epoch_line(row, self.sequence))
        return stop

    def check(self, epoch: int) -> None:
        """Read the device's sums; stop at a non-finite loss, naming its step and the last good checkpoint."""
        found = self.watch.read(self.world)
        self.state["partial"] = self.watch.partial
        if found is None:
            return
        bad, value = found
        steps = len(self.loader)
        at = (f"{value} at epoch {epoch + 1}, step {bad - epoch * steps} (global step {bad})" if bad >= 0
              else "non-finite on another process")
        last = self.run_dir / "last.pt"
        kept = f"The last good checkpoint is {last}" if last.is_file() else "No checkpoint was written before it"
        raise TrainfastError(f"the loss became {at}; stopped. {kept}; try a lower --lr, --clip 1, or --precision fp32")

    def flush(self, epoch: int) -> None:
        """Save where training went on since the last checkpoint (SAVE_EVERY_S), as a run stops."""
        if self.saved[0] != self.state["step"]:
            self.save(epoch)

    def save(self, epoch: int) -> None:
        """Write last.pt, and best.pt: the same file where this is the best epoch's end, else the
        best epoch's checkpoint kept in memory, if one is."""
        self.check(epoch)  # never a checkpoint of weights that went NaN
        # the epoch's sums so far over all ranks: a resumed run (with any number of processes) starts
        # rank 0 from them and the others from zero
        partial = distributed.sum_all(self.watch.partial, self.world)
        self.saved = (self.state["step"], time.perf_counter())  # on every rank: flush() is collective too
        if not self.world.is_main:
            return
        ck = self._checkpoint(partial)
        last, best = self.run_dir / "last.pt", self.run_dir / "best.pt"
        checkpoint.save(last, ck)
        if self.best_step == self.state["step"]:  # the same checkpoint under a second name: linked, not serialised
            if not files.link_whole(last, best):
                checkpoint.save(best, ck)
        elif self.best_ck is not None:
            checkpoint.save(best, self.best_ck)
        self.best_ck = None

    def _checkpoint(self, partial: list[float]) -> dict:
        # NOTE: the loader's own position counts batches it handed out; the checkpoint records
        # the batches whose step is done, kept in `state` with the step count and the epoch.
        state = {**self.state, "partial": partial}
        return {"model_name": self.name, "signature": checkpoint.signature(self.net), "model": self.net.state_dict(),
                "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "loader": {"seed": self.cfg.seed, "epoch": state["epoch"], "position": state["position"]},
                "rng": checkpoint.rng_state(self.dev), "state": state}


def _epoch_row(epoch: int, partial: list[float], sched, seconds: float, images: int, world) -> dict:
    p = distributed.sum_all(partial, world)  # loss·images, correct items, items, images
    return {"epoch": epoch, "train_loss": p[0] / max(p[3], 1), "train_acc": p[1] / max(p[2], 1),
            "lr": sched.get_last_lr()[0], "seconds": seconds, "images_per_s": images / max(seconds, 1e-9)}


def _epoch_line(row: dict, sequence: bool) -> str:
    extra = f", val loss {row['val_loss']:.4f}, val acc {row['val_acc']:.2%}" if "val_loss" in row else ""
    if "val_loss" in row and sequence:
        extra += f", whole sequences {row['val_seq_acc']:.2%}"
    return (f"epoch {row['epoch'] + 1}: train loss {row['train_loss']:.4f}{extra}, {units.rate(row['images_per_s'])} img/s, "
            f"{units.rate(row['seconds'])} s")


def _timed_rate(rows: list[dict], label: str) -> float | None:
    """The median images/s tune timed for the setting `label` (a setting timed several times
    counts at its median, as tune's table shows it); None if it was not timed."""
    rates = [r["images_per_s"] for r in rows if r["label"] == label and r["images_per_s"]]
    return statistics.median(rates) if rates else None


def _pays(best: Speed, rows: list, planned_images: int, say) -> Speed:
    """`best` if it is not compiled, or if its compile time is won back over the planned
    images; else the same settings uncompiled."""
    if not best.compile:
        return best
    plain = replace(best, compile=False)
    fast, slow = _timed_rate(rows, best.label()), _timed_rate(rows, plain.label())
    if fast is None or slow is None:
        return best
    compile_s = max(r["compile_s"] for r in rows if r["label"] == best.label())
    saved = planned_images / slow - planned_images / fast
    if saved > compile_s:
        return best
    say(f"torch.compile left out: it would save {saved:.1f} s over this run's {planned_images:,} images "
        f"and takes {compile_s:.1f} s to compile")
    return plain


_now = time.perf_counter  # the time budget's clock (tests replace it)

RATE_OFF = 0.6
"""A run whose epoch trains below this share of the rate tune timed for its setting says so
(tune times in-memory batches; on 2 cores the plate demo's epochs run at about 0.8× of it)."""


def _check_tuned_rate(tuned, tried: list[dict], speed: Speed, row: dict, say) -> bool:
    """Compare an epoch's images/s with what tune timed for the run's setting; where it is far
    below, say why it may be: other processes' load during the epoch, the data path (the row's
    `waited`: seconds spent waiting for batches; without them the steps kept up), or a stale
    cached choice (then dropped from the cache, so that no run uses it again). True for a
    stale cached choice."""
    from trainfast.tuning import forget

    rate = _timed_rate(tried, speed.label())
    if rate is None or row["images_per_s"] >= RATE_OFF * rate:
        return False
    said = (f"epoch {row['epoch'] + 1} trained at {units.rate(row['images_per_s'])} images/s, "
            f"{row['images_per_s'] / rate:.2f}× the {units.rate(rate)} tune timed for {speed.label()}")
    waited = row.get("waited", 0.0)
    stepping = row["images_per_s"] * row["seconds"] / max(row["seconds"] - waited, 1e-9)  # the rate without waits
    if hardware.is_busy(row.get("other_cores")):
        say(f"note: {said}: other processes kept {row['other_cores']:.1f} cores busy during it")
    elif stepping >= RATE_OFF * rate:
        say(f"note: {said}: its steps waited {waited:.1f} s of {row['seconds']:.1f} s for batches (without the waits: "
            f"{units.rate(stepping)} images/s); `trainfast doctor` shows where the data path's time goes")
    elif tuned.cached:
        forget(tuned)
        say(f"note: {said} on a quiet machine: the cached choice looks stale; dropped from the cache")
        return True
    else:
        say(f"note: {said}: the data path or the model's own work outside tune's in-memory timing costs that much "
            "more; `trainfast doctor` shows where the time goes")
    return False


def _retune(run: "_Run", given: torch.nn.Module, pk: Pack, pin: dict, images: int, budget_share: float, say) -> None:
    """A stale cached choice, found by the run that uses it: tune measures again now, at the
    run's batch (its schedule, loader position and learning rate are made for it), within
    budget_share of the `images` left to train, and the run goes on with what it finds from
    the next epoch: precision, memory format, rewrites, compile. Rewrites already applied stay
    (they are exact, and cannot be taken out); config.json records the new setting, so a resume
    goes on with it. The run's random streams are left as they were."""
    from trainfast.tuning import tune as _tune

    old = run.speed
    if run.world.distributed:
        say("the next run measures again (under torchrun every rank would have to switch at once)")
        return
    if run.cfg.deterministic:
        say("the next run measures again (a --deterministic run keeps its settings)")
        return
    h, w, c = pk.shape
    probe = copy.deepcopy(given).to(memory_format=torch.contiguous_format)  # the model as the first tune saw it
    t = time.perf_counter()
    gpus = [] if run.dev.type != "cuda" else [run.dev.index if run.dev.index is not None else
                                               torch.cuda.current_device()]
    with torch.random.fork_rng(devices=gpus):  # NOTE: the CUDA branch has not run on a GPU
        result = _tune(probe, (c, h, w), device=run.dev, batch_size=old.batch_size, planned_images=images,
                       budget_share=budget_share, try_compile=pin.get("compile", True),
                       try_rewrites="rewrites" not in pin, optimizer=run.cfg.optimizer, retune=True,
                       log=lambda m: None)
    rows = [r.to_dict() for r in result.rows]
    new = replace(result.best if "compile" in pin else _pays(result.best, rows, images, say), **pin)
    new = replace(new, rewrites=new.rewrites or old.rewrites)
    took = time.perf_counter() - t
    if new.label() == old.label():
        say(f"re-tuned at batch {old.batch_size} in {took:.1f} s: {old.label()} is still the fastest setting here")
        return
    _use(run, new)
    rate = _timed_rate(rows, new.label())
    say(f"re-tuned at batch {old.batch_size} in {took:.1f} s: training on with {new.label()}"
        f"{f' ({units.rate(rate)} images/s as timed)' if rate else ''}, was {old.label()}")
    _record_speed(run)


def _use(run: "_Run", new: Speed) -> None:
    """Train on with `new`'s precision, memory format, rewrites and compile from the next step
    (one process; the batch stays): the model and the optimizer's moments in its memory format."""
    old = run.speed
    _step.prepare(run.net, new, run.dev)  # the rewrites, the memory format
    if old.channels_last and not new.channels_last:
        run.net.to(memory_format=torch.contiguous_format)
    _moments_like_weights(run.opt)
    run.trained = _step.compile_model(run.net, run.dev) if new.compile else run.net
    run.scaler = _step.make_scaler(new, run.dev)
    run.speed = new


def _moments_like_weights(opt: torch.optim.Optimizer) -> None:
    """Each of the optimizer's per-parameter tensors (AdamW's moments) in its parameter's memory
    layout. A fused update reads both as flat memory: a moment left channels_last beside a
    contiguous weight (after a switch of memory format, or loaded from a checkpoint saved before
    one) is silently applied to the wrong elements (measured: weights 0.16 apart after a step)."""
    for p, kept in opt.state.items():
        for k, v in kept.items():
            if torch.is_tensor(v) and v.shape == p.shape and v.stride() != p.stride():
                kept[k] = torch.empty_like(p, dtype=v.dtype).copy_(v)


def _record_speed(run: "_Run", tried: list[dict] | None = None) -> None:
    """config.json's setting is the run's now (a resume goes on with it); speed.json adds `tried`."""
    if not run.world.is_main:
        return
    changes = {"config.json": {}, **({"speed.json": {"tried": tried}} if tried is not None else {})}
    for name, extra in changes.items():
        saved = json.loads((run.run_dir / name).read_text())
        files.write_text(run.run_dir / name, json.dumps({**saved, "speed": run.speed.to_dict(), **extra}, indent=1))


class _FirstSteps:
    """tune's quick comparison for a run too short to search, made on the run's own first
    steps rather than on a copy of the model. The candidate (tune's likeliest winner: the
    fastest precision the device runs, in channels_last) must first give the loss the first
    setting gives on the first batch from the initial weights (tuning._loss_matches; forward
    passes without a gradient, batch-norm statistics and random streams put back). Then WARM
    + TIMED steps train at the first setting and WARM + TIMED at the candidate, the last TIMED
    of each timed, and the run keeps the candidate where it ran SHORT_GAIN× faster, else goes
    back. Every step trains: the comparison costs two forward passes, the switches of memory
    format and the candidate's warm-up, where timing it on a copy cost the copy and WARM + 1
    steps that trained nothing. One process on a CPU only (a GPU's timing would need
    synchronising; under torchrun every rank would have to switch at once)."""

    WARM, TIMED = 1, 2

    def __init__(self, run: "_Run", candidate: Speed, tried: list[dict]):
        from trainfast.tuning import _loss_matches

        self.first, self.candidate, self.tried = run.speed, candidate, tried
        self.began, self.load = 0.0, None
        self.timed: dict[str, dict] = {}
        self.line = ""  # what it found, said after the epoch's progress bar
        if len(run.loader) < 2 * (self.WARM + self.TIMED):  # both timings within the first epoch, none across its end
            self.line = (f"first steps: {candidate.label()} not compared: an epoch of {len(run.loader)} steps is too "
                         "few to time both settings")
        elif candidate.precision != self.first.precision:  # the same precision in another layout computes the same
            x, y = run.loader.batch(0, epoch=0)
            losses = []
            for speed in (self.first, candidate):
                try:
                    with _step.kept_state(run.net), torch.no_grad():
                        loss = _step.forward_loss(run.trained, x, y, speed, run.dev, run.cfg.label_smoothing)[0]
                except Exception as e:  # noqa: BLE001 - the first setting's failure is the run's to raise
                    if speed is self.first:
                        raise
                    self.line = f"first steps: {candidate.label()} left out: its forward pass failed ({in_words(e)})"
                    return
                losses.append(loss.item())
            if not _loss_matches(losses[1], losses[0]):
                self.line = (f"first steps: {candidate.label()} left out: its loss on the first batch, "
                             f"{losses[1]:.4g}, is not {self.first.label()}'s {losses[0]:.4g}")

    def after_step(self, run: "_Run") -> bool:
        """Called after each of the run's steps; True once the comparison is over."""
        from trainfast.tuning import SHORT_GAIN, Trial

        if self.line:  # the candidate's loss was off: no comparison
            return self._done(run)
        n, per = run.state["step"], self.WARM + self.TIMED  # a new run's steps: the comparison is made at its start
        if n in (self.WARM, per + self.WARM):
            self.began, self.load = time.perf_counter(), hardware.OtherLoad().__enter__()
            return False
        if n not in (per, 2 * per):
            return False
        seconds = time.perf_counter() - self.began
        self.load.__exit__(None, None, None)
        rate = self.TIMED * run.loader.batch_size / seconds
        self.timed[run.speed.label()] = Trial(run.speed, rate, note="the run's first steps",
                                              other_cores=self.load.cores).to_dict()
        if n == per:
            _use(run, self.candidate)
            return False
        ref, alt = (self.timed[s.label()]["images_per_s"] for s in (self.first, self.candidate))
        keep = alt >= SHORT_GAIN * ref
        if not keep:
            _use(run, self.first)
        self.line = (f"first steps: {self.candidate.label()} ran {units.rate(alt)} images/s, {self.first.label()} "
                     f"{units.rate(ref)} ({alt / ref:.2f}×{'' if keep else f', under the {SHORT_GAIN}× a switch takes'}"
                     f"): training on with {run.speed.label()}")
        return self._done(run)

    def trying(self, run: "_Run") -> bool:
        """The run trains at the candidate, and the comparison is not over."""
        return run.speed == self.candidate and not self.line

    def failed(self, run: "_Run", e: Exception) -> None:
        """The candidate's step raised: back to the first setting, the step's gradients dropped."""
        _use(run, self.first)
        run.opt.zero_grad(set_to_none=True)
        self.line = f"first steps: {self.candidate.label()} left out: its training step failed ({in_words(e)})"

    def _done(self, run: "_Run") -> bool:
        self.tried.extend(self.timed.values())
        _record_speed(run, self.tried)
        return True


def _shorten(run: "_Run", cfg: TrainConfig, more: int, epoch_s: float, epoch: int) -> TrainConfig:
    """The run's plan cut to `more` epochs after this one (TrainConfig.minutes), its learning
    rate annealed over them (_tail_scheduler); kept in the checkpoint, so a resume goes on with it."""
    steps = more * len(run.loader)
    lrs = [g["lr"] for g in run.opt.param_groups]
    run.sched = _tail_scheduler(run.opt, lrs, steps)
    new = replace(cfg, epochs=run.state["epoch"] + more)
    run.state["shortened"] = {"epochs": new.epochs, "steps": steps, "lrs": lrs}
    run.cfg = new
    run.save(epoch)
    run.say(f"time budget: epoch {epoch + 1} took {epoch_s:.1f} s, so {more} more fit the "
            f"{units.minutes(cfg.minutes)}: "
            f"{new.epochs} epochs instead of {cfg.epochs}, the learning rate annealed over them")
    return new


def _tuned(net, pk: Pack, dev, pin: dict, progress_log, say, *, images: int, epochs: int,
           world_size: int = 1, budget_share: float = 0.0, optimizer: str = "adamw",
           other_cores: float | None = None, compare_in_run: bool = False) -> tuple[Speed, list[dict], list, object]:
    """The fastest settings tune measures for `net` on `pk`'s images, keeping what the user
    pinned: the batch bounded by the data (data_max_batch of this process's share of `images`),
    the tune's time by budget_share of the planned training, a larger batch only where it is
    BATCH_GAIN× faster than a smaller one (more steps per epoch), torch.compile only where it
    pays for itself over `epochs`. Also the settings worth racing to a loss (race.contenders;
    [] where the batch is pinned), and the TuneResult."""
    from trainfast.train import race
    from trainfast.tuning import MAX_BATCH, fastest_by_batch, more_steps_unless_faster
    from trainfast.tuning import tune as _tune

    h, w, c = pk.shape
    per_process = images // world_size
    limit = min(MAX_BATCH.get(dev.type, MAX_BATCH["cpu"]), data_max_batch(per_process))
    result = _tune(net, (c, h, w), device=dev, batch_size=pin.get("batch_size"), max_batch=limit,
                   planned_images=per_process * epochs, budget_share=budget_share,
                   try_compile=pin.get("compile", True), try_rewrites="rewrites" not in pin, optimizer=optimizer,
                   other_cores=other_cores, compare_in_run=compare_in_run, log=progress_log)
    say(result.table())
    best, front = result.best, []
    if "batch_size" not in pin:
        say(f"batch bound by the data: at most {limit} ({per_process:,} images per process, "
            f"≥ {MIN_STEPS_PER_EPOCH} steps per epoch)")
        timed = [r.speed.batch_size for r in result.rows if r.images_per_s]
        floor = timed[0] if timed else 1  # never below where tune started
        best, why = more_steps_unless_faster(result, floor=floor)
        front = [(rate, replace(s, **pin)) for rate, s in race.contenders(fastest_by_batch(result, floor=floor))]
        if why and not front:
            say(why)
    rows = [r.to_dict() for r in result.rows]
    best = best if "compile" in pin else _pays(best, rows, per_process * epochs, say)
    return replace(best, **pin), rows, front, result


def _raced(net, pk: Pack, subset, front: list, rule: Speed, cfg: TrainConfig, dev, augment: Augment, user_batch: int,
           planned_images: int, say) -> tuple[Speed, dict]:
    """The batch whose copy of `net` reaches the lowest loss in equal wall time (race.py), among
    the `front` tune found, each at the learning rate the run would give it before the range
    test (the user's, scaled with the batch, or the optimizer's default for the batch); the
    `rule`'s choice (BATCH_GAIN) where the run is too short to afford the laps."""
    from trainfast.train import race

    seconds = race.lap_seconds(front, planned_images)
    if seconds is None:
        say(f"batch: the rule's {rule.batch_size} (tune timed batch {front[-1][1].batch_size} "
            f"{front[-1][0] / front[0][0]:.2f}× batch {front[0][1].batch_size}'s rate, but this run is too short to "
            f"race them to a loss: {race.RACE_SHARE:.0%} of it would not fit {race.MIN_LAP_STEPS} steps of each)")
        return rule, {}
    def lr_for(batch: int) -> float:
        return scale_lr(cfg.optimizer, cfg.lr, user_batch, batch) if cfg.lr else default_lr(cfg.optimizer, batch)
    laps = [race.Lap(replace(s, compile=False), rate, lr_for(s.batch_size)) for rate, s in front]  # compile: rule's
    pool = np.arange(len(pk)) if subset is None else subset  # a seeded sample: packs are often in class order
    probe_idx = np.sort(np.random.default_rng([cfg.seed, 104729]).permutation(pool)[:race.PROBE_IMAGES])
    probe = Loader(pk, min(256, len(probe_idx)), shuffle=False, drop_last=False, device=dev, subset=probe_idx)
    laps, cached = race.race(
        net, laps, lambda b: Loader(pk, b, shuffle=True, seed=cfg.seed, device=dev, augment=augment, subset=subset),
        probe, lambda p, lr: _optimizer(p, cfg, lr, dev), dev, seconds,
        f"{pack_record(pk)['id']}|{len(probe_idx)}|{None if subset is None else len(subset)}|{augment}|{cfg.seed}|"
        f"{cfg.weight_decay}|{cfg.label_smoothing}", cfg.optimizer,
        cfg.label_smoothing, cfg.seed)
    won = race.choose(laps, replace(rule, compile=False))
    say(race.table(laps, won, seconds, len(probe_idx), cached))
    return replace(won, compile=rule.compile), {"lap_s": seconds, "laps": [lap.to_dict() for lap in laps], "cached": cached}


def _training_pack(data, pin: dict | None, say, what: str = "train") -> tuple[Pack, dict | None]:
    """fit's data as a Pack: a Pack or its path; a Loader (its pack, and its batch size pinned);
    or (images, labels) arrays, packed once into trainfast's cache and reused while they are the same."""
    if isinstance(data, Loader):
        pin = {**(pin or {}), "batch_size": (pin or {}).get("batch_size") or data.batch_size}
        say(f"{what}: the Loader's pack {data.pack.path}, at batch {pin['batch_size']} (fit makes its own Loader, "
            "with its augmentations and held-out split)")
        return data.pack, pin
    if is_arrays(data):
        pk, notes = pack_arrays(*data, name=f"{what} arrays")
        h, w, c = pk.shape
        say(f"{what}: packed the ({len(pk)} images {h}×{w}×{c}, labels) arrays into {pk.path} (reused while "
            "the arrays are the same)" + "".join(f"; {n}" for n in notes))
        return pk, pin
    return as_pack(data, f"fit's {what} data"), pin


def _label_names(pk: Pack) -> str:
    if pk.alphabet:
        return f"alphabet {pk.alphabet!r}"
    names = pk.classes or []
    return ", ".join(names[:5]) + (f", … ({len(names)})" if len(names) > 5 else "")


def _dir_name(model_name: str) -> str:
    """A model's name as one plain folder name: 'nets/plate.py:build' → 'plate.build' (no
    slash to nest folders, no colon that some file systems and tools refuse)."""
    if ":" in model_name:
        file, _, attr = model_name.rpartition(":")
        model_name = f"{Path(file).stem}.{attr}"
    return re.sub(r"[^\w.-]+", "-", model_name).strip("-.") or "model"


def _held_out(train_pk: Pack, val_pk: Pack | None, cfg: TrainConfig):
    """(validation pack, training indices, validation indices): without a validation pack,
    cfg.val_fraction of the training pack, by a seeded permutation, the same on every rank."""
    if val_pk is not None or cfg.val_fraction <= 0:
        return val_pk, None, None
    order = np.random.default_rng([cfg.seed, 7919]).permutation(len(train_pk))
    n_val = max(1, int(len(train_pk) * cfg.val_fraction))
    return train_pk, np.sort(order[n_val:]), np.sort(order[:n_val])


STUCK_SHARE = 0.3  # the loss watch judges "stuck" after max(2, this share of the epochs)
STUCK_STEPS = 50  # ... and after at least this many optimizer steps
STUCK_MARGIN = 0.02  # "stuck": the epoch's training loss is within 2% of ln K, or above it ...
STILL_FALLING = 0.9  # ... and not below this share of the epoch before's (a loss far above ln K can be falling) ...
ABOVE_CHANCE = 2.0  # ... and training accuracy under this many times chance (1/K): one that reads 2× chance learns
DIVERGED = 1.5  # "diverging": an epoch's training loss over 1.5× the first epoch's, and over ln K


def _shape_findings(net, pk: Pack) -> list[str]:
    """The doctor's findings about why `net`'s shape may keep it from learning (counted on a
    copy, on the CPU; not its costs)."""
    from trainfast.diagnose.cost import layer_costs, learning_findings
    h, w, c = pk.shape
    try:
        return learning_findings(layer_costs(copy.deepcopy(net).cpu().float(), (c, h, w)))
    except Exception:  # noqa: BLE001 - a model the counter cannot trace: no structural findings, still a message
        return []


def diverging(losses: list[float], classes: int) -> bool:
    """The epochs' training losses climb: the last is over DIVERGED× the first, and over ln K."""
    return len(losses) >= 2 and losses[-1] > DIVERGED * losses[0] and losses[-1] > math.log(max(classes, 2))


def at_chance(losses: list[float], classes: int, acc: float | None = None) -> bool:
    """The last epoch's training loss sits at ln K (within STUCK_MARGIN, or above it) and is not
    falling fast, and the training accuracy (where known) is under ABOVE_CHANCE× chance."""
    if not losses or classes < 2:
        return False
    last, n = losses[-1], len(losses)
    learning = (n >= 2 and last < STILL_FALLING * losses[-2]) or (acc is not None and acc >= ABOVE_CHANCE / classes)
    return last >= (1 - STUCK_MARGIN) * math.log(classes) and not learning


def loss_watch(losses: list[float], epochs: int, classes: int, lr: float, findings: list[str],
               steps: int = STUCK_STEPS, frozen: bool = False, acc: float | None = None) -> str | None:
    """Why the run should stop, in words, or None. `losses`: training loss per epoch so far;
    `steps`: optimizer steps taken; `frozen`: the findings measured every output the same for
    all training images (then no learning rate is the remedy, and none is offered); `acc`: the
    last epoch's training accuracy (per character for sequences), where known.

    A cross-entropy loss that stays at ln K (K classes per prediction) means the model
    predicts chance; with a warm-up a good run can sit there for an epoch or two (the CIFAR
    CNN on digits left it in its third of 15 epochs), so "stuck" is judged only after
    max(2, STUCK_SHARE of the epochs) and STUCK_STEPS steps, unless `frozen` (dead units stay
    dead: judged after any epoch at chance). A loss that starts far above ln K
    (large initial logits) is not stuck while it still falls fast, nor while the model reads
    ABOVE_CHANCE× chance: it learns, with overconfident logits."""
    if not losses or classes < 2:
        return None
    chance, last, n = math.log(classes), losses[-1], len(losses)
    hint = (" The doctor's findings about this model: " +
            "; ".join(f"({i}) {f}" for i, f in enumerate(findings, 1)) + ".") if findings else ""
    if diverging(losses, classes):
        return (f"the training loss is diverging: {losses[0]:.3f} after epoch 1, {last:.3f} after epoch {n}. "
                f"The learning rate ({lr:.3g}) is likely too high: try --lr {lr / 10:.2g}, or --clip 1.{hint}")
    judged = frozen or (n >= max(2, math.ceil(STUCK_SHARE * epochs)) and steps >= STUCK_STEPS)  # dead stays dead
    if judged and at_chance(losses, classes, acc):
        why = ("its output no longer depends on its input, and no gradient reaches the layers before that, so no "
               "learning rate can revive it now; the model's structure is the cause, or a rate too high early on "
               "(units that die stay dead)" if frozen else
               f"the learning rate ({lr:.3g}) may be too low (try --lr {lr * 10:.2g}) or too high "
               f"(--lr {lr / 10:.2g}), or the model cannot carry what the task needs")
        return (f"the training loss has not left chance after {n} of {epochs} epochs: {last:.3f}, where predicting "
                f"all {classes} classes alike gives ln {classes} = {chance:.3f}. The model is not learning: "
                f"{why}.{hint} (--no-loss-watch trains on regardless.)")
    return None


def _learning_rate(net, loader: Loader, cfg: TrainConfig, speed: Speed, dev, world, train_pk: Pack, saved, user_batch,
                   say) -> float:
    """The run's peak learning rate: the saved one on resume; the user's, scaled from their batch
    to the tuned one (scale_lr); else the optimizer's default for the batch (default_lr),
    checked by a range test on this data (10% of the planned steps, 20 to 100), which lowers it
    where a tenth of the rate at the test's lowest loss is lower (RangeTest.peak)."""
    if saved is not None and saved.get("lr"):
        return float(saved["lr"])
    if cfg.lr:
        lr = scale_lr(cfg.optimizer, cfg.lr, user_batch, speed.batch_size)
        if speed.batch_size != user_batch:
            say(f"batch size {user_batch} → {speed.batch_size} (tuned): learning rate scaled {cfg.lr:g} → {lr:g}")
        return lr
    default = default_lr(cfg.optimizer, speed.batch_size * world.size)
    if not cfg.lr_test:
        return default
    steps = min(lr_range.STEPS, max(20, int(cfg.tune_share * cfg.epochs * len(loader))))
    found = None
    if world.is_main:  # on the global batch, as one process would: torchrun and one process agree
        probe = loader if world.size == 1 else Loader(
            train_pk, speed.batch_size * world.size, seed=cfg.seed, device=dev, augment=loader.augment,
            subset=loader.subset)
        found = lr_range.cached_range_test(
            net, lambda i: probe.batch(i % len(probe), epoch=0), lambda p, lr: _optimizer(p, cfg, lr, dev),
            replace(speed, batch_size=probe.batch_size), dev, f"{pack_record(train_pk)['id']}|{probe.samples}",
            cfg.optimizer, steps, cfg.label_smoothing)
        say(found.sentence(default, cfg.optimizer))
    # every process takes rank 0's answer
    return distributed.sum_all([found.peak(default) if world.is_main else 0.0], world)[0]


def _runnable(speed: Speed, dev: torch.device, say) -> Speed:
    """A resumed run's settings on `dev`: a precision this device cannot run (fp16 saved on a
    GPU, resumed on a CPU) becomes the next one it can, and says so."""
    if _step.check(speed, dev) is None:
        return speed
    for p in ("fp32",) if speed.precision == "tf32" else ("bf16", "fp32"):
        alt = replace(speed, precision=p)
        if _step.check(alt, dev) is None:
            say(f"{speed.precision} cannot run on {dev}: resuming in {p}")
            return alt
    return speed


@contextlib.contextmanager
def _determinism(on: bool):
    """Deterministic kernels (cuDNN, cuBLAS, scatter-adds) for the run, where torch has them:
    two runs with the same seed end with the same weights on the same device."""
    if not on:
        yield
        return
    # NOTE: cuBLAS reads this when it starts; set after the first CUDA matmul it is too late,
    # and torch then warns instead of raising (warn_only).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = before[2]


class _StartOver(Exception):
    """Raised by an attempt at trainfast's own learning rate (the default, or a fraction of it after
    a start-over) whose loss watch fired with epochs left: fit starts the run over from the first
    weights at half that rate (_start_over)."""

    def __init__(self, why: str, run_dir: Path, speed: Speed, lr: float, first_weights: dict):
        super().__init__(why)
        self.why, self.run_dir, self.speed, self.lr, self.first_weights = why, run_dir, speed, lr, first_weights


def fit(model, train, val=None, *, epochs: int | None = None, batch_size: int | None = None, lr: float | None = None,
        optimizer: str | None = None, minutes: float | None = None, config: TrainConfig | None = None,
        speed: Speed | None = None, pin: dict | None = None, augment: Augment | None = None, device=None, run_dir=None,
        resume: bool = False, tune: bool = True, progress: bool = True, log=print) -> FitResult:
    """Train `model` on the pack `train`, validating on `val` (or a held-out split).

        trainfast.fit("cifar_resnet", "cifar.pack", epochs=10)

    Args:
        model: an nn.Module or a registered name.
        train, val: packs (or their paths); without `val`, config.val_fraction is held out.
        epochs, batch_size, lr, optimizer, minutes: as `trainfast train` names them; they
            override `config`, and a batch_size is pinned (tuning keeps it). minutes: a
            wall-clock budget for the epochs (the run cut to what fits, its learning rate
            annealed over them; FitResult.stopped "out-of-time" where not one more fits).
        config: a TrainConfig; speed: the settings to use (default: tuned on this machine
            when tune=True, else Speed(); where tune times a larger batch clearly faster, the
            batches are raced to a loss on `train` first, see train/race.py); pin: settings
            fixed by the user, e.g. {"batch_size": 64}, that tuning keeps; augment: batched
            augmentations.
        device: 'cpu', 'cuda', 'cuda:N', or None for CUDA when there is one.
        run_dir: where the config, metrics, curves and checkpoints go (created).
        resume: continue the run in run_dir from its last checkpoint (on this or another device).

    Returns:
        FitResult with the history and the best validation accuracy.
    """
    cfg = replace(config or TrainConfig(), **{k: v for k, v in (("epochs", epochs), ("lr", lr),
                                                               ("optimizer", optimizer), ("minutes", minutes))
                                                  if v is not None})
    if batch_size is not None:
        pin = {**(pin or {}), "batch_size": batch_size}
    _check_config(cfg)
    augment = _augment(augment)
    saved = None
    if resume:
        if not run_dir:
            raise TrainfastError("resume=True needs the run_dir to resume")
        saved = read_run_config(run_dir, device)
        cfg = TrainConfig(**saved["train"])
    # NOTE: the caller's random streams are put back: the CPU's, and the current GPU's where CUDA
    # is in use already (forking every GPU's would start CUDA on each, in each torchrun process).
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with _determinism(cfg.deterministic), torch.random.fork_rng(devices=cuda):
        threads = torch.get_num_threads()  # a run may lower them for a while (_Threads) or pin them (Speed.threads)
        try:
            try:
                with contextlib.ExitStack() as stack:
                    return _fit(model, train, val, cfg, speed, pin, augment, device, run_dir, saved, tune, progress,
                                log, stack, start_overs=0 if resume or cfg.lr else START_OVERS)
            except _StartOver as again:
                return _start_over(again, model, train, val, cfg, pin, augment, device, progress, log)
        finally:
            torch.set_num_threads(threads)


START_OVERS = 2
"""A run at the default rate starts over at most this often, each time at half the last rate:
the first attempt whenever its loss watch fires with epochs left, the second only where it died."""


def _start_over(again: _StartOver, model, train, val, cfg: TrainConfig, pin, augment, device, progress, log):
    """The run again from its first weights, at half the rate it could not learn at, in the same
    run directory (emptied of what the attempt before wrote: the directory was empty or new when
    it began), with the settings the first attempt tuned; at most START_OVERS times. Measured on
    outside models (digits, 5 epochs): SqueezeNet's ReLU'd outputs die at AdamW's default peak
    (2.1e-3 at batch 32) and a ViT-tiny stays at chance; at 1e-3 they reach 56% and 58%, where a
    lower default for every model cost ShuffleNet 28 points. SqueezeNet dies at 1.06e-3 too in
    about half of its runs (in fp32 and bf16 alike), and reaches 68-86% at 5.3e-4: an attempt
    that dies at half the rate starts over once more (one that lives trains on)."""
    left = START_OVERS
    while True:  # an attempt with no start-overs left returns, or raises what stopped it
        left -= 1
        lr = again.lr / 2
        log(f"warning: {again.why} Starting over from the first weights at half the learning rate, {lr:.3g} "
            f"({again.lr:.3g} is too high for some models); --lr sets it yourself.")
        if isinstance(model, torch.nn.Module):  # a model built by name is built again from the seed
            with torch.no_grad():
                model.load_state_dict(again.first_weights)
        for name in RUN_FILES:
            with contextlib.suppress(FileNotFoundError):
                (again.run_dir / name).unlink()
        for tmp in files.stale_temporaries(again.run_dir, RUN_FILES):
            tmp.unlink()
        pin = {**(pin or {}), "batch_size": again.speed.batch_size}
        try:
            with contextlib.ExitStack() as stack:
                return _fit(model, train, val, replace(cfg, lr=lr), again.speed, pin, augment, device, again.run_dir,
                            None, False, progress, log, stack, start_overs=left)
        except _StartOver as later:
            again = later


def _augment(augment) -> Augment | None:
    """fit's augment: an Augment, or a dict of its fields (as a notebook user writes it)."""
    if augment is None or isinstance(augment, Augment):
        return augment
    if isinstance(augment, dict):
        known = [f.name for f in fields(Augment)]
        unknown = sorted(set(augment) - set(known))
        if unknown:
            raise TrainfastError(f"augment: {', '.join(unknown)} is not an augmentation trainfast has "
                                 f"({', '.join(known)})")
        return Augment(**augment)
    raise TrainfastError(f"augment must be a trainfast.Augment (or a dict of its fields), not {type(augment).__name__}")


def _elastic(speed: Speed, saved_world: int, world, say) -> Speed:
    """A run saved by N processes resumes with M: the same global batch, split M ways. The k-th
    global batch holds the same images for any number of processes (rank r takes every M-th of
    the epoch's order), and the steps per epoch are the same, so the run goes on at the same
    step with the same data, the interrupted epoch's rest neither repeated nor skipped."""
    if world.size == saved_world:
        return speed
    total = speed.batch_size * saved_world
    if total % world.size:
        fits = ", ".join(str(m) for m in range(1, min(total, 64) + 1) if total % m == 0)
        raise TrainfastError(f"this run trained with {saved_world} process{'es' * (saved_world > 1)} and a global "
                             f"batch of {total}, which {world.size} processes cannot split evenly; resume with a "
                             f"number of processes that divides it ({fits})")
    say(f"resuming a run of {saved_world} process{'es' * (saved_world > 1)} with {world.size}: batch "
        f"{total // world.size} per process keeps the global batch of {total}")
    return replace(speed, batch_size=total // world.size)


def _working_copy(net: torch.nn.Module) -> torch.nn.Module:
    """A copy of `net`'s module tree that holds `net`'s own parameter and buffer tensors:
    training it trains `net` (optimizers and batch-norm update those tensors in place), while
    the speed rewrites, which reorder, replace or reconfigure modules, change only the copy.
    So the user's model object keeps its module tree, its classes and its mode."""
    shared = {id(t): t for t in (*net.parameters(), *net.buffers())}
    return copy.deepcopy(net, memo=shared)


FORWARD_IMAGES = 256
FORWARD_BYTES = 32 * 2**20


def forward_batch(batch: int, pk: Pack) -> int:
    """The batch for forward passes that keep no activations for a backward pass (held-out
    evaluation, the batch-norm measurement): the training batch's largest multiple within
    FORWARD_IMAGES images and FORWARD_BYTES of uint8 input, and never below the training batch.
    On 2 CPU cores a forward pass at 256 took 0.09-0.53 ms per 32×32 image where batch 32 took
    0.24-0.69 ms (ShuffleNet 2.6×, RegNetX-400MF 2.3×, ResNet-18 1.2×, MobileNetV3 1.3× faster);
    a 512² RGB image (786 kB) gets 42 images at most."""
    h, w, c = pk.shape
    most = min(FORWARD_IMAGES, FORWARD_BYTES // (h * w * c))
    return max(batch, most // batch * batch)


BN_IMAGES = 256
"""Batch-norm statistics are measured afresh at each epoch's end on about this many training
images (at least two batches, at most an epoch): _measure_batch_norm."""


def _measure_batch_norm(net: torch.nn.Module, loader: Loader, epoch: int, speed: Speed, dev, world) -> None:
    """Set every batch-norm layer's running statistics to those of the weights as they are now:
    the plain average of the batch statistics over the first BN_IMAGES training images of
    `epoch` (forward passes in training mode, no gradient), as in "precise BatchNorm" (Wu &
    Johnson, 2021). Each layer's momentum, the model's mode and the random streams are put back.

    The running averages that training keeps trail the weights: at fit's peak rate on digits,
    ResNet-18 read 37% of the held-out images after epoch 1 (val loss 10.6) where its training
    loss was 0.56, and 83% with statistics measured so (0.10 s an epoch). A momentum set for
    ImageNet's thousands of steps an epoch (torchvision's MobileNetV3 0.01, MnasNet 0.0003) left
    them the initial ones after 220 steps: chance held out, after training to 97%. Evaluation,
    the checkpoints and the model given back all read the measured statistics; under torchrun,
    each process measures on its share and they take the mean."""
    layers = [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
              and m.track_running_stats]
    if not layers:
        return
    momenta, was_training = [m.momentum for m in layers], net.training
    batches = min(len(loader), max(2, math.ceil(BN_IMAGES / loader.batch_size)))
    together = forward_batch(loader.batch_size, loader.pack) // loader.batch_size  # the loader's batches per forward
    try:
        for m in layers:
            m.reset_running_stats()
            m.momentum = None  # a plain average over the forward passes that follow
        net.train()
        with torch.no_grad(), torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            for k in range(0, batches, together):
                x = torch.cat([loader.batch(j, epoch=epoch)[0] for j in range(k, min(k + together, batches))])
                with _step.autocast(speed, dev):
                    net(x)
    finally:
        for m, momentum in zip(layers, momenta):
            m.momentum = momentum
        net.train(was_training)
    distributed.average_all([b for m in layers for b in (m.running_mean, m.running_var) if b is not None], world)


def _given_back(user: torch.nn.Module) -> None:
    """The user's model as it was given, but trained: its 4-D weights in the default memory
    layout again (channels_last trains them in place; the values are the same)."""
    with torch.no_grad():
        for p in user.parameters():
            if p.dim() == 4 and not p.is_contiguous():
                p.data = p.data.contiguous()


def _fit(model, train, val, cfg: TrainConfig, speed, pin, augment, device, run_dir, saved, tune, progress, log,
         stack: contextlib.ExitStack, start_overs: int = 0):
    """fit, after its arguments are read; `saved` is the run's config.json when resuming; the run
    directory's lock is held on `stack` (released when fit returns or fails)."""
    setup = hardware.OtherLoad().__enter__()  # other processes' load, sampled while the run sets up (_Threads)
    resume = saved is not None
    torch.manual_seed(cfg.seed)  # before the model is built: its initial weights follow the seed
    net, name = _model_and_name(model)
    params = list(net.parameters())
    if not any(p.requires_grad for p in params):
        raise TrainfastError(f"{name}: nothing to train: " + (f"all {sum(p.numel() for p in params):,} parameters are "
                                                              "frozen (requires_grad=False)" if params else
                                                              "the model has no parameters"))
    try:
        dev = hardware.resolve_device(device)
    except ValueError as e:
        raise TrainfastError(str(e)) from None
    train_pk, pin = _training_pack(train, pin, say=log)
    val_pk = None if val is None else _training_pack(val, None, say=log, what="val")[0]
    classes, out = check_fits(net, train_pk, say=log)
    if val_pk is not None:
        check_fits(net, val_pk, out=out if val_pk.shape == train_pk.shape else None)
        a, b = sorted((val_pk.classes or [], train_pk.classes or []), key=len)
        if val_pk.alphabet != train_pk.alphabet or b[:len(a)] != a:  # a split may lack the last classes, no more
            raise TrainfastError(f"{val_pk.path} labels other classes than {train_pk.path} "
                                 f"({_label_names(val_pk)} vs {_label_names(train_pk)}): its accuracy would "
                                 "compare mismatched labels")
    world = distributed.setup(dev)  # after the checks: a bad input stops every rank before any waits for the others
    dev = world.device
    if resume and world.distributed and distributed.sum_all([0.0], world)[0] > 0:  # see fit(): a node without it
        raise TrainfastError(f"{run_dir}: another node has no such run directory to resume; every node reads it "
                             "(config.json, last.pt): put it on a file system all nodes share, or copy it to each")
    given = net.to(dev)  # trained in place: its parameters and buffers live on the device from here
    # An attempt at the default rate (or at a fraction of it, after a start-over) may start over at
    # half of it (_start_over, at most START_OVERS times), from these first weights, kept on the CPU.
    first_weights = None
    if start_overs and cfg.loss_watch and not cfg.minutes and not world.distributed:
        first_weights = {k: v.detach().to("cpu", copy=True) for k, v in given.state_dict().items()}
    net = _working_copy(given)
    say = log if world.is_main else (lambda *a, **k: None)
    run_dir = Path(run_dir or f"runs/{_dir_name(name)}-{time.strftime('%Y%m%d-%H%M%S')}")
    if world.is_main:
        _own_run_dir(run_dir, resume, stack)
    distributed.barrier(world)
    started = not resume or (run_dir / "last.pt").is_file()  # killed before its first checkpoint: start it over
    if not started:
        say(f"{run_dir}: the run stopped before its first checkpoint; starting it over with its saved settings")

    tune_table, front, raced, tuned = [], [], {}, None
    if resume:
        _same_pack(train_pk, saved["train_pack"], "training")
        if val_pk is not None:
            _same_pack(val_pk, saved.get("val_pack"), "validation")
        speed = _elastic(_runnable(Speed(**saved["speed"]), dev, say), int(saved.get("world_size", 1)), world, say)
        augment = Augment(**saved["augment"])
        pin = {"batch_size": saved["user_batch_size"]}
    pin = dict(pin or {})
    user_batch = pin.get("batch_size") or (speed.batch_size if speed else Speed().batch_size)
    val_pk, train_idx, val_idx = _held_out(train_pk, val_pk, cfg)
    n_train = len(train_pk) if train_idx is None else len(train_idx)
    if speed is None and pin.get("batch_size") and n_train // world.size < pin["batch_size"]:  # before any tuning
        held = f" ({len(train_pk) - n_train} held out for validation)" if train_idx is not None else ""
        per = f" per process ({world.size} processes)" if world.size > 1 else ""
        raise TrainfastError(f"{train_pk.path}: {n_train} training images{held} are too few for batch size "
                             f"{pin['batch_size']}{per}: give a batch size of at most {n_train // world.size}")
    threads = _Threads(dev.type == "cpu" and not world.distributed and not cfg.deterministic
                       and not (speed and speed.threads) and not pin.get("threads"), say, since=setup)
    if speed is None:
        speed, tune_table, front, tuned = _tuned(net, train_pk, dev, pin, say if progress else (lambda m: None), say,
                                                 images=n_train, epochs=cfg.epochs, world_size=world.size,
                                                 budget_share=cfg.tune_share, optimizer=cfg.optimizer,
                                                 other_cores=threads.at_start,
                                                 compare_in_run=dev.type == "cpu" and world.size == 1
                                                 and not cfg.deterministic) if tune \
            else (Speed(**pin), [], [], None)
    reason = _step.check(speed, dev)
    if reason:
        raise TrainfastError(reason)
    augment = augment or Augment()
    if front and world.size == 1:  # NOTE: under torchrun the rule's batch stands: one race would need every rank
        speed, raced = _raced(net, train_pk, train_idx, front, speed, cfg, dev, augment, user_batch,
                              n_train * cfg.epochs, say)

    torch.manual_seed(cfg.seed)
    net = _step.prepare(net, speed, dev)
    loader = Loader(train_pk, speed.batch_size, shuffle=True, seed=cfg.seed, device=dev, augment=augment,
                    rank=world.rank, world_size=world.size, subset=train_idx)
    val_loader = None if val_pk is None else Loader(val_pk, forward_batch(speed.batch_size, val_pk), shuffle=False,
                                                     drop_last=False, device=dev, rank=world.rank,
                                                     world_size=world.size, subset=val_idx)
    steps_per_epoch = len(loader)
    lr = _learning_rate(net, loader, cfg, speed, dev, world, train_pk, saved, user_batch, say)
    opt = _optimizer(net.parameters(), cfg, lr, dev)
    sched = _scheduler(opt, cfg, cfg.epochs * steps_per_epoch, lr)
    scaler = _step.make_scaler(speed, dev)
    # NOTE: CUDA graphs only for one process: DDP's gradient hooks run between the graph's kernels.
    trained = distributed.wrap(_step.compile_model(net, dev, graphs=world.size == 1) if speed.compile else net, world)

    log_csv = MetricsLog(run_dir / "metrics.csv")
    state = {"epoch": 0, "step": 0, "best": -1.0, "bad_epochs": 0, "partial": [0.0, 0.0, 0.0, 0.0],
             "epochs": cfg.epochs}  # the plan its schedule was made for
    if resume and started:
        ck = checkpoint.load(run_dir / "last.pt", name, net)  # on the CPU; load_state_dict moves it
        net.load_state_dict(ck["model"])
        kernels = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in opt.param_groups]
        opt.load_state_dict(ck["optimizer"])
        _moments_like_weights(opt)  # a checkpoint written before a switch of memory format (_use) has the old one
        for g, k in zip(opt.param_groups, kernels):  # this device's kernels, not the saving device's
            g.update(k)
        if ck["state"].get("epochs", cfg.epochs) != cfg.epochs:  # config.json edited: the schedule would break
            raise TrainfastError(f"{run_dir}/config.json plans {cfg.epochs} epochs, but the run's learning-rate "
                                 f"schedule was made for {ck['state']['epochs']}; a run resumes with its own plan (to "
                                 "train longer, start a new run)")
        if ck["state"].get("shortened"):  # a run the time budget shortened goes on with its shorter plan
            short = ck["state"]["shortened"]
            cfg = replace(cfg, epochs=short["epochs"])
            sched = _tail_scheduler(opt, short["lrs"], short["steps"])
        sched.load_state_dict(ck["scheduler"])
        if scaler is not None and ck.get("scaler"):
            scaler.load_state_dict(ck["scaler"])
        loader.load_state_dict(ck["loader"])
        if differs := checkpoint.set_rng_state(ck["rng"], dev):
            say(f"note: {differs}")
        state = ck["state"]
        say(f"resuming {run_dir} at epoch {state['epoch'] + 1}, batch {loader.position} of {steps_per_epoch}")
    if world.is_main:
        log_csv.load(state["epoch"])
        if not resume:
            files.write_text(run_dir / "config.json", json.dumps(
                {"model": name, "train": cfg.to_dict(), "speed": speed.to_dict(), "augment": asdict(augment),
                 "train_pack": pack_record(train_pk), "val_pack": None if val is None else pack_record(val_pk),
                 "world_size": world.size, "lr": lr, "user_batch_size": user_batch, "device": str(dev)},
                indent=1))
            files.write_text(run_dir / "speed.json", json.dumps(
                {"speed": speed.to_dict(), "tried": tune_table, "raced": raced, "machine": hardware.describe(dev),
                 "data_path": loader.describe()}, indent=1))
    say(f"training {name} on {train_pk.path} ({loader.samples} images, {steps_per_epoch} steps/epoch) on {dev} with "
        f"{speed.label()}{f' × {world.size} processes' if world.distributed else ''}, lr {lr:g}; run dir {run_dir}")

    state.setdefault("position", loader.position)  # checkpoints from before it was kept in state
    run = _Run(name, net, trained, opt, sched, scaler, loader, val_loader, cfg, speed, dev, world, run_dir, say,
               state, _Watch(dev, state["partial"] if world.is_main else [0.0] * 4,
                             every=READ_EVERY.get(dev.type, READ_EVERY["cuda"])), log_csv,
               train_pk.sequence_length is not None, (len(log_csv.rows), time.perf_counter()),
               saved=(state["step"], time.perf_counter()))
    candidate = replace(tuned.candidate, **pin) if tuned is not None and tuned.candidate and not raced else None
    if candidate is not None and candidate != speed and _step.check(candidate, dev) is None:
        run.first_steps = _FirstSteps(run, candidate, tune_table)  # tune left its comparison to these steps
    stopped, epoch = "finished", state["epoch"]
    interrupts = _Interrupts(True, world, agree_every=1 if dev.type == "cpu" else READ_EVERY["cuda"])
    lost = starting_over = False  # another process of the run died; this attempt gives way to another
    warned = False  # the loss watch's warning for a run that is stuck but not hopeless: once
    deadline = _now() + 60 * cfg.minutes if cfg.minutes else None
    check_rate = tuned is not None and world.is_main  # the run's rate against tune's, once
    try:
        with interrupts:
            while state["epoch"] < cfg.epochs:
                epoch, began = state["epoch"], _now()
                with threads:
                    row = run.train_epoch(epoch, interrupts, progress)
                    row["threads"] = torch.get_num_threads()
                row["other_cores"] = threads.load.cores
                if run.end_epoch(epoch, row):
                    stopped = "early-stopped"
                    say(f"early stop: no better validation accuracy for {cfg.patience} epochs")
                    break
                if check_rate and (epoch >= 1 or state["epoch"] >= cfg.epochs):  # past the first epoch's warm-up
                    check_rate = False
                    if _check_tuned_rate(tuned, tune_table, run.speed, row, say) and state["epoch"] < cfg.epochs:
                        t = _now()
                        _retune(run, given, train_pk, pin, n_train * (cfg.epochs - state["epoch"]), cfg.tune_share,
                                say)
                        began += _now() - t  # the time budget's epoch time is the epoch's, not the re-tune's
                if deadline and state["epoch"] < cfg.epochs:
                    now = _now()
                    more = int((deadline - now) // max(now - began, 1e-9))
                    if more <= 0:
                        stopped = "out-of-time"
                        say(f"time budget: {units.minutes(cfg.minutes)} spent; stopping after epoch {epoch + 1} of "
                            f"{cfg.epochs}")
                        break
                    if state["epoch"] + more < cfg.epochs:
                        cfg = _shorten(run, cfg, more, now - began, epoch)
                watch = (state["losses"], cfg.epochs, classes, lr)
                # Before the watch judges "stuck" (epoch 2 at the earliest), a model at chance is
                # measured too: one frozen (SqueezeNet's ReLU'd logits, dead in epoch 1 at the
                # default rate) cannot come back, and starts over after one epoch, not three.
                why = None
                if cfg.loss_watch and (loss_watch(*watch, [], state["step"], acc=state.get("last_acc"))
                                       or not warned and at_chance(state["losses"], classes, state.get("last_acc"))):
                    from trainfast.diagnose.cost import measured_findings
                    found, frozen = measured_findings(net, loader.batch(0, epoch=epoch)[0], when="now ")
                    if loss_watch(*watch, found, state["step"], frozen, acc=state.get("last_acc")):
                        why = loss_watch(*watch, found + _shape_findings(net, train_pk), state["step"], frozen,
                                         acc=state.get("last_acc"))
                if why:
                    # Stopped only where going on cannot help: every output frozen, or a climbing loss.
                    # A model whose gradients still flow may leave chance late (a ViT on digits at
                    # epoch 4 of 5): it is told once, and trains on.
                    hopeless = frozen or diverging(state["losses"], classes)
                    # The first attempt starts over whenever the watch fires; a later one only where it
                    # died, which would otherwise end the run in an error (one alive at half the rate
                    # trains on: a quarter of it left plates-reading mobile nets further under chance).
                    if first_weights is not None and state["epoch"] < cfg.epochs and (
                            hopeless or start_overs == START_OVERS):
                        raise _StartOver(why, run_dir, run.speed, lr, first_weights)
                    if hopeless and state["epoch"] < cfg.epochs:  # epochs left: stop rather than spend them
                        run.flush(epoch)
                        raise TrainfastError(f"{why} Stopped; the run so far is in {run_dir}.")
                    if hopeless or not warned:
                        say(f"warning: {why}" + ("" if hopeless or state["epoch"] >= cfg.epochs else
                                                 " Its output still depends on its input, so it trains on."))
                        warned = True
            run.flush(epoch)  # a run the time budget stopped
    except RuntimeError as e:
        reason = distributed.peer_lost(e) if world.distributed else ""
        if reason:  # another process of the run died: say so, don't hang
            lost = True
            raise TrainfastError(f"another process of this run stopped ({reason}); this one stops too. The last "
                                 f"checkpoint rank 0 saved is in {run_dir}: resume with torchrun … -m trainfast train "
                                 f"--resume {shlex.quote(str(run_dir))}") from None
        raise
    except KeyboardInterrupt:
        if interrupts.torn:  # a second Ctrl-C mid-step: weights and position may disagree; keep the last save
            say(f"\ninterrupted mid-step; the last checkpoint {run_dir / 'last.pt'} is from before it")
        else:
            run.save(epoch)
            say(f"\ninterrupted; saved {run_dir / 'last.pt'}. Continue with: trainfast train --resume "
                f"{shlex.quote(str(run_dir))}")
        raise
    except _StartOver:
        starting_over = True  # the next attempt draws its own curves in this directory
        raise
    finally:
        _given_back(given)
        with contextlib.suppress(Exception):  # the figure is not worth hiding why a run stopped
            if not starting_over:
                run.plot(force=True)
        if not lost:  # with a process gone, no collective can complete
            distributed.barrier(world)
    return FitResult(run_dir, log_csv.rows, state["best"], run.speed, stopped, given)

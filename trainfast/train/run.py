"""The run loop: epochs of steps from where the loader stands, each epoch's end (validation,
metrics, checkpoint) and what a checkpoint holds. It knows nothing of who watches it: the loss
watch, the re-tune and the time budget are handed in as watchers (watch.py, adapt.py), called
after each epoch.

The loop is plain single-device code; DDP (under torchrun) is a wrapper around the model and a
shard of the Loader, and only rank 0 prints, logs and writes.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from trainfast import files, units
from trainfast import step as _step
from trainfast.config import Speed, TrainConfig
from trainfast.data.loader import Loader
from trainfast.errors import Detail, TrainfastError
from trainfast.train import checkpoint, distributed
from trainfast.train.costs import Costs
from trainfast.train.evaluate import evaluate, measure_batch_norm
from trainfast.train.metrics import MetricsLog, correct, plot_curves
from trainfast.train.optim import tail_scheduler
from trainfast.train.rundir import record_decision
from trainfast.train.signals import Interrupts
from trainfast.units import shell_arg

# Steps between reads of the loss off the device (see EpochSums). On a CPU a read costs nothing.
READ_EVERY = {"cpu": 1, "cuda": 25}


class EpochSums:
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
class Run:
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
    watch: EpochSums
    log_csv: MetricsLog
    sequence: bool
    plotted: tuple[int, float]  # rows drawn in curves.png, and when (at the start: the rows resumed, now)
    saved: tuple[int, float] = (-1, 0.0)  # the step of the last checkpoint written, and when (set at the start)
    best_step: int = -1  # the step at which the best epoch ended
    best_ck: dict | None = None  # that epoch's checkpoint, where it is not yet written (SAVE_EVERY_S)
    first_steps: object | None = None  # adapt.FirstSteps: a short run's comparison on its first steps, until made
    threads: object | None = None  # adapt.Threads: the thread count, timed on the run's steps (run_epochs sets it)
    began: float = 0.0  # when the epoch under way began (the time budget's clock; a re-tune moves it on)
    costs: Costs = field(default_factory=Costs)  # the call's seconds per phase (fit hands its own in)

    def plot(self, force: bool = False) -> None:
        """Redraw curves.png with the rows so far: at most every PLOT_EVERY_S, and when `force`d
        (the run's end, however it ends)."""
        rows, (drawn, at) = self.log_csv.rows, self.plotted
        if not self.world.is_main or len(rows) == drawn:
            return
        if force or time.perf_counter() - at >= PLOT_EVERY_S:
            with self.costs.phase("curves"):
                plot_curves(rows, self.run_dir / "curves.png", self.sequence)
            self.plotted = (len(rows), time.perf_counter())

    def train_epoch(self, epoch: int, interrupts: Interrupts, progress: bool) -> dict:
        """The steps of `epoch` from where the loader stands; the epoch's training row."""
        from trainfast.progress import tqdm

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
                if self.threads is not None:
                    self.threads.after_step(steps - loader.position, ready=self.first_steps is None)
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
        for line in (said, self.threads.line if self.threads is not None else ""):
            if line:
                self.say(line)
        if self.threads is not None:
            for decision in self.threads.decisions if self.world.is_main else ():
                record_decision(self.run_dir, {**decision, "epoch": epoch + 1})
            self.threads.line, self.threads.decisions = "", []
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
        with self.costs.phase("validation"):
            measure_batch_norm(self.net, self.loader, epoch, self.speed, self.dev, self.world)
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
        with self.costs.phase("checkpoints"):
            self._save(epoch)

    def _save(self, epoch: int) -> None:
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

    def restore(self, ck: dict) -> None:
        """Go on from the checkpoint `ck` (read on the CPU): weights, optimizer, schedule (a plan the
        time budget shortened goes on shortened), scaler, the loader's place and the random streams."""
        self.net.load_state_dict(ck["model"])
        opt = self.opt
        kernels = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in opt.param_groups]
        opt.load_state_dict(ck["optimizer"])
        moments_like_weights(opt)  # a checkpoint written before a switch of memory format (use_speed) has the old one
        for g, k in zip(opt.param_groups, kernels):  # this device's kernels, not the saving device's
            g.update(k)
        if ck["state"].get("epochs", self.cfg.epochs) != self.cfg.epochs:  # config.json edited: the schedule would break
            raise TrainfastError(f"{self.run_dir}/config.json plans {self.cfg.epochs} epochs, but the run's "
                                 f"learning-rate schedule was made for {ck['state']['epochs']}; a run resumes with its "
                                 "own plan (to train longer, start a new run)")
        if ck["state"].get("shortened"):  # a run the time budget shortened goes on with its shorter plan
            short = ck["state"]["shortened"]
            self.cfg = replace(self.cfg, epochs=short["epochs"])
            self.sched = tail_scheduler(opt, short["lrs"], short["steps"])
        self.sched.load_state_dict(ck["scheduler"])
        if self.scaler is not None and ck.get("scaler"):
            self.scaler.load_state_dict(ck["scaler"])
        self.loader.load_state_dict(ck["loader"])
        if differs := checkpoint.set_rng_state(ck["rng"], self.dev):
            self.say(f"note: {differs}")
        if self.cfg.deterministic and self.dev.type == "cpu":
            self._threads_as_saved(ck.get("threads"))
        self.state = ck["state"]
        self.state.setdefault("position", self.loader.position)  # checkpoints from before it was kept in state
        self.watch = EpochSums(self.dev, self.state["partial"] if self.world.is_main else [0.0] * 4, self.watch.every)
        self.saved = (self.state["step"], time.perf_counter())

    def _threads_as_saved(self, saved: int | None) -> None:
        """A --deterministic CPU run resumes with the thread count its checkpoint was trained with:
        another count sums a kernel's terms in another order, and the weights would drift apart
        from an uninterrupted run's (fit puts the caller's count back at its end)."""
        now, most = torch.get_num_threads(), os.cpu_count() or 1
        if saved is None or saved == now:
            return
        if saved > most:
            self.say(f"note: the checkpoint was trained with {saved} threads and this machine has {most}: the "
                     "resumed run's sums differ from an uninterrupted run's in the last bits")
            return
        torch.set_num_threads(saved)
        self.say(Detail(f"threads {now} → {saved}: as the checkpoint was trained (a --deterministic run resumes "
                        "with the same sums)"))

    def _checkpoint(self, partial: list[float]) -> dict:
        # NOTE: the loader's own position counts batches it handed out; the checkpoint records
        # the batches whose step is done, kept in `state` with the step count and the epoch.
        state = {**self.state, "partial": partial}
        return {"model_name": self.name, "signature": checkpoint.signature(self.net), "model": self.net.state_dict(),
                "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "loader": {"seed": self.cfg.seed, "epoch": state["epoch"], "position": state["position"]},
                "rng": checkpoint.rng_state(self.dev), "threads": torch.get_num_threads(), "state": state}


def moments_like_weights(opt: torch.optim.Optimizer) -> None:
    """Each of the optimizer's per-parameter tensors (AdamW's moments) in its parameter's memory
    layout. A fused update reads both as flat memory: a moment left channels_last beside a
    contiguous weight (after a switch of memory format, or loaded from a checkpoint saved before
    one) is silently applied to the wrong elements (measured: weights 0.16 apart after a step)."""
    for p, kept in opt.state.items():
        for k, v in kept.items():
            if torch.is_tensor(v) and v.shape == p.shape and v.stride() != p.stride():
                kept[k] = torch.empty_like(p, dtype=v.dtype).copy_(v)


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


clock = time.perf_counter  # the time budget's clock (tests replace it)



class GivesWay(Exception):
    """Raised by a watcher to end this attempt for another one in the same run directory
    (watch.StartOver: the run again from its first weights at a lower learning rate)."""


class Watcher:
    """What looks at the run after each epoch (Lightning's callbacks, one hook): the loss watch,
    the check of the rate tune timed, the time budget. `after_epoch` may change the run (its
    setting, its plan), raise to end it, or return why it stops ("out-of-time"); None goes on."""

    def after_epoch(self, run: Run, epoch: int, row: dict) -> str | None:
        raise NotImplementedError


def run_epochs(run: Run, threads, watchers: list[Watcher], progress: bool) -> str:
    """Train until the plan's epochs are done, early stopping stops, or a watcher stops the run;
    how it stopped ("finished", "early-stopped", "out-of-time"). Ctrl-C and SIGTERM save and say
    how to resume; another process of the run dying is said in one line; a start-over leaves the
    curves to the next attempt."""
    world, run_dir, say = run.world, run.run_dir, run.say
    interrupts = Interrupts(True, world, agree_every=1 if run.dev.type == "cpu" else READ_EVERY["cuda"])
    stopped, epoch = "finished", run.state["epoch"]
    run.threads = threads
    lost = starting_over = False  # another process of the run died; this attempt gives way to another
    try:
        with interrupts:
            while run.state["epoch"] < run.cfg.epochs:
                epoch, run.began = run.state["epoch"], clock()
                with threads, run.costs.phase("training"):
                    row = run.train_epoch(epoch, interrupts, progress)
                    row["threads"] = torch.get_num_threads()
                row["other_cores"] = threads.load.cores
                if run.end_epoch(epoch, row):
                    stopped = "early-stopped"
                    say(f"early stop: no better validation accuracy for {run.cfg.patience} epochs")
                    break
                why = next((w for w in (w.after_epoch(run, epoch, row) for w in watchers) if w), None)
                if why:
                    stopped = why
                    break
            run.flush(epoch)  # a run the time budget stopped
    except RuntimeError as e:
        reason = distributed.peer_lost(e) if world.distributed else ""
        if reason:  # another process of the run died: say so, don't hang
            lost = True
            raise TrainfastError(f"another process of this run stopped ({reason}); this one stops too. The last "
                                 f"checkpoint rank 0 saved is in {run_dir}: resume with torchrun … -m trainfast train "
                                 f"--resume {shell_arg(run_dir, path=True)}") from None
        raise
    except KeyboardInterrupt:
        if interrupts.torn:  # a second Ctrl-C mid-step: weights and position may disagree; keep the last save
            say(f"\ninterrupted mid-step; the last checkpoint {run_dir / 'last.pt'} is from before it")
        else:
            run.save(epoch)
            say(f"\ninterrupted; saved {run_dir / 'last.pt'}. Continue with: trainfast train --resume "
                f"{shell_arg(run_dir, path=True)}")
        raise
    except GivesWay:
        starting_over = True  # the next attempt draws its own curves in this directory
        raise
    finally:
        with contextlib.suppress(Exception):  # the figure is not worth hiding why a run stopped
            if not starting_over:
                run.plot(force=True)
        if not lost:  # with a process gone, no collective can complete
            distributed.barrier(world)
    return stopped

"""`trainfast.fit`: train a model on a pack with measured speed settings, and a run directory
that survives being killed. This file is the story of a run, top to bottom: read the arguments,
check the model and the data (inputs), choose the speed settings (speed), build the run
(optim, rundir, checkpoint) and let the epochs run (run), watched by the loss watch (watch) and
what adapts the run as it goes (adapt). A run at trainfast's own learning rate that cannot learn
starts over here, at half of it.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from trainfast import hardware, units
from trainfast import step as _step
from trainfast.config import Augment, Speed, TrainConfig, as_augment, check_pin
from trainfast.data.format import Pack
from trainfast.data.loader import Loader
from trainfast.errors import Detail, TrainfastError
from trainfast.train import checkpoint, distributed
from trainfast.train.adapt import FirstSteps, RateCheck, Threads, TimeBudget
from trainfast.train.costs import Costs
from trainfast.train.evaluate import held_out_loader
from trainfast.train.inputs import (check_batch_fits, check_config, check_fits, check_trainable,
                                    check_val_fits, held_out, model_and_name, training_pack)
from trainfast.train.metrics import MetricsLog
from trainfast.train.optim import learning_rate, optimizer_for, scheduler_for
from trainfast.train.run import READ_EVERY, EpochSums, Run, run_epochs
from trainfast.train.rundir import (dir_name, empty, own_run_dir, pack_record, read_run_config, record_costs,
                                    same_pack, write_start)
from trainfast.train.speed import elastic, raced_batch, runnable, tuned_speed
from trainfast.train.watch import START_OVERS, LossWatch, StartOver


@dataclass
class FitResult:
    run_dir: Path
    history: list[dict]
    best: float  # best validation accuracy (per character for sequences)
    speed: Speed
    stopped: str  # "finished", "early-stopped", "out-of-time" (TrainConfig.minutes)
    model: torch.nn.Module | None = field(default=None, repr=False)  # the model given (or built by name), trained
    costs: dict = field(default_factory=dict, repr=False)  # seconds per phase of the call (train/costs.py), "total"

    def __repr__(self) -> str:  # what a notebook cell shows: the outcome, not every epoch's dict
        last = self.history[-1] if self.history else {}
        acc = f", best held-out accuracy {self.best:.1%}" if self.best >= 0 else ""
        tail = (f"; last epoch: train loss {last['train_loss']:.4g}, {units.rate(last['images_per_s'])} images/s"
                if last else "")
        return (f"FitResult({len(self.history)} epochs, {self.stopped}{acc}{tail}; {self.speed.label()}; "
                f"run dir {self.run_dir})")


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
    pin = check_pin(pin)
    if batch_size is not None:
        pin = check_pin({**pin, "batch_size": batch_size})
    check_config(cfg)
    augment = as_augment(augment)
    saved = None
    if resume:
        if not run_dir:
            raise TrainfastError("resume=True needs the run_dir to resume")
        saved = read_run_config(run_dir, device)
        cfg = TrainConfig(**saved["train"])
    # NOTE: the caller's random streams are put back: the CPU's, and the current GPU's where CUDA
    # is in use already (forking every GPU's would start CUDA on each, in each torchrun process).
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with _determinism(cfg.deterministic), torch.random.fork_rng(devices=cuda), hardware.flushed_denormals():
        threads = torch.get_num_threads()  # a run may lower them for a while (Threads) or pin them (Speed.threads)
        try:
            try:
                with contextlib.ExitStack() as stack:
                    return _fit(model, train, val, cfg, speed, pin, augment, device, run_dir, saved, tune, progress,
                                log, stack, start_overs=0 if resume or cfg.lr else START_OVERS)
            except StartOver as again:
                return _start_over(again, model, train, val, cfg, pin, augment, device, progress, log)
        finally:
            torch.set_num_threads(threads)


def _start_over(again: StartOver, model, train, val, cfg: TrainConfig, pin, augment, device, progress, log):
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
        empty(again.run_dir)
        pin = {**(pin or {}), "batch_size": again.speed.batch_size}
        try:
            with contextlib.ExitStack() as stack:
                return _fit(model, train, val, replace(cfg, lr=lr), again.speed, pin, augment, device, again.run_dir,
                            None, False, progress, log, stack, start_overs=left, costs=again.costs)
        except StartOver as later:
            again = later


def _working_copy(net: torch.nn.Module) -> torch.nn.Module:
    """A copy of `net`'s module tree that holds `net`'s own parameter and buffer tensors:
    training it trains `net` (optimizers and batch-norm update those tensors in place), while
    the speed rewrites, which reorder, replace or reconfigure modules, change only the copy.
    So the user's model object keeps its module tree, its classes and its mode."""
    shared = {id(t): t for t in (*net.parameters(), *net.buffers())}
    return copy.deepcopy(net, memo=shared)


def _given_back(user: torch.nn.Module) -> None:
    """The user's model as it was given, but trained: its 4-D weights in the default memory
    layout again (channels_last trains them in place; the values are the same)."""
    with torch.no_grad():
        for p in user.parameters():
            if p.dim() == 4 and not p.is_contiguous():
                p.data = p.data.contiguous()


@dataclass
class Plan:
    """A run as fit reads it: what trains, on which data, where, and what it keeps of a run it
    resumes. Made once (_plan) and read by every stage after it."""

    name: str
    given: torch.nn.Module  # the user's model (or the one built by name) on the device: trained in place
    net: torch.nn.Module  # the working copy the speed rewrites change; its tensors are `given`'s
    cfg: TrainConfig
    dev: torch.device
    world: distributed.World
    train_pk: Pack
    val_pk: Pack | None  # the validation pack, or the training pack with val_idx held out
    val_given: bool  # a validation pack was given (config.json records it)
    train_idx: np.ndarray | None
    val_idx: np.ndarray | None
    classes: int  # per prediction: the loss watch's chance level is ln of this
    pin: dict  # settings the user fixed, which tuning keeps
    augment: Augment | None
    user_batch: int  # the batch the user's learning rate was meant for
    run_dir: Path
    saved: dict | None  # the config.json of a run resumed
    started: bool  # a resumed run has a checkpoint to go on from
    first_weights: dict | None  # on the CPU, where this attempt may start over (StartOver)
    say: object

    @property
    def n_train(self) -> int:
        return len(self.train_pk) if self.train_idx is None else len(self.train_idx)


@dataclass
class Chosen:
    """How the run's speed settings were chosen: tune's rows, its result, the race."""

    speed: Speed
    tried: list[dict] = field(default_factory=list)
    result: object = None  # the TuneResult, where tune ran
    raced: dict = field(default_factory=dict)


def _fit(model, train, val, cfg: TrainConfig, speed, pin, augment, device, run_dir, saved, tune, progress, log,
         stack: contextlib.ExitStack, start_overs: int = 0, costs: Costs | None = None):
    """fit, after its arguments are read; `saved` is the run's config.json when resuming; the run
    directory's lock is held on `stack` (released when fit returns or fails). `costs`: the call's
    account so far, where an attempt before this one was started over."""
    setup = hardware.OtherLoad().__enter__()  # other processes' load, sampled while the run sets up (Threads)
    costs = costs or Costs()
    with costs.phase("setup"):
        plan, speed = _plan(model, train, val, cfg, speed, pin, augment, device, run_dir, saved, log, stack,
                            start_overs)
    threads = Threads(plan.dev.type == "cpu" and not plan.world.distributed and not cfg.deterministic
                      and not (speed and speed.threads) and not plan.pin.get("threads"), since=setup)
    with costs.phase("tune"):
        chosen = _choose(plan, speed, tune, threads, progress)
    with costs.phase("start (learning rate, loaders)"):
        run, lr = _start(plan, chosen)
    run.costs = costs
    watchers = [RateCheck(chosen.result, chosen.tried, plan.given, plan.train_pk, plan.pin, plan.n_train)
                if chosen.result is not None and plan.world.is_main else None,
                TimeBudget(cfg.minutes) if cfg.minutes else None,
                LossWatch(plan.classes, lr, plan.train_pk, plan.first_weights,
                          start_overs)]
    try:
        stopped = run_epochs(run, threads, [w for w in watchers if w is not None], progress)
    except StartOver as again:
        costs.fold("attempts started over")
        again.costs = costs
        raise
    finally:
        _given_back(plan.given)
    spent = costs.as_dict()
    if plan.world.is_main:
        record_costs(plan.run_dir, spent)
    plan.say(Detail(costs.line()))
    return FitResult(plan.run_dir, run.log_csv.rows, run.state["best"], run.speed, stopped, plan.given, spent)


def _plan(model, train, val, cfg: TrainConfig, speed, pin, augment, device, run_dir, saved, log,
          stack: contextlib.ExitStack, start_overs: int) -> tuple[Plan, Speed | None]:
    """The model and data read and checked, the device and processes set up, the run directory
    held; a resumed run's settings from its config.json. Returns the plan and the speed settings
    given (None: to be tuned)."""
    resume = saved is not None
    torch.manual_seed(cfg.seed)  # before the model is built: its initial weights follow the seed
    net, name = model_and_name(model)
    check_trainable(net, name)
    try:
        dev = hardware.resolve_device(device)
    except ValueError as e:
        raise TrainfastError(str(e)) from None
    train_pk, pin = training_pack(train, pin, say=log)
    val_pk = None if val is None else training_pack(val, None, say=log, what="val")[0]
    classes, out = check_fits(net, train_pk, say=log)
    if val_pk is not None:
        check_val_fits(net, val_pk, train_pk, out)
    world = distributed.setup(dev)  # after the checks: a bad input stops every rank before any waits for the others
    dev = world.device
    if resume and world.distributed and distributed.sum_all([0.0], world)[0] > 0:  # see fit(): a node without it
        raise TrainfastError(f"{run_dir}: another node has no such run directory to resume; every node reads it "
                             "(config.json, last.pt): put it on a file system all nodes share, or copy it to each")
    given = net.to(dev)  # trained in place: its parameters and buffers live on the device from here
    # An attempt at the default rate (or at a fraction of it, after a start-over) may start over at
    # half of it (at most START_OVERS times), from these first weights, kept on the CPU.
    first_weights = None
    if start_overs and cfg.loss_watch and not cfg.minutes and not world.distributed:
        first_weights = {k: v.detach().to("cpu", copy=True) for k, v in given.state_dict().items()}
    say = log if world.is_main else (lambda *a, **k: None)
    run_dir = Path(run_dir or f"runs/{dir_name(name)}-{time.strftime('%Y%m%d-%H%M%S')}")
    if world.is_main:
        own_run_dir(run_dir, resume, stack)
    distributed.barrier(world)
    started = not resume or (run_dir / "last.pt").is_file()  # killed before its first checkpoint: start it over
    if not started:
        say(f"{run_dir}: the run stopped before its first checkpoint; starting it over with its saved settings")
    if resume:
        same_pack(train_pk, saved["train_pack"], "training")
        if val_pk is not None:
            same_pack(val_pk, saved.get("val_pack"), "validation")
        speed = elastic(runnable(Speed(**saved["speed"]), dev, say), int(saved.get("world_size", 1)), world, say)
        augment = Augment(**saved["augment"])
        pin = {"batch_size": saved["user_batch_size"]}
    pin = dict(pin or {})
    user_batch = pin.get("batch_size") or (speed.batch_size if speed else Speed().batch_size)
    held, train_idx, val_idx = held_out(train_pk, val_pk, cfg)
    plan = Plan(name, given, _working_copy(given), cfg, dev, world, train_pk, held, val is not None, train_idx,
                val_idx, classes, pin, augment, user_batch, run_dir, saved, started, first_weights, say)
    if speed is None and pin.get("batch_size"):  # before any tuning
        check_batch_fits(train_pk, plan.n_train, pin["batch_size"], world.size)
    return plan, speed


def _choose(plan: Plan, speed: Speed | None, tune: bool, threads: Threads, progress: bool) -> Chosen:
    """The run's speed settings: `speed` where given (or resumed); else tune's on this machine
    (tune=True), then a race of the batches it found fastest; else the defaults with the pins."""
    dev, world, say, cfg = plan.dev, plan.world, plan.say, plan.cfg
    chosen = Chosen(speed) if speed is not None else Chosen(Speed(**plan.pin))
    if speed is None and tune:
        best, tried, front, result = tuned_speed(
            plan.net, plan.train_pk, dev, plan.pin, say if progress else (lambda m: None), say,
            images=plan.n_train, epochs=cfg.epochs, world_size=world.size, budget_share=cfg.tune_share,
            optimizer=cfg.optimizer, other_cores=threads.at_start, try_threads=not threads.active,
            compare_in_run=dev.type == "cpu" and world.size == 1 and not cfg.deterministic)
        chosen = Chosen(best, tried, result)
        if front and world.size == 1:  # NOTE: under torchrun the rule's batch stands: one race would need every rank
            chosen.speed, chosen.raced = raced_batch(
                plan.net, plan.train_pk, plan.train_idx, front, best, cfg, dev, plan.augment or Augment(),
                plan.user_batch, plan.n_train * cfg.epochs, say)
    reason = _step.check(chosen.speed, dev)
    if reason:
        raise TrainfastError(reason)
    plan.augment = plan.augment or Augment()
    return chosen


def _chosen_by(chosen: Chosen) -> str:
    """How the run's first setting was chosen, in words (speed.json's first decision)."""
    if chosen.result is None:
        return "given (or resumed), or the defaults with the pins"
    how = "tune's cached choice" if chosen.result.cached else "tune's timing"
    return how + (", then a race of the fastest batches" if chosen.raced else "") + \
        (f"; short run: {chosen.result.short}" if chosen.result.short else "")


def _start(plan: Plan, chosen: Chosen) -> tuple[Run, float]:
    """The run ready for its first step: the model prepared for its setting, the loaders, the
    learning rate, optimizer and schedule, the run directory's files (or the checkpoint it goes
    on from), and a short run's comparison on its first steps where tune left it to them."""
    cfg, speed, dev, world, say, run_dir = plan.cfg, chosen.speed, plan.dev, plan.world, plan.say, plan.run_dir
    torch.manual_seed(cfg.seed)
    net = _step.prepare(plan.net, speed, dev)
    loader = Loader(plan.train_pk, speed.batch_size, shuffle=True, seed=cfg.seed, device=dev, augment=plan.augment,
                    rank=world.rank, world_size=world.size, subset=plan.train_idx)
    val_loader = None if plan.val_pk is None else held_out_loader(plan.val_pk, plan.train_pk, speed.batch_size, dev,
                                                                   world, plan.val_idx)
    lr = learning_rate(net, loader, cfg, speed, dev, world, plan.train_pk, plan.saved, plan.user_batch, say)
    opt = optimizer_for(net.parameters(), cfg, lr, dev)
    sched = scheduler_for(opt, cfg, cfg.epochs * len(loader), lr)
    # NOTE: CUDA graphs only for one process: DDP's gradient hooks run between the graph's kernels.
    trained = distributed.wrap(_step.compile_model(net, dev, graphs=world.size == 1) if speed.compile else net, world)
    state = {"epoch": 0, "step": 0, "best": -1.0, "bad_epochs": 0, "partial": [0.0, 0.0, 0.0, 0.0],
             "epochs": cfg.epochs, "position": 0}  # epochs: the plan its schedule was made for
    log_csv = MetricsLog(run_dir / "metrics.csv")
    run = Run(plan.name, net, trained, opt, sched, _step.make_scaler(speed, dev), loader, val_loader, cfg, speed, dev,
              world, run_dir, say, state, EpochSums(dev, state["partial"], every=READ_EVERY.get(dev.type, READ_EVERY["cuda"])),
              log_csv, plan.train_pk.sequence_length is not None, (0, time.perf_counter()),
              saved=(0, time.perf_counter()))
    if plan.saved is not None and plan.started:
        run.restore(checkpoint.load(run_dir / "last.pt", plan.name, net))  # on the CPU; load_state_dict moves it
        say(Detail(f"resuming {run_dir} at epoch {run.state['epoch'] + 1}, batch {loader.position} of {len(loader)}"))
    if world.is_main:
        log_csv.load(run.state["epoch"])
        run.plotted = (len(log_csv.rows), time.perf_counter())
        if plan.saved is None:
            write_start(run_dir, {"model": plan.name, "train": cfg.to_dict(), "speed": speed.to_dict(),
                                  "augment": asdict(plan.augment), "train_pack": pack_record(plan.train_pk),
                                  "val_pack": pack_record(plan.val_pk) if plan.val_given else None,
                                  # what every image the model sees is normalised with, held-out ones too
                                  "normalize": {"mean": list(plan.train_pk.mean), "std": list(plan.train_pk.std)},
                                  "world_size": world.size, "lr": lr, "user_batch_size": plan.user_batch,
                                  "device": str(dev)},
                        {"speed": speed.to_dict(), "tried": chosen.tried, "raced": chosen.raced,
                         "machine": hardware.describe(dev), "data_path": loader.describe(),
                         "decisions": [{"what": "settings", "chose": speed.label(), "by": _chosen_by(chosen)}]})
    say(f"training {plan.name} on {plan.train_pk.path} ({loader.samples} images, {len(loader)} steps/epoch) on {dev} "
        f"with {speed.label()}{f' × {world.size} processes' if world.distributed else ''}, lr {lr:g}; run dir "
        f"{run_dir}")
    result = chosen.result
    candidate = replace(result.candidate, **plan.pin) if result is not None and result.candidate and not chosen.raced \
        else None
    if candidate is not None and candidate != speed and _step.check(candidate, dev) is None:
        run.first_steps = FirstSteps(run, candidate, chosen.tried)  # tune left its comparison to these steps
    return run, lr

"""`trainfast.fit`: train a model on a pack with measured speed settings, and a run
directory that survives being killed.

The loop is plain single-device code; DDP (under torchrun) is a wrapper around the model
and a shard of the Loader, and only rank 0 prints, logs and writes.
"""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from trainfast import hardware, models
from trainfast import step as _step
from trainfast.config import BASE_BATCH, BASE_LR, OPTIMIZERS, SCHEDULES, Augment, Speed, TrainConfig
from trainfast.data.format import Pack
from trainfast.data.loader import Loader
from trainfast.errors import TrainfastError
from trainfast.train import checkpoint, distributed
from trainfast.train.metrics import MetricsLog, correct, plot_curves


@dataclass
class FitResult:
    run_dir: Path
    history: list[dict]
    best: float  # best validation accuracy (per character for sequences)
    speed: Speed
    stopped: str  # "finished", "early-stopped"


def _model_and_name(model) -> tuple[torch.nn.Module, str]:
    try:
        return models.load(model)
    except ValueError as e:
        raise TrainfastError(str(e)) from None


def check_fits(model: torch.nn.Module, pk: Pack) -> None:
    """The pack's image shape and label kind must be what the model takes and predicts."""
    h, w, c = pk.shape
    want = getattr(model, "input_shape", None)
    if want is not None and tuple(want) != (c, h, w):
        raise TrainfastError(f"{pk.path} holds {c}×{h}×{w} images; the model takes {'×'.join(map(str, want))}")
    out = getattr(model, "output_shape", None)
    if out is None:
        return
    if pk.sequence_length:
        if len(out) != 2 or out[0] != pk.sequence_length or out[1] < len(pk.alphabet):
            raise TrainfastError(f"{pk.path} has sequence labels ({pk.sequence_length} × {len(pk.alphabet)} "
                                 f"characters); the model predicts {'×'.join(map(str, out))}")
    elif len(out) != 1 or out[0] < len(pk.classes or []):
        raise TrainfastError(f"{pk.path} has {len(pk.classes or [])} classes; the model predicts "
                             f"{'×'.join(map(str, out))}")


def _optimizer(params, cfg: TrainConfig, lr: float):
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=True, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.RMSprop(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


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
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=cfg.warmup,
                                                   anneal_strategy="linear", div_factor=10, final_div_factor=100)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(cfg, step, total))


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _check_config(cfg: TrainConfig) -> None:
    if cfg.optimizer not in OPTIMIZERS:
        raise TrainfastError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {cfg.optimizer!r}")
    if cfg.schedule not in SCHEDULES:
        raise TrainfastError(f"schedule must be one of {', '.join(SCHEDULES)}, not {cfg.schedule!r}")
    if cfg.epochs < 1:
        raise TrainfastError(f"epochs must be ≥ 1, not {cfg.epochs}")
    if not 0 <= cfg.val_fraction < 1:
        raise TrainfastError(f"val_fraction must be in [0, 1), not {cfg.val_fraction}")


def _prepare_run_dir(run_dir: Path, resume: bool) -> None:
    if resume:
        if not (run_dir / "config.json").is_file():
            raise TrainfastError(f"{run_dir}: not a run directory to resume (no config.json)")
        return
    if run_dir.exists() and any(run_dir.iterdir()):
        raise TrainfastError(f"{run_dir}: exists and is not empty; choose another --run-dir or --resume it")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise TrainfastError(f"{run_dir}: cannot write the run directory ({e.strerror or e})") from None


def evaluate(model, loader: Loader, speed: Speed, device, world) -> dict:
    """Loss and accuracy over `loader` (summed over ranks under DDP)."""
    model.eval()
    sums = [0.0, 0.0, 0.0, 0.0, 0.0]  # loss·n, correct, correct sequences, items, images
    with torch.no_grad():
        for x, y in loader:
            loss, out = _step.forward_loss(model, x, y, speed, device)
            c, cs, n = correct(out, y)
            sums = [sums[0] + float(loss) * len(x), sums[1] + c, sums[2] + cs, sums[3] + n, sums[4] + len(x)]
    loss_n, c, cs, n, imgs = distributed.sum_all(sums, world)
    model.train()
    return {"loss": loss_n / max(imgs, 1), "acc": c / max(n, 1), "seq_acc": cs / max(imgs, 1)}


def fit(model, train, val=None, *, config: TrainConfig | None = None, speed: Speed | None = None,
        pin: dict | None = None, augment: Augment | None = None, device=None, run_dir=None,
        resume: bool = False, tune: bool = True, progress: bool = True, log=print) -> FitResult:
    """Train `model` on the pack `train`, validating on `val` (or a held-out split).

    Args:
        model: an nn.Module or a registered name.
        train, val: packs (or their paths); without `val`, config.val_fraction is held out.
        config: a TrainConfig; speed: the settings to use (default: tuned on this machine
            when tune=True, else Speed()); pin: settings fixed by the user, e.g.
            {"batch_size": 64}, that tuning keeps; augment: batched augmentations.
        run_dir: where the config, metrics, curves and checkpoints go (created).
        resume: continue the run in run_dir from its last checkpoint.

    Returns:
        FitResult with the history and the best validation accuracy.
    """
    cfg = config or TrainConfig()
    _check_config(cfg)
    torch.manual_seed(cfg.seed)  # before the model is built: its initial weights follow the seed
    net, name = _model_and_name(model)
    try:
        dev = hardware.resolve_device(device)
    except ValueError as e:
        raise TrainfastError(str(e)) from None
    world = distributed.setup(dev)
    dev = world.device
    say = log if world.is_main else (lambda *a, **k: None)
    train_pk = train if isinstance(train, Pack) else Pack(train)
    val_pk = None if val is None else (val if isinstance(val, Pack) else Pack(val))
    check_fits(net, train_pk)
    if val_pk is not None:
        check_fits(net, val_pk)
    run_dir = Path(run_dir or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if world.is_main:
        _prepare_run_dir(run_dir, resume)
    distributed.barrier(world)

    tune_table, saved = [], None
    if resume:
        saved = json.loads((run_dir / "config.json").read_text())
        cfg = TrainConfig(**saved["train"])
        speed = Speed(**saved["speed"])
        augment = Augment(**saved["augment"])
        pin = {"batch_size": saved["user_batch_size"]}
    pin = dict(pin or {})
    user_batch = pin.get("batch_size") or (speed.batch_size if speed else Speed().batch_size)
    if speed is None:
        if tune:
            from trainfast.tune import tune as _tune
            h, w, c = train_pk.shape
            result = _tune(net, (c, h, w), device=dev, batch_size=pin.get("batch_size"),
                           try_compile=pin.get("compile", True), try_rewrites="rewrites" not in pin,
                           log=say if progress else (lambda m: None))
            speed, tune_table = replace(result.best, **pin), [r.to_dict() for r in result.rows]
            say(result.table())
        else:
            speed = Speed(**pin)
    reason = _step.check(speed, dev)
    if reason:
        raise TrainfastError(reason)
    augment = augment or Augment()

    torch.manual_seed(cfg.seed)
    net = _step.prepare(net, speed, dev)
    # Held-out split: a seeded permutation of the pack, the same on every rank.
    if val_pk is None and cfg.val_fraction > 0:
        order = np.random.default_rng([cfg.seed, 7919]).permutation(len(train_pk))
        n_val = max(1, int(len(train_pk) * cfg.val_fraction))
        train_idx, val_idx = np.sort(order[n_val:]), np.sort(order[:n_val])
        val_pk = train_pk
    else:
        train_idx, val_idx = None, None
    loader = Loader(train_pk, speed.batch_size, shuffle=True, seed=cfg.seed, device=dev, augment=augment,
                    rank=world.rank, world_size=world.size, subset=train_idx)
    val_loader = None if val_pk is None else Loader(val_pk, speed.batch_size, shuffle=False, drop_last=False,
                                                     device=dev, rank=world.rank, world_size=world.size,
                                                     subset=val_idx)
    # Linear scaling: the user's lr belongs to the user's batch; defaults to a global batch of 256.
    lr = cfg.lr * speed.batch_size / user_batch if cfg.lr else \
        BASE_LR[cfg.optimizer] * speed.batch_size * world.size / BASE_BATCH
    if cfg.lr and speed.batch_size != user_batch:
        say(f"batch size {user_batch} → {speed.batch_size} (tuned): learning rate scaled {cfg.lr:g} → {lr:g}")
    steps_per_epoch = len(loader)
    opt = _optimizer(net.parameters(), cfg, lr)
    sched = _scheduler(opt, cfg, cfg.epochs * steps_per_epoch, lr)
    scaler = _step.make_scaler(speed, dev)
    trained = distributed.wrap(torch.compile(net) if speed.compile else net, world)

    log_csv = MetricsLog(run_dir / "metrics.csv")
    state = {"epoch": 0, "step": 0, "best": -1.0, "bad_epochs": 0, "partial": [0.0, 0.0, 0.0, 0.0]}
    if resume:
        ck = checkpoint.load(run_dir / "last.pt", name, net, map_location=dev)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        if scaler is not None and ck.get("scaler"):
            scaler.load_state_dict(ck["scaler"])
        loader.load_state_dict(ck["loader"])
        torch.set_rng_state(ck["rng"])
        state = ck["state"]
        say(f"resuming {run_dir} at epoch {state['epoch'] + 1}, batch {loader.position} of {steps_per_epoch}")
    if world.is_main:
        log_csv.load(state["epoch"])
        if not resume:
            (run_dir / "config.json").write_text(json.dumps(
                {"model": name, "train": cfg.to_dict(), "speed": speed.to_dict(), "augment": asdict(augment),
                 "train_pack": str(train_pk.path), "val_pack": None if val is None else str(val_pk.path),
                 "world_size": world.size, "lr": lr, "user_batch_size": user_batch}, indent=1))
            (run_dir / "speed.json").write_text(json.dumps(
                {"speed": speed.to_dict(), "tried": tune_table, "machine": hardware.describe(dev)}, indent=1))
    say(f"training {name} on {train_pk.path} ({loader.samples} images, {steps_per_epoch} steps/epoch) with "
        f"{speed.label()}{f' × {world.size} processes' if world.distributed else ''}, lr {lr:g}; run dir {run_dir}")

    def save(which=("last.pt",)):
        if not world.is_main:
            return
        ck = {"model_name": name, "signature": checkpoint.signature(net), "model": net.state_dict(),
              "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
              "scaler": scaler.state_dict() if scaler is not None else None,
              "loader": loader.state_dict(), "rng": torch.get_rng_state(), "state": state}
        for fn in which:
            checkpoint.save(run_dir / fn, ck)

    from tqdm import tqdm

    stopped = "finished"
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    if world.is_main:  # a polite kill saves like Ctrl-C
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        while state["epoch"] < cfg.epochs:
            epoch = state["epoch"]
            if loader.position == 0:
                loader.set_epoch(epoch)
            started, done_before = time.perf_counter(), loader.position
            bar = tqdm(total=steps_per_epoch, initial=loader.position, desc=f"epoch {epoch + 1}/{cfg.epochs}",
                       unit="step", disable=not (progress and world.is_main), dynamic_ncols=True, leave=True)
            for x, y in loader:
                loss, out = _step.forward_loss(trained, x, y, speed, dev, cfg.label_smoothing)
                value = float(loss.detach())
                bad = distributed.sum_all([0.0 if math.isfinite(value) else 1.0], world)[0]
                if bad:
                    raise TrainfastError(f"the loss became {value} at epoch {epoch + 1}, step {loader.position} "
                                         f"(global step {state['step'] + 1}); stopped. The last good checkpoint is "
                                         f"{run_dir / 'last.pt'}; try a lower --lr, --clip 1, or --precision fp32")
                _step.backward(loss, scaler)
                _step.optimizer_step(opt, scaler, cfg.clip, net)
                sched.step()
                c, _, n = correct(out.detach(), y)
                p = state["partial"]
                state["partial"] = [p[0] + value * len(x), p[1] + c, p[2] + n, p[3] + len(x)]
                state["step"] += 1
                bar.update(1)
                if bar.n % 5 == 0 or bar.n == steps_per_epoch:
                    rate = (bar.n - done_before) * speed.batch_size * world.size / (time.perf_counter() - started)
                    bar.set_postfix_str(f"loss {state['partial'][0] / state['partial'][3]:.3f}, {rate:,.0f} img/s")
                if cfg.save_every and state["step"] % cfg.save_every == 0:
                    save()
            bar.close()
            seconds = time.perf_counter() - started
            p = distributed.sum_all(state["partial"], world)
            row = {"epoch": epoch, "train_loss": p[0] / max(p[3], 1), "train_acc": p[1] / max(p[2], 1),
                   "lr": sched.get_last_lr()[0], "seconds": seconds,
                   "images_per_s": (steps_per_epoch - done_before) * speed.batch_size * world.size / seconds}
            if val_loader is not None:
                v = evaluate(net, val_loader, speed, dev, world)
                row.update(val_loss=v["loss"], val_acc=v["acc"], val_seq_acc=v["seq_acc"])
            score = row.get("val_acc", row["train_acc"])
            improved = score > state["best"]
            state.update(epoch=epoch + 1, partial=[0.0, 0.0, 0.0, 0.0],
                         best=max(state["best"], score), bad_epochs=0 if improved else state["bad_epochs"] + 1)
            if world.is_main:
                log_csv.add(row)
                plot_curves(log_csv.rows, run_dir / "curves.png", train_pk.sequence_length is not None)
            save(("last.pt", "best.pt") if improved else ("last.pt",))
            extra = f", val loss {row['val_loss']:.4f}, val acc {row['val_acc']:.2%}" if "val_loss" in row else ""
            if "val_loss" in row and train_pk.sequence_length:
                extra += f", whole sequences {row['val_seq_acc']:.2%}"
            say(f"epoch {epoch + 1}: train loss {row['train_loss']:.4f}{extra}, {row['images_per_s']:,.0f} img/s, "
                f"{seconds:.1f} s")
            if cfg.patience and state["bad_epochs"] >= cfg.patience:
                stopped = "early-stopped"
                say(f"early stop: no better validation accuracy for {cfg.patience} epochs")
                break
    except KeyboardInterrupt:
        save()
        say(f"\ninterrupted; saved {run_dir / 'last.pt'}. Continue with: trainfast train --resume {run_dir}")
        raise
    finally:
        if world.is_main:
            signal.signal(signal.SIGTERM, previous_sigterm)
        distributed.barrier(world)
    result = FitResult(run_dir, log_csv.rows, state["best"], speed, stopped)
    return result

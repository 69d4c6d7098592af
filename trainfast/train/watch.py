"""The loss watch: after each epoch, is the model learning? A loss at chance or climbing is said
with the doctor's findings, and a run at trainfast's own learning rate that cannot learn starts
over from its first weights at half the rate (StartOver, caught by fit)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

from trainfast.config import Speed
from trainfast.data.format import Pack
from trainfast.errors import TrainfastError
from trainfast.train.run import GivesWay, Run, Watcher


STUCK_SHARE = 0.3  # the loss watch judges "stuck" after max(2, this share of the epochs)
STUCK_STEPS = 50  # ... and after at least this many optimizer steps
STUCK_MARGIN = 0.02  # "stuck": the epoch's training loss is within 2% of ln K, or above it ...
STILL_FALLING = 0.9  # ... and not below this share of the epoch before's (a loss far above ln K can be falling) ...
ABOVE_CHANCE = 2.0  # ... and training accuracy under this many times chance (1/K): one that reads 2× chance learns
DIVERGED = 1.5  # "diverging": an epoch's training loss over 1.5× the first epoch's, and over ln K


def shape_findings(net, pk: Pack) -> list[str]:
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


class StartOver(GivesWay):
    """Raised by an attempt at trainfast's own learning rate (the default, or a fraction of it after
    a start-over) whose loss watch fired with epochs left: fit starts the run over from the first
    weights at half that rate (_start_over)."""

    def __init__(self, why: str, run_dir: Path, speed: Speed, lr: float, first_weights: dict):
        super().__init__(why)
        self.why, self.run_dir, self.speed, self.lr, self.first_weights = why, run_dir, speed, lr, first_weights
        self.costs = None  # the call's account so far (train.costs.Costs), which the next attempt goes on with


START_OVERS = 2
"""A run at the default rate starts over at most this often, each time at half the last rate:
the first attempt whenever its loss watch fires with epochs left, the second only where it died."""


class LossWatch(Watcher):
    """After each epoch: is the model learning (loss_watch)? Before the watch judges "stuck"
    (epoch 2 at the earliest), a model at chance is measured too: one frozen (SqueezeNet's
    ReLU'd logits, dead in epoch 1 at the default rate) cannot come back, and starts over after
    one epoch, not three. A run is stopped only where going on cannot help (every output frozen,
    or a climbing loss); a model whose gradients still flow may leave chance late (a ViT on
    digits at epoch 4 of 5): it is told once, and trains on.

    `first_weights`: kept where this attempt may start over (at trainfast's own learning rate),
    None otherwise; `start_overs`: how many it has left (the first attempt starts over whenever
    the watch fires; a later one only where it died: a quarter of the rate left plates-reading
    mobile nets further under chance)."""

    def __init__(self, classes: int, lr: float, pk: Pack, first_weights: dict | None, start_overs: int):
        self.classes, self.lr, self.pk = classes, lr, pk
        self.first_weights, self.start_overs = first_weights, start_overs
        self.warned = False  # the warning for a run that is stuck but not hopeless: once

    def after_epoch(self, run: Run, epoch: int, row: dict) -> str | None:
        from trainfast.diagnose.cost import measured_findings

        state, epochs, classes = run.state, run.cfg.epochs, self.classes
        watch, acc = (state["losses"], epochs, classes, self.lr), state.get("last_acc")
        if not (run.cfg.loss_watch and (loss_watch(*watch, [], state["step"], acc=acc)
                                        or not self.warned and at_chance(state["losses"], classes, acc))):
            return None
        found, frozen = measured_findings(run.net, run.loader.batch(0, epoch=epoch)[0], when="now ")
        if not loss_watch(*watch, found, state["step"], frozen, acc=acc):
            return None
        why = loss_watch(*watch, found + shape_findings(run.net, self.pk), state["step"], frozen, acc=acc)
        hopeless, left = frozen or diverging(state["losses"], classes), state["epoch"] < epochs
        if self.first_weights is not None and left and (hopeless or self.start_overs == START_OVERS):
            raise StartOver(why, run.run_dir, run.speed, self.lr, self.first_weights)
        if hopeless and left:  # epochs left: stop rather than spend them
            run.flush(epoch)
            raise TrainfastError(f"{why} Stopped; the run so far is in {run.run_dir}.")
        if hopeless or not self.warned:
            run.say(f"warning: {why}" + ("" if hopeless or not left else
                                         " Its output still depends on its input, so it trains on."))
            self.warned = True
        return None

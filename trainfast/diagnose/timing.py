"""Where one training step's time goes, and how many images/s training runs at.

Two measurements, because on a GPU one cannot serve for both:

- `step_breakdown`: data wait, host→device copy, forward, backward, optimizer, other, per
  step, after warm-up; on CUDA with CUDA events, so that asynchronous work is charged to the
  stage that launched it. It synchronises after every step, which on CUDA removes the overlap
  of the host's kernel launches with the device's work: a launch-bound step looks slower
  than it trains.
- `throughput`: steps issued back to back, as training issues them, synchronised once at the
  end. This is the images/s that the doctor, tune and fit all report.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import asdict, dataclass

import torch

from trainfast import step as _step
from trainfast.config import Speed
from trainfast.data.loader import GoesOnWarning
from trainfast.errors import TrainfastError

STAGES = ("data", "copy", "forward", "backward", "optimizer", "other")


@dataclass
class StepTimes:
    """Mean seconds per step of each stage over the timed steps; they add up to `step`."""

    steps: int
    batch_size: int
    data: float
    copy: float
    forward: float
    backward: float
    optimizer: float
    other: float
    step: float  # mean wall time per step
    loss: float  # median loss over the timed steps (finite check)
    steady: float | None = None  # images/s of steps issued back to back (CUDA; see throughput)

    @property
    def images_per_s(self) -> float:
        """What training runs at: the back-to-back rate where measured, else per timed step."""
        return self.steady or self.batch_size / self.step

    def share(self, stage: str) -> float:
        return getattr(self, stage) / self.step if self.step else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "images_per_s": self.images_per_s}


class _Clock:
    """Stage boundaries: perf_counter on CPU; CUDA events on the current stream on CUDA."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def _batches(data, need: int):
    """Yield `need` batches from `data`, starting it over if it is re-iterable."""
    got = 0
    it = iter(data)
    while got < need:
        try:
            with warnings.catch_warnings():  # taking a few batches and leaving is what timing does
                warnings.simplefilter("ignore", GoesOnWarning)
                batch = next(it)
        except StopIteration:
            if it is data or got == 0:
                raise TrainfastError(f"the data ran out after {got} batches; {need} are needed "
                                     "(lower --steps or give more data)") from None
            it = iter(data)
            continue
        got += 1
        yield batch


def step_breakdown(model: torch.nn.Module, data, *, device: torch.device, speed: Speed | None = None,
                   steps: int = 30, warmup: int = 5, optimizer=None, lr: float = 0.01, on_step=None) -> StepTimes:
    """Run warmup + steps training steps of `model` on batches from `data`; time each stage.

    `data` is any iterable of (images, labels): a trainfast Loader, a DataLoader, a
    generator, or a Sequence-like object. The model is trained by these steps (SGD unless
    an optimizer is given): pass a copy if its weights matter. `on_step()` is called after each
    step (a progress bar's update), outside the timed stages.
    """
    speed = speed or Speed()
    model = _step.prepare(model, speed, device)
    model.train()
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = _step.make_scaler(speed, device)
    clock = _Clock(device)
    rows, losses, batch = [], [], 0
    host = time.perf_counter
    t_prev = host()
    for i, (x, y) in enumerate(_batches(data, warmup + steps)):
        t_data = host()
        m0 = clock.mark()
        x, y = _step.to_device(x, y, speed, device)
        m1 = clock.mark()
        loss, _ = _step.forward_loss(model, x, y, speed, device)
        m2 = clock.mark()
        _step.backward(loss, scaler)
        m3 = clock.mark()
        _step.optimizer_step(opt, scaler)
        m4 = clock.mark()
        clock.sync()
        value = float(loss.detach())
        t_end = host()
        if i >= warmup:
            batch = len(x)
            wall = t_end - t_prev
            stages = [t_data - t_prev, clock.seconds(m0, m1), clock.seconds(m1, m2),
                      clock.seconds(m2, m3), clock.seconds(m3, m4)]
            rows.append(stages + [max(wall - sum(stages), 0.0), wall])
            losses.append(value)
        if on_step is not None:
            on_step()
        t_prev = host()
    mean = [statistics.fmean(col) for col in zip(*rows)]
    return StepTimes(steps, batch, *mean, loss=statistics.median(losses))


def throughput(model: torch.nn.Module, data, *, device: torch.device, speed: Speed | None = None,
               steps: int = 30, warmup: int = 3, optimizer=None, lr: float = 0.01,
               clock=time.perf_counter, on_step=None) -> float:
    """images/s of `steps` training steps issued back to back, after `warmup` of them.

    The device is synchronised once after the warm-up and once at the end, never in between,
    so host-side launches overlap device work as in training. Like step_breakdown, this trains
    `model` (pass a copy if its weights matter); `data` is any iterable of (images, labels).
    """
    speed = speed or Speed()
    model = _step.prepare(model, speed, device)
    model.train()
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = _step.make_scaler(speed, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    images, started = 0, None
    for i, (x, y) in enumerate(_batches(data, warmup + steps)):
        if i == warmup:
            sync()
            started = clock()
        x, y = _step.to_device(x, y, speed, device)
        loss, _ = _step.forward_loss(model, x, y, speed, device)
        _step.backward(loss, scaler)
        _step.optimizer_step(opt, scaler)
        if i >= warmup:
            images += len(x)
        if on_step is not None:  # a host-side counter: it does not synchronise the device
            on_step()
    sync()
    return images / max(clock() - started, 1e-9)


def synthetic_batches(shape, output_shape, batch_size: int, device: torch.device, n: int = 4):
    """A few random batches already on the device, for timing the compute side alone."""
    # NOTE: drawn on the device: a large trial batch of 512² images is tens of GB, which the
    # host would first have to fill and copy.
    g = torch.Generator(device).manual_seed(0)
    x = torch.rand((n, batch_size, *shape), generator=g, device=device)
    if len(output_shape) == 2:  # sequences: (L, K)
        y = torch.randint(0, output_shape[1], (n, batch_size, output_shape[0]), generator=g, device=device)
    else:
        y = torch.randint(0, output_shape[0], (n, batch_size), generator=g, device=device)
    return [(x[i], y[i]) for i in range(n)]

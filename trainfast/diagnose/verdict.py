"""The verdict (input-, compute- or overhead-bound) and its rules, and the roofline.

Thresholds are the customary ones (TensorFlow's input-pipeline analyzer uses the same
split): data wait ≥ 20% of the step is highly input-bound, 5–20% moderately.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from trainfast.diagnose.cost import ModelCost
from trainfast.diagnose.timing import StepTimes

HIGHLY_INPUT_BOUND = 0.20
MODERATELY_INPUT_BOUND = 0.05
OVERHEAD_SHARE_OF_PEAK = 0.10  # below this share of peak FLOP/s at a small batch: overhead-bound
SMALL_BATCH = 16


@dataclass
class Roofline:
    compute_s: float  # per image: training FLOPs ÷ peak FLOP/s
    memory_s: float  # per image: estimated bytes moved ÷ copy bandwidth
    measured_s: float  # per image, compute stages only (copy + forward + backward + optimizer)
    achieved_flops: float  # training FLOPs per second during the compute stages
    peak_flops: float
    dtype: str
    ceiling_s: float | None = None  # per image: the kernels' ceiling (diagnose.ceiling), where measured

    @property
    def bound_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def share_of_peak(self) -> float:
        return self.achieved_flops / self.peak_flops if self.peak_flops else 0.0

    @property
    def share_of_ceiling(self) -> float | None:
        """The kernels' ceiling over the measured time: 1.0 where the step is nothing but its
        convolutions and matrix products, each at its best."""
        return self.ceiling_s / self.measured_s if self.ceiling_s and self.measured_s else None

    @property
    def kernels_share_of_peak(self) -> float | None:
        """The FLOP rate of the kernels alone, as a share of the peak: how well they suit these shapes."""
        if not self.ceiling_s or not self.peak_flops:
            return None
        return self.compute_s / self.ceiling_s

    def to_dict(self) -> dict:
        return {**asdict(self), "bound_s": self.bound_s, "share_of_peak": self.share_of_peak,
                "share_of_ceiling": self.share_of_ceiling, "kernels_share_of_peak": self.kernels_share_of_peak}

    def ceiling_sentence(self) -> str:
        """What the kernels' ceiling says about the step, in words ('' where not measured)."""
        if self.share_of_ceiling is None:
            return ""
        return (f"its convolutions and matrix products alone, each in its fastest layout, would take "
                f"{self.ceiling_s * 1e3:.3g} ms per image against {self.measured_s * 1e3:.3g} ms measured: the step "
                f"runs at {self.share_of_ceiling:.0%} of what its kernels allow (the rest is activations, pooling, "
                f"dropout, normalisation, the optimizer and per-operator overhead), and the kernels themselves reach "
                f"{self.kernels_share_of_peak:.0%} of the {self.dtype} matmul peak on these shapes")


def roofline(cost: ModelCost, times: StepTimes, peaks: dict, precision: str, ceiling=None) -> Roofline:
    """Per-image time bounds from the model's FLOPs and bytes and the device's measured peaks.

    Memory bound (an estimate): every activation is written in forward, read and its
    gradient written in backward (3 passes), and the weights are read twice and their
    gradients written once per step, shared over the batch. `ceiling`: the kernels' ceiling
    (diagnose.ceiling.Ceiling) where measured.
    """
    dtype = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]
    flops = peaks["matmul_flops"]
    peak = flops.get(dtype) or flops["float32"]
    act_scale = 0.5 if precision in ("bf16", "fp16") else 1.0  # activations in 16-bit under autocast
    bytes_per_image = 3 * cost.activation_bytes * act_scale + 3 * cost.param_bytes / max(times.batch_size, 1)
    compute_stage = times.copy + times.forward + times.backward + times.optimizer
    measured = compute_stage / max(times.batch_size, 1)
    return Roofline(compute_s=cost.train_flops / peak, memory_s=bytes_per_image / peaks["copy_bytes"],
                    measured_s=measured, achieved_flops=cost.train_flops / measured if measured else 0.0,
                    peak_flops=peak, dtype=dtype, ceiling_s=ceiling.per_image_s if ceiling else None)


@dataclass
class Verdict:
    kind: str  # "input-bound", "compute-bound", "overhead-bound"
    degree: str  # "highly", "moderately", ""
    sentence: str

    def to_dict(self) -> dict:
        return asdict(self)


def verdict(times: StepTimes, roof: Roofline) -> Verdict:
    data_share = times.share("data")
    if data_share >= HIGHLY_INPUT_BOUND:
        return Verdict("input-bound", "highly", f"highly input-bound: {data_share:.0%} of each step waits for "
                       f"data (≥ {HIGHLY_INPUT_BOUND:.0%} is highly input-bound)")
    if data_share >= MODERATELY_INPUT_BOUND:
        return Verdict("input-bound", "moderately", f"moderately input-bound: {data_share:.0%} of each step "
                       f"waits for data ({MODERATELY_INPUT_BOUND:.0%}–{HIGHLY_INPUT_BOUND:.0%})")
    if roof.share_of_peak < OVERHEAD_SHARE_OF_PEAK and times.batch_size <= SMALL_BATCH:
        return Verdict("overhead-bound", "", f"overhead-bound: at batch {times.batch_size} the device reaches "
                       f"{roof.share_of_peak:.1%} of its measured peak; per-step overhead, not arithmetic, "
                       "sets the pace")
    if roof.share_of_peak < OVERHEAD_SHARE_OF_PEAK:  # the model's own work, but not its arithmetic
        where = ("the time goes to memory traffic and per-layer work (depthwise or grouped convolutions, "
                 "normalisation, activations) that FLOP counts do not show")
        if roof.share_of_ceiling is not None:  # measured, not guessed: around the kernels, or in them
            where = (f"its convolutions and matrix products alone take {roof.share_of_ceiling:.0%} of the step's "
                     f"compute and reach {roof.kernels_share_of_peak:.0%} of the peak on these shapes; the rest of "
                     "the time goes around them (activations, pooling, normalisation, the optimizer, per-operator "
                     "overhead)")
        return Verdict("compute-bound", "", f"compute-bound: data wait is {data_share:.0%} of the step; the model's "
                       f"own work sets the pace, yet its arithmetic reaches only {roof.share_of_peak:.1%} of the "
                       f"device's measured peak: {where}")
    return Verdict("compute-bound", "", f"compute-bound: data wait is {data_share:.0%} of the step; the "
                   f"model's arithmetic runs at {roof.share_of_peak:.0%} of the device's measured peak")


@dataclass
class Recommendation:
    title: str
    action: str  # the exact command or code change
    speedup: float  # expected step-time ratio old/new
    measured: bool  # measured on the spot (True) or an estimate (False)
    evidence: str = ""
    spread: tuple[float, float] | None = None  # the lowest and highest gain over interleaved rounds
    builds_on: str = ""  # the title of the fix this one's gain assumes is made first

    def to_dict(self) -> dict:
        return asdict(self)


def ranked(recs: list[Recommendation]) -> list[Recommendation]:
    """Best gain first; a fix measured on top of another comes right after it."""
    titles = {r.title for r in recs}
    top = sorted((r for r in recs if r.builds_on not in titles), key=lambda r: -r.speedup)
    out = []
    for r in top:
        out.append(r)
        out += sorted((d for d in recs if d.builds_on == r.title), key=lambda d: -d.speedup)
    return out


def cores_sentence(r) -> str:
    """The CIFAR story's question, "how do I use all my cores?", answered from the report's own
    measurements: the cores there are, the ones the step and the data side use, and what more
    would buy (a step that waits for data gains nothing from faster compute)."""
    s, t = r.system, r.times
    cores, threads = s["physical_cores"], s["torch_threads"]
    usable = s.get("usable_cores", cores)
    have = f"This machine has {cores} physical cores" + (f" ({usable} usable by this process)" if usable != cores else "")
    busy = f"; other programs kept {r.other_load:.1f} of them busy" if r.other_load and r.other_load >= 0.3 else ""
    side = r.data_side or "the training process itself"
    data, compute = t.share("data"), 1 - t.share("data")
    if s["device"].startswith("cuda"):
        return (f"{have}{busy}. The model runs on the GPU; the CPU's cores feed it: the data side runs on {side}, "
                f"and waits take {data:.0%} of each step.")
    uses = f"the training step runs on torch's {threads} threads, the data side on {side}"
    if data >= 0.5:
        more = (f"{data:.0%} of each step waits for data, so more cores for the model buy little: the data side is "
                "the lever (What to do)")
    elif threads < cores:
        more = (f"torch uses {threads} of the {cores} cores: torch.set_num_threads({cores}) (--threads {cores}) "
                "puts the rest to work on the step")
    else:
        twice = 1 / (data + compute / 2)
        more = (f"the step already uses every core; twice as many would make a step at most {twice:.2g}× faster "
                f"(its compute side is {compute:.0%} of it, if it scaled perfectly): beyond that, a GPU, or the "
                "settings above")
    return f"{have}{busy}; {uses}. {more[0].upper()}{more[1:]}."

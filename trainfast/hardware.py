"""What this machine is: cores, CPU model, speed-relevant ISA features, devices.

NOTE: imports nothing of ours, and torch only inside functions, so that pack workers can
ask how many cores there are without paying for a torch import.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from functools import lru_cache

# Flags in /proc/cpuinfo that change which kernels torch can use, in the order we print them.
_ISA_FLAGS = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX512-BF16",
    "avx512_vnni": "AVX512-VNNI",
    "amx_bf16": "AMX-BF16",
    "amx_tile": "AMX",
}


def usable_cores() -> int:
    """CPUs this process may run on (affinity-aware; what `--workers` defaults to)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


@lru_cache(maxsize=1)
def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def physical_cores() -> int:
    """Physical cores (hyper-threads counted once), falling back to usable_cores()."""
    pairs = set()
    phys = core = None
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "physical id":
            phys = value.strip()
        elif key == "core id":
            core = value.strip()
        elif not key and phys is not None and core is not None:
            pairs.add((phys, core))
            phys = core = None
    if phys is not None and core is not None:
        pairs.add((phys, core))
    return min(len(pairs), usable_cores()) if pairs else usable_cores()


def cpu_model() -> str:
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def isa_features() -> list[str]:
    """Speed-relevant instruction-set features of this CPU, e.g. ['AVX2', 'AVX-512']."""
    flags = set()
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    return [name for flag, name in _ISA_FLAGS.items() if flag in flags]


def cpu_has_bf16() -> bool:
    """This CPU has bf16 instructions (AVX512-BF16 or AMX-BF16). Without them torch runs bf16
    on CPU by converting in software, slower than fp32 (about 1 GFLOP/s of matmul measured on
    an AVX2-only EPYC, against 129 in fp32)."""
    return any(f in isa_features() for f in ("AVX512-BF16", "AMX-BF16"))


def fast_precisions(device) -> tuple[str, ...]:
    """The reduced precisions this device runs fast, of 'tf32', 'bf16' and 'fp16'.

    CUDA: fp16 from sm70 (tensor cores), bf16 and tf32 from sm80. NOTE: torch.cuda.is_bf16_supported()
    also says True on older GPUs, where bf16 is emulated (a GTX 1080, the 512² story's GPU, is
    sm61). CPU: bf16 with AVX512-BF16 or AMX-BF16 only; fp16 never (no scaled fp16 training there).
    """
    import torch

    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        return tuple(p for p, need in (("tf32", (8, 0)), ("bf16", (8, 0)), ("fp16", (7, 0))) if cc >= need)
    if device.type == "cpu" and cpu_has_bf16():
        return ("bf16",)
    return ()


def denormals_flushed() -> bool:
    """This thread's CPU arithmetic flushes denormal floats to zero (torch has no getter: a
    denormal float32 written under flush-to-zero reads back as 0)."""
    import torch

    return torch.tensor(1e-40, dtype=torch.float32).item() == 0.0


@contextlib.contextmanager
def flushed_denormals():
    """CPU float results below 1.2e-38 flushed to zero for the block, as TensorFlow's thread pools
    do; the caller's setting put back after. A run whose loss nears zero fills its gradients and
    the optimizer's squared averages with denormal numbers, which x86 CPUs compute many times
    slower: on a 2-core Xeon (AVX-512) the CIFAR CNN's epochs on learnable images went from 7 s to
    13-16 s once its loss passed 0.001, and the whole call took 1.6x as long. No effect on a GPU's
    arithmetic; False from torch.set_flush_denormal (a CPU without SSE3 DAZ) leaves all as it was."""
    import torch

    if denormals_flushed() or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def resolve_device(name: str | None):
    """'auto' / None → cuda if available else cpu; otherwise check the device exists.

    Raises ValueError with a readable reason for a device this machine does not have.
    """
    import torch

    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"unknown device {name!r} ({e})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {name!r} was asked for, but {why}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} was asked for, but only {torch.cuda.device_count()} GPU(s) exist")
    elif device.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ValueError(f"device {name!r} was asked for, but MPS is not available")
    elif device.type != "cpu":
        raise ValueError(f"device {name!r} is not supported (use cpu, cuda or cuda:N)")
    return device


# --- other processes' load -----------------------------------------------------------------------

def _busy_cpu_seconds() -> float | None:
    """CPU seconds all processes have used since boot, from /proc/stat (Linux); None elsewhere.
    Counts steal time too: a hypervisor giving our cores to other guests is load as well."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    t = os.times()  # all our threads, and children we have waited for (pack workers)
    return t.user + t.system + t.children_user + t.children_system


class OtherLoad:
    """How many cores other processes kept busy while a measurement ran.

        with OtherLoad() as load:
            ...measure...
        load.cores, load.warning()

    On 2 cores a second heavy process slows torch's threads 10× or more, so a figure measured
    beside one says more about the neighbour than about the code."""

    def __enter__(self):
        self.start = (time.perf_counter(), _busy_cpu_seconds(), _own_cpu_seconds())
        self.cores: float | None = None
        return self

    def __exit__(self, *exc):
        self.cores = self.so_far()
        return False

    def so_far(self) -> float | None:
        """The cores others kept busy from the start until now (None: not measurable)."""
        wall0, busy0, own0 = self.start
        busy = _busy_cpu_seconds()
        wall = time.perf_counter() - wall0
        if busy is not None and busy0 is not None and wall >= 0.05:  # /proc/stat counts 10 ms ticks
            return max(0.0, (busy - busy0) - (_own_cpu_seconds() - own0)) / wall
        return None

    def summary(self) -> str:
        """One line for a benchmark's output: the warning, or how idle the machine stayed."""
        if self.cores is None:
            return "(other processes' load: not measurable here)"
        return self.warning() or f"(other processes kept {self.cores:.2f} cores busy on average while this ran)"

    @property
    def busy(self) -> bool:
        return is_busy(self.cores)

    def warning(self) -> str:
        """A sentence when others used a quarter of the usable cores or more, else ''."""
        cores = usable_cores()
        if not self.busy:
            return ""
        return (f"other processes kept {self.cores:.1f} of this machine's {cores} cores busy while this ran: the "
                "figures may be low, by a large factor on few cores; measure again on an idle machine")


def is_busy(other_cores: float | None) -> bool:
    """Other processes kept enough cores busy to move a measurement here: a quarter of the
    usable cores or more (half a core on 2: one spinning process slowed torch's two threads
    2.5× on the CIFAR CNN: 790 images/s with 2 threads, 1,990 with 1, 1,880 quiet)."""
    return other_cores is not None and other_cores >= max(0.25 * usable_cores(), 0.3)


def other_cores_now(seconds: float = 0.15, since: OtherLoad | None = None) -> float | None:
    """Cores other processes keep busy, sampled over `seconds` now (while this process waits);
    or over the time since `since` (an OtherLoad entered earlier, while this process did its
    set-up on about one thread, which leaves another core to a neighbour), waiting only for
    what is left of `seconds`. fit's set-up takes 0.1-0.3 s: the sample costs it nothing then."""
    load = since or OtherLoad().__enter__()
    rest = seconds - (time.perf_counter() - load.start[0])
    if rest > 0:
        time.sleep(rest)
    load.__exit__(None, None, None)
    return load.cores


def default_threads() -> int:
    """torch's intra-op threads as this process first had them (what it goes back to when the
    machine is quiet again; a run's timed threads lower them for a while)."""
    import torch

    global _DEFAULT_THREADS
    if _DEFAULT_THREADS is None:
        _DEFAULT_THREADS = torch.get_num_threads()
    return _DEFAULT_THREADS


_DEFAULT_THREADS: int | None = None


# --- measured peaks ---------------------------------------------------------------------------

def cache_dir():
    """trainfast's cache folder: $TRAINFAST_CACHE, else ~/.cache/trainfast (XDG_CACHE_HOME honoured)."""
    from pathlib import Path

    root = os.environ.get("TRAINFAST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "trainfast")
    return Path(root)


def model_key(net) -> str:
    """What a cached measurement of a model depends on: its layers and its parameters' shapes."""
    return repr(net) + repr([(n, tuple(p.shape)) for n, p in net.named_parameters()])


def machine_key(device) -> str:
    """What the measured peaks depend on: the processor or GPU, the torch build, the threads."""
    import torch

    if device.type == "cuda":
        what = torch.cuda.get_device_name(device)
    else:  # the threads this process runs with when quiet, not while a run has lowered them
        what = f"{cpu_model()} x{default_threads()}"
    return f"{device.type}|{what}|torch {torch.__version__}"


def _time(fn, device, min_seconds: float = 0.5) -> float:
    """Seconds of the fastest call of fn(), after a warm-up, over at least min_seconds. A peak
    is what the hardware can do: another tenant of a shared machine only makes calls slower
    (a median measured in a busy moment read 161 GFLOP/s fp32 on a CPU that does 188)."""
    import time

    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_seconds or len(times) < 3:
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_peaks(device) -> dict:
    """Dense matmul FLOP/s per dtype and memory-copy bytes/s of `device`, measured now.

    Returns {"matmul_flops": {"float32": …, "bfloat16": …, "float16": …}, "copy_bytes": …}
    with dtypes the device cannot run fast left out (see fast_precisions).
    """
    import torch

    n = 4096 if device.type == "cuda" else 1536
    fast = fast_precisions(device)
    dtypes = [torch.float32] + [dt for p, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)) if p in fast]
    flops = {}
    for dt in dtypes:
        a = torch.randn(n, n, device=device).to(dt)
        b = torch.randn(n, n, device=device).to(dt)
        flops[str(dt).replace("torch.", "")] = 2 * n ** 3 / _time(lambda: a @ b, device)
    src = torch.empty(64 << 20, dtype=torch.uint8, device=device).fill_(1)  # 64 MiB, beyond the caches
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / _time(lambda: dst.copy_(src), device)  # bytes read + written
    return {"matmul_flops": flops, "copy_bytes": copy}


def read_cache(name: str) -> dict:
    """A JSON cache file under ~/.cache/trainfast ($TRAINFAST_CACHE); {} if absent or unreadable."""
    import json

    try:
        data = json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}  # a file edited into a list or a number: as if absent


def cached_entry(name: str, key: str, parse, what: str, say=None):
    """Entry `key` of the JSON cache file `name`, as `parse` reads it; None where there is none
    or `parse` returns None. An entry `parse` cannot read (edited by hand, left by another
    version: it raises TypeError, ValueError, KeyError, AttributeError or a TrainfastError) is
    ignored, said in one line naming the file, and measured again: a cache is never the reason
    a run fails."""
    from trainfast.errors import TrainfastError, in_words

    entry = read_cache(name).get(key)
    if entry is None:
        return None
    try:
        return parse(entry)
    except (TypeError, ValueError, KeyError, AttributeError, TrainfastError) as e:
        if say is not None:
            say(f"  (ignored the cached {what} in {cache_dir() / name}: {in_words(e)}; measuring again)")
        return None


def is_rate(v) -> bool:
    """A finite number above 0 (not a bool): a cached rate a run may divide by."""
    import math

    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def positive(v, name: str) -> float:
    """`v` where it is_rate; else ValueError naming it."""
    if not is_rate(v):
        raise ValueError(f"{name} is {v!r}, not a positive number")
    return float(v)


def write_cache(name: str, data: dict) -> None:
    """Write a JSON cache file atomically; a read-only home just goes uncached."""
    import json

    path = cache_dir() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


def peaks(device, remeasure: bool = False) -> dict:
    """measure_peaks(device), cached per machine_key in ~/.cache/trainfast/peaks.json with the
    load it was measured under ("other_cores"). A measurement taken while other processes kept
    cores busy is returned ("busy": True) but not cached as the machine's peak (one beside 1.3
    busy cores read 62 GFLOP/s fp32 on a CPU that does 190): a later call measures again, and a
    quiet measurement already cached is kept and used instead of a busy one."""
    cache = read_cache("peaks.json")
    key = machine_key(device) + "|quiet"  # older entries recorded no load: measured again, once
    if not remeasure and _valid_peaks(cache.get(key)):
        return {**cache[key], "cached": True, "busy": False}
    with OtherLoad() as load:
        result = {**measure_peaks(device), "other_cores": None}
    result["other_cores"] = load.cores
    if load.busy and device.type == "cpu":  # a GPU's peaks do not share its cores with other programs
        if _valid_peaks(cache.get(key)):
            return {**cache[key], "cached": True, "busy": False}
        return {**result, "cached": False, "busy": True}
    cache[key] = result
    write_cache("peaks.json", cache)
    return {**result, "cached": False, "busy": False}


def _valid_peaks(entry) -> bool:
    """A cached peaks entry trainfast can divide by: matmul FLOP/s per dtype and copy bytes/s, each
    a positive, finite number (a zero or a string edited in is measured again, never a
    ZeroDivisionError or AttributeError in the doctor)."""
    if not isinstance(entry, dict) or not is_rate(entry.get("copy_bytes")):
        return False
    flops = entry.get("matmul_flops")
    return isinstance(flops, dict) and bool(flops) and all(isinstance(k, str) and is_rate(v) for k, v in flops.items())


def describe(device) -> dict:
    """The system section of the doctor's report: device in use, devices present, CPU, threads."""
    import torch

    info = {
        "device": str(device),
        "cpu": cpu_model(),
        "physical_cores": physical_cores(),
        "usable_cores": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "isa": isa_features(),
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": [],
        "nvidia_gpu_present": _nvidia_present(),
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            cc = (p.major, p.minor)
            tensor_cores = ["float16"] + (["bfloat16"] if cc >= (8, 0) else []) + (["tf32"] if cc >= (8, 0) else []) \
                + (["float8"] if cc >= (8, 9) else [])
            info["gpus"].append({"name": p.name, "compute_capability": f"{cc[0]}.{cc[1]}",
                                 "memory_gb": round(p.total_memory / 1e9, 1),
                                 "tensor_core_dtypes": tensor_cores if cc >= (7, 0) else []})
    return info


def _nvidia_present() -> bool:
    """An NVIDIA GPU in this machine, whether or not this torch build can use it."""
    return os.path.exists("/proc/driver/nvidia/gpus") or os.path.exists("/dev/nvidia0")

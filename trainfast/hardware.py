"""What this machine is: cores, CPU model, speed-relevant ISA features, devices.

NOTE: imports nothing of ours, and torch only inside functions, so that pack workers can
ask how many cores there are without paying for a torch import.
"""

from __future__ import annotations

import os
import platform
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

"""Distributed training is PyTorch's DDP launched by torchrun (DESIGN.md, decision 4).

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; `setup()` reads them, joins the process
group (gloo on CPU, NCCL on CUDA) and picks this process's device: cuda:LOCAL_RANK, one
process per GPU, or the CPU for every process with device "cpu" (even where CUDA exists).
Without torchrun it is a world of one and nothing here does anything.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainfast.errors import TrainfastError


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def setup(device: torch.device) -> World:
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World(device=device)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        here, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", size)), torch.cuda.device_count()
        if here > gpus:  # before any process group: every rank stops at once, none waits for the others
            raise TrainfastError(f"{here} processes on a machine with {gpus} CUDA device{'s' if gpus != 1 else ''}: "
                                 f"use --nproc_per_node {gpus}, or --device cpu")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    _stop_when_orphaned()
    return World(rank, size, local, device)


def _stop_when_orphaned() -> None:
    """When torchrun dies without passing a signal on (SIGKILL of its process group leaves its
    workers, which have their own, training on as orphans), this process sends itself SIGTERM:
    the ranks agree to stop after a step, rank 0 saves, all exit. Looks once a second."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="trainfast-torchrun-watch", daemon=True).start()


def wrap(model: torch.nn.Module, world: World) -> torch.nn.Module:
    if not world.distributed:
        return model
    ids = [world.device.index] if world.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def sum_all(values: list[float], world: World) -> list[float]:
    """Sum a few numbers over all processes (metrics, NaN flags)."""
    if not world.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(t)
    return t.tolist()


def average_all(tensors: list[torch.Tensor], world: World) -> None:
    """Each tensor, in place, the mean of its values over all processes (the batch-norm
    statistics each process measured on its own share of the data)."""
    if not world.distributed:
        return
    for t in tensors:
        dist.all_reduce(t)
        t.div_(world.size)


_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
         "Socket Timeout", "Connection refused")


def peer_lost(e: BaseException) -> str:
    """The reason, when `e` is a collective failing because another process of the run is gone
    (gloo's 'Connection closed by peer', NCCL's abort), else ''."""
    text = str(e)
    found = next((m for m in _LOST if m in text), "")
    if not found and type(e).__name__ != "DistBackendError":
        return ""
    return f"{type(e).__name__}: {found or text.splitlines()[0][:120]}"


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def cleanup(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()

"""Starting worker processes: under torchrun as they are, otherwise spawned here (gloo or NCCL)."""

from __future__ import annotations

import os
import socket
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CPU_DEFAULT_WORKERS = 2


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_nproc() -> int:
    """All local GPUs, or two gloo workers on a CPU-only machine."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return CPU_DEFAULT_WORKERS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(local_rank: int, nproc: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
        WORLD_SIZE=str(nproc), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(nproc),
    )
    _run_and_close(fn, args)


def _run_and_close(fn: Callable, args: tuple) -> None:
    fn(*args)
    if dist.is_initialized():
        # Ranks finish at different times (rank 0 writes files); leaving with live gloo
        # threads aborts the process, so meet once and close the group.
        dist.barrier()
        dist.destroy_process_group()


def launch(fn: Callable, args: tuple = (), nproc: Optional[int] = None) -> None:
    """Run ``fn(*args)`` on every rank: in this process under torchrun or for one rank,
    else in ``nproc`` spawned processes on this machine (the default is ``default_nproc()``)."""
    if under_torchrun():
        _run_and_close(fn, args)
        return
    nproc = nproc or default_nproc()
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise ValueError(f"nproc={nproc} but only {torch.cuda.device_count()} GPUs are visible")
    if nproc == 1:
        _child(0, 1, _free_port(), fn, args)
        return
    mp.start_processes(_child, args=(nproc, _free_port(), fn, args), nprocs=nproc, start_method="spawn")

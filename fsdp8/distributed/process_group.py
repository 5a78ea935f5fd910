"""The default process group and this rank's device: start-up (torchrun or alone; NCCL on GPUs,
gloo on CPUs) and the one place that says which device a rank computes on."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .comm import guard_gloo_exit


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: Optional[str] = None, timeout_s: float = 600.0) -> None:
    """Start the default process group once; later calls start nothing.

    Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); without
    it, starts a group of one process. Uses NCCL with this process's local GPU when CUDA
    is available, gloo otherwise (``backend`` overrides). Every call, also on a group the
    user started (fully_shard and save call this), arms fsdp8's exit guard for gloo groups
    (comm.py [Note: gloo at exit]), on NCCL runs too: checkpoints use a gloo side group."""
    if not dist.is_initialized():
        _start_default_group(backend, timeout_s)
    guard_gloo_exit()


def _start_default_group(backend: Optional[str], timeout_s: float) -> None:
    env = os.environ
    kwargs = {}
    if "RANK" not in env or "WORLD_SIZE" not in env:
        # A group of one on a fresh port (a MASTER_PORT inherited from a parent is in use),
        # without writing torchrun's variables into the environment: code that later asks
        # whether it runs under torchrun (fsdp8 train's launcher) must still be told no.
        kwargs.update(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    use_cuda = torch.cuda.is_available() and backend in (None, "nccl")
    if use_cuda:
        local_rank = int(env.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
                "start at most one process per GPU"
            )
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(
        backend or ("nccl" if use_cuda else "gloo"),
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )


def default_device_type() -> str:
    """``cuda`` when the default group runs NCCL (or torch's "fake" backend, which stands in
    for any, on a machine with a GPU: fsdp8/app/bench/loopback.py), else ``cpu``."""
    backend = str(dist.get_backend()) if dist.is_initialized() else ""
    return "cuda" if "nccl" in backend or ("fake" in backend and torch.cuda.is_available()) else "cpu"


def current_device(device_type: Optional[str] = None) -> torch.device:
    """The device this rank computes on for ``device_type`` (default: the default group's,
    ``default_device_type``): its current GPU for ``cuda``, else that device type's device."""
    device_type = device_type or default_device_type()
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's tensors on ``mesh`` live on (its current GPU for a CUDA mesh)."""
    return current_device(mesh.device_type)

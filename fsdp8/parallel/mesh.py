"""Process-group start-up and device meshes: NCCL on GPUs, gloo on CPUs, torchrun or alone."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: Optional[str] = None, timeout_s: float = 600.0) -> None:
    """Start the default process group once; later calls do nothing.

    Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); without
    it, starts a group of one process. Uses NCCL with this process's local GPU when CUDA
    is available, gloo otherwise (``backend`` overrides)."""
    if dist.is_initialized():
        return
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        # A group of one on a fresh port (a MASTER_PORT inherited from a parent is in use).
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    use_cuda = torch.cuda.is_available() and backend in (None, "nccl")
    kwargs = {}
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
    """``cuda`` when the default group runs NCCL, else ``cpu``."""
    backend = str(dist.get_backend()) if dist.is_initialized() else ""
    return "cuda" if "nccl" in backend else "cpu"


def make_mesh(dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1, tp: int = 1) -> DeviceMesh:
    """The data-parallel mesh: 1-D ``(dp_shard,)`` or 2-D ``(dp_replicate, dp_shard)`` for HSDP.

    ``dp_shard=-1`` takes whatever the world leaves. Context and tensor parallel
    dimensions are not available yet and raise."""
    init_distributed()
    if cp != 1 or tp != 1:
        raise NotImplementedError("context and tensor parallel meshes are not supported yet (cp=1, tp=1)")
    world = dist.get_world_size()
    if dp_replicate < 1:
        raise ValueError(f"dp_replicate must be >= 1, got {dp_replicate}")
    if dp_shard == -1:
        if world % dp_replicate:
            raise ValueError(f"world size {world} is not divisible by dp_replicate={dp_replicate}")
        dp_shard = world // dp_replicate
    if dp_replicate * dp_shard != world:
        raise ValueError(
            f"dp_replicate * dp_shard = {dp_replicate} * {dp_shard} = {dp_replicate * dp_shard}, "
            f"but the world has {world} ranks"
        )
    device_type = default_device_type()
    if dp_replicate == 1:
        return init_device_mesh(device_type, (dp_shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device_type, (dp_replicate, dp_shard), mesh_dim_names=("dp_replicate", "dp_shard"))

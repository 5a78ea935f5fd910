"""Process-group start-up and device meshes: NCCL on GPUs, gloo on CPUs, torchrun or alone."""

from __future__ import annotations

import math
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


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's tensors on ``mesh`` live on (its current GPU for a CUDA mesh)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def init_distributed(backend: Optional[str] = None, timeout_s: float = 600.0) -> None:
    """Start the default process group once; later calls start nothing.

    Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); without
    it, starts a group of one process. Uses NCCL with this process's local GPU when CUDA
    is available, gloo otherwise (``backend`` overrides). Every call, also on a group the
    user started (fully_shard and save call this), arms fsdp8's exit guard for gloo groups
    (comm.py [Note: gloo at exit]), on NCCL runs too: checkpoints use a gloo side group."""
    from ..engine.comm import guard_gloo_exit

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
    for any, on a machine with a GPU: benchmarks/loopback.py), else ``cpu``."""
    backend = str(dist.get_backend()) if dist.is_initialized() else ""
    return "cuda" if "nccl" in backend or ("fake" in backend and torch.cuda.is_available()) else "cpu"


MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


def mesh_dims(world: int, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1, tp: int = 1) -> dict[str, int]:
    """The world mesh's dimensions, outermost first: ``{name: size}`` in ``MESH_DIMS`` order.

    ``dp_shard`` is always there (size 1 too: the engine shards over it); ``dp_replicate``,
    ``cp`` and ``tp`` only when larger than 1, so the cp = tp = 1 meshes are today's 1-D and
    2-D ones. One size may be ``-1``: it takes what the world leaves."""
    sizes = dict(zip(MESH_DIMS, (dp_replicate, dp_shard, cp, tp)))
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(f"{name} must be a positive int or -1 (inferred), got {size!r}")
    spelled = " x ".join(f"{name} {size}" for name, size in sizes.items())
    inferred = [name for name, size in sizes.items() if size == -1]
    if len(inferred) > 1:
        raise ValueError(
            f"only one mesh size may be -1 (inferred), got {spelled}; dp_shard defaults to -1, "
            "so give it a size when another one is -1"
        )
    known = math.prod(size for size in sizes.values() if size != -1)
    if inferred:
        if world % known:
            raise ValueError(
                f"{spelled}: the given sizes multiply to {known}, which does not divide the world of "
                f"{world} ranks, so {inferred[0]} cannot be inferred; choose sizes whose product divides {world}"
            )
        sizes[inferred[0]] = world // known
    elif known != world:
        raise ValueError(f"{spelled} = {known}, but the world has {world} ranks")
    return {name: size for name, size in sizes.items() if name == "dp_shard" or size > 1}


def flattened_dims(dims: dict[str, int]) -> dict[str, tuple[str, ...]]:
    """The flattened views of a world mesh with ``dims``, as torchtitan names them.

    ``dp``: every data-parallel rank (data loading), when there are two dp dims;
    ``dp_shard_cp``: what the engine shards over once context parallelism splits the
    sequence; ``dp_cp``: the ranks a loss is averaged over."""
    views = {}
    if "dp_replicate" in dims:
        views["dp"] = ("dp_replicate", "dp_shard")
    if "cp" in dims:
        views["dp_shard_cp"] = ("dp_shard", "cp")
        views["dp_cp"] = tuple(name for name in ("dp_replicate", "dp_shard", "cp") if name in dims)
    return views


def make_mesh(dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1, tp: int = 1) -> DeviceMesh:
    """The world mesh, ordered ``(dp_replicate, dp_shard, cp, tp)`` with named dimensions.

    TP is innermost, so a TP group is neighbouring ranks (one node); dims of size 1 other
    than ``dp_shard`` are left out, so without cp and tp this is the 1-D ``(dp_shard,)`` or
    the 2-D HSDP ``(dp_replicate, dp_shard)`` mesh. One size may be ``-1`` (by default
    ``dp_shard``): it takes what the world leaves. The flattened views of
    ``flattened_dims`` are created, so ``mesh["dp"]``, ``mesh["dp_shard_cp"]`` and
    ``mesh["tp"]`` work; ``data_parallel_mesh`` and ``tp_mesh`` pick the sub-meshes."""
    init_distributed()
    dims = mesh_dims(dist.get_world_size(), dp_replicate, dp_shard, cp, tp)
    mesh = init_device_mesh(default_device_type(), tuple(dims.values()), mesh_dim_names=tuple(dims))
    for name, parts in flattened_dims(dims).items():
        mesh[parts]._flatten(name)
    return mesh


def _dim_names(mesh: DeviceMesh) -> tuple[str, ...]:
    names = tuple(mesh.mesh_dim_names or ())
    if "dp_shard" not in names:
        raise ValueError(
            f"mesh with dimensions {names or tuple(mesh.shape)} has no 'dp_shard' dimension; "
            "build the world mesh with fsdp8.make_mesh(dp_replicate=, dp_shard=, cp=, tp=)"
        )
    return names


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel sub-mesh of a world mesh from ``make_mesh``: what ``fully_shard`` takes.

    2-D ``(dp_replicate, dp_shard)`` with HSDP, else 1-D ``(dp_shard,)``; with context
    parallelism the shard dim is the flattened ``dp_shard_cp`` (cp ranks hold different
    tokens of the same sequences, so they share parameter shards like dp ranks)."""
    names = _dim_names(mesh)
    if "cp" not in names:
        wanted = tuple(name for name in ("dp_replicate", "dp_shard") if name in names)
        return mesh if names == wanted else mesh[wanted]
    if "dp_replicate" in names:
        return mesh["dp_replicate", "dp_shard_cp"]
    # Flattening again returns the view make_mesh created (torch >= 2.11 deprecates
    # slicing a flattened dim from the root mesh).
    return mesh["dp_shard", "cp"]._flatten("dp_shard_cp")


def tp_mesh(mesh: DeviceMesh) -> Optional[DeviceMesh]:
    """The 1-D tensor-parallel sub-mesh of a world mesh from ``make_mesh``, or None without tp."""
    return mesh["tp"] if "tp" in _dim_names(mesh) else None

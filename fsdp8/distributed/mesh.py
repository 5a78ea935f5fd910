"""The world device mesh ``(dp_replicate, dp_shard, cp, tp)``: its sizes, its flattened views and
the data-parallel and tensor-parallel slices of it."""

from __future__ import annotations

import math
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .process_group import default_device_type, init_distributed

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")

# [Note: one mesh per layout] Each init_device_mesh call splits new process groups off the
# world (on GPUs an NCCL communicator per group: a collective split and its buffers). A process
# that lays out several models (a student and a teacher, an evaluation copy, a test's twenty
# layouts) reuses the mesh of the first, as torchtitan keeps one world mesh. The memo belongs
# to the default process group: once it is destroyed and started again, meshes are built anew.
_meshes: dict[tuple, DeviceMesh] = {}
_meshes_world: Optional[object] = None


def _device_mesh(device_type: str, dims: dict[str, int]) -> tuple[DeviceMesh, bool]:
    """The mesh of ``dims`` (names to sizes, outermost first) on this default process group, and
    whether this call built it."""
    global _meshes_world
    if dist.group.WORLD is not _meshes_world:
        _meshes.clear()
        _meshes_world = dist.group.WORLD
    key = (device_type, tuple(dims.items()))
    built = key not in _meshes
    if built:
        _meshes[key] = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    return _meshes[key], built


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
    mesh, built = _device_mesh(default_device_type(), dims)
    if built:
        for name, parts in flattened_dims(dims).items():
            mesh[parts]._flatten(name)
    return mesh


def make_expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The experts' view of the world mesh: its ``dp_shard`` dim split into ``(efsdp, ep)``.

    Expert parallelism borrows ``ep`` ranks from the data-parallel shard dim, as torchtitan and
    Megatron do: each expert lives on one rank of every ``ep`` group (neighbouring ranks, inside
    one node where the world allows), and is sharded by the engine over the ``efsdp`` ranks
    that remain (``efsdp x cp``, and replicated or sharded over ``dp_replicate`` as the dense
    parameters are). Rank ``(r, s, c, t)`` of the world is rank ``(r, s // ep, s % ep, c, t)``
    here, so the two meshes cover the same ranks in the same order. ``data_parallel_mesh``
    of the result is what the experts are sharded over."""
    names = _dim_names(mesh)
    if "dp_shard" not in names:
        raise ValueError(f"make_expert_mesh takes the world mesh of fsdp8.make_mesh, got dims {names}")
    sizes = dict(zip(names, mesh.shape))
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or sizes["dp_shard"] % ep:
        raise ValueError(
            f"ep={ep!r} must be a positive divisor of dp_shard={sizes['dp_shard']} (expert parallelism borrows its "
            "ranks from the data-parallel shard dim); choose ep among "
            f"{[d for d in range(1, sizes['dp_shard'] + 1) if sizes['dp_shard'] % d == 0]}"
        )
    dims: dict[str, int] = {}
    for name, size in sizes.items():
        if name == "dp_shard":
            dims["efsdp"], dims["ep"] = size // ep, ep
        else:
            dims[name] = size
    expert, built = _device_mesh(mesh.device_type, dims)
    if built and "cp" in dims:
        expert["efsdp", "cp"]._flatten("efsdp_cp")
    return expert


def _shard_dim(names: tuple[str, ...]) -> str:
    return "efsdp" if "efsdp" in names else "dp_shard"


def _dim_names(mesh: DeviceMesh) -> tuple[str, ...]:
    names = tuple(mesh.mesh_dim_names or ())
    if "dp_shard" not in names and "efsdp" not in names:
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
    shard = _shard_dim(names)  # the experts' mesh shards over efsdp (make_expert_mesh)
    if "cp" not in names:
        wanted = tuple(name for name in ("dp_replicate", shard) if name in names)
        return mesh if names == wanted else mesh[wanted]
    if "dp_replicate" in names:
        return mesh["dp_replicate", f"{shard}_cp"]
    # Flattening again returns the view make_mesh created (torch >= 2.11 deprecates
    # slicing a flattened dim from the root mesh).
    return mesh[shard, "cp"]._flatten(f"{shard}_cp")


def token_groups(mesh: DeviceMesh) -> tuple:
    """The process groups of a world mesh's dims whose ranks hold other tokens of the global
    batch (``dp_replicate``, ``dp_shard``, ``cp``; not ``tp``, whose ranks see the same
    sequences), those of more than one rank: summing over each in turn sums over all of them."""
    names = _dim_names(mesh)
    return tuple(mesh[name].get_group() for name in ("dp_replicate", "dp_shard", "cp")
                 if name in names and mesh[name].size() > 1)


def tp_mesh(mesh: DeviceMesh) -> Optional[DeviceMesh]:
    """The 1-D tensor-parallel sub-mesh of a world mesh from ``make_mesh``, or None without tp."""
    return mesh["tp"] if "tp" in _dim_names(mesh) else None

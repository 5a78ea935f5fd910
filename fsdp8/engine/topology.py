"""Which ranks hold which chunk, over which groups weights gather and gradients reduce.

[Note: chunk order under HSDP]
The data-parallel mesh is ``(replicate, shard)`` of sizes ``(R, S)`` (a 1-D mesh is
``R = 1``). Main weights are cut into ``N`` chunks: ``S`` when only the inner dimension
shards, ``R`` when only the outer one does (inner ``no_shard``, outer ``optim``), ``R * S``
when both do, 1 when neither does. Rank ``(r, s)`` holds chunk ``k = r * S' + s'`` with
``S'`` the inner chunk count and ``r``/``s`` counted only along sharded dimensions. This is
the row-major order of the mesh, which is also the rank order of the flattened group, so
a ``Shard(0)`` DTensor over the flattened mesh describes the both-sharded case exactly.

When both dimensions shard and parameters are resharded after use (ZeRO-3 + outer
``optim``), a rank first gathers its ``R`` outer chunks once per optimizer step (across
replicas) and then, per use, gathers ``S`` of those blocks inside its shard group. The
result is ``[S, R, M]``, whose transpose ``[R, S, M]`` is in chunk order; the copy-out
reads it through that transposed view, so no extra pass is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from ..config import OuterStrategy, Strategy
from .dtensor_params import concatenate


@dataclass(frozen=True)
class ChunkPlan:
    """Pure description of chunk ownership for one rank (no process groups)."""

    replicate_size: int
    shard_size: int
    replicate_rank: int
    shard_rank: int
    inner_sharded: bool
    outer_sharded: bool

    @property
    def inner_chunks(self) -> int:
        return self.shard_size if self.inner_sharded else 1

    @property
    def outer_chunks(self) -> int:
        return self.replicate_size if self.outer_sharded else 1

    @property
    def num_chunks(self) -> int:
        return self.inner_chunks * self.outer_chunks

    @property
    def chunk_index(self) -> int:
        r = self.replicate_rank if self.outer_sharded else 0
        s = self.shard_rank if self.inner_sharded else 0
        return r * self.inner_chunks + s


class Topology:
    """Process groups and DTensor placements for one ``fully_shard`` call.

    ``mesh`` is the data-parallel mesh; ``inner_mesh`` the tensor-parallel mesh the model's
    DTensor parameters live on (None without TP), which the engine never gathers over."""

    def __init__(self, mesh: DeviceMesh, strategy: Strategy, outer: OuterStrategy,
                 inner_mesh: Optional[DeviceMesh] = None):
        self.mesh = mesh
        self.strategy = strategy
        self.outer = outer
        self.inner_mesh = inner_mesh
        if mesh.ndim == 1:
            self.replicate_group = None
            self.shard_group = mesh.get_group(0)
            replicate_size, replicate_rank = 1, 0
            shard_size, shard_rank = mesh.size(0), mesh.get_local_rank(0)
            self.dp_mesh = mesh
        else:
            self.replicate_group = mesh.get_group(0)
            self.shard_group = mesh.get_group(1)
            replicate_size, replicate_rank = mesh.size(0), mesh.get_local_rank(0)
            shard_size, shard_rank = mesh.size(1), mesh.get_local_rank(1)
            self.dp_mesh = _flatten(mesh)
        self.dp_group = self.dp_mesh.get_group(0)
        # Every rank holding a piece of the model (data-parallel x tensor-parallel): FP8 scales
        # and delayed amaxes are agreed over it, so a TP run scales as one process would.
        self.model_group = self.dp_group if inner_mesh is None else _model_group(self.dp_mesh, inner_mesh)
        self.plan = ChunkPlan(
            replicate_size=replicate_size,
            shard_size=shard_size,
            replicate_rank=replicate_rank,
            shard_rank=shard_rank,
            inner_sharded=strategy.shards_main,
            outer_sharded=outer is OuterStrategy.OPTIM,
        )

    # -- where the main weights live -------------------------------------------------
    def main_placement(self) -> Tuple[DeviceMesh, tuple]:
        """The mesh and placements of the main-weight DTensors."""
        inner, outer = self.plan.inner_sharded, self.plan.outer_sharded
        if self.mesh.ndim == 1:
            return self.mesh, ((Shard(0),) if inner else (Replicate(),))
        if inner and outer:
            return self.dp_mesh, (Shard(0),)
        if inner:
            return self.mesh, (Replicate(), Shard(0))
        if outer:
            return self.mesh, (Shard(0), Replicate())
        return self.mesh, (Replicate(), Replicate())

    @property
    def main_group(self) -> Optional[dist.ProcessGroup]:
        """The group whose ranks hold distinct main chunks (None: every rank holds all)."""
        inner, outer = self.plan.inner_sharded, self.plan.outer_sharded
        if inner and outer:
            return self.dp_group
        if inner:
            return self.shard_group
        if outer:
            return self.replicate_group
        return None

    # -- how gradients are reduced ---------------------------------------------------
    def grad_reduce_steps(self, sync: bool) -> List[Tuple[str, Optional[dist.ProcessGroup]]]:
        """Collectives, in order, that turn an unsharded gradient into this rank's main chunk.

        Each step is ``("rs" | "ar", group)``; both average over the group. With
        ``sync=False`` (inside ``no_sync``) only the steps that can be deferred without
        keeping unsharded gradients are dropped: the cross-replica all-reduce of
        sharded-gradient strategies. Unsharded-gradient strategies defer everything and
        never call this with ``sync=False``."""
        inner, outer = self.plan.inner_sharded, self.plan.outer_sharded
        if inner and outer:
            return [("rs", self.dp_group)]
        if inner:
            steps = [("rs", self.shard_group)]
            if sync and self.replicate_group is not None:
                steps.append(("ar", self.replicate_group))
            return steps
        if outer:
            return [("ar", self.shard_group), ("rs", self.replicate_group)]
        return [("ar", self.dp_group)]

    @property
    def inner_group(self) -> Optional[dist.ProcessGroup]:
        """The tensor-parallel group (None without TP)."""
        return None if self.inner_mesh is None else self.inner_mesh.get_group(0)

    @property
    def grads_unsharded(self) -> bool:
        """ZeRO-0/1 keep full gradients per rank and reduce them once per synced backward."""
        return self.strategy in (Strategy.NO_SHARD, Strategy.OPTIM)


def _flatten(mesh: DeviceMesh) -> DeviceMesh:
    """A 1-D mesh over all ranks of a 2-D mesh, in row-major (= group rank) order."""
    if mesh.mesh_dim_names:
        # A slice of a larger world mesh (TP beside it): torch flattens it through the root
        # mesh, which every rank calls alike (a mesh of this rank's slice alone would not).
        return mesh._flatten("_".join(mesh.mesh_dim_names))
    ranks = mesh.mesh.flatten().tolist()
    if ranks != sorted(ranks):
        raise ValueError(
            f"the data-parallel mesh {mesh.mesh.tolist()} is not in increasing rank order; "
            "build it with fsdp8.make_mesh or init_device_mesh so that flattening it keeps "
            "the process-group rank order"
        )
    return DeviceMesh(mesh.device_type, mesh.mesh.flatten())


def _model_group(dp_mesh: DeviceMesh, inner_mesh: DeviceMesh) -> dist.ProcessGroup:
    both = concatenate([dp_mesh, inner_mesh])
    return both._flatten("_".join(both.mesh_dim_names)).get_group(0)

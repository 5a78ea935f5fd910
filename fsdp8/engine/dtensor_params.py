"""Parameters that arrive as DTensors on a model-parallel mesh (tensor parallelism).

[Note: model-parallel parameters]
A parameter placed by torch's tensor-parallel styles is a DTensor on the ``tp`` mesh.
The engine treats its local tensor like any plain parameter: sharded on dim 0 over the
data-parallel ranks, gathered over them only. Three things depend on the placement, and
they all live here:

- the module computes with a DTensor of the original placements, wrapping the gathered
  local tensor (``InnerSpec.wrap``);
- the optimizer's main weights are DTensors on the concatenated (data-parallel..., tp)
  mesh with global shapes, placed as torch FSDP2 places them: a data-parallel ``Shard(0)``
  becomes ``_StridedShard(0, split_factor=tp)`` when tp also shards dim 0 (each rank holds
  its dp chunk *of its tp chunk*), so checkpoints reshard across any (dp, tp) change and
  interoperate with FSDP2 + TP (``combined_placement``);
- a full (global) tensor, from an initializer or a state dict, is cut to this rank's tp
  piece before the data-parallel rows are taken (``InnerSpec.local_piece``).

Plain parameters of a model that has tp-placed ones are treated as tp-``Replicate``, so
every main weight lives on the same mesh and a checkpoint stores each of them once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, List, Sequence, Tuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard


def contiguous_stride(shape) -> Tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


@dataclass(frozen=True)
class InnerSpec:
    """Where a parameter lives on the model-parallel mesh: placements and global shape."""

    mesh: DeviceMesh
    placements: Tuple[Placement, ...]
    shape: Tuple[int, ...]
    # False for a plain parameter of a TP model: its module computes with plain tensors.
    computes_as_dtensor: bool = True

    @classmethod
    def of(cls, param: DTensor) -> "InnerSpec":
        return cls(param.device_mesh, tuple(param.placements), tuple(param.shape))

    @classmethod
    def replicated(cls, mesh: DeviceMesh, shape) -> "InnerSpec":
        return cls(mesh, tuple(Replicate() for _ in range(mesh.ndim)), tuple(shape), computes_as_dtensor=False)

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def local_region(self) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """(local shape, global offset) of this rank's piece."""
        shape, offset = compute_local_shape_and_global_offset(self.shape, self.mesh, self.placements)
        return tuple(shape), tuple(offset)

    def local_piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the global tensor ``full`` (a view)."""
        if tuple(full.shape) != self.shape:
            raise ValueError(f"expected a tensor of global shape {self.shape}, got {tuple(full.shape)}")
        shape, offset = self.local_region()
        piece = full
        for dim, (start, size) in enumerate(zip(offset, shape)):
            if size != full.shape[dim]:
                piece = piece.narrow(dim, start, size)
        return piece

    def wrap(self, local: torch.Tensor, requires_grad: bool = False) -> DTensor:
        """``local`` as this rank's piece of a DTensor of the original placements."""
        meta = TensorMeta(torch.Size(self.shape), contiguous_stride(self.shape), local.dtype)
        return DTensor(local, DTensorSpec(self.mesh, self.placements, tensor_meta=meta), requires_grad=requires_grad)

    def describe(self) -> str:
        return f"tp{tuple(self.mesh.shape)} {', '.join(map(str, self.placements))} global {self.shape}"


def inner_meshes_of(params: Iterable[Tuple[str, torch.Tensor]], device_type: str) -> List[DeviceMesh]:
    """The model-parallel meshes the DTensor parameters live on, in order of first use (empty:
    no DTensors). Meshes of different root meshes may mix (the tp slice of the world mesh and
    the ep slice of the experts' mesh: see [Note: meshes of their own] in model.py); two of one
    root may not.

    Raises on what the engine cannot shard: placements other than Shard/Replicate, or two
    meshes of one root."""
    found: List[Tuple[DeviceMesh, str]] = []  # (mesh, first parameter on it)
    for name, p in params:
        if not isinstance(p, DTensor):
            continue
        for placement in p.placements:
            if not isinstance(placement, (Shard, Replicate)) or isinstance(placement, _StridedShard):
                raise ValueError(
                    f"parameter {name!r} is a DTensor placed {tuple(p.placements)}; fsdp8 shards parameters placed "
                    "with Shard(dim) or Replicate() on a tensor-parallel mesh (apply tensor parallelism before "
                    "fully_shard, and fully_shard a model only once)"
                )
        # Equal meshes are one mesh: torch hands DTensors equal mesh objects of other roots.
        mesh = p.device_mesh
        if any(mesh == m for m, _ in found):
            continue
        sibling = next(((m, first) for m, first in found if m._get_root_mesh() == mesh._get_root_mesh()), None)
        if sibling is not None:
            raise ValueError(
                f"parameters {sibling[1]!r} and {name!r} are DTensors on different meshes ({sibling[0]} and {mesh}); "
                "place every tensor-parallel parameter on the same tp mesh (e.g. fsdp8.make_mesh(tp=N)['tp'])"
            )
        if mesh.device_type != device_type:
            raise ValueError(f"the tensor-parallel mesh is on {mesh.device_type!r} but fully_shard runs on "
                             f"{device_type!r}")
        found.append((mesh, name))
    return [mesh for mesh, _ in found]


def concatenate(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dimensions are those of ``meshes`` (slices of one world mesh), in order."""
    concat = getattr(DeviceMesh, "_concatenate", None)
    if concat is not None:
        return concat(list(meshes))
    names = tuple(n for m in meshes for n in (m.mesh_dim_names or ()))
    return meshes[0]._get_root_mesh()[names]


def combined_placement(dp_mesh: DeviceMesh, dp_placements: Sequence[Placement], inner: InnerSpec):
    """The mesh and placements of a main weight sharded by ``dp_placements`` over ``dp_mesh``
    on top of its model-parallel ``inner`` placement (see the note at the top)."""
    split = {}
    for mesh_dim, p in enumerate(inner.placements):
        if isinstance(p, Shard):
            split[p.dim] = split.get(p.dim, 1) * inner.mesh.size(mesh_dim)
    placements = []
    for p in dp_placements:
        if isinstance(p, Shard) and split.get(p.dim, 1) > 1:
            placements.append(_StridedShard(p.dim, split_factor=split[p.dim]))
        else:
            placements.append(p)
    return concatenate([dp_mesh, inner.mesh]), tuple(placements) + tuple(inner.placements)


def to_placements(grad: torch.Tensor, inner: InnerSpec) -> torch.Tensor:
    """A gradient DTensor redistributed to its parameter's placements (local tensor back).

    Partial sums (a tp-replicated weight used on sequence shards) are summed over tp here
    only when they come alone; units batch them (``sum_partials``)."""
    if not isinstance(grad, DTensor):
        return grad
    if tuple(grad.placements) != inner.placements:
        grad = grad.redistribute(inner.mesh, inner.placements)
    return grad._local_tensor


def partial_dims(grad: torch.Tensor) -> Tuple[int, ...]:
    """Mesh dims over which a gradient DTensor holds partial sums."""
    if not isinstance(grad, DTensor):
        return ()
    return tuple(i for i, p in enumerate(grad.placements) if isinstance(p, Partial))


def numel_of(shape) -> int:
    return math.prod(shape)

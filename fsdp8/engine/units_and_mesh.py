"""What fully_shard shards and over which ranks: the units (chosen by class, by a callable
or as the children of every nn.ModuleList), each parameter's unit (the innermost one holding
all its registrations), a description of both that every rank must agree on, and the
data-parallel mesh (given, or the data-parallel part of a world mesh)."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ..config import OuterStrategy
from ..distributed.mesh import data_parallel_mesh
from .dtensor_params import InnerSpec
from .unit import ParamSlot

UnitSpec = Union[None, Sequence[Type[nn.Module]], Callable[[str, nn.Module], bool]]


def find_units(root: nn.Module, units: UnitSpec) -> List[Tuple[str, nn.Module]]:
    if units is None:
        chosen = []
        for name, module in root.named_modules():
            if isinstance(module, nn.ModuleList):
                prefix = f"{name}." if name else ""
                chosen.extend((prefix + child_name, child) for child_name, child in module.named_children())
        return [(n, m) for n, m in chosen if any(True for _ in m.parameters())]
    if callable(units) and not isinstance(units, (list, tuple)) and not isinstance(units, type):
        match = units
    else:
        classes = tuple(units) if isinstance(units, (list, tuple)) else (units,)
        for c in classes:
            if not isinstance(c, type) or not issubclass(c, nn.Module):
                raise TypeError(f"units must be nn.Module classes or a callable(name, module) -> bool, got {c!r}")
        match = lambda name, module: isinstance(module, classes)  # noqa: E731
    chosen = [(n, m) for n, m in root.named_modules() if n and match(n, m)]
    if not chosen:
        raise ValueError(
            f"units={units!r} matches no submodule of {type(root).__name__}; pass the block classes "
            "(e.g. units=[MyBlock]) or a callable(name, module) -> bool that selects some modules"
        )
    return chosen


def collect_slots(root: nn.Module, unit_modules: List[Tuple[str, nn.Module]]):
    """Assign every distinct parameter to the innermost unit containing all its registrations."""
    unit_of_module: Dict[int, str] = {}
    unit_names = {id(m): n for n, m in unit_modules}

    def walk(module: nn.Module, prefix: str, current: str) -> None:
        current = unit_names.get(id(module), current)
        unit_of_module[id(module)] = current
        for child_name, child in module.named_children():
            walk(child, f"{prefix}{child_name}.", current)

    walk(root, "", "")
    registrations: Dict[int, List[Tuple[str, nn.Module, str, str]]] = {}
    params: Dict[int, nn.Parameter] = {}
    for mod_name, module in root.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None:
                continue
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            registrations.setdefault(id(p), []).append((fqn, module, attr, unit_of_module[id(module)]))
            params[id(p)] = p
    per_unit: Dict[str, List[ParamSlot]] = {n: [] for n, _ in [("", root)] + unit_modules}
    originals: Dict[int, nn.Parameter] = {}
    for pid, regs in registrations.items():
        p = params[pid]
        owners = sorted({r[3] for r in regs})
        if len(owners) > 1:
            names = ", ".join(repr(o or "<root>") for o in owners)
            raise ValueError(
                f"parameter {regs[0][0]!r} is shared by units {names}; a parameter must belong to one "
                "unit: put the modules that share it in the same unit (or outside all units), or untie it"
            )
        if p.dim() == 0:
            raise ValueError(f"parameter {regs[0][0]!r} is 0-dimensional; give it shape (1,) so it can be sharded")
        if not p.is_floating_point():
            raise ValueError(f"parameter {regs[0][0]!r} has dtype {p.dtype}; only floating-point parameters can be sharded")
        slot = ParamSlot(fqn=regs[0][0], aliases=[(m, a) for _, m, a, _ in regs], layout=None, requires_grad=p.requires_grad,
                         inner=InnerSpec.of(p) if isinstance(p, DTensor) else None)
        per_unit[owners[0]].append(slot)
        originals[id(slot)] = p
    return per_unit, originals


def describe_slots(per_unit, originals, extra: List[str]) -> List[str]:
    lines = list(extra)
    for unit_name, slots in per_unit.items():
        lines.append(f"unit {unit_name or '<root>'}")
        for s in slots:
            p = originals[id(s)]
            placed = f" {s.inner.describe()}" if s.inner is not None else ""
            lines.append(f"  {s.fqn} {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad}{placed}")
    return lines


def local_shape(slot: ParamSlot, param: torch.Tensor) -> Tuple[int, ...]:
    """The shape the engine lays out: this rank's tensor-parallel piece, or the whole parameter."""
    return slot.inner.local_region()[0] if slot.inner is not None else tuple(param.shape)


MODEL_PARALLEL_DIMS = ("cp", "tp", "ep")


def resolve_mesh(mesh: Optional[DeviceMesh], device_type: str, outer: OuterStrategy,
                  inner: Optional[DeviceMesh]) -> DeviceMesh:
    """The data-parallel mesh to shard over: ``mesh`` itself, or the data-parallel part of a
    world mesh (one with tp/cp dimensions, as fsdp8.make_mesh builds)."""
    world = dist.get_world_size()
    if mesh is None and inner is not None:
        mesh = inner._get_root_mesh()
        if mesh is inner:
            raise ValueError(
                f"the model's tensor-parallel mesh {inner} has no data-parallel dimension beside it; pass "
                "mesh=fsdp8.make_mesh(tp=N) (its dp_shard dimension may have size 1) to fully_shard"
            )
    if mesh is None:
        if outer is OuterStrategy.OPTIM:
            raise ValueError("outer_strategy='optim' needs a 2-D (replicate, shard) mesh; pass mesh=fsdp8.make_mesh(dp_replicate=R)")
        return init_device_mesh(device_type, (world,))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh or None, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if any(n in MODEL_PARALLEL_DIMS for n in names):
        if "tp" in names and mesh["tp"].size() > 1 and inner is None:
            raise ValueError(
                f"the mesh has a tp dimension of size {mesh['tp'].size()} but no parameter of the model is a "
                "tensor-parallel DTensor; apply fsdp8.parallel.tensor_parallel(model, mesh['tp']) before fully_shard, "
                "or build the mesh without tp"
            )
        mesh = data_parallel_mesh(mesh)
    if mesh.ndim not in (1, 2):
        raise ValueError(f"mesh must be 1-D (shard) or 2-D (replicate, shard), got {mesh.ndim}-D {tuple(mesh.shape)}")
    shared = set(mesh.mesh_dim_names or ()) & set(inner.mesh_dim_names or ()) if inner is not None else set()
    if shared:
        raise ValueError(
            f"the data-parallel mesh {mesh} and the tensor-parallel mesh {inner} share dimensions {sorted(shared)}; "
            "pass fully_shard the world mesh from fsdp8.make_mesh(...), or its data-parallel slice"
        )
    inner_size = inner.size() if inner is not None else 1
    if mesh.size() * inner_size != world:
        what = f" x the tensor-parallel mesh's {inner_size}" if inner is not None else ""
        raise ValueError(
            f"the data-parallel mesh {tuple(mesh.shape)} covers {mesh.size()} ranks{what}, but the world has {world}; "
            "the data-parallel mesh (times the tensor-parallel one) must cover every rank: build both with "
            "fsdp8.make_mesh(dp_replicate=..., dp_shard=..., tp=...)"
        )
    if mesh.ndim == 1 and outer is OuterStrategy.OPTIM:
        raise ValueError("outer_strategy='optim' needs a 2-D (replicate, shard) mesh; got a 1-D mesh")
    return mesh

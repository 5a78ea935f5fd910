"""fully_shard(): turn a module into a ShardedModel in place (sharded.py says what that is)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import OuterStrategy, Precision, Strategy
from ..distributed import comm
from ..distributed.check import check_same_everywhere
from ..distributed.process_group import current_device, default_device_type, init_distributed
from ..fp8.convert import convert_units_to_fp8, is_fp8_primary, tp_aware_filter, warn_tp_kept
from ..fp8.grouped_delayed import delayed_experts_on
from ..fp8.linear import Float8Linear
from ..fp8.recipes import Recipe
from .fp8_experts import gathers_fp8_expert
from .fp8_scales import ScaleAgreement, delayed_states_of
from .fp8_unit import Float8Unit
from .grads import check_finite as check_finite_grads
from .dtensor_params import InnerSpec, inner_meshes_of
from .layout import plan_unit
from .materialize import materialize_and_load, meta_leftovers, rng_fingerprint
from .schedule import Schedule
from .sharded import Engine, ShardedModel, sharded_class, track
from .topology import Topology
from .unit import ParamSlot, ShardedUnit
from .units_and_mesh import UnitSpec, collect_slots, describe_slots, find_units, local_shape, resolve_mesh


def fully_shard(
    module: nn.Module,
    mesh: Optional[DeviceMesh] = None,
    units: UnitSpec = None,
    strategy: Union[str, int, Strategy] = "optim_grads_params",
    outer_strategy: Union[str, int, OuterStrategy] = "no_shard",
    precision: Optional[Precision] = None,
    device: Optional[Union[str, torch.device]] = None,
    reshard_after_forward: bool = True,
    fp8: Optional[Recipe] = None,
    fp8_filter: Optional[Callable[[str, nn.Linear], bool]] = None,
    check_finite: bool = False,
    offload: Optional[str] = None,
    expert_mesh: Optional[DeviceMesh] = None,
) -> ShardedModel:
    """Shard ``module`` in place over the data-parallel ranks and return it as a ShardedModel.

    With ``fp8=recipe``, the ``nn.Linear`` layers inside units become Float8Linear (those
    ``fp8_filter`` accepts; by default those with dimensions divisible by 16) and their
    weights are all-gathered as FP8 bytes. ``check_finite=True`` checks every gradient after
    each synced backward and raises NonFiniteGradError naming parameters and ranks (one
    all-gather and a host synchronization per step). ``offload="optim"`` keeps main weights,
    their gradients and so the optimizer state in (pinned) host memory: the optimizer steps
    on the CPU, and the GPU holds only compute copies and activations. ``expert_mesh``: the
    experts' mesh of ``fsdp8.distributed.mesh.make_expert_mesh``, when some parameters are
    DTensors on its ``ep`` dim (``fsdp8.parallel.ep.expert_parallel``): those are sharded over
    its data-parallel dims (see [Note: meshes of their own])."""
    if isinstance(module, ShardedModel):
        raise RuntimeError(f"{type(module).__name__} is already sharded by fsdp8.fully_shard; wrap a model only once")
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    strategy = Strategy.parse(strategy)
    outer = OuterStrategy.parse(outer_strategy)
    if offload not in (None, "optim"):
        raise ValueError(f"offload={offload!r}: use None or 'optim' (main weights, gradients and optimizer "
                         "state in host memory)")
    if offload is not None and (fp8 is not None or any(isinstance(m, Float8Linear) for m in module.modules())):
        raise NotImplementedError("offload='optim' with FP8 layers is not supported yet: FP8 weights are quantized "
                                  "from the main weights on the GPU; train FP8 without offload")
    precision = precision if precision is not None else Precision()
    if not isinstance(precision, Precision):
        raise TypeError(f"precision must be fsdp8.Precision, got {type(precision).__name__}")
    init_distributed()
    device_type = mesh.device_type if isinstance(mesh, DeviceMesh) else default_device_type()
    inner_mesh, own_meshes = _split_meshes(inner_meshes_of(module.named_parameters(), device_type), mesh,
                                           expert_mesh)
    mesh = resolve_mesh(mesh, device_type, outer, inner_mesh)
    device = torch.device(device) if device is not None else current_device(device_type)
    if device.type != device_type:
        raise ValueError(f"device {device} does not match the mesh's device type {device_type!r}")

    unit_modules = find_units(module, units)
    if fp8 is not None:
        if not isinstance(fp8, Recipe):
            raise TypeError(f"fp8 must be an fsdp8 FP8 recipe (e.g. fsdp8.Float8CurrentScaling()), got {fp8!r}")
        tp_kept = []
        if inner_mesh is not None:
            fp8_filter, tp_kept = tp_aware_filter(fp8_filter, fp8)
        convert_units_to_fp8(module, unit_modules, fp8, fp8_filter)
        warn_tp_kept(tp_kept)
    recipe = _model_recipe(module, fp8)
    per_unit, originals = collect_slots(module, unit_modules)
    own_mesh_of = {name: _own_mesh(name, slots, own_meshes) for name, slots in per_unit.items()}
    for name, slots in per_unit.items():
        for s in slots:
            if own_mesh_of[name] is not None:  # the given root's own slice (see the Note)
                s.inner = dataclasses.replace(s.inner, mesh=own_mesh_of[name])
    if inner_mesh is not None:
        for name, slots in per_unit.items():
            for s in slots:
                if s.inner is None and own_mesh_of[name] is None:  # plain beside TP ones: replicated over tp
                    s.inner = InnerSpec.replicated(inner_mesh, originals[id(s)].shape)
    has_meta = any(p.is_meta for p in originals.values())
    header = [
        f"strategy={strategy.label} outer={outer.label} mesh={tuple(mesh.shape)}",
        f"precision={precision} fp8={fp8}",
        f"reshard_after_forward={reshard_after_forward}",
    ]
    if has_meta:
        header.append(f"rng={rng_fingerprint(device)}")
    rng_hint = {
        "rng=": "A meta-device model is initialized by reset_parameters() on every rank: call "
        "torch.manual_seed(<same seed>) on every rank before fully_shard."
    }
    check_same_everywhere(
        describe_slots(per_unit, originals, header), "the sharded model's structure", dist.group.WORLD, device, rng_hint
    )

    topology = Topology(mesh, strategy, outer, inner_mesh)
    own_topologies = [Topology(resolve_mesh(m._get_root_mesh(), device_type, outer, m), strategy, outer, m)
                      for m in own_meshes]
    streams = comm.Streams(device)
    built: Dict[str, ShardedUnit] = {}
    for (name, unit_module) in [("", module)] + unit_modules:
        slots = sorted(per_unit[name], key=lambda s: not s.requires_grad)  # trainable first (stable)
        if not slots:
            continue
        shapes = [local_shape(s, originals[id(s)]) for s in slots]
        own = own_mesh_of[name]
        unit_topology = topology if own is None else next(t for t in own_topologies if t.inner_mesh == own)
        layout = plan_unit(shapes, sum(s.requires_grad for s in slots), unit_topology.plan.num_chunks)
        for s, p in zip(slots, layout.params):
            s.layout = p
        args = (name, unit_module, slots, layout, unit_topology, precision, device, streams)
        fp8_slots = [s for s in slots if _fp8_weight_owner(s) is not None or gathers_fp8_expert(s, recipe)]
        if fp8_slots:
            delayed = {id(s): _fp8_weight_owner(s).delayed_state(device) for s in fp8_slots if recipe.delayed}
            primary = any(is_fp8_primary(originals[id(s)]) or getattr(_fp8_weight_owner(s), "fp8_primary", False)
                          for s in fp8_slots)
            built[name] = Float8Unit(*args, reshard_after_forward=reshard_after_forward and name != "", offload=False,
                                     recipe=recipe, fp8_slots=fp8_slots, delayed=delayed, primary=primary)
        else:
            built[name] = ShardedUnit(*args, reshard_after_forward=reshard_after_forward and name != "",
                                      offload=offload is not None)
    slot_unit = {id(s): u for u in built.values() for s in u.slots}
    # FP8 experts' delayed histories start on the device here, before materialization would give
    # meta ones empty (uninitialized) memory (fsdp8/fp8/grouped_delayed.py).
    experts_states = delayed_experts_on(module, device)
    materialize_and_load(module, built, originals, slot_unit, device)
    for unit in built.values():
        unit.register(compute=False)

    root_unit = built.get("")
    units_list = [built[n] for n, _ in unit_modules if n in built]
    schedule = Schedule(module, root_unit, units_list, precision.param_dtype if precision.casts_inputs else None)
    engine = Engine(topology, precision, units_list, root_unit, schedule, own_topologies)
    fp8_units = [u for u in built.values() if isinstance(u, Float8Unit)]
    if fp8_units or experts_states:
        states = delayed_states_of(fp8_units)
        for m in module.modules():
            if isinstance(m, Float8Linear) and m.delayed_state(device) in states:
                m.external_delayed_update = True  # folded in by the one all-reduce per step
        for experts in experts_states:
            experts.external_update = True  # the same all-reduce: every rank holds every expert's row
            states += experts.states
        engine.scales = ScaleAgreement(fp8_units, states, topology.model_group)
        schedule.before_forward.append(engine.scales.refresh)

    def preflight() -> None:
        leftovers = meta_leftovers(module)
        if leftovers:
            raise RuntimeError(
                f"forward called while {', '.join(leftovers[:5])}{' ...' if len(leftovers) > 5 else ''} "
                "are still on the meta device; give their modules a reset_parameters() that fills them, "
                "or build those buffers on a real device"
            )

    schedule._preflight = preflight
    if offload is not None and device.type == "cuda":
        # Gradients are copied to the host asynchronously; the optimizer (on the CPU) and
        # clip_grad_norm_ read them right after backward: wait for the copies once per step.
        schedule.after_backward.insert(0, torch.cuda.current_stream(device).synchronize)
    if check_finite:
        schedule.after_backward.append(lambda: check_finite_grads(module) if schedule.sync_grads else None)
    schedule.install()
    module.__class__ = sharded_class(type(module))
    module._fsdp8 = engine
    track(engine)
    return module


def _model_recipe(module: nn.Module, fp8: Optional[Recipe]) -> Optional[Recipe]:
    """The one FP8 recipe of the model's Float8Linears and FP8 experts (converted here, by the user,
    or by fp8_init)."""
    recipes = {m.recipe for m in module.modules() if isinstance(m, Float8Linear)}
    recipes |= {m.fp8_recipe for m in module.modules() if getattr(m, "fp8_recipe", None) is not None}
    if len(recipes) > 1:
        raise ValueError(f"the model's Float8Linear layers and FP8 experts use {len(recipes)} different recipes "
                         f"({recipes}); fsdp8 shards a model with one FP8 recipe")
    return next(iter(recipes), None)


def _fp8_weight_owner(slot: ParamSlot) -> Optional[Float8Linear]:
    """The Float8Linear whose 2-D weight this slot is, if any."""
    for module, attr in slot.aliases:
        if isinstance(module, Float8Linear) and attr == "weight" and len(slot.layout.shape) == 2:
            return module
    return None


# [Note: meshes of their own]
# Parameters may be DTensors on a slice of another root mesh than the world mesh the model
# is sharded over: a mixture-of-experts model's experts are split over the ``ep`` dim of the
# experts' mesh (fsdp8.distributed.mesh.make_expert_mesh), which cuts the world's data-parallel
# ranks differently. That mesh gets a Topology of its own: its parameters are sharded over
# the data-parallel dims of the experts' mesh, and only the world mesh's model-parallel slice
# is the usual one (tp, with plain parameters replicated over it). A unit holds parameters of
# one topology, so such parameters form units of their own. The caller names the experts'
# mesh (``expert_mesh=``): a parameter's own mesh cannot say which root it came from, since
# torch shares equal meshes between DTensors (the ``ep`` slices of two experts' meshes of
# different layouts are equal), so the engine takes the given root's slice equal to it.
def _split_meshes(meshes, mesh: Optional[DeviceMesh], expert_mesh: Optional[DeviceMesh]):
    """(the model-parallel mesh of the world's root, the slices of ``expert_mesh`` that
    parameters live on)."""
    own = []
    if expert_mesh is not None:
        names = set(expert_mesh.mesh_dim_names or ())
        for m in meshes:
            dims = tuple(m.mesh_dim_names or ())
            if dims and set(dims) <= names and "ep" in dims and expert_mesh[dims] == m:
                own.append(expert_mesh[dims])
    world = [m for m in meshes if not any(m == o for o in own)]
    if len(world) > 1:
        raise ValueError(
            f"parameters are DTensors on different meshes ({world[0]} and {world[1]}); place every tensor-parallel "
            "parameter on the same tp mesh (e.g. fsdp8.make_mesh(tp=N)['tp'])"
        )
    return (world[0] if world else None), own


def _own_mesh(unit_name: str, slots, own_meshes) -> Optional[DeviceMesh]:
    """The mesh of another root that the unit's parameters live on (None: the world's)."""
    if not own_meshes:
        return None
    own = [m for m in own_meshes if any(s.inner is not None and s.inner.mesh == m for s in slots)]
    if not own:
        return None
    first = next(s.fqn for s in slots if s.inner is not None and s.inner.mesh == own[0])
    others = [s.fqn for s in slots if s.inner is None or s.inner.mesh != own[0]]
    if others:
        raise ValueError(
            f"unit {unit_name or '<root>'!r} holds {first!r} (a DTensor on {own[0]}) beside {others[0]!r}, which is "
            "placed otherwise; a unit's parameters must share one mesh: make the module that holds the first its "
            "own unit (units=...)"
        )
    return own[0]

"""Memory per rank: the engine's persistent buffers exactly (as memory_report() counts them), the
rest of a step's peak by formula (activations, buffers in flight, gradient transients).

[Note: exact and estimated memory]
Persistent bytes come from the same layout code fully_shard runs (``engine.layout.plan_unit``,
the FP8 wire layout of ``engine/fp8_unit.py`` with ``chunk_align=16``, the chunk counts of
``engine.topology.ChunkPlan``), so they equal ``memory_report()`` byte for byte
(tests/dist/test_plan_memory.py). Everything else is a model of what is alive at the moments a
step's memory can peak (end of forward, the loss's backward, the first and last unit's
backward, the end of backward), written out in docs/PLANNING.md.

[Note: the units of a mixture of experts]
A mixture-of-experts layer is one unit with its experts while ep = 1. Under expert parallelism
(fsdp8.parallelize with ep > 1) its experts module is a unit of its own inside it: each ep rank
holds E/ep experts (``gate_up_proj`` [E/ep, 2I, H], ``down_proj`` [E/ep, H, I]), which the engine
shards over the experts' mesh, ``efsdp = dp_shard / ep`` (x cp, and dp_replicate as the outer
strategy says), while the layer's other weights and the dense ones are sharded over
``dp_shard`` (x cp) as before. A ``LayerGroup`` is a kind of layer with its units; the peak
takes each per-layer transient from the larger kind when a model mixes dense and MoE layers.
Beside tensor parallelism (ep x tp) the layer's attention is split over tp as a dense layer's,
its norms, router and experts are not (``Param.tp`` is None for them): every tp rank holds the
same E/ep experts, sharded over efsdp (x cp) as above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Tuple, Union

from ..config import OuterStrategy, Strategy
from ..engine.layout import UnitLayout, plan_unit
from ..engine.sharded import MemoryReport
from ..engine.topology import ChunkPlan
from ..fp8.formats import mx_scale_count
from .activations import Activations
from .model import ModelSpec, Param, converts_to_fp8, ep_shape, gathers_fp8_experts, local_shape
from .setup import Setup

MAIN_BYTES = 4  # fp32 main weights, gradients and AdamW moments
REDUCE_BYTES = 4  # gradients are reduced in fp32 (fsdp8 train's precisions)
ADAMW_STATES = 2
DELAYED_HISTORY = 1024  # DelayedScaling.amax_history_len: 3 rows of fp32 per FP8 linear


@dataclass(frozen=True)
class UnitPlan:
    """One unit's buffers on one rank, as fully_shard builds them; ``count`` identical units."""

    name: str
    count: int
    layout: UnitLayout  # main weights and gradients (elements)
    wire: UnitLayout  # what gathers carry and modules compute with (elements of wire_bytes)
    wire_bytes: int
    local_numel: int  # this rank's elements of the unsharded (tensor-parallel local) parameters
    main_local: int  # elements of this rank's main chunk without padding (what AdamW keeps)
    fp8_numel: int  # elements of FP8 weights
    fp8_linears: int
    scale_bytes: int  # the unit's persistent FP8 scale buffers
    aliased: bool  # ShardedUnit.aliased: one chunk, no dtype change, no offload: computes on the main buffer
    gathered_scale_bytes: int = 0  # MX scale_inv under ZeRO-3: allocated and freed with the unsharded parameters
    experts: bool = False  # an experts module under ep > 1: sharded over the experts' mesh

    @property
    def unsharded_bytes(self) -> int:
        return self.wire.unsharded_numel * self.wire_bytes

    @property
    def chunks(self) -> int:
        return self.layout.num_chunks


def chunk_plan(setup: Setup, experts: bool = False) -> ChunkPlan:
    """How the engine chunks a unit: over dp_shard x cp, or an experts unit's over efsdp x cp
    (fsdp8.distributed.mesh.make_expert_mesh), and dp_replicate with outer ``optim``."""
    p = setup.parallel
    shard = p.dp_shard // p.ep if experts else p.dp_shard
    return ChunkPlan(replicate_size=p.dp_replicate, shard_size=shard * p.cp, replicate_rank=0, shard_rank=0,
                     inner_sharded=p.strategy.shards_main, outer_sharded=p.outer_strategy is OuterStrategy.OPTIM)


def _scale_bytes(shapes: List[Tuple[int, ...]], recipe: str) -> int:
    """Float8Unit._allocate_scales: scale and scale_inv per FP8 weight (MX: scale_inv only), or
    per expert of an experts weight [E, N, K], each weight's padded to 4 floats."""
    def count(shape: Tuple[int, ...]) -> int:
        *experts, rows, cols = shape
        if recipe == "block":
            return math.prod(experts) * math.ceil(rows / 128) * math.ceil(cols / 128)
        if recipe == "mxfp8":
            return mx_scale_count(shape)
        return math.prod(experts)

    floats = sum(4 * math.ceil(count(s) / 4) for s in shapes)
    buffers = 1 if recipe == "mxfp8" else 2
    return buffers * 4 * floats + (3 * 4 * DELAYED_HISTORY * len(shapes) if recipe == "delayed" else 0)


def _unit(name: str, count: int, params: List[Param], setup: Setup, tp_rank: int, in_unit: bool,
          experts: bool = False) -> UnitPlan:
    chunks = chunk_plan(setup, experts).num_chunks
    shapes = [ep_shape(p, local_shape(p, setup.parallel.tp, tp_rank), setup.parallel.ep) for p in params]
    layout = plan_unit(shapes, len(shapes), chunks)
    experts_fp8 = gathers_fp8_experts([p for p in params if p.expert], setup.fp8)
    fp8 = [in_unit and (experts_fp8 if p.expert else converts_to_fp8(p, setup.fp8, setup.parallel.tp, tp_rank))
           for p in params]
    e = setup.compute_bytes
    if any(fp8):
        # Float8Unit._plan_wire: compute-dtype entries, then FP8 bytes, then MX's e8m0 scales.
        rows = [(s[0], math.prod(s[1:]) * e) for s, f in zip(shapes, fp8) if not f]
        rows += [(s[0], math.prod(s[1:])) for s, f in zip(shapes, fp8) if f]
        if setup.fp8 == "mxfp8":  # per layout row (an expert: its N rows), a byte per 32 columns
            rows += [(s[0], mx_scale_count(s[1:])) for s, f in zip(shapes, fp8) if f]
        wire, wire_bytes = plan_unit(rows, len(rows), chunks, chunk_align=16), 1
    else:
        wire, wire_bytes = layout, e
    fp8_shapes = [s for s, f in zip(shapes, fp8) if f]
    scales = _scale_bytes(fp8_shapes, setup.fp8) if fp8_shapes else 0
    if setup.fp8 == "delayed" and in_unit:  # an amax history per expert, all E on every rank (fp8/grouped_delayed.py)
        scales += sum(3 * 4 * DELAYED_HISTORY * p.shape[0] for p in params
                      if p.expert and all(d % 16 == 0 for d in p.shape[1:]))
    # Float8Unit._free_unsharded: MX's scale_inv is made at each gather and freed at reshard.
    gathered = scales if setup.fp8 == "mxfp8" and setup.parallel.strategy.shards_params else 0
    return UnitPlan(name, count, layout, wire, wire_bytes, sum(math.prod(s) for s in shapes),
                    sum(math.prod(p.chunk_shape(0)) for p in layout.params), sum(math.prod(s) for s in fp8_shapes),
                    len(fp8_shapes), scales - gathered,
                    aliased=chunks == 1 and wire_bytes == MAIN_BYTES and setup.parallel.offload is None,
                    gathered_scale_bytes=gathered, experts=experts)


def unit_plans(spec: ModelSpec, setup: Setup, tp_rank: int = 0) -> List[UnitPlan]:
    """The root unit (embedding, final norm, head), then the decoder layers, one plan per kind
    (``ModelSpec.layer_kinds``): ``layer`` for dense ones, ``moe layer`` for mixtures of experts,
    followed under ep > 1 by their ``experts`` units (see [Note: the units of a mixture of experts])."""
    units = [_unit("root", 1, spec.root_params(), setup, tp_rank, in_unit=False)]
    own_experts = setup.parallel.ep > 1
    for kind, count in spec.layer_kinds():
        if kind == "dense":
            units.append(_unit("layer", count, spec.block_params(), setup, tp_rank, in_unit=True))
            continue
        params = spec.moe_block_params() + ([] if own_experts else spec.expert_params())
        units.append(_unit("moe layer", count, params, setup, tp_rank, in_unit=True))
        if own_experts:
            units.append(_unit("experts", count, spec.expert_params(), setup, tp_rank, in_unit=True, experts=True))
    return units


@dataclass(frozen=True)
class LayerGroup:
    """Decoder layers of one kind (``"dense"`` or ``"moe"``): ``count`` of them, each gathering and
    reducing ``units`` (its own, then under ep > 1 its experts')."""

    kind: str
    count: int
    units: Tuple[UnitPlan, ...]


def layer_groups(units: List[UnitPlan]) -> List[LayerGroup]:
    """``unit_plans``' layers (all but the root) as LayerGroups, in its order."""
    groups: List[LayerGroup] = []
    for u in units[1:]:
        if u.experts:
            last = groups[-1]
            groups[-1] = LayerGroup(last.kind, last.count, last.units + (u,))
        else:
            groups.append(LayerGroup("dense" if u.name == "layer" else "moe", u.count, (u,)))
    return groups


def _persistent_compute(unit: UnitPlan, setup: Setup) -> int:
    """ShardedUnit.persistent_compute_bytes."""
    if unit.aliased:
        return 0
    if not setup.parallel.strategy.shards_params:
        return unit.unsharded_bytes
    if setup.parallel.outer_strategy is OuterStrategy.OPTIM:
        return setup.parallel.dp_replicate * unit.wire.chunk_numel * unit.wire_bytes
    return 0


def memory_report(spec: ModelSpec, setup: Setup, tp_rank: int = 0) -> MemoryReport:
    """What ``model.memory_report()`` returns on a rank of tensor-parallel rank ``tp_rank``
    (data-parallel ranks all hold chunks of one size)."""
    units = unit_plans(spec, setup, tp_rank)
    grads_unsharded = setup.parallel.strategy in (Strategy.NO_SHARD, Strategy.OPTIM)
    largest = 0
    if setup.parallel.strategy.shards_params:
        largest = max((u.unsharded_bytes for u in units if not u.aliased), default=0)
    return MemoryReport(
        strategy=setup.parallel.strategy.label,
        main_weights=sum(u.count * u.layout.chunk_numel * MAIN_BYTES for u in units),
        grads=sum(u.count * u.layout.trainable_numel * MAIN_BYTES for u in units),
        compute_copies=sum(u.count * _persistent_compute(u, setup) for u in units),
        grad_accumulation=sum(u.count * u.chunks * u.layout.trainable_numel * REDUCE_BYTES for u in units)
        if grads_unsharded else 0,
        largest_unsharded_unit=largest,
        offloaded=setup.parallel.offload is not None,
    )


# -- the peak ------------------------------------------------------------------------------
@dataclass
class Peak:
    """Device bytes alive at one moment of the step, by kind."""

    moment: str
    parts: Dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def peaks(spec: ModelSpec, setup: Setup, report: MemoryReport, units: List[UnitPlan],
          acts: Union[Activations, Mapping[str, Activations]]) -> List[Peak]:
    """The moments of a steady-state step at which memory can peak: optimizer state exists,
    gradients were freed by zero_grad(set_to_none=True) before the step's first forward (and
    ZeRO-2/3 carry them between micro-batches), ZeRO-3 gathers as schedule.py does (the root
    and the last layer kept through forward into backward, one layer prefetched). ``acts``: each
    kind of layer's activations (``activations.layer_activations``), or one for all."""
    root, groups = units[0], layer_groups(units)
    kinds = {g.kind: g for g in groups}
    acts = acts if isinstance(acts, Mapping) else {g.kind: acts for g in groups}
    # The layers whose place the moments name: the last (kept into backward), the one before it
    # (prefetched in backward), the first and the second (their gradients meet in the reduction).
    n = spec.layers
    last, before_last = kinds[spec.layer_kind(n - 1)], kinds[spec.layer_kind(max(n - 2, 0))]
    first, second = kinds[spec.layer_kind(0)], kinds[spec.layer_kind(min(1, n - 1))]
    device = not report.offloaded
    t = setup.micro_batch * setup.seq_len / setup.parallel.cp  # tokens of this rank's micro-batch
    e = setup.compute_bytes
    base = {
        "main weights": report.main_weights * device,
        "optimizer state": optimizer_bytes(units) * device,
        "compute copies": report.compute_copies,
        "gradient accumulation": report.grad_accumulation,
        "FP8 scales": sum(u.count * u.scale_bytes for u in units),
    }
    grads = report.grads * device
    carried = grads if setup.accumulation > 1 and setup.parallel.strategy >= Strategy.OPTIM_GRADS else 0
    zero3 = setup.parallel.strategy.shards_params

    def gathered(u: UnitPlan) -> int:  # its unsharded buffer (and MX scales) while gathered
        return u.unsharded_bytes + u.gathered_scale_bytes if zero3 and not u.aliased else 0

    def layer_grads(g: LayerGroup) -> int:  # one layer's gradient shards
        return sum(u.layout.trainable_numel for u in g.units) * MAIN_BYTES * device

    def in_flight(g: LayerGroup) -> int:
        return sum(gathered(u) for u in g.units)

    def prefetch(g: LayerGroup) -> int:
        # A unit prefetched: its unsharded buffer (and scales) and the gathered one; one at a time.
        return max(gathered(u) + (u.unsharded_bytes if u.chunks > 1 and gathered(u) else 0) for u in g.units)

    # Unsharded gradients from autograd (compute dtype), and their rank-major pack in the reduce
    # dtype (ZeRO-0/1 pack into their accumulator; one rank with nothing to add packs in place).
    def unsharded_grads(g: LayerGroup) -> int:
        return sum(u.local_numel for u in g.units) * e

    def pack(u: UnitPlan) -> int:
        in_place = report.grad_accumulation or (u.chunks == 1 and setup.parallel.dp_replicate == 1
                                                and setup.accumulation == 1)
        return 0 if in_place else u.chunks * REDUCE_BYTES * u.layout.trainable_numel

    def transpose(g: LayerGroup) -> int:  # FP8 weights' transposes: made in backward, freed at reshard
        return sum(u.fp8_numel for u in g.units)

    u_root, g_root = gathered(root), root.local_numel * e
    # During the layers' backward the root holds the head's and the final norm's gradients;
    # an untied embedding's arrives last, when backward reaches the model's input.
    embed = next(p for p in spec.root_params() if p.name == "embed")
    embedding = 0 if spec.tied else math.prod(local_shape(embed, setup.parallel.tp, 0))
    g_head = g_root - embedding * e
    saved = {g.kind: acts[g.kind].saved * t for g in groups}
    all_saved = sum(g.count * saved[g.kind] for g in groups)
    but_last = sum((g.count - (g is last)) * saved[g.kind] for g in groups)
    all_grads = sum(g.count * layer_grads(g) for g in groups)

    def live(g: LayerGroup) -> float:
        return (acts[g.kind].layer_live + acts[g.kind].backward_work) * t

    def moment(name: str, gradients: float, transients: float, buffers: float, activations: float) -> Peak:
        parts = dict(base, **{"gradient shards": gradients, "gradient transients": transients,
                              "unit buffers in flight": buffers, "activations": activations})
        return Peak(name, {k: float(v) for k, v in parts.items()})

    a_root = acts[last.kind]
    return [
        # Some layer computing while the next is prefetched (the largest such pair).
        moment("forward, last layer", carried, 0, u_root + max(in_flight(g) + prefetch(g) for g in groups),
               all_saved),
        moment("end of forward (loss)", carried, 0, u_root + in_flight(last),
               all_saved + (a_root.root + a_root.loss_forward) * t),
        moment("loss backward", carried, 0, u_root + in_flight(last),
               all_saved + (a_root.root + a_root.loss_backward) * t),
        moment("backward of the last layer", carried, g_head + unsharded_grads(last),
               u_root + in_flight(last) + prefetch(before_last) + transpose(last), but_last + live(last)),
        # A unit's reduction frees its unsharded parameters (and FP8 transposes) first, then
        # lands its gradients (a new shard) from their pack; the previous unit's unsharded
        # gradients stay until this reduction is issued (one reduction in flight).
        moment("backward of the first layer", max(carried, all_grads - layer_grads(first)),
               g_head + unsharded_grads(first) + unsharded_grads(second),
               u_root + in_flight(first) + transpose(first), live(first)),
        moment("reduction of the first layer", max(carried, all_grads),
               g_head + unsharded_grads(first) + unsharded_grads(second) + sum(pack(u) for u in first.units),
               u_root, 0),
        moment("backward of the root", max(carried, all_grads), g_root + unsharded_grads(first), u_root, 0),
        moment("end of backward", grads, g_root + unsharded_grads(first) + pack(root), 0, 0),
    ]


def optimizer_bytes(units: List[UnitPlan]) -> int:
    """AdamW's two fp32 moments per element of this rank's main chunk (padding excluded)."""
    return sum(u.count * u.main_local for u in units) * ADAMW_STATES * MAIN_BYTES

"""Memory per rank: the engine's persistent buffers exactly (as memory_report() counts them), the
rest of a step's peak by formula (activations, buffers in flight, gradient transients).

[Note: exact and estimated memory]
Persistent bytes come from the same layout code fully_shard runs (``engine.layout.plan_unit``,
the FP8 wire layout of ``engine/fp8_unit.py`` with ``chunk_align=16``, the chunk counts of
``engine.topology.ChunkPlan``), so they equal ``memory_report()`` byte for byte
(tests/dist/test_plan_memory.py). Everything else is a model of what is alive at the moments a
step's memory can peak (end of forward, the loss's backward, the first and last unit's
backward, the end of backward), written out in docs/PLANNING.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from ..config import OuterStrategy, Strategy
from ..engine.layout import UnitLayout, plan_unit
from ..engine.sharded import MemoryReport
from ..engine.topology import ChunkPlan
from .model import ModelSpec, Param, converts_to_fp8, local_shape
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

    @property
    def unsharded_bytes(self) -> int:
        return self.wire.unsharded_numel * self.wire_bytes


def chunk_plan(setup: Setup) -> ChunkPlan:
    p = setup.parallel
    return ChunkPlan(replicate_size=p.dp_replicate, shard_size=p.dp_shard * p.cp, replicate_rank=0, shard_rank=0,
                     inner_sharded=p.strategy.shards_main, outer_sharded=p.outer_strategy is OuterStrategy.OPTIM)


def _scale_bytes(shapes: List[Tuple[int, int]], recipe: str) -> int:
    """Float8Unit._allocate_scales: scale and scale_inv per FP8 weight (MX: scale_inv only), each
    padded to 4 floats."""
    def count(rows: int, cols: int) -> int:
        if recipe == "block":
            return math.ceil(rows / 128) * math.ceil(cols / 128)
        if recipe == "mxfp8":
            return rows * math.ceil(cols / 32)
        return 1

    floats = sum(4 * math.ceil(count(r, c) / 4) for r, c in shapes)
    buffers = 1 if recipe == "mxfp8" else 2
    return buffers * 4 * floats + (3 * 4 * DELAYED_HISTORY * len(shapes) if recipe == "delayed" else 0)


def _unit(name: str, count: int, params: List[Param], setup: Setup, tp_rank: int, in_unit: bool) -> UnitPlan:
    chunks = chunk_plan(setup).num_chunks
    shapes = [local_shape(p, setup.parallel.tp, tp_rank) for p in params]
    layout = plan_unit(shapes, len(shapes), chunks)
    fp8 = [in_unit and converts_to_fp8(p, setup.fp8, setup.parallel.tp, tp_rank) for p in params]
    e = setup.compute_bytes
    if any(fp8):
        # Float8Unit._plan_wire: compute-dtype entries, then FP8 bytes, then MX's e8m0 scales.
        rows = [(s[0], math.prod(s[1:]) * e) for s, f in zip(shapes, fp8) if not f]
        rows += [(s[0], math.prod(s[1:])) for s, f in zip(shapes, fp8) if f]
        if setup.fp8 == "mxfp8":
            rows += [(s[0], math.ceil(s[1] / 32)) for s, f in zip(shapes, fp8) if f]
        wire, wire_bytes = plan_unit(rows, len(rows), chunks, chunk_align=16), 1
    else:
        wire, wire_bytes = layout, e
    fp8_shapes = [s for s, f in zip(shapes, fp8) if f]
    scales = _scale_bytes(fp8_shapes, setup.fp8) if fp8_shapes else 0
    # Float8Unit._free_unsharded: MX's scale_inv is made at each gather and freed at reshard.
    gathered = scales if setup.fp8 == "mxfp8" and setup.parallel.strategy.shards_params else 0
    return UnitPlan(name, count, layout, wire, wire_bytes, sum(math.prod(s) for s in shapes),
                    sum(math.prod(p.chunk_shape(0)) for p in layout.params), sum(math.prod(s) for s in fp8_shapes),
                    len(fp8_shapes), scales - gathered,
                    aliased=chunks == 1 and wire_bytes == MAIN_BYTES and setup.parallel.offload is None,
                    gathered_scale_bytes=gathered)


def unit_plans(spec: ModelSpec, setup: Setup, tp_rank: int = 0) -> List[UnitPlan]:
    """The root unit (embedding, final norm, head) and the decoder layers (one plan, ``layers`` units)."""
    return [_unit("root", 1, spec.root_params(), setup, tp_rank, in_unit=False),
            _unit("layer", spec.layers, spec.block_params(), setup, tp_rank, in_unit=True)]


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
    chunks = chunk_plan(setup).num_chunks
    grads_unsharded = setup.parallel.strategy in (Strategy.NO_SHARD, Strategy.OPTIM)
    largest = 0
    if setup.parallel.strategy.shards_params:
        largest = max((u.unsharded_bytes for u in units if not u.aliased), default=0)
    return MemoryReport(
        strategy=setup.parallel.strategy.label,
        main_weights=sum(u.count * u.layout.chunk_numel * MAIN_BYTES for u in units),
        grads=sum(u.count * u.layout.trainable_numel * MAIN_BYTES for u in units),
        compute_copies=sum(u.count * _persistent_compute(u, setup) for u in units),
        grad_accumulation=sum(u.count * chunks * u.layout.trainable_numel * REDUCE_BYTES for u in units)
        if grads_unsharded else 0,
        largest_unsharded_unit=largest,
        offloaded=setup.parallel.offload is not None,
    )


def expands_kv(spec: ModelSpec) -> bool:
    """Whether the attention repeats K and V to every query head before SDPA."""
    return spec.family == "fsdp8" and spec.kv_heads != spec.heads


# -- activations -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Activations:
    """Bytes per token (of the rank's micro-batch) of one layer, and of the root."""

    saved: float  # kept from forward to backward under the AC mode
    layer_live: float  # one layer's full set, as during its backward (recomputed under AC)
    backward_work: float  # gradients of activations alive inside one layer's backward
    root: float  # final norm and head input, log-softmax output
    loss_forward: float  # beyond ``root`` at the cross-entropy of forward
    loss_backward: float  # beyond ``root`` at the cross-entropy's backward


def activations(spec: ModelSpec, setup: Setup, fp8: Dict[str, bool]) -> Activations:
    """Per-token activation bytes of the Llama block under ``setup`` (docs/PLANNING.md derives
    each term from the tensors autograd saves). ``fp8``: which linears are Float8Linear."""
    e, tp = setup.compute_bytes, setup.parallel.tp
    d, q, kv, f, v = spec.hidden, spec.q_dim / tp, spec.kv_dim / tp, spec.ffn / tp, spec.vocab
    dn = d / tp if setup.parallel.sequence_parallel else d  # the residual stream as norms see it
    # RMSNorm: fsdp8's keeps x in fp32 and the normalized fp32 product; transformers' keeps x in
    # fp32 and the normalized value in the compute dtype; both a fp32 rsqrt per token.
    norm = (8 * dn if spec.family == "fsdp8" else (4 + e) * dn) + 4

    def inputs(*names: str, width: float) -> float:
        # A linear saves its input: in the compute dtype, or as FP8 bytes (shared by its siblings).
        kinds = {fp8.get(n, False) for n in names}
        return (e * width if False in kinds else 0) + (width if True in kinds else 0)

    # SDPA keeps its inputs: under GQA fsdp8's Llama passes repeat_interleave copies, transformers
    # (no attention mask) the kv heads themselves with enable_gqa. Under context parallelism they
    # are the whole sequence's keys and values, gathered from the cp ranks.
    k_saved = e * (q if expands_kv(spec) else kv) * setup.parallel.cp
    attention = e * q + 2 * k_saved + e * q + 4 * spec.heads / tp  # q, k, v, output, logsumexp
    wo_input = q if fp8.get("wo") else 0  # the output is kept for SDPA already; FP8 adds its bytes
    qk_norm = ((4 + e) * (q + kv) + 8) if spec.qk_norm else 0
    ffn = 3 * e * f + (f if fp8.get("w2") else e * f)  # w1 and w3 outputs, silu, the product
    none = 2 * norm + inputs("wq", "wk", "wv", width=d) + attention + wo_input + qk_norm \
        + inputs("w1", "w3", width=d) + ffn
    x_in = e * dn  # the block input, which checkpointing keeps
    if setup.parallel.activation_checkpointing == "full":
        saved = x_in
    elif setup.parallel.activation_checkpointing == "selective":
        # Every second matmul's output (wq, wv, w1, w2), SDPA's outputs, reduce-scatter outputs;
        # and FP8 linears' quantized inputs, which the policy does not drop (measured on H200:
        # model A, fp8-current, kept 1.7 GiB more than bf16, these bytes).
        saved = x_in + e * (q + kv + f + d) + e * q + 4 * spec.heads / tp
        saved += (d if fp8.get("wq") else 0) + (q if fp8.get("wo") else 0) + (d if fp8.get("w1") else 0) \
            + (f if fp8.get("w2") else 0)
        if setup.parallel.sequence_parallel:
            saved += 2 * e * dn
    else:
        saved = none
    # Inside a layer's backward: SwiGLU's three F-wide gradients, or attention's dq/dk/dv with
    # FA2's fp32 dq accumulator, or the norms' fp32 temporaries; plus the residual's gradient.
    work = max(3 * e * f, (4 + 3 * e) * q, 12 * dn) + 2 * e * d
    # Final norm, head input, log-softmax output (fp32; every vocabulary entry, or this rank's
    # share of them under loss parallelism).
    v_local = v / tp if setup.parallel.loss_parallel else v
    root = norm + e * d + 4 * v_local
    return Activations(saved, none, work, root, loss_forward=(e + 4) * v_local, loss_backward=8 * v_local)


# -- the peak ------------------------------------------------------------------------------
@dataclass
class Peak:
    """Device bytes alive at one moment of the step, by kind."""

    moment: str
    parts: Dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def peaks(spec: ModelSpec, setup: Setup, report: MemoryReport, units: List[UnitPlan], acts: Activations) -> List[Peak]:
    """The moments of a steady-state step at which memory can peak: optimizer state exists,
    gradients were freed by zero_grad(set_to_none=True) before the step's first forward (and
    ZeRO-2/3 carry them between micro-batches), ZeRO-3 gathers as schedule.py does (the root
    and the last layer kept through forward into backward, one layer prefetched)."""
    root, layer = units
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
    layer_grads = layer.layout.trainable_numel * MAIN_BYTES * device
    chunks = chunk_plan(setup).num_chunks
    zero3 = setup.parallel.strategy.shards_params
    u_root = root.unsharded_bytes + root.gathered_scale_bytes if zero3 and not root.aliased else 0
    u_layer = layer.unsharded_bytes + layer.gathered_scale_bytes if zero3 and not layer.aliased else 0
    # Its unsharded buffer (and scales) and the gathered one.
    prefetch = u_layer + (layer.unsharded_bytes if chunks > 1 and u_layer else 0)
    # Unsharded gradients from autograd (compute dtype), and their rank-major pack in the reduce
    # dtype (ZeRO-0/1 pack into their accumulator; one rank with nothing to add packs in place).
    g_layer, g_root = layer.local_numel * e, root.local_numel * e
    # During the layers' backward the root holds the head's and the final norm's gradients;
    # an untied embedding's arrives last, when backward reaches the model's input.
    embed = next(p for p in spec.root_params() if p.name == "embed")
    embedding = 0 if spec.tied else math.prod(local_shape(embed, setup.parallel.tp, 0))
    g_head = g_root - embedding * e
    in_place = report.grad_accumulation or (chunks == 1 and setup.parallel.dp_replicate == 1
                                            and setup.accumulation == 1)
    pack = 0 if in_place else chunks * REDUCE_BYTES
    transpose = layer.fp8_numel  # FP8 weights' transposes: made in backward, freed at reshard
    n, saved = spec.layers, acts.saved * t
    live = (acts.layer_live + acts.backward_work) * t

    def moment(name: str, gradients: float, transients: float, buffers: float, activations: float) -> Peak:
        parts = dict(base, **{"gradient shards": gradients, "gradient transients": transients,
                              "unit buffers in flight": buffers, "activations": activations})
        return Peak(name, {k: float(v) for k, v in parts.items()})

    return [
        moment("forward, last layer", carried, 0, u_root + u_layer + prefetch, n * saved),
        moment("end of forward (loss)", carried, 0, u_root + u_layer, n * saved + (acts.root + acts.loss_forward) * t),
        moment("loss backward", carried, 0, u_root + u_layer, n * saved + (acts.root + acts.loss_backward) * t),
        moment("backward of the last layer", carried, g_head + g_layer, u_root + u_layer + prefetch + transpose,
               (n - 1) * saved + live),
        # A unit's reduction frees its unsharded parameters (and FP8 transposes) first, then
        # lands its gradients (a new shard) from their pack; the previous unit's unsharded
        # gradients stay until this reduction is issued (one reduction in flight).
        moment("backward of the first layer", max(carried, (n - 1) * layer_grads), g_head + 2 * g_layer,
               u_root + u_layer + transpose, live),
        moment("reduction of the first layer", max(carried, n * layer_grads),
               g_head + 2 * g_layer + pack * layer.layout.trainable_numel, u_root, 0),
        moment("backward of the root", max(carried, n * layer_grads), g_root + g_layer, u_root, 0),
        moment("end of backward", grads, g_root + g_layer + pack * root.layout.trainable_numel, 0, 0),
    ]


def optimizer_bytes(units: List[UnitPlan]) -> int:
    """AdamW's two fp32 moments per element of this rank's main chunk (padding excluded)."""
    return sum(u.count * u.main_local for u in units) * ADAMW_STATES * MAIN_BYTES

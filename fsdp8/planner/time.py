"""Step time: compute at a roofline of the GPU, each collective at the bandwidth of the link its group
spans, and what of the communication the engine's overlap schedule leaves exposed.

[Note: the overlap model]
Ranks are laid out row-major over ``(dp_replicate, dp_shard, cp, tp)`` and nodes hold
consecutive ranks, so a group's link follows from its size and stride (tp innermost: NVLink
while it fits in a node). Data-parallel collectives run on the engine's side streams: in
forward, unit i+1's all-gather runs during unit i's compute; in backward, unit i-1's gather and
unit i+1's reduce-scatter (and HSDP all-reduce) run during unit i's compute; two collectives on
one link share it, collectives on different links run side by side, and one stream's
collectives run one after another. What a unit's compute cannot hide is exposed, and so are
the root's gather at the start of each forward (and the first unit's, which only the
embedding could hide) and the last reductions at the end of backward, which the optimizer
waits for. Tensor- and context-parallel collectives run on the compute stream: all exposed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Tuple

from ..config import OuterStrategy, Strategy
from .hardware import HostCost, host_model
from .memory import MAIN_BYTES, REDUCE_BYTES, UnitPlan, chunk_plan, expands_kv
from .model import ModelSpec, converts_to_fp8, local_shape
from .setup import Setup

ADAMW_BYTES = 28  # fused AdamW per fp32 element: reads weight, gradient and 2 moments, writes 3


@dataclass(frozen=True)
class Group:
    """A process group as the planner sees it: its size, the link it spans, and how its
    ranks spread over nodes (``per_node`` of them in each of ``nodes``)."""

    name: str
    size: int
    nodes: int
    per_node: int

    @property
    def link(self) -> str:
        return "local" if self.size == 1 else ("NVLink" if self.nodes == 1 else "network")


def group(name: str, size: int, stride: int, gpus_per_node: int) -> Group:
    """The group of ``size`` ranks ``stride`` apart, starting at rank 0."""
    nodes = len({(i * stride) // gpus_per_node for i in range(size)})
    return Group(name, size, nodes, size // nodes)


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a step: ``calls`` of ``nbytes`` each (the gathered output, the
    reduce-scatter input, the all-reduced tensor), ``seconds`` for all of them."""

    what: str
    op: str  # all_gather | reduce_scatter | all_reduce | copy (host <-> device)
    group: Group
    calls: int
    nbytes: float
    seconds: float
    overlapped: bool  # on a side stream (may hide behind compute) or on the compute stream


def collective_seconds(op: str, nbytes: float, g: Group, setup: Setup) -> float:
    """One collective: latency plus bytes over the slowest of its links. Inside a node a ring
    moves (n-1)/n of the buffer through each GPU's NVLink; across nodes each node moves
    (k-1)/k of it through its NICs (one per member GPU), which can run side by side."""
    if g.size == 1:
        return 0.0
    gpu, eff = setup.cluster.gpu, setup.efficiency
    factor = 2 if op == "all_reduce" else 1
    seconds = factor * (g.size - 1) / g.size * nbytes / (gpu.nvlink_gbps * 1e9 * eff.link) if g.per_node > 1 else 0.0
    if g.nodes > 1:
        network = factor * (g.nodes - 1) / g.nodes * nbytes / (g.per_node * gpu.network_gbps * 1e9 * eff.link)
        seconds = max(seconds, network)
    return eff.latency_us * 1e-6 + seconds


@dataclass(frozen=True)
class Groups:
    tp: Group
    cp: Group
    shard: Group  # dp_shard x cp: what the engine shards over
    replicate: Group
    dp: Group  # replicate x shard, flattened


def groups(setup: Setup) -> Groups:
    p, gpn = setup.parallel, setup.cluster.gpus_per_node
    tp, cp, s, r = p.tp, p.cp, p.dp_shard, p.dp_replicate
    return Groups(tp=group("tp", tp, 1, gpn), cp=group("cp", cp, tp, gpn), shard=group("dp_shard", s * cp, tp, gpn),
                  replicate=group("dp_replicate", r, s * cp * tp, gpn), dp=group("dp", r * s * cp, tp, gpn))


# -- compute ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Compute:
    """Seconds of one micro-batch's compute on one rank (recomputation included, collectives
    not): a layer's forward and backward, the root's (embedding, final norm, head, loss); and
    the FLOPs executed."""

    layer_fwd: float
    layer_bwd: float
    root_fwd: float
    root_bwd: float
    flops: float
    host: HostCost  # the host's time to issue each pass


def _elementwise_bytes(spec: ModelSpec, setup: Setup) -> float:
    """Bytes one layer's forward moves through HBM per token outside GEMMs and attention (eager
    ops: norms in fp32, rotary, the repeat of K and V, residual adds, SwiGLU); backward moves
    twice that."""
    e, tp = setup.compute_bytes, setup.parallel.tp
    d = spec.hidden / tp if setup.parallel.sequence_parallel else spec.hidden
    q, kv, f = spec.q_dim / tp, spec.kv_dim / tp, spec.ffn / tp
    gqa = 2 * e * (kv + q) if expands_kv(spec) else 0
    return 2 * (32 + 2 * e) * d + 9 * e * (q + kv) + gqa + 6 * e * d + 5 * e * f


# Matmuls whose outputs selective checkpointing recomputes: every second one of the block
# (wq, wk, wv, wo, w1, w3, w2 in order; parallel/checkpointing.py keeps the odd ones).
_SELECTIVE_RECOMPUTED = ("wk", "wo", "w3")


def compute(spec: ModelSpec, setup: Setup) -> Compute:
    gpu, eff = setup.cluster.gpu, setup.efficiency
    e, tp, ac = setup.compute_bytes, setup.parallel.tp, setup.parallel.activation_checkpointing
    t = setup.micro_batch * setup.seq_len / setup.parallel.cp  # tokens of this rank's micro-batch
    hbm = gpu.hbm_gbps * 1e9 * eff.hbm
    dense = (gpu.bf16_tflops if e == 2 else gpu.fp32_tflops) * 1e12 * eff.gemm
    fp8_rate = gpu.fp8_tflops * 1e12 * eff.fp8_gemm
    gemm, recompute_gemm, quant, mm_flops, recompute_flops, fp8_linears = 0.0, 0.0, 0.0, 0.0, 0.0, 0
    for p in spec.block_params():
        if not p.linear:
            continue
        out, inp = local_shape(p, tp, 0)
        flops = 2 * t * out * inp
        fp8 = converts_to_fp8(p, setup.fp8, tp, 0)
        seconds = flops / (fp8_rate if fp8 else dense)
        gemm += seconds
        mm_flops += flops
        if ac == "full" or (ac == "selective" and p.name in _SELECTIVE_RECOMPUTED):
            recompute_gemm += seconds
            recompute_flops += flops
        if fp8:  # quantize x and dy, and transpose both for the weight gradient
            quant += (e + 3) * (out + inp) * t / hbm
            fp8_linears += 1
    # Causal attention: QK^T and PV over half the score matrix; backward recomputes the
    # scores (5 matmuls to forward's 2).
    attn_flops = 2 * setup.micro_batch * setup.seq_len ** 2 * spec.q_dim / (setup.parallel.cp * tp)
    attn = attn_flops / ((gpu.bf16_tflops if e == 2 else gpu.fp32_tflops) * 1e12 * eff.attention)
    elementwise = _elementwise_bytes(spec, setup) * t / hbm
    recompute = recompute_gemm + (elementwise if ac != "none" else 0.0) + (attn if ac == "full" else 0.0)
    layer_fwd = gemm + attn + elementwise + quant / 3
    layer_bwd = 2 * gemm + 2.5 * attn + 2 * elementwise + 2 * quant / 3 + recompute

    v_local = -(-spec.vocab // tp)
    head = 2 * t * spec.hidden * v_local / dense
    # Logits to fp32, log-softmax and its backward (on this rank's vocabulary under loss parallelism).
    loss = (32 + 2 * e) * (v_local if setup.parallel.loss_parallel else spec.vocab) * t / hbm
    norm = (32 + 2 * e) * spec.hidden * t / hbm
    flops = spec.layers * (3 * mm_flops + recompute_flops + 3.5 * attn_flops + (attn_flops if ac == "full" else 0)) \
        + 3 * 2 * t * spec.hidden * v_local
    return Compute(layer_fwd, layer_bwd, root_fwd=head + loss / 3 + norm, root_bwd=2 * head + 2 * loss / 3 + 2 * norm,
                   flops=flops, host=eff.host or host_model(eff, ac, fp8_linears))


# -- communication and the step ----------------------------------------------------------------
PCIE = Group("host", 2, 1, 1)  # a host <-> device copy: its own link (PCIe), see _seconds


@dataclass(frozen=True)
class Transfer:
    """One collective (or offload copy) a unit issues, and the stream it runs on."""

    what: str
    op: str
    group: Group
    nbytes: float
    stream: str  # "gather" | "reduce" | "compute"
    calls: int = 1

    def times(self, calls: int) -> "Transfer":
        return replace(self, calls=self.calls * calls)


def _seconds(x: Transfer, setup: Setup) -> float:
    """All ``x.calls`` of it."""
    if x.op == "copy":
        return x.calls * x.nbytes / (setup.cluster.gpu.pcie_gbps * 1e9 * setup.efficiency.link)
    return x.calls * collective_seconds(x.op, x.nbytes, x.group, setup)


def _busy(transfers: List[Transfer], setup: Setup) -> float:
    """Time ``transfers`` take when issued together: each stream runs its own in order, and
    collectives on one link share it."""
    streams: Dict[str, float] = {}
    links: Dict[str, float] = {}
    for x in transfers:
        seconds = _seconds(x, setup)
        streams[x.stream] = streams.get(x.stream, 0.0) + seconds
        link = "PCIe" if x.op == "copy" else x.group.link
        links[link] = links.get(link, 0.0) + seconds
    return max(list(streams.values()) + list(links.values()), default=0.0)


def _gathers(u: UnitPlan, setup: Setup, g: Groups, refresh_outer: bool) -> List[Transfer]:
    """ShardedUnit.gather: what one gather of ``u`` moves (nothing when one chunk holds it all)."""
    chunks = chunk_plan(setup).num_chunks
    if chunks == 1 or u.aliased:
        return []
    out, p = [], setup.parallel
    outer = p.outer_strategy is OuterStrategy.OPTIM
    if p.strategy.shards_params and outer:
        if refresh_outer:  # the R outer chunks, once per optimizer step
            out.append(Transfer("all-gather params across replicas", "all_gather", g.replicate,
                                p.dp_replicate * u.wire.chunk_numel * u.wire_bytes, "gather"))
        out.append(Transfer("all-gather params", "all_gather", g.shard, u.unsharded_bytes, "gather"))
    else:
        main = g.dp if p.strategy.shards_main and outer else g.shard if p.strategy.shards_main else g.replicate
        out.append(Transfer("all-gather params", "all_gather", main, u.unsharded_bytes, "gather"))
    if p.offload:
        out.append(Transfer("copy main chunk to GPU", "copy", PCIE, u.layout.chunk_numel * MAIN_BYTES, "gather"))
    return out


def _reductions(u: UnitPlan, setup: Setup, g: Groups, sync: bool) -> List[Transfer]:
    """Topology.grad_reduce_steps for one unit's gradients (ZeRO-0/1 reduce only when ``sync``)."""
    if setup.parallel.strategy in (Strategy.NO_SHARD, Strategy.OPTIM) and not sync:
        return []
    n = chunk_plan(setup).num_chunks
    packed, shard = n * u.layout.trainable_numel * REDUCE_BYTES, u.layout.trainable_numel * REDUCE_BYTES
    inner, outer = setup.parallel.strategy.shards_main, setup.parallel.outer_strategy is OuterStrategy.OPTIM
    if inner and outer:
        steps = [("reduce-scatter grads", "reduce_scatter", g.dp, packed)]
    elif inner:
        steps = [("reduce-scatter grads", "reduce_scatter", g.shard, packed)]
        if sync:
            steps.append(("all-reduce grads across replicas", "all_reduce", g.replicate, shard))
    elif outer:
        steps = [("all-reduce grads in shard group", "all_reduce", g.shard, packed),
                 ("reduce-scatter grads across replicas", "reduce_scatter", g.replicate, packed)]
    else:
        steps = [("all-reduce grads", "all_reduce", g.dp, packed)]
    out = [Transfer(what, op, grp, nbytes, "reduce") for what, op, grp, nbytes in steps if grp.size > 1]
    if setup.parallel.offload:
        out.append(Transfer("copy grads to host", "copy", PCIE, shard, "reduce"))
    return out


def _model_parallel(spec: ModelSpec, setup: Setup, g: Groups) -> List[Transfer]:
    """Tensor- and context-parallel collectives of one micro-batch (torch's TP styles and CP's
    K/V gathers; recomputation repeats those checkpointing does not keep)."""
    p = setup.parallel
    e, t, ac, layers = setup.compute_bytes, setup.micro_batch * setup.seq_len / p.cp, p.activation_checkpointing, \
        spec.layers
    out: List[Transfer] = []
    if g.tp.size > 1:
        act = t * spec.hidden * e
        tensorwise = setup.fp8 in ("current", "delayed")
        x_in = t * spec.hidden * (1 if tensorwise and converts_to_fp8(spec.block_params()[1], setup.fp8, p.tp, 0)
                                  else e)
        if p.sequence_parallel:
            # Per layer: gather the norm outputs for attention and FFN, reduce-scatter their outputs;
            # backward the reverse. Selective keeps the reduce-scatter outputs.
            gathers = 2 * layers * (2 + (ac != "none"))
            scatters = 2 * layers * (2 + (ac == "full"))
            out += [Transfer("TP all-gather activations", "all_gather", g.tp, x_in, "compute", gathers),
                    Transfer("TP reduce-scatter activations", "reduce_scatter", g.tp, act, "compute", scatters)]
            # The embedding's output and the head's input gradient are reduce-scattered, the
            # head's input gathered.
            out += [Transfer("TP reduce-scatter embedding/head", "reduce_scatter", g.tp, act, "compute", 2),
                    Transfer("TP all-gather head input", "all_gather", g.tp, act, "compute")]
        else:
            calls = 2 * layers * (2 + (ac != "none"))
            out.append(Transfer("TP all-reduce activations", "all_reduce", g.tp, act, "compute", calls + 2))
        if not p.loss_parallel:  # replicated logits are gathered; loss parallelism keeps them sharded
            logits = t * -(-spec.vocab // p.tp) * p.tp * e
            out.append(Transfer("TP all-gather logits", "all_gather", g.tp, logits, "compute"))
    if g.cp.size > 1:
        kv = 2 * t * p.cp * spec.kv_dim / p.tp * e  # K and V of the whole sequence
        out += [Transfer("CP all-gather K/V", "all_gather", g.cp, kv, "compute", layers * (1 + (ac != "none"))),
                Transfer("CP reduce-scatter dK/dV", "reduce_scatter", g.cp, kv, "compute", layers)]
    return out


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on one rank, by kind, and the collectives behind them."""

    compute: float  # every micro-batch's compute and the engine's copies (casts, packs), on the GPU
    compute_fwd: float  # the forward passes' share of it
    host: float  # the host issuing it all
    host_fwd: float  # and the forward passes' share
    model_parallel: float  # TP and CP collectives, on the compute stream
    exposed: float  # data-parallel communication the overlap schedule leaves exposed
    optimizer: float
    flops: float  # executed per step (recomputation included)
    collectives: Tuple[Collective, ...]

    @property
    def issue_bound(self) -> float:
        """Forward, then backward: each pass waits for the slower of the GPU and the host
        issuing its kernels (a host ahead in forward cannot lend that time to backward, which
        starts when the loss does)."""
        return max(self.compute_fwd, self.host_fwd) + max(self.compute - self.compute_fwd, self.host - self.host_fwd)

    @property
    def step(self) -> float:
        return self.issue_bound + self.model_parallel + self.exposed + self.optimizer


def step_time(spec: ModelSpec, setup: Setup, units: List[UnitPlan]) -> StepTime:
    """The step under [Note: the overlap model]."""
    g = groups(setup)
    root, layer = units
    c = compute(spec, setup)
    gpu, eff, e = setup.cluster.gpu, setup.efficiency, setup.compute_bytes
    hbm = gpu.hbm_gbps * 1e9 * eff.hbm
    chunks = chunk_plan(setup).num_chunks
    zero3 = setup.parallel.strategy.shards_params
    issued: List[Transfer] = []
    compute_s = compute_fwd = exposed = 0.0

    def gather_copies(u: UnitPlan) -> float:  # cast into the send buffer, copy out of the gathered one
        return (u.layout.chunk_numel * MAIN_BYTES + u.wire.chunk_numel * u.wire_bytes
                + (2 * u.unsharded_bytes if chunks > 1 else 0)) / hbm

    def reduce_copies(u: UnitPlan) -> float:  # pack the unsharded gradients in the reduce dtype
        return (u.local_numel * e + chunks * u.layout.trainable_numel * REDUCE_BYTES) / hbm

    for mb in range(setup.accumulation):
        first, last = mb == 0, mb == setup.accumulation - 1
        gathering = not root.aliased and (zero3 or (first and chunks > 1))
        fwd_root = _gathers(root, setup, g, first) if gathering else []
        fwd_layer = _gathers(layer, setup, g, first) if gathering else []
        bwd_layer = _gathers(layer, setup, g, False) if zero3 else []
        red_layer, red_root = _reductions(layer, setup, g, last), _reductions(root, setup, g, last)
        n = spec.layers
        issued += fwd_root + [x.times(n) for x in fwd_layer] + [x.times(n - 1) for x in bwd_layer] \
            + [x.times(n) for x in red_layer] + red_root
        # Forward: the root's and the first layer's gathers wait; each later gather hides
        # behind the layer before it.
        exposed += _busy(fwd_root, setup) + _busy(fwd_layer, setup)
        exposed += (n - 1) * max(0.0, _busy(fwd_layer, setup) - c.layer_fwd)
        # Backward: the last layer is kept; layer i's compute hides i-1's gather and i+1's
        # reductions; the first layer's and the root's reductions end the backward exposed.
        if n > 1:
            exposed += max(0.0, _busy(bwd_layer, setup) - c.layer_bwd)
            exposed += (n - 2) * max(0.0, _busy(bwd_layer + red_layer, setup) - c.layer_bwd)
            exposed += max(0.0, _busy(red_layer, setup) - c.layer_bwd)
        exposed += _busy(red_layer, setup) + _busy(red_root, setup)
        forward = n * c.layer_fwd + c.root_fwd + gathering * (gather_copies(root) + n * gather_copies(layer))
        compute_fwd += forward
        compute_s += forward + n * c.layer_bwd + c.root_bwd + gathering * (n - 1) * zero3 * gather_copies(layer) \
            + n * reduce_copies(layer) + reduce_copies(root)

    mp = [x.times(setup.accumulation) for x in _model_parallel(spec, setup, g)]
    issued += mp
    main_elems = sum(u.count * u.main_local for u in units)
    host = gpu.host_gbps * 1e9
    optimizer = main_elems * ADAMW_BYTES / (host if setup.parallel.offload else hbm) + main_elems * MAIN_BYTES / hbm
    # Once per step: the FP8 scales' max all-reduce and clip_grad_norm_'s, over every rank.
    world = Group("world", setup.cluster.world, setup.cluster.nodes, setup.cluster.world // setup.cluster.nodes)
    step_level = [Transfer("all-reduce grad norm", "all_reduce", world, 4, "compute")]
    if setup.fp8:
        amaxes = sum(u.count * u.fp8_linears for u in units) * (3 if setup.fp8 == "delayed" else 1)
        step_level.append(Transfer("all-reduce FP8 amaxes", "all_reduce", world, 4 * amaxes, "compute"))
    issued += step_level
    exposed += sum(_seconds(x, setup) for x in step_level)
    h, acc = c.host, setup.accumulation
    host_fwd = acc * (spec.layers * h.layer_fwd + h.root_fwd)
    host = host_fwd + acc * (spec.layers * h.layer_bwd + h.root_bwd)
    return StepTime(compute_s, compute_fwd, host, host_fwd, sum(_seconds(x, setup) for x in mp), exposed, optimizer,
                    c.flops * acc, tuple(_summarize(issued, setup)))


def _summarize(issued: List[Transfer], setup: Setup) -> List[Collective]:
    """One row per kind of collective (what, op, group, size), its calls added up."""
    rows: Dict[Tuple[str, str, str, float], Transfer] = {}
    for x in issued:
        key = (x.what, x.op, x.group.name, x.nbytes)
        rows[key] = replace(rows[key], calls=rows[key].calls + x.calls) if key in rows else x
    return [Collective(x.what, x.op, x.group, x.calls, x.nbytes, _seconds(x, setup), x.stream != "compute")
            for x in rows.values()]

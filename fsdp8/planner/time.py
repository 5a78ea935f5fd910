"""Step time: compute at a roofline of the GPU (compute.py), each collective at the bandwidth of the link
its group spans, and what of the communication the engine's overlap schedule leaves exposed.

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

A model of dense and mixture-of-experts layers counts, for each layer, its own kind's compute
against its neighbours' collectives. Under expert parallelism a layer gathers and reduces two
units (its own over dp_shard x cp, its experts' over efsdp x cp, one after the other on each
stream), and its dispatch and combine all-to-alls run on the compute stream (exposed), each
forward (recomputation too) reading the split sizes on the host (one synchronisation, a stated
fixed cost: ``Efficiency.host_sync_us``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Dict, List, Tuple

from ..config import OuterStrategy, Strategy
from .activations import routed_share
from .compute import compute
from .links import Collective, Group, Groups, collective_seconds, groups
from .memory import MAIN_BYTES, REDUCE_BYTES, LayerGroup, UnitPlan, layer_groups
from .model import ModelSpec, converts_to_fp8, traces_fp8
from .setup import Setup

ADAMW_BYTES = 28  # fused AdamW per fp32 element: reads weight, gradient and 2 moments, writes 3


def _sharded_over(u: UnitPlan, g: Groups) -> Tuple[Group, Group]:
    """The groups a unit is sharded over: (shard x cp, flattened data-parallel), the experts' own
    under ep > 1."""
    return (g.expert_shard, g.expert_dp) if u.experts else (g.shard, g.dp)


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
    if u.chunks == 1 or u.aliased:
        return []
    out, p = [], setup.parallel
    outer = p.outer_strategy is OuterStrategy.OPTIM
    shard, dp = _sharded_over(u, g)
    params = "experts" if u.experts else "params"
    if p.strategy.shards_params and outer:
        if refresh_outer:  # the R outer chunks, once per optimizer step
            out.append(Transfer(f"all-gather {params} across replicas", "all_gather", g.replicate,
                                p.dp_replicate * u.wire.chunk_numel * u.wire_bytes, "gather"))
        out.append(Transfer(f"all-gather {params}", "all_gather", shard, u.unsharded_bytes, "gather"))
    else:
        main = dp if p.strategy.shards_main and outer else shard if p.strategy.shards_main else g.replicate
        out.append(Transfer(f"all-gather {params}", "all_gather", main, u.unsharded_bytes, "gather"))
    if p.offload:
        out.append(Transfer("copy main chunk to GPU", "copy", PCIE, u.layout.chunk_numel * MAIN_BYTES, "gather"))
    return out


def _reductions(u: UnitPlan, setup: Setup, g: Groups, sync: bool) -> List[Transfer]:
    """Topology.grad_reduce_steps for one unit's gradients (ZeRO-0/1 reduce only when ``sync``)."""
    if setup.parallel.strategy in (Strategy.NO_SHARD, Strategy.OPTIM) and not sync:
        return []
    n = u.chunks
    packed, shard = n * u.layout.trainable_numel * REDUCE_BYTES, u.layout.trainable_numel * REDUCE_BYTES
    inner, outer = setup.parallel.strategy.shards_main, setup.parallel.outer_strategy is OuterStrategy.OPTIM
    shard_group, dp = _sharded_over(u, g)
    grads = "expert grads" if u.experts else "grads"
    if inner and outer:
        steps = [(f"reduce-scatter {grads}", "reduce_scatter", dp, packed)]
    elif inner:
        steps = [(f"reduce-scatter {grads}", "reduce_scatter", shard_group, packed)]
        if sync:
            steps.append((f"all-reduce {grads} across replicas", "all_reduce", g.replicate, shard))
    elif outer:
        steps = [(f"all-reduce {grads} in shard group", "all_reduce", shard_group, packed),
                 (f"reduce-scatter {grads} across replicas", "reduce_scatter", g.replicate, packed)]
    else:
        steps = [(f"all-reduce {grads}", "all_reduce", dp, packed)]
    out = [Transfer(what, op, grp, nbytes, "reduce") for what, op, grp, nbytes in steps if grp.size > 1]
    if setup.parallel.offload:
        out.append(Transfer("copy grads to host", "copy", PCIE, shard, "reduce"))
    return out


def _gathers_fp8_bytes(setup: Setup) -> bool:
    """Whether FP8 layers all-gather a sequence-sharded input as FP8 bytes: per-tensor recipes
    whose linears are not traced into a compiled graph (eager layers; delayed scaling under TP in
    compiled ones); traced linears gather in high precision (fp8/tp_forward.py [Note: FP8 under
    TP, compiled])."""
    return setup.fp8 in ("current", "delayed") and not traces_fp8(setup.parallel)


def _amax_agreements(spec: ModelSpec, setup: Setup, g: Groups) -> Transfer:
    """Current scaling under TP agrees each sharded operand's per-tensor scale over tp, one
    4-byte max all-reduce each (fp8/tp_forward.py): per layer, in forward the row-parallel
    layers' inputs and, under sequence parallelism, the gathered inputs (q/k/v's and a dense
    layer's gate/up's, fp8/tp_gather.py; an MoE layer's router and experts take the rank's own
    tokens), and in backward the column-parallel layers' output gradients; recomputation repeats
    the forward's. Latency-bound: their count is the cost. Compiled layers gather the inputs in
    high precision and quantize the whole of them (fp8/tp_forward.py [Note: FP8 under TP,
    compiled]): no agreement for those."""
    p = setup.parallel
    calls = 0
    for kind, count in spec.layer_kinds():
        block = spec.moe_block_params() if kind == "moe" else spec.block_params()
        fp8 = [q for q in block if converts_to_fp8(q, setup.fp8, p.tp, 0)]
        col, row = sum(q.tp == "col" for q in fp8), sum(q.tp == "row" for q in fp8)
        gathered = p.sequence_parallel and col and _gathers_fp8_bytes(setup)
        forward = row + ((1 if kind == "moe" else 2) if gathered else 0)
        calls += count * (forward * (1 + (p.activation_checkpointing != "none")) + col)
    return Transfer("TP FP8 amax agreements", "all_reduce", g.tp, 4, "compute", calls)


def _model_parallel(spec: ModelSpec, setup: Setup, g: Groups) -> List[Transfer]:
    """Tensor- and context-parallel collectives of one micro-batch (torch's TP styles and CP's
    K/V gathers; recomputation repeats those checkpointing does not keep), and expert
    parallelism's all-to-alls. Beside tp an MoE layer's attention is tensor-parallel and its
    router and experts are not: they take the rank's own tokens with no TP collective (under
    sequence parallelism the router's output is gathered over tp for the load-balancing loss, and
    the router's and experts' gradients, partial sums over tp, are summed in one all-reduce per
    unit on the compute stream: engine/unit_grads.py), and the all-to-alls carry this tp rank's
    share of the tokens (activations.py [Note: a mixture of experts beside tensor parallelism])."""
    p = setup.parallel
    e, t, ac, layers = setup.compute_bytes, setup.micro_batch * setup.seq_len / p.cp, p.activation_checkpointing, \
        spec.layers
    out: List[Transfer] = []
    if g.tp.size > 1:
        act = t * spec.hidden * e
        x_in = t * spec.hidden * (1 if _gathers_fp8_bytes(setup)
                                  and converts_to_fp8(spec.block_params()[1], setup.fp8, p.tp, 0) else e)
        blocks = layers + (layers - spec.moe_layers)  # attention in every layer, the MLP in dense ones
        if p.sequence_parallel:
            # Per block: gather the norm outputs for attention and FFN, reduce-scatter their outputs;
            # backward the reverse. Selective keeps the reduce-scatter outputs.
            gathers = blocks * (2 + (ac != "none"))
            scatters = blocks * (2 + (ac == "full"))
            out += [Transfer("TP all-gather activations", "all_gather", g.tp, x_in, "compute", gathers),
                    Transfer("TP reduce-scatter activations", "reduce_scatter", g.tp, act, "compute", scatters)]
            # The embedding's output and the head's input gradient are reduce-scattered, the
            # head's input gathered.
            out += [Transfer("TP reduce-scatter embedding/head", "reduce_scatter", g.tp, act, "compute", 2),
                    Transfer("TP all-gather head input", "all_gather", g.tp, act, "compute")]
            if spec.moe_layers:
                forwards = spec.moe_layers * (1 + (ac != "none"))
                local = -(-spec.experts // p.ep) * 3 * spec.expert_ffn * spec.hidden
                out += [Transfer("TP all-gather router output", "all_gather", g.tp, 4 * t * spec.experts, "compute",
                                 forwards),
                        Transfer("TP all-reduce partial router grads", "all_reduce", g.tp,
                                 spec.experts * spec.hidden * e, "compute", spec.moe_layers),
                        Transfer("TP all-reduce partial expert grads", "all_reduce", g.tp, local * e, "compute",
                                 spec.moe_layers)]
        else:
            calls = blocks * (2 + (ac != "none"))
            out.append(Transfer("TP all-reduce activations", "all_reduce", g.tp, act, "compute", calls + 2))
        if setup.fp8 == "current":
            out.append(_amax_agreements(spec, setup, g))
        if not p.loss_parallel:  # replicated logits are gathered; loss parallelism keeps them sharded
            logits = t * -(-spec.vocab // p.tp) * p.tp * e
            out.append(Transfer("TP all-gather logits", "all_gather", g.tp, logits, "compute"))
    if g.cp.size > 1:
        kv = 2 * t * p.cp * spec.kv_dim / p.tp * e  # K and V of the whole sequence
        out += [Transfer("CP all-gather K/V", "all_gather", g.cp, kv, "compute", layers * (1 + (ac != "none"))),
                Transfer("CP reduce-scatter dK/dV", "reduce_scatter", g.cp, kv, "compute", layers)]
    if g.ep.size > 1 and spec.moe_layers:
        # Per MoE layer and forward (recomputation too): the counts per expert (int64), then the
        # T k rows dispatched (this tp rank's share of T) and as many combined; backward sends
        # the gradients back, twice.
        forwards = spec.moe_layers * (1 + (ac != "none"))
        routed = t * routed_share(setup) * spec.experts_per_token
        rows = routed * spec.hidden * e
        if p.fp8_dispatch:  # each dispatched row as e4m3 bytes and a 4-byte scale per 128 (parallel/ep.py)
            out += [Transfer("EP all-to-all tokens, FP8 dispatch", "all_to_all", g.ep,
                             routed * (spec.hidden + 4 * -(-spec.hidden // 128)), "compute", forwards),
                    Transfer("EP all-to-all tokens", "all_to_all", g.ep, rows, "compute",
                             forwards + 2 * spec.moe_layers)]
        else:
            out.append(Transfer("EP all-to-all tokens", "all_to_all", g.ep, rows, "compute",
                                2 * forwards + 2 * spec.moe_layers))
        out.append(Transfer("EP all-to-all counts per expert", "all_to_all", g.ep, 8 * spec.experts, "compute",
                            forwards))
    return out


def host_syncs(spec: ModelSpec, setup: Setup) -> int:
    """Host synchronisations per micro-batch: expert parallelism reads its all-to-all's split
    sizes on the host in each MoE layer's forward and recomputation."""
    if setup.parallel.ep == 1:
        return 0
    return spec.moe_layers * (1 + (setup.parallel.activation_checkpointing != "none"))


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
    syncs: float = 0.0  # host synchronisations (expert parallelism's), the GPU idle meanwhile

    @property
    def issue_bound(self) -> float:
        """Forward, then backward: each pass waits for the slower of the GPU's compute stream
        and the host issuing its kernels (a host ahead in forward cannot lend that time to
        backward, which starts when the loss does). The compute stream also runs the tensor-,
        context- and expert-parallel collectives, whose launches the host issues among the
        layers' (a measured host counts them): while the host sets the pace they run in its
        shadow, not after it. They are split between the passes as the compute is."""
        share = self.compute_fwd / self.compute if self.compute > 0 else 0.0
        stream_fwd = self.compute_fwd + share * self.model_parallel
        stream_bwd = self.compute - self.compute_fwd + (1.0 - share) * self.model_parallel
        return max(stream_fwd, self.host_fwd) + max(stream_bwd, self.host - self.host_fwd)

    @property
    def step(self) -> float:
        # The optimizer's kernels start once backward's last reduction ends: after the issue-bound
        # passes, whoever set their pace.
        return self.issue_bound + self.exposed + self.optimizer + self.syncs


def step_time(spec: ModelSpec, setup: Setup, units: List[UnitPlan]) -> StepTime:
    """The step under [Note: the overlap model]."""
    g = groups(setup)
    root, kinds = units[0], {lg.kind: lg for lg in layer_groups(units)}
    c = compute(spec, setup)
    gpu, eff, e = setup.cluster.gpu, setup.efficiency, setup.compute_bytes
    hbm = gpu.hbm_gbps * 1e9 * eff.hbm
    zero3 = setup.parallel.strategy.shards_params
    n = spec.layers
    order = [spec.layer_kind(i) for i in range(n)]
    # Which kinds of layers meet where: a layer's compute hides its neighbours' collectives.
    pairs = Counter(zip(order, order[1:]))  # forward: (layer, the next)
    triples = Counter(zip(order, order[1:], order[2:]))  # backward: (previous, layer, next)
    issued: List[Transfer] = []
    compute_s = compute_fwd = exposed = 0.0

    def gathering(u: UnitPlan, first: bool) -> bool:  # ZeRO-3 gathers for each use, ZeRO-1/2 once a step
        return not u.aliased and (zero3 or (first and u.chunks > 1))

    def gather_copies(u: UnitPlan) -> float:  # cast into the send buffer, copy out of the gathered one
        return (u.layout.chunk_numel * MAIN_BYTES + u.wire.chunk_numel * u.wire_bytes
                + (2 * u.unsharded_bytes if u.chunks > 1 else 0)) / hbm

    def reduce_copies(u: UnitPlan) -> float:  # pack the unsharded gradients in the reduce dtype
        return (u.local_numel * e + u.chunks * u.layout.trainable_numel * REDUCE_BYTES) / hbm

    def per_layer(lg: LayerGroup, transfers) -> List[Transfer]:  # a layer's units' transfers, in order
        return [x for u in lg.units for x in transfers(u)]

    for mb in range(setup.accumulation):
        first, last = mb == 0, mb == setup.accumulation - 1
        fwd_root = _gathers(root, setup, g, first) if gathering(root, first) else []
        fwd = {k: per_layer(lg, lambda u: _gathers(u, setup, g, first) if gathering(u, first) else [])
               for k, lg in kinds.items()}
        bwd = {k: per_layer(lg, lambda u: _gathers(u, setup, g, False) if zero3 else []) for k, lg in kinds.items()}
        red = {k: per_layer(lg, lambda u: _reductions(u, setup, g, last)) for k, lg in kinds.items()}
        red_root = _reductions(root, setup, g, last)
        # Every layer gathers in forward, all but the last (kept) again in backward, and reduces.
        issued += fwd_root + [x.times(lg.count) for k, lg in kinds.items() for x in fwd[k]] \
            + [x.times(lg.count - (k == order[-1])) for k, lg in kinds.items() for x in bwd[k]] \
            + [x.times(lg.count) for k, lg in kinds.items() for x in red[k]] + red_root
        # Forward: the root's and the first layer's gathers wait; each later gather hides
        # behind the layer before it.
        exposed += _busy(fwd_root, setup) + _busy(fwd[order[0]], setup)
        for (layer, following), count in pairs.items():
            exposed += count * max(0.0, _busy(fwd[following], setup) - c.layers[layer].fwd)
        # Backward: the last layer is kept; layer i's compute hides i-1's gather and i+1's
        # reductions; the first layer's and the root's reductions end the backward exposed.
        if n > 1:
            exposed += max(0.0, _busy(bwd[order[-2]], setup) - c.layers[order[-1]].bwd)
            for (previous, layer, following), count in triples.items():
                exposed += count * max(0.0, _busy(bwd[previous] + red[following], setup) - c.layers[layer].bwd)
            exposed += max(0.0, _busy(red[order[1]], setup) - c.layers[order[0]].bwd)
        exposed += _busy(red[order[0]], setup) + _busy(red_root, setup)
        layer_units = [(lg, u) for lg in kinds.values() for u in lg.units]
        copies = sum(u.count * gather_copies(u) for u in [root] + [u for _, u in layer_units] if gathering(u, first))
        forward = sum(lg.count * c.layers[k].fwd for k, lg in kinds.items()) + c.root_fwd + copies
        regather = sum((lg.count - (lg.kind == order[-1])) * gather_copies(u) for lg, u in layer_units
                       if zero3 and gathering(u, first))
        compute_fwd += forward
        compute_s += forward + sum(lg.count * c.layers[k].bwd for k, lg in kinds.items()) + c.root_bwd + regather \
            + sum(lg.count * reduce_copies(u) for lg, u in layer_units) + reduce_copies(root)

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
    acc = setup.accumulation
    host_fwd = acc * (sum(lg.count * c.layers[k].host_fwd for k, lg in kinds.items()) + c.host.root_fwd)
    host = host_fwd + acc * (sum(lg.count * c.layers[k].host_bwd for k, lg in kinds.items()) + c.host.root_bwd)
    syncs = acc * host_syncs(spec, setup) * eff.host_sync_us * 1e-6
    return StepTime(compute_s, compute_fwd, host, host_fwd, sum(_seconds(x, setup) for x in mp), exposed, optimizer,
                    c.flops * acc, tuple(_summarize(issued, setup)), syncs)


def _summarize(issued: List[Transfer], setup: Setup) -> List[Collective]:
    """One row per kind of collective (what, op, group, size), its calls added up."""
    rows: Dict[Tuple[str, str, str, float], Transfer] = {}
    for x in issued:
        key = (x.what, x.op, x.group.name, x.nbytes)
        rows[key] = replace(rows[key], calls=rows[key].calls + x.calls) if key in rows else x
    return [Collective(x.what, x.op, x.group, x.calls, x.nbytes, _seconds(x, setup), x.stream != "compute")
            for x in rows.values()]

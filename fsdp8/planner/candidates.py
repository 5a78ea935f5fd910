"""fsdp8.planner.search(): every configuration of a model on a cluster that fits, fastest first; and what would
make a configuration that does not fit fit."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Iterable, List, Optional, Sequence, Union

from ..config import AC_MODES, STRATEGY_NAMES, FP8Recipe, ParallelConfig, Precision
from .hardware import GPU, Cluster, Efficiency, gpu_named
from .model import ModelSpec, check_tp, model_spec
from .predict import Plan, plan_setup
from .setup import Setup, make_setup

MAX_NODES = 4096


@dataclass(frozen=True)
class Candidate:
    """A configuration that fits: its layout (a ``fsdp8.ParallelConfig`` with every mesh size
    known, ready for ``parallelize``; ``dataclasses.replace`` sets its other fields, e.g.
    ``compile=True``), the micro-batch in sequences per data-parallel rank, and its prediction."""

    parallel: ParallelConfig
    micro_batch: int
    accumulation: int
    plan: Plan

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.plan.tokens_per_s_per_gpu

    def describe(self) -> str:
        return f"micro batch {self.micro_batch} x {self.accumulation}, {self.plan.setup.describe()}"


def _candidate(p: Plan) -> Candidate:
    return Candidate(p.setup.parallel, p.setup.micro_batch, p.setup.accumulation, p)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_degrees(spec: ModelSpec, dp_shard: int, tp: int) -> List[int]:
    """The ep a layout can take (what fsdp8.parallelize accepts): 1 for a dense model; for a
    mixture of experts every divisor of dp_shard that splits the experts evenly, but 1 beside
    tensor parallelism (tp splits attention and dense layers; the experts need ep > 1)."""
    if not spec.experts:
        return [1]
    return [d for d in _divisors(dp_shard) if spec.experts % d == 0 and (d > 1 or tp == 1)]


def _plans(spec: ModelSpec, cluster: Cluster, seq_len: int, global_batch: int, precision: Optional[Precision],
           fp8: Optional[FP8Recipe], efficiency: Optional[Efficiency], strategies: Sequence[str], tps: Iterable[int],
           cps: Iterable[int], ac_modes: Sequence[str], offloads: Sequence[Optional[str]], max_micro_batch: int,
           loss_parallel: bool) -> List[Plan]:
    """A prediction for every valid configuration of the space (fitting or not)."""
    world, found = cluster.world, []
    for tp, cp in itertools.product(tps, cps):
        if world % (tp * cp):
            continue
        try:
            check_tp(spec, tp)
        except ValueError:
            continue
        dp = world // (tp * cp)
        for replicate, micro in itertools.product(_divisors(dp), _divisors(max(1, global_batch // dp))):
            if micro > max_micro_batch or global_batch % (micro * dp):
                continue
            outers = ("no_shard", "optim") if replicate > 1 else ("no_shard",)
            eps = expert_degrees(spec, dp // replicate, tp)
            for strategy, outer, ac, offload, sp, ep in itertools.product(strategies, outers, ac_modes, offloads,
                                                                          (False, True) if tp > 1 else (False,), eps):
                try:
                    parallel = ParallelConfig(dp_replicate=replicate, cp=cp, tp=tp, ep=ep, sequence_parallel=sp,
                                              loss_parallel=loss_parallel and tp > 1, activation_checkpointing=ac,
                                              fp8=fp8, precision=precision, strategy=strategy, outer_strategy=outer,
                                              offload=offload)
                    setup = make_setup(spec, cluster, parallel, seq_len=seq_len, micro_batch=micro,
                                       global_batch=global_batch, efficiency=efficiency)
                except ValueError:  # LayoutNotSupported too
                    continue
                found.append(plan_setup(spec, setup))
    return found


def search(model: Union[str, ModelSpec, None] = None, *, gpu: Union[str, GPU] = "h100", nodes: int = 1,
           gpus_per_node: int = 8, seq_len: int = 2048, global_batch: Optional[int] = None,
           precision: Optional[Precision] = None, fp8: Optional[FP8Recipe] = None,
           efficiency: Optional[Efficiency] = None, strategies: Sequence[str] = STRATEGY_NAMES,
           tps: Optional[Iterable[int]] = None,
           cps: Iterable[int] = (1,), ac_modes: Sequence[str] = AC_MODES,
           offloads: Optional[Sequence[Optional[str]]] = None, max_micro_batch: int = 64,
           loss_parallel: bool = False, top: Optional[int] = None, **sizes) -> List[Candidate]:
    """The configurations of ``model`` on the cluster that fit, fastest (predicted tokens/s/GPU)
    first: strategies x outer strategies x dp_replicate x tp x cp x activation checkpointing x
    micro-batch (within ``global_batch``, default one sequence per GPU) x offload x sequence
    parallelism, and for a mixture of experts x ep (the divisors of dp_shard that split its
    experts; beside tp > 1 only ep > 1, as fsdp8.parallelize requires); of those that predict
    the same speed and differ only in how the data-parallel ranks shard, the one with the least
    memory (and the fewest replicas). ``tps`` defaults to
    the divisors of gpus_per_node (TP inside a node), ``cps`` to 1: pass context-parallel
    degrees to weigh them too (worth it for long sequences, whose activations or attention
    time one rank cannot carry). ``precision`` and ``fp8`` are every candidate's, as
    ``fsdp8.ParallelConfig`` takes them (None: what parallelize picks, bf16 on GPUs; no FP8).
    ``loss_parallel=True`` keeps the logits vocabulary-sharded wherever tp > 1 (for a loss
    computed inside torch's ``loss_parallel()``). Raises ValueError, saying what would help,
    when nothing fits."""
    spec = model_spec(model, **sizes)
    cluster = Cluster(gpu if isinstance(gpu, GPU) else gpu_named(gpu), nodes, gpus_per_node)
    global_batch = cluster.world if global_batch is None else global_batch
    offloads = offloads if offloads is not None else ((None,) if fp8 else (None, "optim"))
    tps = tuple(tps) if tps is not None else tuple(_divisors(gpus_per_node))
    plans = _plans(spec, cluster, seq_len, global_batch, precision, fp8, efficiency, strategies, tps, tuple(cps),
                   ac_modes, offloads, max_micro_batch, loss_parallel)
    if not plans:
        raise ValueError(f"no configuration of the search space can run {spec.name} on {cluster.world} GPUs with "
                         f"global batch {global_batch} (tp {tps}, cp {tuple(cps)}): the global batch must be a "
                         "multiple of the data-parallel ranks, and tp must divide the heads")
    fitting = _distinct(sorted((p for p in plans if p.memory.fits), key=_rank))
    if not fitting:
        smallest = min(plans, key=lambda p: p.memory.total)
        raise ValueError(f"nothing fits: the smallest footprint found ({smallest.setup.describe()}, micro batch "
                         f"{smallest.setup.micro_batch}) needs {smallest.memory.total / 2**30:.1f} GiB per GPU of "
                         f"{cluster.gpu.memory_gib:g}; {_more_gpus(spec, cluster, smallest.setup)}")
    return [_candidate(p) for p in fitting[:top]]


def _rank(p: Plan):
    """Fastest first; among equals (meshes the engine treats alike), the least memory, then the
    simplest: fewer replicas, less tensor parallelism, no offload."""
    s = p.setup.parallel
    return (-p.tokens_per_s_per_gpu, p.memory.total, s.dp_replicate, s.outer_strategy, s.tp, s.ep,
            s.sequence_parallel, s.offload is not None)


def _distinct(ranked: List[Plan]) -> List[Plan]:
    """The first of each group of plans that predict the same speed with the same layout and
    differ only in how the data-parallel ranks shard (dp_replicate, strategy, outer strategy),
    e.g. 1 x 8 ZeRO-1 and 8 x 1 HSDP sharding the optimizer across replicas. ``ranked`` puts
    first the one with the least memory, and among those the simplest (fewest replicas): the
    others hold more for nothing, or are the same choice said in another way."""
    seen, kept = set(), []
    for p in ranked:
        s = p.setup.parallel
        key = (f"{p.tokens_per_s_per_gpu:.6g}", s.cp, s.tp, s.ep, s.sequence_parallel, s.loss_parallel,
               s.activation_checkpointing, s.offload, p.setup.micro_batch)
        if key not in seen:
            seen.add(key)
            kept.append(p)
    return kept


def _more_gpus(spec: ModelSpec, cluster: Cluster, setup: Setup) -> str:
    """How many nodes the smallest-footprint configuration needs, or that none suffice."""
    nodes = cluster.nodes
    while nodes < MAX_NODES:
        nodes *= 2
        bigger = Cluster(cluster.gpu, nodes, cluster.gpus_per_node)
        try:
            p = plan_setup(spec, _changed(spec, setup, bigger, global_batch=None))
        except ValueError:
            continue
        if p.memory.fits:
            return f"it fits on {nodes} nodes of {cluster.gpus_per_node} (--nodes {nodes})"
    return (f"it does not fit on {MAX_NODES} nodes either: what each GPU holds whatever their number (gathered "
            f"layers, a micro-batch's activations and logits at {setup.seq_len} tokens) is too large; use GPUs with "
            "more memory, more tensor or context parallelism, or shorter sequences")


_BATCH = ("micro_batch", "global_batch")


def _changed(spec: ModelSpec, setup: Setup, cluster: Cluster, **change) -> Setup:
    """``setup`` on ``cluster`` with ``change`` (ParallelConfig fields, micro_batch, global_batch),
    its data-parallel shards inferred again."""
    layout = {key: value for key, value in change.items() if key not in _BATCH}
    batch = {key: change.get(key, getattr(setup, key)) for key in _BATCH}
    return make_setup(spec, cluster, replace(setup.parallel, dp_shard=-1, **layout), seq_len=setup.seq_len,
                      efficiency=setup.efficiency, **batch)


# fsdp8 plan's flag for each setting a fix may change.
_FLAGS = {"strategy": "--strategy", "activation_checkpointing": "--ac", "micro_batch": "--micro-batch", "tp": "--tp",
          "sequence_parallel": "--sequence-parallel", "offload": "--offload", "ep": "--ep"}


def fixes(p: Plan, limit: int = 3) -> List[str]:
    """Changes of one or two settings that make a plan that does not fit fit, fastest first, as
    fsdp8 plan's flags. Each changes only settings not already in effect, and a pair is offered
    only where neither of its changes fits alone (it would say nothing the single one does not)."""
    s, spec = p.setup, p.spec
    changes = [{"strategy": "optim_grads_params"}, {"activation_checkpointing": "selective"},
               {"activation_checkpointing": "full"}, {"micro_batch": 1}]
    changes += [{"tp": t, "sequence_parallel": True} for t in _divisors(s.cluster.gpus_per_node) if t > s.parallel.tp]
    changes += [{"ep": ep} for ep in expert_degrees(spec, s.parallel.dp_shard, s.parallel.tp) if ep > s.parallel.ep]
    if not s.fp8 and s.parallel.strategy.label != "no_shard":
        changes.append({"offload": "optim"})
    changes = [c for c in (_new_settings(s, c) for c in changes) if c]

    def speed(change: dict) -> Optional[float]:
        """Tokens/s/GPU with ``change`` where it fits; None where it does not, or cannot be made."""
        try:
            q = plan_setup(spec, _changed(spec, s, s.cluster, **change))
        except ValueError:
            return None
        return q.tokens_per_s_per_gpu if q.memory.fits else None

    singles = [speed(c) for c in changes]
    found = [(tokens, c) for tokens, c in zip(singles, changes) if tokens is not None]
    for (i, a), (j, b) in itertools.combinations(enumerate(changes), 2):
        if not set(a) & set(b) and singles[i] is None and singles[j] is None:
            tokens = speed(dict(a, **b))
            if tokens is not None:
                found.append((tokens, dict(a, **b)))
    found.sort(key=lambda item: -item[0])
    return [f"{_as_flags(c)} ({tokens:,.0f} tokens/s/GPU)" for tokens, c in found[:limit]]


def _new_settings(s: Setup, change: dict) -> dict:
    """``change`` less the settings ``s`` already has."""
    def current(key: str):
        if key in _BATCH:
            return getattr(s, key)
        value = getattr(s.parallel, key)
        return value.label if key == "strategy" else value

    return {key: value for key, value in change.items() if current(key) != value}


def _as_flags(change: dict) -> str:
    return " ".join(_FLAGS[key] if value is True else f"{_FLAGS[key]} {value}" for key, value in change.items())

"""Process groups as the planner sees them and what a collective costs on their links.

Ranks are laid out row-major over ``(dp_replicate, dp_shard, cp, tp)`` and nodes hold
consecutive ranks, so a group's link follows from its size and stride (tp innermost: NVLink
while it fits in a node); an experts' mesh (``fsdp8.distributed.mesh.make_expert_mesh``) splits
dp_shard into ``(efsdp, ep)``. time.py schedules these collectives into a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

from .setup import Setup


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


def mesh_group(name: str, mesh: Sequence[Tuple[str, int]], dims: Sequence[str], gpus_per_node: int) -> Group:
    """Rank 0's group over ``dims`` of a row-major mesh of ``(dim, size)``s laid over the world's
    ranks (an experts' mesh's groups are not evenly strided: efsdp x cp jumps over the ep ranks)."""
    sizes, strides, stride = dict(mesh), {}, 1
    for dim, size in reversed(mesh):
        strides[dim], stride = stride, stride * size
    ranks = [0]
    for dim in dims:
        ranks = [r + i * strides[dim] for r in ranks for i in range(sizes[dim])]
    nodes = len({r // gpus_per_node for r in ranks})
    return Group(name, len(ranks), nodes, len(ranks) // nodes)


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
    if op == "all_to_all":
        return eff.latency_us * 1e-6 + _all_to_all_seconds(nbytes, g, setup)
    factor = 2 if op == "all_reduce" else 1
    seconds = factor * (g.size - 1) / g.size * nbytes / (gpu.nvlink_gbps * 1e9 * eff.link) if g.per_node > 1 else 0.0
    if g.nodes > 1:
        network = factor * (g.nodes - 1) / g.nodes * nbytes / (g.per_node * gpu.network_gbps * 1e9 * eff.link)
        seconds = max(seconds, network)
    return eff.latency_us * 1e-6 + seconds


def _all_to_all_seconds(nbytes: float, g: Group, setup: Setup) -> float:
    """An all-to-all of ``nbytes`` per rank, 1/n of it to each member: the members in its node
    take (per_node - 1)/n of it over NVLink, the others (n - per_node)/n through its own NIC,
    side by side; its 1/n stays."""
    gpu, eff = setup.cluster.gpu, setup.efficiency
    inside = (g.per_node - 1) / g.size * nbytes / (gpu.nvlink_gbps * 1e9 * eff.link)
    across = (g.size - g.per_node) / g.size * nbytes / (gpu.network_gbps * 1e9 * eff.link)
    return max(inside, across)


@dataclass(frozen=True)
class Groups:
    tp: Group
    cp: Group
    shard: Group  # dp_shard x cp: what the engine shards over
    replicate: Group
    dp: Group  # replicate x shard, flattened
    ep: Group  # expert parallelism's all-to-alls
    expert_shard: Group  # efsdp x cp: what the engine shards experts over under ep > 1
    expert_dp: Group  # replicate x efsdp x cp, flattened


def groups(setup: Setup) -> Groups:
    p, gpn = setup.parallel, setup.cluster.gpus_per_node
    tp, cp, s, r = p.tp, p.cp, p.dp_shard, p.dp_replicate
    # fsdp8.distributed.mesh.make_expert_mesh: dp_shard split into (efsdp, ep), ep inner.
    experts = (("dp_replicate", r), ("efsdp", s // p.ep), ("ep", p.ep), ("cp", cp), ("tp", tp))
    return Groups(tp=group("tp", tp, 1, gpn), cp=group("cp", cp, tp, gpn), shard=group("dp_shard", s * cp, tp, gpn),
                  replicate=group("dp_replicate", r, s * cp * tp, gpn), dp=group("dp", r * s * cp, tp, gpn),
                  ep=mesh_group("ep", experts, ("ep",), gpn),
                  expert_shard=mesh_group("efsdp", experts, ("efsdp", "cp"), gpn),
                  expert_dp=mesh_group("dp (experts)", experts, ("dp_replicate", "efsdp", "cp"), gpn))

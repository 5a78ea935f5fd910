"""Gradient utilities over sharded parameters: the global norm and clipping."""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..distributed import comm
from .sharded import ShardedModel


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def clip_grad_norm_(
    model: Union[nn.Module, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale gradients so their global ``norm_type``-norm is at most ``max_norm``; return the norm
    (NaN or Inf when a gradient holds one: check it, or call ``check_finite``).

    For a sharded model the norm covers every shard on every rank with one all-reduce
    (sum of ``|g|^p``, or max for ``inf``) over the ranks that hold distinct chunks; no host
    synchronization unless ``error_if_nonfinite``. Other modules fall back to torch's."""
    if not isinstance(model, ShardedModel):
        params = model.parameters() if isinstance(model, nn.Module) else model
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    norm_type = float(norm_type)
    if norm_type <= 0 and not math.isinf(norm_type):
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    engine = model._fsdp8
    device = engine.all_units[0].device if engine.all_units else torch.device("cpu")
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    clipped: List[torch.Tensor] = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    # Each topology's shards are distinct over its own groups (one for a model without
    # parameters on meshes of their own): reduce each there, then add the topologies up.
    local = None
    for topology in engine.topologies:
        part = _local_norm(_grads_of(engine, topology, norm_type), norm_type, device)
        comm.all_reduce(part, topology.main_group, op, "grad_norm")
        comm.all_reduce(part, topology.inner_group, op, "grad_norm/tp")
        local = part if local is None else (torch.maximum(local, part) if math.isinf(norm_type) else local + part)
    total = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        check_finite(model)  # names the parameters and ranks
        raise NonFiniteGradError(f"the total gradient norm is {total.item()}")
    clipped = [g for g in clipped if g.numel() > 0]
    if clipped:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(clipped, coef.to(clipped[0].device))
    return total


def _grads_of(engine, topology, norm_type: float) -> List[torch.Tensor]:
    """The local gradients of the parameters ``topology`` shards, each counted once."""
    mains = [s.main for u in engine.all_units if u.topology is topology for s in u.slots]
    # Under TP a tp-replicated weight's gradient is on every tp rank: count it on one of them
    # for sums (a max does not care). The experts' (ep, tp) mesh is reduced over ep alone
    # (inner_group), so each tp rank already counts its replicas once.
    skip = set()
    inner = topology.inner_mesh
    if inner is not None and inner.ndim == 1 and not math.isinf(norm_type) and inner.get_local_rank() != 0:
        skip = engine.tp_replicated
    return [g for g in (_local(p.grad) for p in mains if p.grad is not None and id(p) not in skip) if g.numel() > 0]


def _local_norm(grads: List[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack(torch._foreach_norm(grads, norm_type)).float()
    # Offloaded gradients are on the host; the collective runs on the compute device.
    return (norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()).to(device)


def nonfinite_grads(model: nn.Module) -> Dict[str, List[int]]:
    """Parameters whose gradient holds NaN or Inf, with the ranks where it does.

    One all-gather of a flag per parameter; a host synchronization, so call it when you
    want to know (``check_finite=True`` does after every backward)."""
    names = [n for n, p in model.named_parameters() if p.grad is not None]
    grads = [dict(model.named_parameters())[n].grad for n in names]
    if not names:
        return {}
    engine = getattr(model, "_fsdp8", None)
    device = engine.all_units[0].device if engine is not None and engine.all_units else _local(grads[0]).device
    flags = torch.stack([~torch.isfinite(_local(g)).all() for g in grads]).to(device=device, dtype=torch.uint8)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        gathered = torch.empty(world * len(names), dtype=torch.uint8, device=flags.device)
        comm.all_gather(gathered, flags, dist.group.WORLD, "non-finite check")
        flags_by_rank = gathered.view(world, -1).cpu()
    else:
        flags_by_rank = flags.view(1, -1).cpu()
    return {name: [r for r in range(world) if flags_by_rank[r, i]] for i, name in enumerate(names)
            if flags_by_rank[:, i].any()}


class NonFiniteGradError(FloatingPointError):
    """A gradient holds NaN or Inf."""


def check_finite(model: nn.Module) -> None:
    """Raise NonFiniteGradError naming every parameter with a NaN/Inf gradient and its ranks."""
    bad = nonfinite_grads(model)
    if bad:
        listed = "; ".join(f"{name} on rank(s) {', '.join(map(str, ranks))}" for name, ranks in bad.items())
        raise NonFiniteGradError(f"non-finite gradients in {len(bad)} parameter(s): {listed}")

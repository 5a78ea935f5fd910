"""What the planner is asked about: one training configuration of a model on a cluster (Setup),
checked by make_setup, which says what cannot work and what would."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..config import ParallelConfig, resolve_precision
from ..distributed.mesh import mesh_dims
from .hardware import Cluster, Efficiency
from .model import FP8_RECIPES, ModelSpec, check_ep, check_tp


@dataclass(frozen=True)
class Setup:
    """A training configuration on a cluster, checked: the layout with every mesh size known
    (``dp_shard`` is what the GPUs leave), ``accumulation`` the micro-batches per optimizer step."""

    cluster: Cluster
    seq_len: int
    micro_batch: int  # sequences per data-parallel rank per micro-batch (a TP group shares them)
    global_batch: int  # sequences per optimizer step
    parallel: ParallelConfig
    efficiency: Efficiency

    @property
    def dp(self) -> int:
        return self.parallel.dp_replicate * self.parallel.dp_shard

    @property
    def accumulation(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def compute_dtype(self) -> torch.dtype:
        # The planner predicts GPUs: an automatic precision is theirs.
        return resolve_precision(self.parallel.precision, "cuda").compute_dtype

    @property
    def precision(self) -> str:
        return "bf16" if self.compute_dtype == torch.bfloat16 else "fp32"

    @property
    def compute_bytes(self) -> int:
        return self.compute_dtype.itemsize

    @property
    def fp8(self) -> Optional[str]:
        """The FP8 recipe's name (``fsdp8.planner.model.FP8_RECIPES``), None without FP8."""
        return self.parallel.fp8.name if self.parallel.fp8 is not None else None

    def describe(self) -> str:
        p = self.parallel
        shard = f"dp_shard {p.dp_shard}" + (f" (ep {p.ep} x efsdp {p.dp_shard // p.ep})" if p.ep > 1 else "")
        mesh = f"dp_replicate {p.dp_replicate} x {shard} x cp {p.cp} x tp {p.tp}"
        extra = [f"outer {p.outer_strategy.label}" if p.dp_replicate > 1 else "",
                 "sequence parallel" if p.sequence_parallel else "", "loss parallel" if p.loss_parallel else "",
                 f"offload {p.offload}" if p.offload else "", "compiled" if p.compiled else ""]
        return (f"{mesh}, {p.strategy.label}{''.join(', ' + x for x in extra if x)}, {self.precision}"
                f"{', fp8 ' + self.fp8 if self.fp8 else ''}, AC {p.activation_checkpointing}")


def layout_fields(parallel: ParallelConfig, precision: str) -> dict:
    """The layout as ``fsdp8 plan --json`` and ``fsdp8 bench --json`` print it: its fields flat,
    strategies and the FP8 recipe by name, and ``precision`` naming the compute precision."""
    p = parallel
    return {"strategy": p.strategy.label, "outer_strategy": p.outer_strategy.label, "dp_replicate": p.dp_replicate,
            "cp": p.cp, "tp": p.tp, "ep": p.ep, "sequence_parallel": p.sequence_parallel,
            "loss_parallel": p.loss_parallel, "precision": precision, "fp8": p.fp8.name if p.fp8 is not None else None,
            "activation_checkpointing": p.activation_checkpointing, "offload": p.offload,
            "compile": p.compiled}


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _mesh_sizes(parallel: ParallelConfig, cluster: Cluster) -> ParallelConfig:
    """``parallel`` with its inferred mesh size (-1) resolved on the cluster's GPUs."""
    world, p = cluster.world, parallel
    if p.dp_shard == -1 and world % (p.dp_replicate * p.cp * p.tp):
        product = p.dp_replicate * p.cp * p.tp
        raise ValueError(f"dp_replicate {p.dp_replicate} x cp {p.cp} x tp {p.tp} = {product} does not divide the "
                         f"{world} ranks ({cluster.describe()}); choose sizes whose product divides {world}")
    sizes = mesh_dims(world, p.dp_replicate, p.dp_shard, p.cp, p.tp)
    return replace(p, **{name: sizes.get(name, 1) for name in ("dp_replicate", "dp_shard", "cp", "tp")})


def make_setup(spec: ModelSpec, cluster: Cluster, parallel: Optional[ParallelConfig] = None, *, seq_len: int,
               micro_batch: int = 1, global_batch: Optional[int] = None,
               efficiency: Optional[Efficiency] = None) -> Setup:
    """A Setup of ``parallel`` (default ``ParallelConfig()``), or a ValueError saying what cannot
    work and what would. What ParallelConfig checks itself it checked when it was made; here,
    the layout against the cluster, the model, the sequence and the batch."""
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch)):
        _positive(name, value)
    parallel = _mesh_sizes(parallel or ParallelConfig(), cluster)
    cp, tp = parallel.cp, parallel.tp
    check_tp(spec, tp)
    check_ep(spec, parallel.ep, parallel.dp_shard, tp)
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(f"seq_len {seq_len} is not a multiple of 2 x cp = {2 * cp} (context parallelism gives each "
                         f"rank a head and a tail chunk); use a seq_len that is")
    if parallel.sequence_parallel and seq_len % tp:
        raise ValueError(f"sequence parallelism splits every sequence over tp={tp}: seq_len {seq_len} must be a multiple")
    dp = cluster.world // (cp * tp)
    per_step = micro_batch * dp
    global_batch = per_step if global_batch is None else _positive("global_batch", global_batch)
    if global_batch % per_step:
        raise ValueError(f"global batch {global_batch} is not a multiple of micro batch {micro_batch} x {dp} data-parallel "
                         f"ranks = {per_step}; use a global batch of {per_step} x k sequences")
    setup = Setup(cluster, seq_len, micro_batch, global_batch, parallel, efficiency or Efficiency())
    if setup.compute_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"precision {parallel.precision!r}: the planner models bf16 or fp32 compute")
    if setup.fp8 is not None and setup.fp8 not in FP8_RECIPES:
        raise ValueError(f"fp8 recipe {setup.fp8!r}: use one of {', '.join(FP8_RECIPES)} (or none)")
    if setup.fp8 is not None and setup.compute_dtype != torch.bfloat16:
        raise ValueError(f"FP8 layers compute in bf16; use precision bf16 with fp8 {setup.fp8!r}")
    if parallel.offload and setup.fp8:
        raise ValueError("offload 'optim' with FP8 layers is not supported by fully_shard yet; drop one of them")
    return setup

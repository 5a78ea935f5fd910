"""What the planner is asked about: one training configuration of a model on a cluster (Setup),
checked by make_setup, which says what cannot work and what would."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import AC_MODES, OuterStrategy, Strategy, check_checkpointing_with_cp
from .hardware import Cluster, Efficiency
from .model import FP8_RECIPES, ModelSpec, check_tp


PRECISIONS = ("bf16", "fp32")


@dataclass(frozen=True)
class Setup:
    """A training configuration on a cluster, checked: ``dp_shard`` is what the GPUs leave,
    ``accumulation`` the micro-batches per optimizer step."""

    cluster: Cluster
    seq_len: int
    micro_batch: int  # sequences per data-parallel rank per micro-batch (a TP group shares them)
    global_batch: int  # sequences per optimizer step
    strategy: Strategy
    outer_strategy: OuterStrategy
    dp_replicate: int
    cp: int
    tp: int
    sequence_parallel: bool
    loss_parallel: bool
    precision: str
    fp8: Optional[str]
    activation_checkpointing: str
    offload: Optional[str]
    efficiency: Efficiency

    @property
    def dp_shard(self) -> int:
        return self.cluster.world // (self.dp_replicate * self.cp * self.tp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def accumulation(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def compute_bytes(self) -> int:
        return 2 if self.precision == "bf16" else 4

    def describe(self) -> str:
        mesh = f"dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x cp {self.cp} x tp {self.tp}"
        extra = [f"outer {self.outer_strategy.label}" if self.dp_replicate > 1 else "",
                 "sequence parallel" if self.sequence_parallel else "", "loss parallel" if self.loss_parallel else "",
                 f"offload {self.offload}" if self.offload else ""]
        return (f"{mesh}, {self.strategy.label}{''.join(', ' + x for x in extra if x)}, {self.precision}"
                f"{', fp8 ' + self.fp8 if self.fp8 else ''}, AC {self.activation_checkpointing}")


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def make_setup(spec: ModelSpec, cluster: Cluster, *, seq_len: int, micro_batch: int = 1,
               global_batch: Optional[int] = None, strategy="optim_grads_params", outer_strategy="no_shard",
               dp_replicate: int = 1, cp: int = 1, tp: int = 1, sequence_parallel: bool = False,
               loss_parallel: bool = False, precision: str = "bf16", fp8: Optional[str] = None, activation_checkpointing: str = "none",
               offload: Optional[str] = None, efficiency: Optional[Efficiency] = None) -> Setup:
    """A Setup, or a ValueError saying what cannot work and what would."""
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("dp_replicate", dp_replicate),
                        ("cp", cp), ("tp", tp)):
        _positive(name, value)
    world = cluster.world
    if world % (dp_replicate * cp * tp):
        raise ValueError(f"dp_replicate {dp_replicate} x cp {cp} x tp {tp} = {dp_replicate * cp * tp} does not divide "
                         f"the {world} ranks ({cluster.describe()}); choose sizes whose product divides {world}")
    check_tp(spec, tp)
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(f"seq_len {seq_len} is not a multiple of 2 x cp = {2 * cp} (context parallelism gives each "
                         f"rank a head and a tail chunk); use a seq_len that is")
    try:  # what parallelize refuses, the planner does not recommend
        check_checkpointing_with_cp(activation_checkpointing, cp)
    except NotImplementedError as e:
        raise ValueError(str(e)) from None
    for name, value in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
        if value and tp == 1:
            raise ValueError(f"{name} needs tp > 1")
    if sequence_parallel and seq_len % tp:
        raise ValueError(f"sequence parallelism splits every sequence over tp={tp}: seq_len {seq_len} must be a multiple")
    strategy, outer = Strategy.parse(strategy), OuterStrategy.parse(outer_strategy)
    if outer is OuterStrategy.OPTIM and dp_replicate == 1:
        raise ValueError("outer_strategy 'optim' shards across HSDP replicas, but dp_replicate=1 makes none; "
                         "set dp_replicate > 1 or keep outer_strategy 'no_shard'")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if fp8 is not None and fp8 not in FP8_RECIPES:
        raise ValueError(f"fp8 recipe {fp8!r}: use one of {', '.join(FP8_RECIPES)} (or none)")
    if fp8 is not None and precision != "bf16":
        raise ValueError(f"FP8 layers compute in bf16; use precision bf16 with fp8 {fp8!r}")
    if activation_checkpointing not in AC_MODES:
        raise ValueError(f"activation checkpointing {activation_checkpointing!r}: use one of {', '.join(AC_MODES)}")
    if offload not in (None, "optim"):
        raise ValueError(f"offload {offload!r}: use none or 'optim' (main weights, gradients, optimizer state on the host)")
    if offload and fp8:
        raise ValueError("offload 'optim' with FP8 layers is not supported by fully_shard yet; drop one of them")
    if offload and strategy is Strategy.NO_SHARD:
        raise ValueError("offload 'optim' moves sharded state to the host; use strategy optim or higher")
    dp = world // (cp * tp)
    per_step = micro_batch * dp
    global_batch = per_step if global_batch is None else _positive("global_batch", global_batch)
    if global_batch % per_step:
        raise ValueError(f"global batch {global_batch} is not a multiple of micro batch {micro_batch} x {dp} data-parallel "
                         f"ranks = {per_step}; use a global batch of {per_step} x k sequences")
    return Setup(cluster, seq_len, micro_batch, global_batch, strategy, outer, dp_replicate, cp, tp, sequence_parallel,
                 loss_parallel, precision, fp8, activation_checkpointing, offload, efficiency or Efficiency())

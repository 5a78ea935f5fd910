"""What one ``fsdp8 bench`` run is (BenchConfig: the model, the batch, the layout, the steps), checked
before a worker starts, and the cluster it runs on as the planner sees it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Dict, Optional

import torch

from ...config import ParallelConfig, Precision
from ...fp8.recipes import recipe_from_name
from ...models.hf_dir import import_transformers
from ...planner.hardware import GPU, Cluster, Efficiency, detect_gpu, gpu_named
from ...planner.model import ModelSpec, model_spec
from ...planner.setup import make_setup

PRECISIONS = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run: the model (a preset, ``hf:DIR``, or sizes), the batch, the layout, the steps."""

    model: Optional[str] = "tiny"
    sizes: Dict[str, object] = field(default_factory=dict)  # layers, hidden, ffn, heads, kv_heads, vocab, tied
    seq_len: int = 128
    micro_batch: int = 2
    accumulation: int = 1
    steps: int = 5
    warmup: int = 2
    strategy: str = "optim_grads_params"
    outer_strategy: str = "no_shard"
    dp_replicate: int = 1
    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    precision: str = "auto"
    fp8: Optional[str] = None
    activation_checkpointing: str = "none"
    offload: Optional[str] = None
    gpu: Optional[str] = None  # the planner's GPU; None: the one found here
    host_probe: bool = True  # measure this host's cost of issuing the step (host.py)
    json: bool = False
    seed: int = 0

    def spec(self) -> ModelSpec:
        return model_spec(self.model, **self.sizes)

    def check(self, world: int) -> None:
        """What can be checked before a worker starts (ValueError, saying what to change)."""
        for name in ("seq_len", "micro_batch", "accumulation", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.model is not None and self.model.startswith("hf:"):
            try:
                import_transformers(f"--model {self.model}")
            except ImportError as e:
                raise ValueError(f"{e} (fsdp8 plan reads hf:DIR without it)") from None
        self.parallel_config()
        self.setup(self.spec(), cluster_here(world, self.gpu, measured=None))

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(dp_replicate=self.dp_replicate, cp=self.cp, tp=self.tp, sequence_parallel=self.sequence_parallel,
                              loss_parallel=self.loss_parallel,
                              activation_checkpointing=self.activation_checkpointing, strategy=self.strategy,
                              outer_strategy=self.outer_strategy, offload=self.offload,
                              fp8=recipe_from_name(f"fp8-{self.fp8}") if self.fp8 else None, precision=self._precision())

    def compute_precision(self) -> str:
        if self.fp8 or self.precision == "bf16":
            return "bf16"
        return "fp32" if self.precision == "fp32" or not torch.cuda.is_available() else "bf16"

    def _precision(self) -> Precision:
        if self.compute_precision() == "bf16":
            return Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return Precision()

    def setup(self, spec: ModelSpec, cluster: Cluster, efficiency: Optional[Efficiency] = None):
        dp = cluster.world // (self.tp * self.cp)
        return make_setup(spec, cluster, seq_len=self.seq_len, micro_batch=self.micro_batch,
                          global_batch=self.micro_batch * self.accumulation * dp, strategy=self.strategy,
                          outer_strategy=self.outer_strategy, dp_replicate=self.dp_replicate, cp=self.cp, tp=self.tp,
                          sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel,
                          precision=self.compute_precision(), fp8=self.fp8,
                          activation_checkpointing=self.activation_checkpointing, offload=self.offload,
                          efficiency=efficiency)


def cluster_here(world: int, gpu: Optional[str], measured: Optional[GPU]) -> Cluster:
    """The cluster this job runs on: ``measured`` (this CPU's rates), else this machine's GPU
    (or ``gpu``'s figures), over ``world`` ranks, LOCAL_WORLD_SIZE of them per node."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if measured is not None:
        hardware = measured
    elif torch.cuda.is_available():
        hardware = detect_gpu(gpu)
    else:
        # Checks need some figures before the CPU is measured (in the workers).
        hardware = replace(gpu_named(gpu or "h100"), name="cpu")
    return Cluster(hardware, max(1, world // local), local)

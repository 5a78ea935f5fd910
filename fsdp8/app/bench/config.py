"""What one ``fsdp8 bench`` run is (BenchConfig: the model, the batch, the layout, the steps), checked
before a worker starts, and the cluster it runs on as the planner sees it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Dict, Optional

import torch

from ...config import ParallelConfig, resolve_precision
from ...models.hf_dir import import_transformers
from ...planner.hardware import GPU, Cluster, Efficiency, detect_gpu, gpu_named
from ...planner.model import ModelSpec, model_spec
from ...planner.setup import layout_fields, make_setup


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run: the model (a preset, ``hf:DIR``, or sizes), the batch, the layout
    (``parallel``, as the layout flags make it), the steps."""

    model: Optional[str] = "tiny"
    sizes: Dict[str, object] = field(default_factory=dict)  # layers, hidden, ffn, heads, kv_heads, vocab, tied
    seq_len: int = 128
    micro_batch: int = 2
    accumulation: int = 1
    steps: int = 5
    warmup: int = 2
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
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
        if self.model is not None and self.model.startswith("hf:"):
            try:
                import_transformers(f"--model {self.model}")
            except ImportError as e:
                raise ValueError(f"{e} (fsdp8 plan reads hf:DIR without it)") from None
        spec = self.spec()
        if spec.experts:
            # run.py builds the model from the spec's dense sizes, and the host probe resizes them.
            raise ValueError(f"fsdp8 bench does not run mixture-of-experts models yet ({spec.name}: {spec.experts} "
                             "experts per layer); fsdp8 plan predicts them, and fsdp8 train --preset moe-* runs them")
        self.setup(spec, cluster_here(world, self.gpu, measured=None))

    def to_dict(self) -> dict:
        """The run's settings as ``--json`` prints them: the layout's fields among the others, its
        precision as --precision names it (auto where it is chosen at run time)."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "parallel":
                values.update(layout_fields(value, "auto" if value.precision is None else value.precision.label))
            else:
                values[f.name] = dict(value) if f.name == "sizes" else value
        return values

    def setup(self, spec: ModelSpec, cluster: Cluster, efficiency: Optional[Efficiency] = None):
        """The planner's Setup of this run on ``cluster``, in the precision it runs in here."""
        here = "cuda" if torch.cuda.is_available() else "cpu"
        parallel = replace(self.parallel, precision=resolve_precision(self.parallel.precision, here))
        dp = cluster.world // (parallel.tp * parallel.cp)
        return make_setup(spec, cluster, parallel, seq_len=self.seq_len, micro_batch=self.micro_batch,
                          global_batch=self.micro_batch * self.accumulation * dp, efficiency=efficiency)


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

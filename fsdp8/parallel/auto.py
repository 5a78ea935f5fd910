"""parallelize(model, "auto"): the layout the planner predicts fastest for this model here."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from ..models.adapter import adapter_for
from ..planner.candidates import Candidate, search
from ..planner.hardware import detect_gpu, gpu_named


def auto_choice(model: nn.Module, seq_len: int = 2048, global_batch: int = 0) -> Candidate:
    """The fastest configuration that fits (fsdp8.planner.search's Candidate) for ``model`` (its sizes
    from its adapter's ``planner_spec``) on this job's GPUs (one sequence of ``seq_len`` per GPU
    unless ``global_batch`` says otherwise). Every rank computes the same answer from the same
    inputs, so no collective is needed. On CPUs the planner's H100 figures stand in for the
    hardware (only the ranking matters there)."""
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpu = detect_gpu(None) if torch.cuda.is_available() else gpu_named("h100")
    spec = adapter_for(model).planner_spec(model)
    return search(spec, gpu=gpu, nodes=max(1, world // local), gpus_per_node=local, seq_len=seq_len,
                  global_batch=global_batch or world, top=1)[0]


def describe_choice(best: Candidate, on_gpus: bool) -> str:
    """The line that says which layout "auto" took and why."""
    s, p = best.plan.setup, best.parallel
    layout = [f"dp_replicate {p.dp_replicate} x dp_shard {p.dp_shard} x cp {p.cp} x tp {p.tp}",
              f"ep {p.ep}" if p.ep > 1 else "", f"strategy {p.strategy.label}",
              f"outer strategy {p.outer_strategy.label}" if p.dp_replicate > 1 else "",
              "sequence parallel" if p.sequence_parallel else "",
              f"activation checkpointing {p.activation_checkpointing}" if p.activation_checkpointing != "none" else "",
              f"offload {p.offload}" if p.offload else ""]
    where = f"on {s.cluster.world} {s.cluster.gpu.name} GPU{'s' if s.cluster.world > 1 else ''}"
    if not on_gpus:
        where += " (the planner's figures for the CPU ranks here: only the ranking counts)"
    return (f"fsdp8.parallelize: 'auto' chose {', '.join(part for part in layout if part)}: the fastest layout that "
            f"fits {where}, predicted {best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU and "
            f"{best.plan.memory.total / 2**30:.1f} GiB per GPU with {s.micro_batch} sequence(s) of {s.seq_len} tokens "
            "per rank (model.parallel_config holds it)")

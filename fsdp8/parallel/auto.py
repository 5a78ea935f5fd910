"""parallelize(model, "auto"): the layout the planner predicts fastest for this model here."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn


def model_spec_of(model: nn.Module):
    """The planner's ModelSpec of a built-in Llama or a Hugging Face Llama-family model."""
    from ..models.llama import Llama
    from ..plan_model import ModelSpec, hf_spec_of

    if isinstance(model, Llama):
        c = model.config
        return ModelSpec("model", c.n_layers, c.dim, c.ffn_dim, c.n_heads, c.n_kv_heads, c.vocab_size,
                         tied=c.tie_embeddings)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        return hf_spec_of(config.to_dict(), type(model).__name__, f"{type(model).__name__}'s config")
    raise ValueError(f"parallelize(model, 'auto') plans fsdp8's Llama and Hugging Face Llama-family models, not "
                     f"{type(model).__name__}; pass a fsdp8.ParallelConfig")


def auto_choice(model: nn.Module, seq_len: int = 2048, global_batch: int = 0):
    """The fastest configuration that fits (fsdp8.plan.search's Candidate) for ``model`` on this
    job's GPUs (one sequence of ``seq_len`` per GPU unless ``global_batch`` says otherwise).
    Every rank computes the same answer from the same inputs, so no collective is needed. On
    CPUs the planner's H100 figures stand in for the hardware (only the ranking matters there)."""
    from ..bench import detect_gpu
    from ..plan_hw import gpu_named
    from ..plan_search import search

    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpu = detect_gpu(None) if torch.cuda.is_available() else gpu_named("h100")
    return search(model_spec_of(model), gpu=gpu, nodes=max(1, world // local), gpus_per_node=local,
                  seq_len=seq_len, global_batch=global_batch or world, top=1)[0]


def describe_choice(best, on_gpus: bool) -> str:
    """The line that says which layout "auto" took and why."""
    s = best.plan.setup
    layout = [f"dp_replicate {best.dp_replicate} x dp_shard {best.dp_shard} x cp {best.cp} x tp {best.tp}",
              f"strategy {best.strategy}", f"outer strategy {best.outer_strategy}" if best.dp_replicate > 1 else "",
              "sequence parallel" if best.sequence_parallel else "",
              f"activation checkpointing {best.activation_checkpointing}"
              if best.activation_checkpointing != "none" else "", f"offload {best.offload}" if best.offload else ""]
    where = f"on {s.cluster.world} {s.cluster.gpu.name} GPU{'s' if s.cluster.world > 1 else ''}"
    if not on_gpus:
        where += " (the planner's figures for the CPU ranks here: only the ranking counts)"
    return (f"fsdp8.parallelize: 'auto' chose {', '.join(part for part in layout if part)}: the fastest layout that "
            f"fits {where}, predicted {best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU and "
            f"{best.plan.memory.total / 2**30:.1f} GiB per GPU with {s.micro_batch} sequence(s) of {s.seq_len} tokens "
            "per rank (model.parallel_config holds it)")

"""What fully_shard holds on each rank, for tests/dist/test_plan_memory.py to set beside the planner."""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist

import fsdp8
from fsdp8.fp8.recipes import recipe_from_name
from fsdp8.models.llama import Llama, LlamaConfig

# (precision, fp8 recipe): the wire layouts the engine has (compute-dtype copies, FP8 bytes
# with per-tensor, 128x128 and MX scales).
PRECISIONS = [("fp32", None), ("bf16", None), ("bf16", "current"), ("bf16", "delayed"), ("bf16", "block"),
              ("bf16", "mxfp8")]
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _precision(name: str) -> fsdp8.Precision:
    if name == "bf16":
        return fsdp8.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return fsdp8.Precision()


def _mesh(shape, tp: int):
    if tp > 1:
        return fsdp8.make_mesh(dp_shard=dist.get_world_size() // tp, tp=tp)
    if shape is None:
        return None
    return fsdp8.make_mesh(dp_replicate=shape[0], dp_shard=shape[1])


def reports(sizes: dict, mesh_shape=None, outer: str = "no_shard", tp: int = 1, offload: bool = False):
    """memory_report() of every strategy x precision (x offload) on this mesh, as dicts keyed by
    (strategy, precision, fp8, offload), and this rank's tensor-parallel rank."""
    mesh = _mesh(mesh_shape, tp)
    out = {}
    cases = [(s, p, r) for s in STRATEGIES for p, r in PRECISIONS]
    if offload:  # fully_shard keeps FP8 on the GPU and refuses offload without sharding
        cases = [(s, p, r) for s, p, r in cases if r is None and s != "no_shard"]
    for strategy, precision, recipe in cases:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Llama(LlamaConfig(max_seq_len=16, **sizes))
        if tp > 1:
            fsdp8.parallel.tensor_parallel(model, mesh["tp"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # layers kept in high precision say so
            sharded = fsdp8.fully_shard(model, mesh=mesh, strategy=strategy, outer_strategy=outer,
                                        precision=_precision(precision),
                                        fp8=recipe_from_name(f"fp8-{recipe}") if recipe else None,
                                        offload="optim" if offload else None)
        out[(strategy, precision, recipe, offload)] = dataclasses.asdict(sharded.memory_report())
    return out, (mesh["tp"].get_local_rank() if tp > 1 else 0)

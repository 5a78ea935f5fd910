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


def qwen3_moe_config(sizes: dict):
    """transformers' Qwen3-MoE config of ``sizes`` (LlamaConfig's names), ``sizes['dense_layers']``
    kept dense."""
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=sizes["vocab_size"], hidden_size=sizes["dim"], num_hidden_layers=sizes["n_layers"],
        num_attention_heads=sizes["n_heads"], num_key_value_heads=sizes["n_kv_heads"], head_dim=sizes["head_dim"],
        intermediate_size=sizes["ffn_dim"], moe_intermediate_size=sizes["moe_ffn_dim"],
        num_experts=sizes["num_experts"], num_experts_per_tok=sizes["num_experts_per_tok"],
        mlp_only_layers=list(sizes["dense_layers"]), max_position_embeddings=32)


def _moe_model(family: str, sizes: dict):
    """A mixture-of-experts model of ``sizes``, the same on every rank: the built-in Llama, or
    transformers' Qwen3-MoE."""
    torch.manual_seed(0)
    if family == "fsdp8":
        return Llama(LlamaConfig(max_seq_len=16, **sizes))
    import transformers

    return transformers.Qwen3MoeForCausalLM(qwen3_moe_config(sizes))


def moe_reports(family: str, sizes: dict, ep: int, dp_replicate: int = 1, outer: str = "no_shard", tp: int = 1,
                sequence_parallel: bool = False):
    """memory_report() of a mixture-of-experts model laid out by parallelize with ``ep`` (its
    experts a unit of their own, sharded over efsdp = dp_shard / ep) and ``tp`` (attention
    tensor-parallel, router and experts not) for every strategy x precision, keyed by
    (strategy, precision, fp8); and this rank's tensor-parallel rank."""
    out = {}
    for strategy, (precision, recipe) in [(s, p) for s in STRATEGIES for p in PRECISIONS]:
        model = _moe_model(family, sizes)
        layout = fsdp8.ParallelConfig(dp_replicate=dp_replicate, ep=ep, tp=tp, sequence_parallel=sequence_parallel,
                                      strategy=strategy, outer_strategy=outer, precision=_precision(precision),
                                      fp8=recipe_from_name(f"fp8-{recipe}") if recipe else None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # routers and experts kept in high precision say so
            sharded = fsdp8.parallelize(model, layout)
        out[(strategy, precision, recipe)] = dataclasses.asdict(sharded.memory_report())
    return out, (dist.get_rank() % tp)  # tp innermost in the world mesh (dp_replicate, dp_shard, cp, tp)

"""The torchao float8 peer under tensor parallelism (peers.py stack ``torchao-tp-fp8``), laid out
as torchtitan lays out Llama: torchao's float8 TP styles with sequence parallelism, then torch
FSDP2 on the data-parallel sub-mesh.

Written for Hugging Face ``LlamaForCausalLM``. The residual stream stays a sequence-sharded
DTensor between layers (HF reads positions off the embedding's output, which must keep its
global shape); attention and the MLP each gather their input once, already in FP8
(PrepareFloat8ModuleInput), for all the projections that read it."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module


def torchao_tp_plan(model: torch.nn.Module) -> dict:
    """Module name -> style, every layer of an HF Llama."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    seq = Shard(1)
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=False),
        "model.norm": SequenceParallel(use_local_output=False),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate(), use_local_output=True),
    }
    for i in range(len(model.model.layers)):
        layer = f"model.layers.{i}"
        plan.update({
            f"{layer}.input_layernorm": SequenceParallel(use_local_output=False),
            f"{layer}.self_attn": PrepareFloat8ModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                                           desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                           use_local_output=False),
            f"{layer}.self_attn.q_proj": Float8ColwiseParallel(),
            f"{layer}.self_attn.k_proj": Float8ColwiseParallel(),
            f"{layer}.self_attn.v_proj": Float8ColwiseParallel(),
            f"{layer}.self_attn.o_proj": Float8RowwiseParallel(output_layouts=seq, use_local_output=False),
            f"{layer}.post_attention_layernorm": SequenceParallel(use_local_output=False),
            f"{layer}.mlp": PrepareFloat8ModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                                     use_local_output=False),
            f"{layer}.mlp.gate_proj": Float8ColwiseParallel(),
            f"{layer}.mlp.up_proj": Float8ColwiseParallel(),
            f"{layer}.mlp.down_proj": Float8RowwiseParallel(output_layouts=seq, use_local_output=False),
        })
    return plan


def convert_torchao(model: torch.nn.Module) -> torch.nn.Module:
    """torchao float8 as the peers run it: tensorwise, FP8 all-gathers under FSDP2, on the
    decoder layers' linears (the head stays bf16); returns ``model``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: "layers" in fqn)


def apply_torchao_tp(model: torch.nn.Module, tp_mesh) -> torch.nn.Module:
    """convert_torchao, then the plan above; returns ``model``."""
    convert_torchao(model)
    parallelize_module(model, tp_mesh, torchao_tp_plan(model))
    return model

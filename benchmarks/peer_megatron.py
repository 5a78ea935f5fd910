"""peers.py's Megatron-FSDP stack (CUDA only; the megatron-fsdp package travels as a wheel)."""

from __future__ import annotations

import torch

from peer_stacks import Built, Context, _short, decoder_layer_cls, make_adamw, wants_fused


def build_megatron_fsdp(model: torch.nn.Module, ctx: Context) -> Built:
    """Megatron-FSDP ZeRO-3 (PyPI megatron-fsdp): decoder layers as its units, fp32 main
    weights, gradients and reduction; its optimizer wrapper around the same AdamW."""
    import megatron_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    if ctx.megatron_mesh is None:
        # megatron-fsdp wants named (dp_shard, tp) dims; one mesh for all models.
        ctx.megatron_mesh = init_device_mesh("cuda", (ctx.world, 1), mesh_dim_names=("fsdp", "tp"))
    _bf16_params_with_fp32_main_init(model)
    model = megatron_fsdp.fully_shard_model(
        model,
        device_mesh=ctx.megatron_mesh,
        dp_shard_dim="fsdp",
        tp_dim="tp",
        fsdp_unit_modules=[decoder_layer_cls()],
        zero_dp_strategy="optim_grads_params",
        device=ctx.device,
        mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(
            main_params_dtype=torch.float32, main_grads_dtype=torch.float32, grad_comm_dtype=torch.float32
        ),
    )
    notes = ["optimizer pre-stepped once with zero grads by fully_shard_optimizer"]
    try:
        optimizer = megatron_fsdp.fully_shard_optimizer(make_adamw(model.parameters(), ctx, wants_fused(ctx)))
    except (RuntimeError, NotImplementedError, TypeError) as err:
        if not wants_fused(ctx):
            raise
        notes.append(f"fused AdamW failed ({_short(err)}); foreach used")
        optimizer = megatron_fsdp.fully_shard_optimizer(make_adamw(model.parameters(), ctx, fused=False))
    return Built(model, optimizer, notes)


def _bf16_params_with_fp32_main_init(model: torch.nn.Module) -> None:
    """Cast parameters (not buffers) to bf16, keeping their fp32 values for the main weights.

    Megatron-FSDP computes in the model's own parameter dtype and fills its fp32
    main-weight buffer from the parameters. Without this its fp32 masters would
    start from bf16-rounded values, unlike the other stacks. It reads the exact
    init through the `get_high_precision_init_val` hook it offers for
    TransformerEngine FP8 parameters. RoPE buffers stay fp32, as under FSDP2.
    """
    for param in model.parameters():
        fp32 = param.detach().clone()
        param.data = param.data.to(torch.bfloat16)
        param.get_high_precision_init_val = lambda fp32=fp32: fp32
        param.clear_high_precision_init_val = lambda p=param: _drop_init_hooks(p)


def _drop_init_hooks(param: torch.nn.Parameter) -> None:
    del param.get_high_precision_init_val
    del param.clear_high_precision_init_val

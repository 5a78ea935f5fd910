"""A linear's three FP8 GEMMs (out, dgrad, wgrad) as one autograd function, on whole tensors or on
tensor-parallel pieces (the operands' side of that is in gemm.py)."""

from __future__ import annotations

from typing import Optional

import torch

from .gemm import (
    TensorParallelGemm, fp8_mm, input_transposed, kept_inverse, quantize_both_ways, quantized_input, weight_operands,
    weight_transposed,
)
from .kernels import Quantized
from .recipes import G, X, DelayedBuffers, DelayedState, Recipe


class Float8LinearFn(torch.autograd.Function):
    """out = x @ w.T (+ bias) with FP8 GEMMs. Takes only tensors, the (frozen) recipe and the
    delayed-scaling state, so torch.compile can trace it when ``state`` is None: a compiled
    graph passes delayed scaling's scale and pending buffers instead (``delayed_scale``,
    ``delayed_pending``), which it reads and updates in place, in forward and in backward,
    and the scales' kept inverses (``delayed_scale_inv``); under current scaling it passes the
    input's per-tensor scale (``x_scale``) for the backward's transposed quantization."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Recipe, state: Optional[DelayedState], qx_data=None, qx_scale_inv=None,
                tp: Optional[TensorParallelGemm] = None, delayed_scale=None, delayed_pending=None, x_scale=None,
                delayed_scale_inv=None):
        if delayed_pending is not None:
            state = DelayedBuffers(delayed_scale, delayed_pending, delayed_scale_inv)
        compute_dtype = x.dtype
        x_shape = x.shape
        qw, qw_t = weight_operands(weight, recipe, state, compute_dtype, tp.amax_group(tp.w_sharded) if tp else None)
        if tp is not None and tp.gathered is not None:
            # x is the sequence gather's placeholder (tp_gather.py); the operands came with it.
            (qx, qx_t), saved_x = tp.gathered, None
        elif qx_data is not None:
            # Compiled graphs (see Float8Linear.forward): quantized by the caller; backward
            # quantizes the input's transpose again from the input itself.
            qx, qx_t, saved_x = Quantized(qx_data, qx_scale_inv, recipe.x_granularity), None, x
        else:
            # Eager: saved for backward are FP8 only (the input's transpose and the weight).
            group = tp.amax_group(tp.x_sharded) if tp else None
            (qx, qx_t), saved_x = quantized_input(x, x.reshape(-1, x.shape[-1]), recipe, state, group), None
        out = fp8_mm(qx, qw, compute_dtype, recipe, fast_accum=True)
        if bias is not None:
            out = out + bias.to(compute_dtype)
        ctx.qx_t, ctx.x, ctx.qw, ctx.qw_t, ctx.weight = qx_t, saved_x, qw, qw_t, weight
        ctx.x_scale = x_scale
        ctx.recipe, ctx.state, ctx.tp = recipe, state, tp
        ctx.has_bias, ctx.x_shape, ctx.compute_dtype = bias is not None, x_shape, compute_dtype
        ctx.weight_dtype = weight.dtype
        return out.view(*x_shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        recipe = ctx.recipe
        dy2d = dy.reshape(-1, dy.shape[-1]).to(ctx.compute_dtype)
        tp = ctx.tp
        qdy, qdy_t = quantize_both_ways(dy2d, recipe.g_granularity, recipe.bwd_dtype, ctx.state, G,
                                         tp.amax_group(tp.dy_sharded) if tp else None)
        qw_t = ctx.qw_t if ctx.qw_t is not None else weight_transposed(ctx.weight, ctx.qw)
        qx_t = ctx.qx_t
        if qx_t is None:
            qx_t = input_transposed(ctx.x, recipe, ctx.state.scale[X] if ctx.state is not None else ctx.x_scale)
            qx_t = Quantized(qx_t.data, kept_inverse(ctx.state, X, qx_t.scale_inv), qx_t.granularity)
        dx = fp8_mm(qdy, qw_t, ctx.compute_dtype, recipe)
        dw = fp8_mm(qdy_t, qx_t, ctx.compute_dtype, recipe)
        dbias = dy2d.sum(0) if ctx.has_bias else None
        ctx.qx_t = ctx.x = ctx.qw = ctx.qw_t = ctx.weight = ctx.x_scale = None
        dx = dx.view(ctx.x_shape)  # a placeholder's: summed over its linears, then reduce-scattered
        return dx, dw.to(ctx.weight_dtype), dbias, None, None, None, None, None, None, None, None, None

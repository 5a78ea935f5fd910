"""MXFP8 linears on devices without MX tensor cores (Hopper, CPUs), in compiled graphs.

Such a device multiplies MX operands through their exact values: e4m3 bytes times e8m0
(power-of-two) scales are exact in bf16 (and fp32), so the emulated GEMM is a bf16 matmul of
the dequantized operands (``linear.fp8_mm``). Made that way, every operand is written twice
(FP8 bytes and scales, then their values) and the transposed operands of the backward GEMMs
are transposed copies, quantized again: model A's compiled MX step ran at 0.56-0.64x bf16's
on an H100 (docs/PERFORMANCE.md, 2026-11-26 sixth session).

Here each operand's MX values are made in one pass (``mx_round``: the block amaxes, the
e8m0 scales, the FP8 rounding and the multiplication back), along its rows (1x32 blocks) or
down its columns (32x1 blocks: the 1x32 blocks of its transpose) in its own layout, and the
matmuls read transposed views: no FP8 copy, no transposed copy. The values are the
quantize-then-dequantize values bit for bit (the tests check it), so a compiled MX linear
computes what the eager one does. On CUDA ``mx_round`` is one Triton kernel, a graph op of
compiled graphs; elsewhere it is the torch reference, which the compiler fuses.
"""

from __future__ import annotations

from typing import Optional

import torch

from .formats import FP8_EMAX, FP8_MAX, Granularity
from .kernels import Quantized, quantize_reference, use_triton
from .recipes import Recipe
from .tensor import Float8Tensor
from . import triton_kernels

triton = triton_kernels.triton
if triton is not None:
    import triton.language as tl

    from .triton_kernels import _clamp_cast, _mx_scale_inv, _reciprocal


def emulation_dtype(device: torch.device, out_dtype: torch.dtype) -> torch.dtype:
    """The dtype the emulated GEMM multiplies in (``linear.fp8_mm``'s rule): bf16 on CUDA,
    where MX values are exact in it; fp64 for an fp64 model elsewhere, else fp32."""
    if device.type == "cuda":
        return torch.bfloat16
    return torch.float64 if out_dtype == torch.float64 else torch.float32


def emulated(recipe: Recipe, device: torch.device) -> bool:
    """Whether ``recipe`` is MX and ``device`` multiplies MX operands through their values."""
    return recipe.x_granularity is Granularity.MX_1x32 and not recipe.native_gemm(device)


def mx_round(x: torch.Tensor, along_rows: bool, fp8_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """The MXFP8 values of 2-D ``x`` in ``dtype``, in ``x``'s shape: quantized in 1x32 blocks
    along its rows, or (``along_rows=False``) in 32x1 blocks down its columns, as ``x.t()``
    would be along its rows; then dequantized. ``quantize(...).dequantize(dtype)`` bit for bit."""
    if x.dim() != 2:
        raise ValueError(f"mx_round expects a 2-D tensor, got shape {tuple(x.shape)}")
    if dtype in (torch.bfloat16, torch.float32) and x.numel() and use_triton(x, in_graph=True):
        return torch.ops.fsdp8.mx_round(x, along_rows, fp8_dtype == torch.float8_e5m2, dtype == torch.float32)
    if along_rows:
        return quantize_reference(x, fp8_dtype, Granularity.MX_1x32).dequantize(dtype)
    return quantize_reference(x.t(), fp8_dtype, Granularity.MX_1x32).dequantize(dtype).t()


if triton is not None:
    @triton.jit
    def _mx_round_kernel(x_ptr, out_ptr, M, K, sxm, sxk, ALONG_ROWS: tl.constexpr, E5M2: tl.constexpr,
                         BR: tl.constexpr, BC: tl.constexpr):
        """A BRxBC tile's MX values: 1x32 blocks along rows (BC == 32) or 32x1 blocks down
        columns (BR == 32), written in x's layout. Loads stay coalesced either way."""
        rm = tl.program_id(0) * BR + tl.arange(0, BR)
        rk = tl.program_id(1) * BC + tl.arange(0, BC)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
        if ALONG_ROWS:
            amax = tl.max(tl.abs(x), axis=1)
            amax = tl.where(tl.max((x != x).to(tl.int32), axis=1) > 0, float("nan"), amax)
        else:
            amax = tl.max(tl.abs(x), axis=0)
            amax = tl.where(tl.max((x != x).to(tl.int32), axis=0) > 0, float("nan"), amax)
        if E5M2:
            scale_inv = _mx_scale_inv(amax, 15)
        else:
            scale_inv = _mx_scale_inv(amax, 8)
        scale = _reciprocal(scale_inv)
        if ALONG_ROWS:
            scale, scale_inv = scale[:, None], scale_inv[:, None]
        else:
            scale, scale_inv = scale[None, :], scale_inv[None, :]
        if E5M2:
            q = _clamp_cast(x * scale, 57344.0, tl.float8e5)
        else:
            q = _clamp_cast(x * scale, 448.0, tl.float8e4nv)
        values = (q.to(tl.float32) * scale_inv).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out_ptr + rm[:, None] * K + rk[None, :], values, mask=mask)

    def _mx_round_op(x, along_rows, e5m2, out_fp32):
        m, k = x.shape
        out = torch.empty((m, k), dtype=torch.float32 if out_fp32 else torch.bfloat16, device=x.device)
        br, bc = (64, 32) if along_rows else (32, 128)
        torch.library.wrap_triton(_mx_round_kernel)[(triton.cdiv(m, br), triton.cdiv(k, bc))](
            x, out, m, k, x.stride(0), x.stride(1), ALONG_ROWS=along_rows, E5M2=e5m2, BR=br, BC=bc, num_warps=4)
        return out

    # The schema comes from annotations, as types (see triton_kernels' both-ways op).
    _mx_round_op.__annotations__ = {"x": torch.Tensor, "along_rows": bool, "e5m2": bool, "out_fp32": bool,
                                    "return": torch.Tensor}
    torch.library.triton_op("fsdp8::mx_round", _mx_round_op, mutates_args=())

# The format constants the kernel spells out (it takes plain constants only).
assert FP8_EMAX[torch.float8_e4m3fn] == 8 and FP8_EMAX[torch.float8_e5m2] == 15
assert FP8_MAX[torch.float8_e4m3fn] == 448.0 and FP8_MAX[torch.float8_e5m2] == 57344.0


def _weight_values(weight: torch.Tensor, recipe: Recipe, compute_dtype: torch.dtype, dtype: torch.dtype):
    """The weight's MX values along its rows: an engine-gathered MX weight's bytes and scales
    dequantized, or a high-precision weight quantized (as ``linear._weight_operands``)."""
    if isinstance(weight, Float8Tensor):
        return Quantized(weight._data, weight._scale_inv, Granularity.MX_1x32).dequantize(dtype)
    return mx_round(weight.detach().to(compute_dtype), True, recipe.fwd_dtype, dtype)


class _MXEmulatedLinearFn(torch.autograd.Function):
    """out = x @ w.T (+ bias) on MX values. ``x_rows`` is x's (made by the caller, so
    linears fed the same input share it once the compiler merges their subgraphs). Backward
    makes dy's values both ways, the weight's down its columns (the weight's transpose
    quantized along its rows, as ``tensor.transpose_of``) and x's down its columns."""

    @staticmethod
    def forward(ctx, x, x_rows, weight, bias, recipe: Recipe):
        compute_dtype = x.dtype
        dtype = x_rows.dtype
        out = (x_rows @ _weight_values(weight, recipe, compute_dtype, dtype).t()).to(compute_dtype)
        if bias is not None:
            out = out + bias.to(compute_dtype)
        ctx.save_for_backward(x)
        ctx.weight, ctx.recipe, ctx.dtype, ctx.has_bias = weight, recipe, dtype, bias is not None
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        recipe, dtype, weight = ctx.recipe, ctx.dtype, ctx.weight
        compute_dtype = x.dtype
        x2d = x.detach().reshape(-1, x.shape[-1])
        dy2d = dy.reshape(-1, dy.shape[-1]).to(compute_dtype)
        w_cols = mx_round(_weight_values(weight, recipe, compute_dtype, torch.float32), False, recipe.fwd_dtype, dtype)
        dx = (mx_round(dy2d, True, recipe.bwd_dtype, dtype) @ w_cols).to(compute_dtype)
        x_cols = mx_round(x2d, False, recipe.fwd_dtype, dtype)
        dw = (mx_round(dy2d, False, recipe.bwd_dtype, dtype).t() @ x_cols).to(compute_dtype)
        dbias = dy2d.sum(0) if ctx.has_bias else None
        ctx.weight = None
        return dx.view(x.shape), None, dw.to(weight.dtype), dbias, None


def mx_emulated_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], recipe: Recipe):
    """A Float8Linear's output under an emulated MX recipe (see the module's docstring)."""
    x_rows = mx_round(x.detach().reshape(-1, x.shape[-1]), True, recipe.fwd_dtype,
                      emulation_dtype(x.device, x.dtype))
    return _MXEmulatedLinearFn.apply(x, x_rows, weight, bias, recipe)

"""Experiment (issue 17): SwiGLU's backward with the block recipe's quantizations fused in.

In a block-scaled (1x128) SwiGLU MLP, ``y = down(silu(gate(x)) * up(x))``, the backward makes
from ``dh`` (the gradient of ``h = silu(g) * u``) and the saved ``g`` and ``u``:

- ``dg`` and ``du``, each quantized both ways (1x128 blocks along its rows for the input
  gradient's GEMM, along its columns, written transposed, for the weight gradient's);
- ``h`` again, quantized along its columns and written transposed, for ``down``'s weight
  gradient.

fsdp8's compiled block step does this op by op: Inductor's pass for the column amaxes of ``h``,
its elementwise backward writing ``dg`` and ``du`` in bf16 (with ``h``'s cast), and fsdp8's
both-ways kernel over each of ``dg`` and ``du``. These kernels make the same outputs from
``dh``, ``g`` and ``u`` directly, without the bf16 ``dg`` and ``du`` in between:

- ``_swiglu_backward_kernel``: one tile of 128x128 per program; each tile's three outputs are
  three programs launched next to one another, so their shared inputs come from L2;
- ``_swiglu_col_amax_kernel`` then ``_swiglu_cast_kernel`` (``two_pass``): the column amaxes
  first, then every cast, R rows of a tile at a time (few registers, no transposed tile held).

The values are those of the op-by-op code in the model's dtype: ``a = silu(g)``, ``h = a * u``,
``da = dh * u``, ``du = dh * a`` and ``dg = silu_backward(da, g)``, each rounded to the dtype
as eager rounds it (``swiglu_backward_reference``). ``FAST=0`` uses the formulas of torch's
CUDA kernels (IEEE division, libdevice's exp): bytes equal to eager's; ``FAST=1`` Triton's
approximate division and exponential; ``FAST=2`` also silu as ``g * sigmoid(g)``
(one exponential; more registers, slower). What they measured (swiglu_backward_kernels.py, H200,
2026-11-26): docs/PERFORMANCE.md. They are not in the library: the gain measured does not
make up block scaling's GEMM gap, and using them needs the MLP's three linears in one
autograd function (the fused gradients cross no autograd boundary as FP8).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from fsdp8.fp8.formats import Granularity
from fsdp8.fp8.kernels import Quantized, quantize_1x128_both_ways, quantize_transposed

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - CPU builds of torch
    triton = None


class SwiGLUGrads(NamedTuple):
    """What the fused backward hands the three GEMMs of the MLP's weight and input gradients."""

    dg: Quantized  # rows in 1x128 blocks: gate's input-gradient GEMM
    dg_t: Quantized  # dg.t(), 1x128 blocks: gate's weight-gradient GEMM
    du: Quantized
    du_t: Quantized
    h_t: Quantized  # h.t(), 1x128 blocks: down's weight-gradient GEMM


def swiglu_backward_reference(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, grad_dtype: torch.dtype,
                              fwd_dtype: torch.dtype) -> SwiGLUGrads:
    """The op-by-op code: autograd's SwiGLU backward, then fsdp8's quantizations."""
    a = F.silu(g)
    h = a * u
    dg = torch.ops.aten.silu_backward(dh * u, g)
    du = dh * a
    dg_q, dg_t = quantize_1x128_both_ways(dg, grad_dtype)
    du_q, du_t = quantize_1x128_both_ways(du, grad_dtype)
    return SwiGLUGrads(dg_q, dg_t, du_q, du_t, quantize_transposed(h, fwd_dtype, Granularity.ROW_1x128))


if triton is not None:
    from fsdp8.fp8.triton_kernels import _clamp_cast, _reciprocal, _scale_from_amax, saturating_cast

    @triton.jit
    def _amax_bits(x, axis: tl.constexpr):
        """Block amaxes as integer maxima of |x|'s bits (a NaN's lie above infinity's), as
        triton_kernels._rows_and_cols_tile finds them."""
        if x.dtype.primitive_bitwidth == 16:
            bits = x.to(tl.int16, bitcast=True) & 0x7FFF
            amax = tl.max(bits, axis=axis).to(tl.int16).to(x.dtype, bitcast=True).to(tl.float32)
        else:
            bits32 = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            amax = tl.max(bits32, axis=axis).to(tl.float32, bitcast=True)
        return amax

    @triton.jit
    def _store_cols(x, qt_ptr, st_ptr, rm, rn, M, mb, FMAX: tl.constexpr, OUT: tl.constexpr, SATURATE: tl.constexpr):
        # 128x1 blocks down the tile's columns, written transposed: 1x128 blocks of x.t().
        col_scale = _scale_from_amax(_amax_bits(x, 0), FMAX)
        q = _clamp_cast(x.to(tl.float32) * col_scale[None, :], FMAX, OUT, SATURATE)
        tl.store(qt_ptr + rn[:, None] * M + rm[None, :], tl.trans(q))
        tl.store(st_ptr + rn * (M // 128) + mb, _reciprocal(col_scale))

    @triton.jit
    def _store_both(x, q_ptr, s_ptr, qt_ptr, st_ptr, rm, rn, M, N, mb, nb, FMAX: tl.constexpr, OUT: tl.constexpr,
                    SATURATE: tl.constexpr):
        row_scale = _scale_from_amax(_amax_bits(x, 1), FMAX)
        tl.store(q_ptr + rm[:, None] * N + rn[None, :], _clamp_cast(x.to(tl.float32) * row_scale[:, None], FMAX, OUT,
                                                                    SATURATE))
        tl.store(s_ptr + rm * (N // 128) + nb, _reciprocal(row_scale))
        _store_cols(x, qt_ptr, st_ptr, rm, rn, M, mb, FMAX, OUT, SATURATE)

    @triton.jit
    def _silu(x, FAST: tl.constexpr, g=None):
        """x / (1 + exp(-g)) (g defaults to x: silu(x); x = 1: sigmoid(g)), as torch's CUDA
        kernels compute it (IEEE division, libdevice's exp) or FAST (approximations)."""
        if g is None:
            g = x
        if FAST:
            out = x / (1.0 + tl.exp(-g))
        else:
            out = tl.math.div_rn(x, 1.0 + libdevice.exp(-g))
        return out

    @triton.jit
    def _swiglu_backward_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, dg_s, dgt_ptr, dgt_s, du_ptr, du_s, dut_ptr, dut_s,
                                ht_ptr, ht_s, M, N, GRAD_E5M2: tl.constexpr, FWD_E5M2: tl.constexpr,
                                SATURATE: tl.constexpr, FAST: tl.constexpr = False):
        B: tl.constexpr = 128
        GMAX: tl.constexpr = 57344.0 if GRAD_E5M2 else 448.0
        GOUT: tl.constexpr = tl.float8e5 if GRAD_E5M2 else tl.float8e4nv
        HMAX: tl.constexpr = 57344.0 if FWD_E5M2 else 448.0
        HOUT: tl.constexpr = tl.float8e5 if FWD_E5M2 else tl.float8e4nv
        # Each tile's three outputs are three programs, launched next to one another (the
        # output is the grid's fastest index), so the inputs they share come from L2 after the
        # first read. One program making all three held three tiles: 255 registers at 8
        # warps, 0.89 ms at best for model A's 8192 x 8192 (FAST=0), against 0.90 for this.
        which, tile = tl.program_id(0), tl.program_id(1)
        mb, nb = tile // (N // B), tile % (N // B)
        rm = mb * B + tl.arange(0, B)
        rn = nb * B + tl.arange(0, B)
        offs = rm[:, None] * N + rn[None, :]
        dt = g_ptr.dtype.element_ty
        if which == 0:
            # h = silu(g) * u for down's weight gradient, each op rounded as eager rounds it,
            # with torch's CUDA formula for silu.
            g = tl.load(g_ptr + offs).to(tl.float32)
            a = _silu(g, FAST).to(dt).to(tl.float32)
            h = (a * tl.load(u_ptr + offs).to(tl.float32)).to(dt)
            _store_cols(h, ht_ptr, ht_s, rm, rn, M, mb, HMAX, HOUT, SATURATE)
        elif which == 1:
            g = tl.load(g_ptr + offs).to(tl.float32)
            a = _silu(g, FAST).to(dt).to(tl.float32)
            du = (tl.load(dh_ptr + offs).to(tl.float32) * a).to(dt)
            _store_both(du, du_ptr, du_s, dut_ptr, dut_s, rm, rn, M, N, mb, nb, GMAX, GOUT, SATURATE)
        else:
            # dg = silu_backward(dh * u, g), torch's CUDA formula.
            da = (tl.load(dh_ptr + offs).to(tl.float32) * tl.load(u_ptr + offs).to(tl.float32)).to(dt).to(tl.float32)
            g = tl.load(g_ptr + offs).to(tl.float32)
            s = _silu(g * 0.0 + 1.0, FAST, g)
            dg = (da * s * (1.0 + g * (1.0 - s))).to(dt)
            _store_both(dg, dg_ptr, dg_s, dgt_ptr, dgt_s, rm, rn, M, N, mb, nb, GMAX, GOUT, SATURATE)

    @triton.jit
    def _swiglu_values(dh_ptr, g_ptr, u_ptr, offs, FAST: tl.constexpr):
        """h, du and dg at ``offs``, each op rounded to the inputs' dtype as eager rounds it."""
        dt = g_ptr.dtype.element_ty
        g = tl.load(g_ptr + offs).to(tl.float32)
        u = tl.load(u_ptr + offs).to(tl.float32)
        dh = tl.load(dh_ptr + offs).to(tl.float32)
        s = _silu(g * 0.0 + 1.0, FAST, g)
        if FAST == 2:  # silu as g * sigmoid(g), as Inductor writes it: one exponential, one division
            a = (g * s).to(dt).to(tl.float32)
        else:
            a = _silu(g, FAST).to(dt).to(tl.float32)
        da = (dh * u).to(dt).to(tl.float32)
        return (a * u).to(dt), (dh * a).to(dt), (da * s * (1.0 + g * (1.0 - s))).to(dt)

    @triton.jit
    def _col_amaxes(dh_ptr, g_ptr, u_ptr, mb, rn, N, R: tl.constexpr, FAST: tl.constexpr):
        """The amaxes of h's, du's and dg's 128x1 column blocks in tile (mb, rn), R rows at a time."""
        h_max = tl.zeros((128, ), dtype=tl.float32)
        du_max = tl.zeros((128, ), dtype=tl.float32)
        dg_max = tl.zeros((128, ), dtype=tl.float32)
        for r in tl.static_range(0, 128, R):
            rm = mb * 128 + r + tl.arange(0, R)
            h, du, dg = _swiglu_values(dh_ptr, g_ptr, u_ptr, rm[:, None] * N + rn[None, :], FAST)
            h_max = tl.maximum(h_max, _amax_bits(h, 0), propagate_nan=tl.PropagateNan.ALL)
            du_max = tl.maximum(du_max, _amax_bits(du, 0), propagate_nan=tl.PropagateNan.ALL)
            dg_max = tl.maximum(dg_max, _amax_bits(dg, 0), propagate_nan=tl.PropagateNan.ALL)
        return h_max, du_max, dg_max

    @triton.jit
    def _swiglu_col_amax_kernel(dh_ptr, g_ptr, u_ptr, amax_ptr, M, N, R: tl.constexpr, FAST: tl.constexpr):
        """Pass 1: the column blocks' amaxes into amax_ptr ((3, N, M / 128) fp32)."""
        mb, nb = tl.program_id(0), tl.program_id(1)
        rn = nb * 128 + tl.arange(0, 128)
        h_max, du_max, dg_max = _col_amaxes(dh_ptr, g_ptr, u_ptr, mb, rn, N, R, FAST)
        at = rn * (M // 128) + mb
        tl.store(amax_ptr + at, h_max)
        tl.store(amax_ptr + N * (M // 128) + at, du_max)
        tl.store(amax_ptr + 2 * N * (M // 128) + at, dg_max)

    @triton.jit
    def _cast_chunk(x, col_scale, q_ptr, s_ptr, qt_ptr, rm, rn, M, N, nb, ROWS: tl.constexpr, FMAX: tl.constexpr,
                    OUT: tl.constexpr, SATURATE: tl.constexpr):
        if ROWS:
            row_scale = _scale_from_amax(_amax_bits(x, 1), FMAX)
            tl.store(q_ptr + rm[:, None] * N + rn[None, :],
                     _clamp_cast(x.to(tl.float32) * row_scale[:, None], FMAX, OUT, SATURATE))
            tl.store(s_ptr + rm * (N // 128) + nb, _reciprocal(row_scale))
        q = _clamp_cast(x.to(tl.float32) * col_scale[None, :], FMAX, OUT, SATURATE)
        tl.store(qt_ptr + rn[:, None] * M + rm[None, :], tl.trans(q))

    @triton.jit
    def _cast_tile(dh_ptr, g_ptr, u_ptr, h_max, du_max, dg_max, dg_ptr, dg_s, dgt_ptr, dgt_s, du_ptr, du_s, dut_ptr,
                   dut_s, ht_ptr, ht_s, mb, nb, rn, M, N, GRAD_E5M2: tl.constexpr, FWD_E5M2: tl.constexpr,
                   SATURATE: tl.constexpr, R: tl.constexpr, FAST: tl.constexpr):
        """The values again, R rows at a time: du and dg in 1x128 row blocks (their scales found
        here), and h, du and dg by column blocks with the given column amaxes."""
        GMAX: tl.constexpr = 57344.0 if GRAD_E5M2 else 448.0
        GOUT: tl.constexpr = tl.float8e5 if GRAD_E5M2 else tl.float8e4nv
        HMAX: tl.constexpr = 57344.0 if FWD_E5M2 else 448.0
        HOUT: tl.constexpr = tl.float8e5 if FWD_E5M2 else tl.float8e4nv
        at = rn * (M // 128) + mb
        h_scale = _scale_from_amax(h_max, HMAX)
        du_scale = _scale_from_amax(du_max, GMAX)
        dg_scale = _scale_from_amax(dg_max, GMAX)
        tl.store(ht_s + at, _reciprocal(h_scale))
        tl.store(dut_s + at, _reciprocal(du_scale))
        tl.store(dgt_s + at, _reciprocal(dg_scale))
        for r in tl.static_range(0, 128, R):
            rm = mb * 128 + r + tl.arange(0, R)
            h, du, dg = _swiglu_values(dh_ptr, g_ptr, u_ptr, rm[:, None] * N + rn[None, :], FAST)
            _cast_chunk(h, h_scale, ht_ptr, ht_s, ht_ptr, rm, rn, M, N, nb, False, HMAX, HOUT, SATURATE)
            _cast_chunk(du, du_scale, du_ptr, du_s, dut_ptr, rm, rn, M, N, nb, True, GMAX, GOUT, SATURATE)
            _cast_chunk(dg, dg_scale, dg_ptr, dg_s, dgt_ptr, rm, rn, M, N, nb, True, GMAX, GOUT, SATURATE)

    @triton.jit
    def _swiglu_cast_kernel(dh_ptr, g_ptr, u_ptr, amax_ptr, dg_ptr, dg_s, dgt_ptr, dgt_s, du_ptr, du_s, dut_ptr,
                            dut_s, ht_ptr, ht_s, M, N, GRAD_E5M2: tl.constexpr, FWD_E5M2: tl.constexpr,
                            SATURATE: tl.constexpr, R: tl.constexpr, FAST: tl.constexpr):
        """Pass 2: every cast, with pass 1's column amaxes."""
        mb, nb = tl.program_id(0), tl.program_id(1)
        rn = nb * 128 + tl.arange(0, 128)
        at = rn * (M // 128) + mb
        _cast_tile(dh_ptr, g_ptr, u_ptr, tl.load(amax_ptr + at), tl.load(amax_ptr + N * (M // 128) + at),
                   tl.load(amax_ptr + 2 * N * (M // 128) + at), dg_ptr, dg_s, dgt_ptr, dgt_s, du_ptr, du_s, dut_ptr,
                   dut_s, ht_ptr, ht_s, mb, nb, rn, M, N, GRAD_E5M2, FWD_E5M2, SATURATE, R, FAST)

    @triton.jit
    def _swiglu_reread_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, dg_s, dgt_ptr, dgt_s, du_ptr, du_s, dut_ptr, dut_s, ht_ptr,
                              ht_s, M, N, GRAD_E5M2: tl.constexpr, FWD_E5M2: tl.constexpr, SATURATE: tl.constexpr,
                              R: tl.constexpr, FAST: tl.constexpr):
        """Both passes in one program: the tile's second read comes from L2 (96 KB just read)."""
        mb, nb = tl.program_id(0), tl.program_id(1)
        rn = nb * 128 + tl.arange(0, 128)
        h_max, du_max, dg_max = _col_amaxes(dh_ptr, g_ptr, u_ptr, mb, rn, N, R, FAST)
        _cast_tile(dh_ptr, g_ptr, u_ptr, h_max, du_max, dg_max, dg_ptr, dg_s, dgt_ptr, dgt_s, du_ptr, du_s, dut_ptr,
                   dut_s, ht_ptr, ht_s, mb, nb, rn, M, N, GRAD_E5M2, FWD_E5M2, SATURATE, R, FAST)

    def two_pass(dh, g, u, outs, grad_e5m2, fwd_e5m2, rows=32, warps=4, fast=0, reread=False):
        """The two passes into ``outs`` (dg, its scales, dg_t, ..., h_t's scales, as SwiGLUGrads
        orders them); ``reread``: both in one program (_swiglu_reread_kernel)."""
        m, n = dh.shape
        dg, dg_s, dgt, dgt_s, du, du_s, dut, dut_s, ht, ht_s = outs
        amaxes = torch.empty((3, n, m // 128), dtype=torch.float32, device=dh.device)
        grid = (m // 128, n // 128)
        if reread:
            _swiglu_reread_kernel[grid](dh, g, u, dg, dg_s, dgt, dgt_s, du, du_s, dut, dut_s, ht, ht_s, m, n,
                                        GRAD_E5M2=grad_e5m2, FWD_E5M2=fwd_e5m2, SATURATE=saturating_cast(dh.device),
                                        R=rows, FAST=fast, num_warps=warps)
            return
        _swiglu_col_amax_kernel[grid](dh, g, u, amaxes, m, n, R=rows, FAST=fast, num_warps=warps)
        _swiglu_cast_kernel[grid](dh, g, u, amaxes, dg, dg_s, dgt, dgt_s, du, du_s, dut, dut_s, ht, ht_s, m, n,
                                          GRAD_E5M2=grad_e5m2, FWD_E5M2=fwd_e5m2, SATURATE=saturating_cast(dh.device),
                                          R=rows, FAST=fast, num_warps=warps)

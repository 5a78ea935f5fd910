"""SwiGLU's backward with block scaling's quantizations fused in (issue 17).

In a block-scaled SwiGLU MLP, ``y = down(silu(gate(x)) * up(x))`` (fp8/mlp.py), the backward
makes from ``dh`` (the gradient of ``h = silu(g) * u``) and the saved ``g`` and ``u``:

- ``dg`` and ``du``, each quantized both ways: 1x128 blocks along its rows for the input
  gradient's GEMM, and along its columns, written transposed, for the weight gradient's;
- ``h`` again, quantized along its columns and written transposed, for ``down``'s weight
  gradient.

Op by op, a compiled step runs Inductor's column amaxes of ``h``, its elementwise backward
writing ``dg`` and ``du`` in bf16, and the both-ways kernel over each: 0.72 ms for model A's
8192 x 8192 on an H200. Two passes over the inputs without the bf16 ``dg`` and ``du`` take
0.46 ms (benchmarks/debug/swiglu_backward_kernels.py): the column amaxes of all three, then
every cast, R rows of a 128x128 tile at a time. (Holding whole tiles took every register and
ran slower; docs/PERFORMANCE.md, 2026-11-26 third session.)

Values: those of the op-by-op code in the model's dtype, ``a = silu(g)``, ``h = a * u``,
``da = dh * u``, ``du = dh * a``, ``dg = silu_backward(da, g)``, each op rounded to the dtype
as eager rounds it (``swiglu_backward_reference``, the code CPUs and compiled CPU graphs run).
The kernels use Triton's approximate exponential and division: a value may land one ulp of
the dtype from eager's (one byte of 67 million in the H200 check; ``EXACT=True``, torch's own
CUDA formulas, gives eager's bytes and 1.6 ms). A compiled op-by-op graph is further off:
Inductor does not round between fused ops.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import torch
import torch.nn.functional as F

from .formats import Granularity
from .kernels import Quantized, quantize_1x128_both_ways, quantize_transposed, use_triton

try:  # Triton ships with CUDA builds of torch; CPU builds have none.
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - CPU-only machines
    triton = None

# Rows of a tile per step and warps of each pass (benchmarks/debug/swiglu_backward_kernels.py,
# model A's 8192 x 8192 on an H200): the amax pass alone 0.17 ms (32 rows: 0.20; 32 rows at 8
# warps: 0.31); both passes 0.46 ms (the cast at 4 warps: 0.49; 64 cast rows at 8 warps: 0.52;
# 16 cast rows at 4 warps: 0.89).
AMAX_ROWS, AMAX_WARPS = 16, 4
CAST_ROWS, CAST_WARPS = 32, 8


class SwiGLUGrads(NamedTuple):
    """What the fused backward hands the MLP's GEMMs."""

    dg: Quantized  # 1x128 blocks along rows: gate's input-gradient GEMM
    dg_t: Quantized  # dg.t() likewise: gate's weight-gradient GEMM
    du: Quantized
    du_t: Quantized
    h_t: Quantized  # h.t(): down's weight-gradient GEMM

    @classmethod
    def from_outputs(cls, outs) -> "SwiGLUGrads":
        """From the kernels' ten outputs (dg, its scales, dg.t(), its scales, ..., h.t()'s scales)."""
        return cls(*(Quantized(outs[i], outs[i + 1], Granularity.ROW_1x128) for i in range(0, 10, 2)))


def swiglu_backward_reference(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, grad_dtype: torch.dtype,
                              fwd_dtype: torch.dtype) -> SwiGLUGrads:
    """The op-by-op code: autograd's SwiGLU backward, then fsdp8's quantizations."""
    a = F.silu(g)
    dg = torch.ops.aten.silu_backward(dh * u, g)
    du = dh * a
    dg_q, dg_t = quantize_1x128_both_ways(dg, grad_dtype)
    du_q, du_t = quantize_1x128_both_ways(du, grad_dtype)
    return SwiGLUGrads(dg_q, dg_t, du_q, du_t, quantize_transposed(a * u, fwd_dtype, Granularity.ROW_1x128))


def swiglu_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, grad_dtype: torch.dtype,
                    fwd_dtype: torch.dtype) -> SwiGLUGrads:
    """``swiglu_backward_reference``'s results for 2-D ``dh``, ``g``, ``u`` of one shape and
    dtype: in two passes on CUDA (whole 128x128 tiles), else by the reference code."""
    if not (dh.dim() == 2 and dh.shape[0] % 128 == 0 and dh.shape[1] % 128 == 0 and dh.numel()
            and g.shape == u.shape == dh.shape and g.dtype == u.dtype == dh.dtype
            and dh.dtype in (torch.bfloat16, torch.float16, torch.float32) and use_triton(dh, in_graph=True)):
        return swiglu_backward_reference(dh, g, u, grad_dtype, fwd_dtype)
    return SwiGLUGrads.from_outputs(torch.ops.fsdp8.swiglu_backward_quantized(
        dh.contiguous(), g.contiguous(), u.contiguous(), grad_dtype == torch.float8_e5m2, fwd_dtype == torch.float8_e5m2))


if triton is not None:
    from .triton_kernels import _clamp_cast, _reciprocal, _scale_from_amax, saturating_cast, scale_blocks_outer_major

    @triton.jit
    def _over_one_plus_exp(x, g, EXACT: tl.constexpr):
        """x / (1 + exp(-g)): silu(g) for x = g, sigmoid(g) for x = 1. EXACT: IEEE division and
        libdevice's exp, as torch's CUDA kernels compute it; else Triton's approximations."""
        if EXACT:
            out = tl.math.div_rn(x, 1.0 + libdevice.exp(-g))
        else:
            out = x / (1.0 + tl.exp(-g))
        return out

    @triton.jit
    def _swiglu_values(dh_ptr, g_ptr, u_ptr, offs, EXACT: tl.constexpr):
        """h, du and dg at ``offs``, each op rounded to the inputs' dtype as eager rounds it."""
        dt = g_ptr.dtype.element_ty
        g = tl.load(g_ptr + offs).to(tl.float32)
        u = tl.load(u_ptr + offs).to(tl.float32)
        dh = tl.load(dh_ptr + offs).to(tl.float32)
        s = _over_one_plus_exp(g * 0.0 + 1.0, g, EXACT)
        a = _over_one_plus_exp(g, g, EXACT).to(dt).to(tl.float32)
        da = (dh * u).to(dt).to(tl.float32)
        return (a * u).to(dt), (dh * a).to(dt), (da * s * (1.0 + g * (1.0 - s))).to(dt)

    @triton.jit
    def _abs_bits(x):
        """|x|'s bits as an integer of x's width: they order as the values do, and a NaN's lie
        above infinity's, so a block holding a NaN gets a NaN amax (as torch.amax)."""
        if x.dtype.primitive_bitwidth == 16:
            bits = x.to(tl.int16, bitcast=True) & 0x7FFF
        else:
            bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        return bits

    @triton.jit
    def _bits_amax(bits, dt: tl.constexpr, axis: tl.constexpr):
        """Maxima of _abs_bits values along ``axis``, as fp32 values of dtype ``dt``."""
        return tl.max(bits, axis=axis).to(bits.dtype).to(dt, bitcast=True).to(tl.float32)

    @triton.jit
    def _col_amaxes(dh_ptr, g_ptr, u_ptr, mb, rn, N, R: tl.constexpr, EXACT: tl.constexpr):
        """The amaxes of h's, du's and dg's 128x1 column blocks in tile (mb, rn), R rows at a
        time: elementwise maxima over the steps, one reduction across rows at the end (one at
        every step waits on shared memory each time: 0.29 against 0.17 ms on model A)."""
        dt = g_ptr.dtype.element_ty
        rm = mb * 128 + tl.arange(0, R)
        h, du, dg = _swiglu_values(dh_ptr, g_ptr, u_ptr, rm[:, None] * N + rn[None, :], EXACT)
        h_run, du_run, dg_run = _abs_bits(h), _abs_bits(du), _abs_bits(dg)
        for r in tl.static_range(R, 128, R):
            rm = mb * 128 + r + tl.arange(0, R)
            h, du, dg = _swiglu_values(dh_ptr, g_ptr, u_ptr, rm[:, None] * N + rn[None, :], EXACT)
            h_run = tl.maximum(h_run, _abs_bits(h))
            du_run = tl.maximum(du_run, _abs_bits(du))
            dg_run = tl.maximum(dg_run, _abs_bits(dg))
        return _bits_amax(h_run, dt, 0), _bits_amax(du_run, dt, 0), _bits_amax(dg_run, dt, 0)

    @triton.jit
    def _swiglu_col_amax_kernel(dh_ptr, g_ptr, u_ptr, amax_ptr, M, N, R: tl.constexpr, EXACT: tl.constexpr):
        """Pass 1: the column blocks' amaxes into amax_ptr ((3, N, M / 128) fp32)."""
        mb, nb = tl.program_id(0), tl.program_id(1)
        rn = nb * 128 + tl.arange(0, 128)
        h_max, du_max, dg_max = _col_amaxes(dh_ptr, g_ptr, u_ptr, mb, rn, N, R, EXACT)
        at = rn * (M // 128) + mb
        tl.store(amax_ptr + at, h_max)
        tl.store(amax_ptr + N * (M // 128) + at, du_max)
        tl.store(amax_ptr + 2 * N * (M // 128) + at, dg_max)

    @triton.jit
    def _cast_chunk(x, col_scale, q_ptr, s_ptr, qt_ptr, rm, rn, M, N, nb, ROWS: tl.constexpr, FMAX: tl.constexpr,
                    OUT: tl.constexpr, SATURATE: tl.constexpr):
        """R rows of a tile cast by column blocks (written transposed) and, with ROWS, by row
        blocks (their scales found here: a row block lies in the chunk)."""
        if ROWS:
            row_scale = _scale_from_amax(_bits_amax(_abs_bits(x), x.dtype, 1), FMAX)
            tl.store(q_ptr + rm[:, None] * N + rn[None, :],
                     _clamp_cast(x.to(tl.float32) * row_scale[:, None], FMAX, OUT, SATURATE))
            tl.store(s_ptr + nb * M + rm, _reciprocal(row_scale))  # outer-major, as cuBLAS reads them
        q = _clamp_cast(x.to(tl.float32) * col_scale[None, :], FMAX, OUT, SATURATE)
        tl.store(qt_ptr + rn[:, None] * M + rm[None, :], tl.trans(q))

    @triton.jit
    def _cast_tile(dh_ptr, g_ptr, u_ptr, h_max, du_max, dg_max, dg_ptr, dg_s, dgt_ptr, dgt_s, du_ptr, du_s, dut_ptr,
                   dut_s, ht_ptr, ht_s, mb, nb, rn, M, N, GRAD_E5M2: tl.constexpr, FWD_E5M2: tl.constexpr,
                   SATURATE: tl.constexpr, R: tl.constexpr, EXACT: tl.constexpr):
        """Tile (mb, rn)'s values again, R rows at a time, cast with the given column amaxes."""
        GMAX: tl.constexpr = 57344.0 if GRAD_E5M2 else 448.0
        GOUT: tl.constexpr = tl.float8e5 if GRAD_E5M2 else tl.float8e4nv
        HMAX: tl.constexpr = 57344.0 if FWD_E5M2 else 448.0
        HOUT: tl.constexpr = tl.float8e5 if FWD_E5M2 else tl.float8e4nv
        at = mb * N + rn  # the transposes' scales, outer-major as cuBLAS reads them
        h_scale = _scale_from_amax(h_max, HMAX)
        du_scale = _scale_from_amax(du_max, GMAX)
        dg_scale = _scale_from_amax(dg_max, GMAX)
        tl.store(ht_s + at, _reciprocal(h_scale))
        tl.store(dut_s + at, _reciprocal(du_scale))
        tl.store(dgt_s + at, _reciprocal(dg_scale))
        for r in tl.static_range(0, 128, R):
            rm = mb * 128 + r + tl.arange(0, R)
            h, du, dg = _swiglu_values(dh_ptr, g_ptr, u_ptr, rm[:, None] * N + rn[None, :], EXACT)
            _cast_chunk(h, h_scale, ht_ptr, ht_s, ht_ptr, rm, rn, M, N, nb, False, HMAX, HOUT, SATURATE)
            _cast_chunk(du, du_scale, du_ptr, du_s, dut_ptr, rm, rn, M, N, nb, True, GMAX, GOUT, SATURATE)
            _cast_chunk(dg, dg_scale, dg_ptr, dg_s, dgt_ptr, rm, rn, M, N, nb, True, GMAX, GOUT, SATURATE)

    @triton.jit
    def _swiglu_cast_kernel(dh_ptr, g_ptr, u_ptr, amax_ptr, dg_ptr, dg_s, dgt_ptr, dgt_s, du_ptr, du_s, dut_ptr,
                            dut_s, ht_ptr, ht_s, M, N, GRAD_E5M2: tl.constexpr, FWD_E5M2: tl.constexpr,
                            SATURATE: tl.constexpr, R: tl.constexpr, EXACT: tl.constexpr):
        """Pass 2: every cast, with pass 1's column amaxes."""
        mb, nb = tl.program_id(0), tl.program_id(1)
        rn = nb * 128 + tl.arange(0, 128)
        at = rn * (M // 128) + mb
        _cast_tile(dh_ptr, g_ptr, u_ptr, tl.load(amax_ptr + at), tl.load(amax_ptr + N * (M // 128) + at),
                   tl.load(amax_ptr + 2 * N * (M // 128) + at), dg_ptr, dg_s, dgt_ptr, dgt_s, du_ptr, du_s, dut_ptr,
                   dut_s, ht_ptr, ht_s, mb, nb, rn, M, N, GRAD_E5M2, FWD_E5M2, SATURATE, R, EXACT)

    def swiglu_backward_outputs(dh: torch.Tensor, grad_dtype: torch.dtype, fwd_dtype: torch.dtype):
        """Empty outputs for the two passes: (dg, its scales, dg.t(), its scales, du, ..., h.t()'s scales)."""
        m, n = dh.shape

        def pair(rows, cols, dtype):
            return [torch.empty((rows, cols), dtype=dtype, device=dh.device),
                    scale_blocks_outer_major(rows, cols // 128, dh.device)]

        return (pair(m, n, grad_dtype) + pair(n, m, grad_dtype) + pair(m, n, grad_dtype) + pair(n, m, grad_dtype)
                + pair(n, m, fwd_dtype))

    def two_passes(dh, g, u, outs, grad_e5m2: bool, fwd_e5m2: bool, exact: bool = False, launch=lambda kernel: kernel,
                   amax_rows: int = AMAX_ROWS, cast_rows: int = CAST_ROWS, amax_warps: int = AMAX_WARPS,
                   cast_warps: int = CAST_WARPS):
        """Both passes into ``outs`` (swiglu_backward_outputs). ``launch`` wraps each kernel (a
        compiled graph's wrap_triton)."""
        m, n = dh.shape
        amaxes = torch.empty((3, n, m // 128), dtype=torch.float32, device=dh.device)
        grid = (m // 128, n // 128)
        launch(_swiglu_col_amax_kernel)[grid](dh, g, u, amaxes, m, n, R=amax_rows, EXACT=exact, num_warps=amax_warps)
        launch(_swiglu_cast_kernel)[grid](dh, g, u, amaxes, *outs, m, n, GRAD_E5M2=grad_e5m2, FWD_E5M2=fwd_e5m2,
                                          SATURATE=saturating_cast(dh.device), R=cast_rows, EXACT=exact,
                                          num_warps=cast_warps)

    def _swiglu_backward_op(dh, g, u, grad_e5m2, fwd_e5m2):
        outs = swiglu_backward_outputs(dh, torch.float8_e5m2 if grad_e5m2 else torch.float8_e4m3fn,
                                       torch.float8_e5m2 if fwd_e5m2 else torch.float8_e4m3fn)
        two_passes(dh, g, u, outs, grad_e5m2, fwd_e5m2, launch=torch.library.wrap_triton)
        return tuple(outs)

    # A graph op, as the both-ways quantization ([Note: a Triton kernel inside compiled graphs]
    # in triton_kernels.py); the schema comes from annotations given as types.
    _swiglu_backward_op.__annotations__ = {"dh": torch.Tensor, "g": torch.Tensor, "u": torch.Tensor,
                                           "grad_e5m2": bool, "fwd_e5m2": bool, "return": Tuple[(torch.Tensor, ) * 10]}
    torch.library.triton_op("fsdp8::swiglu_backward_quantized", _swiglu_backward_op, mutates_args=())

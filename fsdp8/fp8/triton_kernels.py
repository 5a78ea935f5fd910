"""Triton versions of the FP8 kernels in kernels.py, bit for bit the same results on CUDA:
the activation and gradient kernels (quantize, cast + transpose, both-ways 1x128,
dequantize) and the cast and scale helpers; triton_weights.py has the engine's weight kernels.
They return plain tensors: kernels.py chooses them and wraps the results.

Exactness rules: fp32 products, IEEE divisions (``div_rn``), clamps that keep NaN, and
round-to-nearest-even conversion; block amaxes are maxima (order-free). A NaN anywhere in a
block makes that block's amax NaN, as ``torch.amax`` does.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from .formats import FP8_EMAX, FP8_MAX, Granularity

try:  # Triton ships with CUDA builds of torch; CPU builds have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the Triton kernels can run (asked for every cast: cached, as CUDA's presence in a
    process does not change)."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:
    @triton.jit
    def _clamp_cast(y, FMAX: tl.constexpr, OUT: tl.constexpr, SATURATE: tl.constexpr = False):
        """round_to_nearest_even(clamp(y, -FMAX, FMAX)) in OUT. SATURATE (see saturating_cast):
        the cast itself saturates on this GPU, so the clamp would change no byte."""
        if not SATURATE:
            y = tl.maximum(y, -FMAX, propagate_nan=tl.PropagateNan.ALL)
            y = tl.minimum(y, FMAX, propagate_nan=tl.PropagateNan.ALL)
        return y.to(OUT, fp_downcast_rounding="rtne")

    @triton.jit
    def _reciprocal(x):
        return tl.math.div_rn(x * 0.0 + 1.0, x)

    @triton.jit
    def _scale_from_amax(amax, FMAX: tl.constexpr):
        raw = tl.math.div_rn(amax * 0.0 + FMAX, amax)
        good = (amax > 0) & (amax < float("inf")) & (raw < float("inf"))
        return tl.where(good, raw, 1.0)

    @triton.jit
    def _mx_scale_inv(amax, EMAX: tl.constexpr):
        exponent = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        biased = tl.minimum(tl.maximum(exponent - EMAX, 0), 254)
        biased = tl.where(amax != amax, 255, biased)
        normal = (biased << 23).to(tl.float32, bitcast=True)
        inv = tl.where(biased == 0, 5.877471754111438e-39, normal)  # 2**-127
        return tl.where(biased == 255, float("nan"), inv)

    @triton.jit
    def _cast_transpose_kernel(x_ptr, q_ptr, qt_ptr, amax_ptr, scale_ptr, partial_ptr, sinv_ptr, M, K, sxm, sxk,
                               FMAX: tl.constexpr, OUT: tl.constexpr, SCALE_FROM_AMAX: tl.constexpr,
                               RELOAD_T: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
        """Quantize x and write it twice (row-major and transposed). Current scaling: the scale
        comes from the amax computed before (amax_ptr). Delayed scaling: the scale is given and
        each program writes its tile's amax to partial_ptr (no atomics: they serialize)."""
        pid_m, pid_k = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rk = pid_k * BK + tl.arange(0, BK)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
        if SCALE_FROM_AMAX:
            scale = _scale_from_amax(tl.load(amax_ptr), FMAX)
        else:
            scale = tl.load(scale_ptr)
            tile = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
            has_nan = tl.max(tl.max((x != x).to(tl.int32), axis=1), axis=0) > 0
            tl.store(partial_ptr + pid_m * tl.num_programs(1) + pid_k, tl.where(has_nan, float("nan"), tile))
        if (pid_m == 0) & (pid_k == 0):
            tl.store(sinv_ptr, _reciprocal(scale))
        q = _clamp_cast(x * scale, FMAX, OUT)
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)
        mask_t = (rk[:, None] < K) & (rm[None, :] < M)
        if RELOAD_T:
            # Transposing 8-bit values converted from fp32 miscompiles in Triton 3.6 (seen on
            # H100): read the tile again transposed instead.
            xt = tl.load(x_ptr + rk[:, None] * sxk + rm[None, :] * sxm, mask=mask_t, other=0.0).to(tl.float32)
            tl.store(qt_ptr + rk[:, None] * M + rm[None, :], _clamp_cast(xt * scale, FMAX, OUT), mask=mask_t)
        else:
            tl.store(qt_ptr + rk[:, None] * M + rm[None, :], tl.trans(q), mask=mask_t)

    @triton.jit
    def _row_blocks_kernel(x_ptr, q_ptr, sinv_ptr, M, K, sxm, sxk, KB,
                           FMAX: tl.constexpr, EMAX: tl.constexpr, MX: tl.constexpr, OUT: tl.constexpr,
                           TM: tl.constexpr, BK: tl.constexpr):
        """1xBK blocks (1x128, or 1x32 with power-of-two scales): TM rows per program."""
        rm = tl.program_id(0) * TM + tl.arange(0, TM)
        kb = tl.program_id(1)
        rk = kb * BK + tl.arange(0, BK)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        amax = tl.where(tl.max((x != x).to(tl.int32), axis=1) > 0, float("nan"), amax)
        if MX:
            scale_inv = _mx_scale_inv(amax, EMAX)
            scale = _reciprocal(scale_inv)
        else:
            scale = _scale_from_amax(amax, FMAX)
            scale_inv = _reciprocal(scale)
        q = _clamp_cast(x * scale[:, None], FMAX, OUT)
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)
        tl.store(sinv_ptr + rm * KB + kb, scale_inv, mask=rm < M)

    @triton.jit
    def _dequantize_rows_kernel(q_ptr, sinv_ptr, out_ptr, M, K, KB, TM: tl.constexpr, BK: tl.constexpr):
        """1xBK-block FP8 to a float dtype: one fp32 product per element (exact for MX's
        powers of two), rounded to nearest-even into the output dtype, as the reference."""
        rm = tl.program_id(0) * TM + tl.arange(0, TM)
        kb = tl.program_id(1)
        rk = kb * BK + tl.arange(0, BK)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        q = tl.load(q_ptr + rm[:, None] * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        sinv = tl.load(sinv_ptr + rm * KB + kb, mask=rm < M, other=1.0)
        out = (q * sinv[:, None]).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out_ptr + rm[:, None] * K + rk[None, :], out, mask=mask)

    @triton.jit
    def _rows_and_cols_kernel(x_ptr, q_ptr, qt_ptr, sinv_ptr, sinv_t_ptr, M, K, sxm, sxk, KB, MB,
                              FMAX: tl.constexpr, OUT: tl.constexpr, RELOAD_T: tl.constexpr, B: tl.constexpr,
                              SATURATE: tl.constexpr):
        _rows_and_cols_tile(x_ptr, q_ptr, qt_ptr, sinv_ptr, sinv_t_ptr, M, K, sxm, sxk, KB, MB, tl.program_id(0),
                            tl.program_id(1), FMAX, OUT, RELOAD_T, B, SATURATE)

    @triton.jit
    def _rows_and_cols_op_kernel(x_ptr, q_ptr, qt_ptr, sinv_ptr, sinv_t_ptr, M, K, sxm, sxk, KB, MB,
                                 E5M2: tl.constexpr, RELOAD_T: tl.constexpr, B: tl.constexpr,
                                 SATURATE: tl.constexpr):
        """The same for a compiled graph, which takes plain constants only (no Triton dtype)."""
        if E5M2:
            _rows_and_cols_tile(x_ptr, q_ptr, qt_ptr, sinv_ptr, sinv_t_ptr, M, K, sxm, sxk, KB, MB, tl.program_id(0),
                                tl.program_id(1), 57344.0, tl.float8e5, RELOAD_T, B, SATURATE)
        else:
            _rows_and_cols_tile(x_ptr, q_ptr, qt_ptr, sinv_ptr, sinv_t_ptr, M, K, sxm, sxk, KB, MB, tl.program_id(0),
                                tl.program_id(1), 448.0, tl.float8e4nv, RELOAD_T, B, SATURATE)

    @triton.jit
    def _rows_and_cols_tile(x_ptr, q_ptr, qt_ptr, sinv_ptr, sinv_t_ptr, M, K, sxm, sxk, KB, MB, mb, kb,
                            FMAX: tl.constexpr, OUT: tl.constexpr, RELOAD_T: tl.constexpr, B: tl.constexpr,
                            SATURATE: tl.constexpr):
        """Tile (mb, kb), BxB, read once, quantized two ways: 1xB blocks along its rows (written
        row-major) and Bx1 blocks down its columns (written transposed, i.e. 1xB blocks of
        x.t()). An activation or gradient needs both for its two GEMMs."""
        rm = mb * B + tl.arange(0, B)
        rk = kb * B + tl.arange(0, B)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        # The tile stays in its own dtype (maxima are exact in it) and is widened to fp32 only
        # to be scaled: 0.173 against 0.207 ms for a bf16 8192x8192 gradient on an H200, the
        # same bytes (benchmarks/debug/both_ways_kernels.py, which also shows the layouts
        # that were slower: column or row strips in two passes, fewer registers, pipelining).
        # With the amaxes as integer maxima and the saturating cast: 0.130 ms.
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0)
        # Block amaxes as integer maxima of |x|'s bits: they order as the values do, and a NaN's
        # lie above infinity's, so a block holding a NaN gets a NaN amax. (Separate NaN flags
        # and their two reductions took registers enough to halve the occupancy, ncu 2026-11-26;
        # written inline: the same code in helper functions compiled to more registers.)
        if x.dtype.primitive_bitwidth == 16:
            bits = x.to(tl.int16, bitcast=True) & 0x7FFF
            row_amax = tl.max(bits, axis=1).to(tl.int16).to(x.dtype, bitcast=True).to(tl.float32)
            col_amax = tl.max(bits, axis=0).to(tl.int16).to(x.dtype, bitcast=True).to(tl.float32)
        else:
            bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            row_amax = tl.max(bits, axis=1).to(tl.float32, bitcast=True)
            col_amax = tl.max(bits, axis=0).to(tl.float32, bitcast=True)
        row_scale = _scale_from_amax(row_amax, FMAX)
        col_scale = _scale_from_amax(col_amax, FMAX)
        q_row = _clamp_cast(x.to(tl.float32) * row_scale[:, None], FMAX, OUT, SATURATE)
        if RELOAD_T:  # see _cast_transpose_kernel
            tl.store(q_ptr + rm[:, None] * K + rk[None, :], q_row, mask=mask)
            mask_t = (rk[:, None] < K) & (rm[None, :] < M)
            xt = tl.load(x_ptr + rk[:, None] * sxk + rm[None, :] * sxm, mask=mask_t, other=0.0).to(tl.float32)
            tl.store(qt_ptr + rk[:, None] * M + rm[None, :], _clamp_cast(xt * col_scale[:, None], FMAX, OUT, SATURATE),
                     mask=mask_t)
        else:
            q_col = _clamp_cast(x.to(tl.float32) * col_scale[None, :], FMAX, OUT, SATURATE)
            tl.store(q_ptr + rm[:, None] * K + rk[None, :], q_row, mask=mask)
            tl.store(qt_ptr + rk[:, None] * M + rm[None, :], tl.trans(q_col),
                     mask=(rk[:, None] < K) & (rm[None, :] < M))
        # Scales outer-dimension-major, as cuBLAS reads 1x128 scales (scale_blocks_outer_major).
        tl.store(sinv_ptr + kb * M + rm, _reciprocal(row_scale), mask=rm < M)
        tl.store(sinv_t_ptr + mb * K + rk, _reciprocal(col_scale), mask=rk < K)

    @triton.jit
    def _tile_blocks_kernel(x_ptr, q_ptr, sinv_ptr, M, K, sxm, sxk, KB,
                            FMAX: tl.constexpr, OUT: tl.constexpr, B: tl.constexpr):
        """One BxB block (128x128) per program, one scale."""
        mb, kb = tl.program_id(0), tl.program_id(1)
        rm = mb * B + tl.arange(0, B)
        rk = kb * B + tl.arange(0, B)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        amax = tl.where(tl.max(tl.max((x != x).to(tl.int32), axis=1), axis=0) > 0, float("nan"), amax)
        scale = _scale_from_amax(amax, FMAX)
        q = _clamp_cast(x * scale, FMAX, OUT)
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], q, mask=mask)
        tl.store(sinv_ptr + mb * KB + kb, _reciprocal(scale))

_TL_FLOAT = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16} if triton else {}


@functools.lru_cache(maxsize=None)
def _tl_dtype(dtype: torch.dtype):
    return {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}[dtype]


def cast_transpose(x: torch.Tensor, fp8_dtype: torch.dtype, scale: Optional[torch.Tensor] = None,
                   x_amax: Optional[torch.Tensor] = None):
    """(q, q.t() contiguous, amax of x, scale_inv). Current scaling (no ``scale``): ``x_amax``,
    the caller's amax of ``x`` (torch's reduction, kernels.amax), then one kernel that derives the
    scale on the device and casts; delayed: one kernel that casts with the given scale and
    leaves per-tile amaxes for a small final reduction."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
    qt = torch.empty((k, m), dtype=fp8_dtype, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    bm, bk = 64, 64
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    if scale is None:
        partial = scale_arg = x_amax  # unused by the kernel in this mode
    else:
        x_amax = None
        scale_arg = scale.float().reshape(()).contiguous()
        partial = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)
    _cast_transpose_kernel[grid](x, q, qt, x_amax if x_amax is not None else scale_arg, scale_arg, partial, scale_inv,
                                 m, k, x.stride(0), x.stride(1), FMAX=FP8_MAX[fp8_dtype], OUT=_tl_dtype(fp8_dtype),
                                 SCALE_FROM_AMAX=scale is None, RELOAD_T=x.dtype == torch.float32, BM=bm, BK=bk)
    if x_amax is None:
        x_amax = partial.amax()
    return q, qt, x_amax, scale_inv


def quantize_blocks(x: torch.Tensor, fp8_dtype: torch.dtype, granularity: Granularity):
    """(data, scale_inv) of a non-empty 2-D ``x`` in ``granularity``'s blocks (128x128, 1x128 or
    1x32 MX); whole-tensor scaling is ``cast_transpose``."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
    fmax, out = FP8_MAX[fp8_dtype], _tl_dtype(fp8_dtype)
    if granularity is Granularity.BLOCK_128x128:
        mb, kb = triton.cdiv(m, 128), triton.cdiv(k, 128)
        sinv = torch.empty((mb, kb), dtype=torch.float32, device=x.device)
        _tile_blocks_kernel[(mb, kb)](x, q, sinv, m, k, x.stride(0), x.stride(1), kb, FMAX=fmax, OUT=out, B=128)
        return q, sinv
    bk = granularity.block[1]
    kb = triton.cdiv(k, bk)
    sinv = torch.empty((m, kb), dtype=torch.float32, device=x.device)
    tm = 16
    _row_blocks_kernel[(triton.cdiv(m, tm), kb)](
        x, q, sinv, m, k, x.stride(0), x.stride(1), kb, FMAX=fmax, EMAX=FP8_EMAX[fp8_dtype],
        MX=granularity is Granularity.MX_1x32, OUT=out, TM=tm, BK=bk,
    )
    return q, sinv


def dequantize_rows(data: torch.Tensor, scale_inv: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Row-block (1x32 MX, 1x128) FP8 data to ``dtype`` in one pass (see kernels.Quantized)."""
    if dtype == torch.float64:  # the torch code's fp32 products, widened (the kernel's cast narrows only)
        return dequantize_rows(data, scale_inv, block, torch.float32).double()
    m, k = data.shape
    out = torch.empty((m, k), dtype=dtype, device=data.device)
    if out.numel():
        tm = 16
        _dequantize_rows_kernel[(triton.cdiv(m, tm), triton.cdiv(k, block))](
            data, scale_inv.contiguous(), out, m, k, triton.cdiv(k, block), TM=tm, BK=block)
    return out


@functools.lru_cache(maxsize=None)
def saturating_cast(device: torch.device) -> bool:
    """Whether Triton's FP8 casts on ``device`` saturate (cvt.rn.satfinite on sm89 and later,
    read in the PTX): finite overflow and infinities go to +-max and NaN stays NaN, so a clamp
    before them changes nothing (_clamp_cast's SATURATE)."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def scale_blocks_outer_major(rows: int, blocks: int, device) -> torch.Tensor:
    """An empty (rows, blocks) fp32 grid of 1x128 scales stored column by column, the layout
    cuBLAS reads them in: a kernel writing them so spares fp8_mm a copy kernel per operand
    (in model A's compiled block step ~15 launches a layer; docs/PERFORMANCE.md, 2026-11-26
    fifth session)."""
    return torch.empty_strided((rows, blocks), (1, rows), dtype=torch.float32, device=device)


def quantize_1x128_both_ways(x: torch.Tensor, fp8_dtype: torch.dtype):
    """(data, scale_inv, data of x.t(), its scale_inv) in 1x128 blocks, in one pass."""
    m, k = x.shape
    mb, kb = triton.cdiv(m, 128), triton.cdiv(k, 128)
    q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
    qt = torch.empty((k, m), dtype=fp8_dtype, device=x.device)
    sinv, sinv_t = scale_blocks_outer_major(m, kb, x.device), scale_blocks_outer_major(k, mb, x.device)
    _rows_and_cols_kernel[(mb, kb)](x, q, qt, sinv, sinv_t, m, k, x.stride(0), x.stride(1), kb, mb,
                                    FMAX=FP8_MAX[fp8_dtype], OUT=_tl_dtype(fp8_dtype),
                                    RELOAD_T=x.dtype == torch.float32, B=128, SATURATE=saturating_cast(x.device))
    return q, sinv, qt, sinv_t


if triton is not None:
    # [Note: a Triton kernel inside compiled graphs]
    # Under torch.compile the 1x128 quantization both ways of a block-scaled linear's output
    # gradient is otherwise generated by Inductor, fused with the op that makes the gradient
    # (SwiGLU's backward for gate and up): three passes over that op's inputs (row blocks,
    # column amaxes, column quantization), 0.458 ms for model A's gate gradient on an H200.
    # As a triton_op, Inductor calls fsdp8's one-pass kernel straight from its generated code
    # (no Python dispatch per call) on the materialized gradient: 0.124 ms to make it plus
    # 0.206 ms to quantize it (benchmarks/debug/block_quant_compile.py); model A's compiled
    # block step went from 70,486 to 72,973 tokens/s. The same bytes as the torch code on the
    # bf16 gradient (tests/gpu). Inductor's fused code gave other bytes for the isolated
    # pattern: fused, it may skip the gradient's rounding to bf16 (torch's
    # emulate_precision_casts is off by default). A two-pass variant (32 rows at a time, from
    # L2 the second time) was faster alone (0.173 ms); in the model its two calls gave block
    # steps of 121.5 and 137.6 ms against 112-113 for this kernel, but this kernel too took
    # 137 ms on another machine, so its effect in the model is not known; this one stays.
    # Since 2026-11-26 the kernel finds its amaxes as integer maxima and leaves saturation to
    # the cast (_rows_and_cols_tile): 0.130 ms for the gate gradient (0.173 before), model A's
    # 112 calls 7.1 ms a step, and the compiled block step from 72.1-73.4k to 74.9-75.4k
    # tokens/s on an H200 (docs/PERFORMANCE.md, 2026-11-26).
    # FSDP8_TRITON_OP=0 leaves the quantization to Inductor.
    def _both_ways_op(x, e5m2):
        m, k = x.shape
        mb, kb = triton.cdiv(m, 128), triton.cdiv(k, 128)
        fp8_dtype = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
        q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
        qt = torch.empty((k, m), dtype=fp8_dtype, device=x.device)
        sinv, sinv_t = scale_blocks_outer_major(m, kb, x.device), scale_blocks_outer_major(k, mb, x.device)
        torch.library.wrap_triton(_rows_and_cols_op_kernel)[(mb, kb)](
            x, q, qt, sinv, sinv_t, m, k, x.stride(0), x.stride(1), kb, mb, E5M2=e5m2,
            RELOAD_T=x.dtype == torch.float32, B=128, SATURATE=saturating_cast(x.device), num_warps=4)
        return q, sinv, qt, sinv_t

    # The schema comes from annotations, as types (this module's are strings, and torch 2.11's
    # triton_op neither reads those nor takes a schema).
    _both_ways_op.__annotations__ = {"x": torch.Tensor, "e5m2": bool,
                                     "return": Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]}
    torch.library.triton_op("fsdp8::quantize_1x128_both_ways", _both_ways_op, mutates_args=())


def quantize_1x128_both_ways_in_graph(x: torch.Tensor, fp8_dtype: torch.dtype):
    """quantize_1x128_both_ways as one op of a compiled graph ([Note: a Triton kernel inside
    compiled graphs])."""
    return torch.ops.fsdp8.quantize_1x128_both_ways(x, fp8_dtype == torch.float8_e5m2)

"""1x128 quantization both ways (row blocks written row-major, column blocks written
transposed) of model A's output gradients, materialized: fsdp8's kernel against candidate
layouts of the same work, each at several warp counts. Checks every variant's bytes against
fsdp8's kernel and prints a table of milliseconds (median of --iters, CUDA events) and
bandwidth (2 bytes read and 2 written per element), with the registers and spills of each
compiled variant.

    python benchmarks/debug/both_ways_kernels.py [--iters 100] [--variants V] [--graph]

Variants:
  fsdp8        triton_kernels._rows_and_cols_kernel (since 2026-11-24 the native layout).
  widened      the 128x128 tile widened to fp32 as it is loaded (fsdp8's kernel before).
  native       the tile held in its own dtype (bf16), converted to fp32 only to be scaled: measured
               best, so it is fsdp8's kernel now (the two names run the same code).
  col_strips   the tile read S columns at a time: each strip's column blocks are complete,
               so they are quantized and stored (transposed) at once while the rows' amaxes
               accumulate; a second pass over the strips (from L1/L2) quantizes the rows.
  row_strips   the same with R rows at a time: rows first, columns in the second pass.
  --variants registers: fsdp8 and widened with maxnreg (fewer registers, more programs per SM).
  --variants check: fsdp8's kernel against the widened one only.
  --variants cols_then_both: two kernels, 6 bytes moved per element instead of 4. Pass 1
               finds the column scales only (elementwise maxima RB rows at a time, as the
               weights' block amax kernel, one reduction at the end); pass 2 reads TM whole
               row blocks, finds their row scales and writes both quantizations. ONLY times
               one pass alone (its bytes then differ).
  --variants pipelined: native, T column tiles per program in a loop of NS software-pipeline stages.
  --variants tma: the tile in and both casts out through TMA descriptors (no per-element
               addresses or masks: 204 registers at 4 warps against 242), one tile per program or
               PERSISTENT programs (PER_SM a multiprocessor) looping over tiles in NS stages.
  --variants lean: fewer instructions an element (amaxes as integer maxima of |x|'s bits; no clamps,
               sm90's saturating cast does the same). ncu on fsdp8's kernel (2026-11-26): 255
               registers, spills, 12.5% occupancy, DRAM 25% busy.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fsdp8.fp8 import triton_kernels as tk  # noqa: E402
from fsdp8.fp8.formats import E4M3, FP8_MAX  # noqa: E402
from fsdp8.fp8.triton_kernels import _clamp_cast, _reciprocal, _scale_from_amax  # noqa: E402


@triton.jit
def _widened_kernel(x_ptr, q_ptr, qt_ptr, sinv_ptr, sinv_t_ptr, M, K, sxm, sxk, KB, MB,
                    FMAX: tl.constexpr, OUT: tl.constexpr, B: tl.constexpr):
    mb, kb = tl.program_id(0), tl.program_id(1)
    rm = mb * B + tl.arange(0, B)
    rk = kb * B + tl.arange(0, B)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
    nan = (x != x).to(tl.int32)
    row_scale = _scale_from_amax(tl.where(tl.max(nan, axis=1) > 0, float("nan"), tl.max(tl.abs(x), axis=1)), FMAX)
    col_scale = _scale_from_amax(tl.where(tl.max(nan, axis=0) > 0, float("nan"), tl.max(tl.abs(x), axis=0)), FMAX)
    tl.store(q_ptr + rm[:, None] * K + rk[None, :], _clamp_cast(x * row_scale[:, None], FMAX, OUT), mask=mask)
    q_col = _clamp_cast(x * col_scale[None, :], FMAX, OUT)
    tl.store(qt_ptr + rk[:, None] * M + rm[None, :], tl.trans(q_col), mask=(rk[:, None] < K) & (rm[None, :] < M))
    tl.store(sinv_ptr + rm * KB + kb, _reciprocal(row_scale), mask=rm < M)
    tl.store(sinv_t_ptr + rk * MB + mb, _reciprocal(col_scale), mask=rk < K)


@triton.jit
def _looped_kernel(x_ptr, q_ptr, qt_ptr, sinv_ptr, sinv_t_ptr, M, K, sxm, sxk, KB, MB,
                   FMAX: tl.constexpr, OUT: tl.constexpr, B: tl.constexpr, T: tl.constexpr, NS: tl.constexpr):
    """T column tiles per program in a loop the compiler may pipeline (NS stages): the next
    tile's load in flight while this one is quantized. Needs KB % T == 0."""
    mb = tl.program_id(0)
    for i in tl.range(0, T, num_stages=NS):
        tk._rows_and_cols_tile(x_ptr, q_ptr, qt_ptr, sinv_ptr, sinv_t_ptr, M, K, sxm, sxk, KB, MB, mb,
                               tl.program_id(1) * T + i, FMAX, OUT, False, B, True)


@triton.jit
def _col_strips_kernel(x_ptr, q_ptr, qt_ptr, sinv_ptr, sinv_t_ptr, M, K, sxm, sxk, KB, MB,
                       FMAX: tl.constexpr, OUT: tl.constexpr, B: tl.constexpr, S: tl.constexpr):
    mb, kb = tl.program_id(0), tl.program_id(1)
    rm = mb * B + tl.arange(0, B)
    row_amax = tl.zeros([B], dtype=tl.float32)
    row_nan = tl.zeros([B], dtype=tl.int32)
    for s in tl.static_range(0, B, S):
        rk = kb * B + s + tl.arange(0, S)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0)
        ax = tl.abs(x).to(tl.float32)
        nan = (x != x).to(tl.int32)
        row_amax = tl.maximum(row_amax, tl.max(ax, axis=1))
        row_nan = row_nan | tl.max(nan, axis=1)
        col_amax = tl.where(tl.max(nan, axis=0) > 0, float("nan"), tl.max(ax, axis=0))
        col_scale = _scale_from_amax(col_amax, FMAX)
        q_col = _clamp_cast(x.to(tl.float32) * col_scale[None, :], FMAX, OUT)
        tl.store(qt_ptr + rk[:, None] * M + rm[None, :], tl.trans(q_col), mask=(rk[:, None] < K) & (rm[None, :] < M))
        tl.store(sinv_t_ptr + rk * MB + mb, _reciprocal(col_scale), mask=rk < K)
    row_scale = _scale_from_amax(tl.where(row_nan > 0, float("nan"), row_amax), FMAX)
    for s in tl.static_range(0, B, S):
        rk = kb * B + s + tl.arange(0, S)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0)
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], _clamp_cast(x.to(tl.float32) * row_scale[:, None], FMAX, OUT),
                 mask=mask)
    tl.store(sinv_ptr + rm * KB + kb, _reciprocal(row_scale), mask=rm < M)


@triton.jit
def _row_strips_kernel(x_ptr, q_ptr, qt_ptr, sinv_ptr, sinv_t_ptr, M, K, sxm, sxk, KB, MB,
                       FMAX: tl.constexpr, OUT: tl.constexpr, B: tl.constexpr, R: tl.constexpr):
    mb, kb = tl.program_id(0), tl.program_id(1)
    rk = kb * B + tl.arange(0, B)
    col_amax = tl.zeros([B], dtype=tl.float32)
    col_nan = tl.zeros([B], dtype=tl.int32)
    for r in tl.static_range(0, B, R):
        rm = mb * B + r + tl.arange(0, R)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0)
        ax = tl.abs(x).to(tl.float32)
        nan = (x != x).to(tl.int32)
        col_amax = tl.maximum(col_amax, tl.max(ax, axis=0))
        col_nan = col_nan | tl.max(nan, axis=0)
        row_amax = tl.where(tl.max(nan, axis=1) > 0, float("nan"), tl.max(ax, axis=1))
        row_scale = _scale_from_amax(row_amax, FMAX)
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], _clamp_cast(x.to(tl.float32) * row_scale[:, None], FMAX, OUT),
                 mask=mask)
        tl.store(sinv_ptr + rm * KB + kb, _reciprocal(row_scale), mask=rm < M)
    col_scale = _scale_from_amax(tl.where(col_nan > 0, float("nan"), col_amax), FMAX)
    for r in tl.static_range(0, B, R):
        rm = mb * B + r + tl.arange(0, R)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0)
        q_col = _clamp_cast(x.to(tl.float32) * col_scale[None, :], FMAX, OUT)
        tl.store(qt_ptr + rk[:, None] * M + rm[None, :], tl.trans(q_col), mask=(rk[:, None] < K) & (rm[None, :] < M))
    tl.store(sinv_t_ptr + rk * MB + mb, _reciprocal(col_scale), mask=rk < K)


@triton.jit
def _col_scales_kernel(x_ptr, cs_ptr, sinv_t_ptr, M, K, sxm, sxk, MB,
                       FMAX: tl.constexpr, B: tl.constexpr, RB: tl.constexpr):
    """Pass 1 of cols_then_both: the 128x1 column scales of a 128x128 tile, its maxima kept
    elementwise RB rows at a time (as the weights' block amax kernel) and reduced once."""
    mb, kb = tl.program_id(0), tl.program_id(1)
    rk = kb * B + tl.arange(0, B)
    acc = tl.zeros([RB, B], dtype=tl.float32)
    acc_nan = tl.zeros([RB, B], dtype=tl.int32)
    for r0 in range(0, B, RB):
        rm = mb * B + r0 + tl.arange(0, RB)
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
        acc = tl.maximum(acc, tl.abs(x).to(tl.float32))
        acc_nan = acc_nan | (x != x).to(tl.int32)
    col_scale = _scale_from_amax(tl.where(tl.max(acc_nan, axis=0) > 0, float("nan"), tl.max(acc, axis=0)), FMAX)
    tl.store(cs_ptr + mb * K + rk, col_scale, mask=rk < K)
    tl.store(sinv_t_ptr + rk * MB + mb, _reciprocal(col_scale), mask=rk < K)


@triton.jit
def _rows_and_apply_kernel(x_ptr, q_ptr, qt_ptr, sinv_ptr, cs_ptr, M, K, sxm, sxk, KB,
                           FMAX: tl.constexpr, OUT: tl.constexpr, B: tl.constexpr, TM: tl.constexpr):
    """Pass 2 of cols_then_both: TM whole 1x128 row blocks, their scales found here (a
    reduction inside a warp), quantized both ways with pass 1's column scales."""
    pm, kb = tl.program_id(0), tl.program_id(1)
    rm = pm * TM + tl.arange(0, TM)
    rk = kb * B + tl.arange(0, B)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0)
    nan = (x != x).to(tl.int8)
    row_amax = tl.where(tl.max(nan, axis=1) > 0, float("nan"), tl.max(tl.abs(x), axis=1).to(tl.float32))
    row_scale = _scale_from_amax(row_amax, FMAX)
    col_scale = tl.load(cs_ptr + ((pm * TM) // B) * K + rk, mask=rk < K, other=1.0)
    tl.store(q_ptr + rm[:, None] * K + rk[None, :], _clamp_cast(x.to(tl.float32) * row_scale[:, None], FMAX, OUT),
             mask=mask)
    q_col = _clamp_cast(x.to(tl.float32) * col_scale[None, :], FMAX, OUT)
    tl.store(qt_ptr + rk[:, None] * M + rm[None, :], tl.trans(q_col), mask=(rk[:, None] < K) & (rm[None, :] < M))
    tl.store(sinv_ptr + rm * KB + kb, _reciprocal(row_scale), mask=rm < M)


@triton.jit
def _lean_kernel(x_ptr, q_ptr, qt_ptr, sinv_ptr, sinv_t_ptr, M, K, sxm, sxk, KB, MB,
                 FMAX: tl.constexpr, OUT: tl.constexpr, B: tl.constexpr, NAN_MAX: tl.constexpr,
                 SATURATE: tl.constexpr, EVEN: tl.constexpr = False):
    """fsdp8's one-pass tile with fewer instructions an element: NAN_MAX finds each block's
    amax as the integer max of |x|'s bits (a NaN's exceed infinity's, so a NaN block's amax
    is NaN: no separate NaN flags and their two reductions; bf16 input only);
    SATURATE drops the clamps before the casts, since sm90's cvt.rn.satfinite saturates
    (PTX checked) exactly as clamping then casting does, NaN included."""
    mb, kb = tl.program_id(0), tl.program_id(1)
    rm = mb * B + tl.arange(0, B)
    rk = kb * B + tl.arange(0, B)
    if EVEN:  # whole tiles (M and K multiples of B): no masks, which cost registers an element
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk)
    else:
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
    ax = tl.abs(x)
    if NAN_MAX:  # bf16 input: |x|'s bits order as its values do, and a NaN's above infinity's
        bits = x.to(tl.int16, bitcast=True) & 0x7FFF
        row_amax = tl.max(bits, axis=1).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
        col_amax = tl.max(bits, axis=0).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        nan = (x != x).to(tl.int8)
        row_amax = tl.where(tl.max(nan, axis=1) > 0, float("nan"), tl.max(ax, axis=1).to(tl.float32))
        col_amax = tl.where(tl.max(nan, axis=0) > 0, float("nan"), tl.max(ax, axis=0).to(tl.float32))
    row_scale = _scale_from_amax(row_amax, FMAX)
    col_scale = _scale_from_amax(col_amax, FMAX)
    if SATURATE:
        q_row = (x.to(tl.float32) * row_scale[:, None]).to(OUT, fp_downcast_rounding="rtne")
        q_col = (x.to(tl.float32) * col_scale[None, :]).to(OUT, fp_downcast_rounding="rtne")
    else:
        q_row = _clamp_cast(x.to(tl.float32) * row_scale[:, None], FMAX, OUT)
        q_col = _clamp_cast(x.to(tl.float32) * col_scale[None, :], FMAX, OUT)
    if EVEN:
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], q_row)
        tl.store(qt_ptr + rk[:, None] * M + rm[None, :], tl.trans(q_col))
    else:
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], q_row, mask=(rm[:, None] < M) & (rk[None, :] < K))
        tl.store(qt_ptr + rk[:, None] * M + rm[None, :], tl.trans(q_col), mask=(rk[:, None] < K) & (rm[None, :] < M))
    tl.store(sinv_ptr + rm * KB + kb, _reciprocal(row_scale), mask=rm < M)
    tl.store(sinv_t_ptr + rk * MB + mb, _reciprocal(col_scale), mask=rk < K)


@triton.jit
def _tma_tile(x_desc, q_desc, qt_desc, sinv_ptr, sinv_t_ptr, M, K, KB, MB, mb, kb,
              FMAX: tl.constexpr, OUT: tl.constexpr, B: tl.constexpr):
    """fsdp8's one-pass tile through TMA: the tile arrives in shared memory by one descriptor
    load (zero-filled past the edges, as the masked load's other=0) and both casts leave by
    descriptor stores, so no thread holds addresses or masks for its elements."""
    x = x_desc.load([mb * B, kb * B])
    bits = x.to(tl.int16, bitcast=True) & 0x7FFF
    row_amax = tl.max(bits, axis=1).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    col_amax = tl.max(bits, axis=0).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    row_scale = _scale_from_amax(row_amax, FMAX)
    col_scale = _scale_from_amax(col_amax, FMAX)
    q_desc.store([mb * B, kb * B], (x.to(tl.float32) * row_scale[:, None]).to(OUT, fp_downcast_rounding="rtne"))
    q_col = (x.to(tl.float32) * col_scale[None, :]).to(OUT, fp_downcast_rounding="rtne")
    qt_desc.store([kb * B, mb * B], tl.trans(q_col))
    rm = mb * B + tl.arange(0, B)
    rk = kb * B + tl.arange(0, B)
    tl.store(sinv_ptr + rm * KB + kb, _reciprocal(row_scale), mask=rm < M)
    tl.store(sinv_t_ptr + rk * MB + mb, _reciprocal(col_scale), mask=rk < K)


@triton.jit
def _tma_kernel(x_desc, q_desc, qt_desc, sinv_ptr, sinv_t_ptr, M, K, KB, MB,
                FMAX: tl.constexpr, OUT: tl.constexpr, B: tl.constexpr, PERSISTENT: tl.constexpr,
                NS: tl.constexpr):
    """One tile per program, or (PERSISTENT) a grid of a few programs per SM striding over the
    tiles in a loop of NS stages: the next tiles' loads in flight (in shared memory, not in
    registers) while this one is quantized. bf16 input, sm90's saturating cast."""
    if PERSISTENT:
        for t in tl.range(tl.program_id(0), MB * KB, tl.num_programs(0), num_stages=NS):
            _tma_tile(x_desc, q_desc, qt_desc, sinv_ptr, sinv_t_ptr, M, K, KB, MB, t // KB, t % KB, FMAX, OUT, B)
    else:
        _tma_tile(x_desc, q_desc, qt_desc, sinv_ptr, sinv_t_ptr, M, K, KB, MB, tl.program_id(0), tl.program_id(1),
                  FMAX, OUT, B)


def bits(t):
    """The tensor's bits, so that torch.equal compares NaN scales too."""
    return t.view(torch.uint8) if t.dtype == E4M3 else t.view(torch.int32)


def outputs(x):
    m, k = x.shape
    return (torch.empty((m, k), dtype=E4M3, device=x.device), torch.empty((m, k // 128), device=x.device),
            torch.empty((k, m), dtype=E4M3, device=x.device), torch.empty((k, m // 128), device=x.device))


def launcher(name, warps, extra):
    extra = dict(extra)
    opts = {"maxnreg": extra.pop("maxnreg")} if "maxnreg" in extra else {}

    def run(x, out):
        m, k = x.shape
        q, sinv, qt, sinv_t = out
        args = (x, q, qt, sinv, sinv_t, m, k, x.stride(0), x.stride(1), k // 128, m // 128)
        common = dict(FMAX=FP8_MAX[E4M3], OUT=tk._tl_dtype(E4M3), B=128, num_warps=warps, **opts)
        grid = (m // 128, k // 128 // extra.get("T", 1))
        if name == "cols_then_both":
            cs = torch.empty((m // 128, k), device=x.device)
            if extra.get("ONLY") != 2:  # ONLY: time one pass (the bytes then differ)
                compiled = _col_scales_kernel[(m // 128, k // 128)](x, cs, sinv_t, m, k, x.stride(0), x.stride(1),
                                                                    m // 128, FMAX=FP8_MAX[E4M3], B=128,
                                                                    RB=extra["RB"], num_warps=4)
                if extra.get("ONLY") == 1:
                    return compiled
            return _rows_and_apply_kernel[(m // extra["TM"], k // 128)](
                x, q, qt, sinv, cs, m, k, x.stride(0), x.stride(1), k // 128, FMAX=FP8_MAX[E4M3],
                OUT=tk._tl_dtype(E4M3), B=128, TM=extra["TM"], num_warps=warps, **opts)
        if name == "tma":
            from triton.tools.tensor_descriptor import TensorDescriptor

            descs = [TensorDescriptor.from_tensor(t, [128, 128]) for t in (x, q, qt)]
            if extra.get("PERSISTENT"):
                sms = torch.cuda.get_device_properties(x.device).multi_processor_count
                grid = (min(sms * extra["PER_SM"], (m // 128) * (k // 128)),)
            tma_args = dict(PERSISTENT=bool(extra.get("PERSISTENT")), NS=extra.get("NS", 1))
            return _tma_kernel[grid](*descs, sinv, sinv_t, m, k, k // 128, m // 128, **common, **tma_args)
        if name in ("fsdp8", "native"):  # the native layout is fsdp8's kernel since it was measured best
            return tk._rows_and_cols_kernel[grid](*args, RELOAD_T=False, SATURATE=True, **common)
        kernel = {"col_strips": _col_strips_kernel, "row_strips": _row_strips_kernel,
                  "looped": _looped_kernel, "widened": _widened_kernel, "lean": _lean_kernel}[name]
        return kernel[grid](*args, **common, **extra)
    return run


GRAPH_LAUNCHES = 20


def timed(fn, iters, graph=False):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:  # launches captured in a CUDA graph: the kernels' own time, without the host's launch cost
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(GRAPH_LAUNCHES):
                fn()
        g.replay()
        torch.cuda.synchronize()
        fn = g.replay
    events = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / (GRAPH_LAUNCHES if graph else 1)


# maxnreg caps the registers per thread (spilling the rest), so more programs share an SM.
VARIANTS = {
    "layouts": [("fsdp8", {}), ("widened", {})] + [("col_strips", {"S": s}) for s in (16, 32, 64)] + [
        ("row_strips", {"R": r}) for r in (16, 32, 64)],
    "registers": [(name, {"maxnreg": n}) for name in ("fsdp8", "widened") for n in (96, 128, 168)],
    "check": [("fsdp8", {}), ("widened", {})],
    "cols_then_both": [("fsdp8", {})] + [("cols_then_both", {"RB": rb, "TM": 64, "ONLY": 1}) for rb in (4, 8, 16)]
    + [("cols_then_both", {"RB": 8, "TM": tm, "ONLY": 2}) for tm in (16, 32, 64)]
    + [("cols_then_both", {"RB": rb, "TM": tm}) for rb in (4, 8) for tm in (16, 32, 64)],
    "tma": [("fsdp8", {}), ("tma", {})] + [("tma", {"PERSISTENT": 1, "PER_SM": p, "NS": ns})
                                          for p in (1, 2, 3) for ns in (1, 2, 3)],
    "pipelined": [("looped", {"T": t, "NS": ns}) for t in (2, 4) for ns in (1, 2, 3)],
    "lean": [("fsdp8", {})] + [("lean", {"NAN_MAX": n, "SATURATE": sat}) for n in (0, 1) for sat in (0, 1)]
    + [("lean", {"NAN_MAX": 1, "SATURATE": 1, "EVEN": True}), ("lean", {"NAN_MAX": 1, "SATURATE": 1, "maxnreg": 128})],
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warps", default="4,8,16")
    p.add_argument("--variants", choices=sorted(VARIANTS), default="layouts")
    p.add_argument("--graph", action="store_true", help=f"time {GRAPH_LAUNCHES} launches replayed from a CUDA graph (kernel time "
                   "alone: the small shapes' plain timings include the host's launch cost)")
    args = p.parse_args()
    torch.manual_seed(0)
    # Model A (tokens 8192): gate/up, q/o/down, k/v output gradients.
    shapes = [(8192, 8192), (8192, 2048), (8192, 1024)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; bf16 -> e4m3")
    print("| shape | variant | warps | ms | TB/s | regs | spills | bytes equal |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    best = {}
    for shape in shapes:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * torch.rand(shape[1], device="cuda",
                                                                                 dtype=torch.bfloat16)
        x[5, 7] = float("nan")  # a NaN block both ways
        expected = outputs(x)
        launcher("fsdp8", 4, {})(x, expected)
        expected = [bits(t) for t in expected]
        moved = 4 * x.numel()
        for name, extra in VARIANTS[args.variants]:
            for warps in (int(w) for w in args.warps.split(",")):
                out = outputs(x)
                try:
                    compiled = launcher(name, warps, extra)(x, out)
                except Exception as exc:  # a variant that does not compile is a row, not a crash
                    print(f"| {shape} | {name} {extra} | {warps} | - | - | - | - | {type(exc).__name__} |", flush=True)
                    continue
                got = [bits(t) for t in out]
                same = all(torch.equal(g, e) for g, e in zip(got, expected))
                ms = timed(lambda: launcher(name, warps, extra)(x, out), args.iters, args.graph)
                regs = getattr(compiled, "n_regs", "?")
                spills = getattr(compiled, "n_spills", "?")
                print(f"| {shape} | {name} {extra or ''} | {warps} | {ms:.4f} | {moved / ms / 1e9:.2f} | {regs} | "
                      f"{spills} | {same} |", flush=True)
                if same and ms < best.get(shape, (1e9,))[0]:
                    best[shape] = (ms, name, extra, warps)
    print("\nbest per shape:", {str(k): v for k, v in best.items()})


if __name__ == "__main__":
    main()

"""The Triton kernels of the grouped FP8 experts (fsdp8/fp8/grouped_kernel.py), each bit for bit the
torch ops of the CPU path (tests/gpu checks them):

- ``group_scales``: every group's amax, scale and inverse, and each row's scale and inverse, from
  the rows' maxima, in one launch (a dozen small torch ops before);
- ``padded_columns``: the 16-aligned token buffer's columns (each column's row) and the groups'
  padded ends, in one launch;
- ``group_cast``: rows cast with their scales, row-major and, where asked, into the transposed
  token buffer in the same pass, tiled by the buffer's columns so that the transposed stores
  are contiguous;
- ``transpose_bytes``: an experts weight's matrices transposed (the input gradient's operand).

Measured on an H200 (torch 2.11, 2026-11-27, 32768 x 2048 bf16 rows, 32 groups;
benchmarks/debug/grouped_fp8_gemms.py --kernels): quantizing the rows took 0.12 ms, 0.15 ms with
the padded buffer, against 0.50 ms with this column-tiled cast but the scales still ~15 small torch
launches; the byte transpose of a [32, 1536, 2048] weight 0.056 ms against torch's strided copy
0.56 ms.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .formats import FP8_MAX
from .triton_kernels import _tl_dtype, available, saturating_cast, triton

if triton is not None:
    import triton.language as tl

    from .triton_kernels import _clamp_cast, _reciprocal, _scale_from_amax

    @triton.jit
    def _group_scales_kernel(rowmax_ptr, offs_ptr, scale_ptr, inv_ptr, row_scale_ptr, row_inv_ptr,
                             FMAX: tl.constexpr, BR: tl.constexpr):
        """Group program_id(0)'s rows [offs[g-1], offs[g]): the largest of their maxima, its scale
        and inverse (exactly formats.amax_to_scale and scale_to_inv: correctly rounded fp32
        divisions; 1 for an empty group, a zero, infinite or NaN amax), stored per group and per row."""
        g = tl.program_id(0)
        start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
        end = tl.load(offs_ptr + g)
        amax = tl.zeros((BR,), dtype=tl.float32)
        for first in range(start, end, BR):
            rows = first + tl.arange(0, BR)
            v = tl.load(rowmax_ptr + rows, mask=rows < end, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.where(v != v, float("inf"), v))  # NaN: no scale, as an infinity
        scale = _scale_from_amax(tl.max(amax, axis=0), FMAX)
        inv = _reciprocal(scale)
        tl.store(scale_ptr + g, scale)
        tl.store(inv_ptr + g, inv)
        for first in range(start, end, BR):
            rows = first + tl.arange(0, BR)
            tl.store(row_scale_ptr + rows, tl.zeros((BR,), dtype=tl.float32) + scale, mask=rows < end)
            tl.store(row_inv_ptr + rows, tl.zeros((BR,), dtype=tl.float32) + inv, mask=rows < end)

    @triton.jit
    def _padded_columns_kernel(offs_ptr, source_ptr, ends_ptr, G, W, BG: tl.constexpr, BC: tl.constexpr):
        """Group program_id(0)'s columns of the 16-aligned token buffer (grouped_kernel.Groups.padded):
        each column's row (-1 for padding) and the group's padded end (the last group's: W)."""
        g = tl.program_id(0)
        index = tl.arange(0, BG)
        ends = tl.load(offs_ptr + index, mask=index < G, other=0)
        starts = tl.load(offs_ptr + index - 1, mask=(index > 0) & (index < G), other=0)
        padded = (ends - starts + 15) // 16 * 16
        padded_ends = tl.cumsum(padded, axis=0)
        mine = index == g
        padded_end = tl.sum(tl.where(mine, padded_ends, 0), axis=0)
        padded_start = padded_end - tl.sum(tl.where(mine, padded, 0), axis=0)
        start = tl.sum(tl.where(mine, starts, 0), axis=0)
        count = tl.sum(tl.where(mine, ends - starts, 0), axis=0)
        last = g == G - 1
        stop = tl.where(last, W, padded_end)
        tl.store(ends_ptr + g, stop)
        for first in range(padded_start, stop, BC):
            column = first + tl.arange(0, BC)
            place = column - padded_start
            tl.store(source_ptr + column, tl.where(place < count, start + place, -1), mask=column < stop)

    @triton.jit
    def _group_cast_kernel(x_ptr, row_scale_ptr, q_ptr, M, K,
                           FMAX: tl.constexpr, OUT: tl.constexpr, SATURATE: tl.constexpr,
                           BM: tl.constexpr, BK: tl.constexpr):
        """Tile (BM rows, BK columns) of x [M, K] (bf16, contiguous): each row times its scale, cast,
        stored to q [M, K]."""
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rk = tl.program_id(1) * BK + tl.arange(0, BK)
        in_m = rm < M
        mask = in_m[:, None] & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(row_scale_ptr + rm, mask=in_m, other=1.0)
        tl.store(q_ptr + rm[:, None] * K + rk[None, :], _clamp_cast(x * scale[:, None], FMAX, OUT, SATURATE), mask=mask)

    @triton.jit
    def _group_cast_padded_kernel(x_ptr, row_scale_ptr, source_ptr, q_ptr, qt_ptr, K, W,
                                  FMAX: tl.constexpr, OUT: tl.constexpr, SATURATE: tl.constexpr,
                                  BC: tl.constexpr, BK: tl.constexpr):
        """Tile (BC token columns, BK features) of the transposed buffer qt [K, W]: each column's
        source row of x [M, K] (``source``, -1 for a padding column) cast with its row's scale,
        stored to q [M, K] at its row and to qt [K, W] at its column (zeros in padding columns).
        Tiled by the buffer's columns, so the transposed stores are contiguous runs of bytes; the
        row gather falls on the loads, which stay contiguous along K."""
        rc = tl.program_id(0) * BC + tl.arange(0, BC)
        rk = tl.program_id(1) * BK + tl.arange(0, BK)
        in_c = rc < W
        in_k = rk < K
        row = tl.load(source_ptr + rc, mask=in_c, other=-1)
        real = row >= 0
        row = tl.where(real, row, 0)
        mask = real[:, None] & in_k[None, :]
        x = tl.load(x_ptr + row[:, None] * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(row_scale_ptr + row, mask=real, other=1.0)
        q = _clamp_cast(x * scale[:, None], FMAX, OUT, SATURATE)  # padding columns: 0.0, the zero byte
        tl.store(q_ptr + row[:, None] * K + rk[None, :], q, mask=mask)
        tl.store(qt_ptr + rk[:, None] * W + rc[None, :], tl.trans(q), mask=in_k[:, None] & in_c[None, :])

    @triton.jit
    def _transpose_bytes_kernel(x_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
        """Matrix program_id(2) of x [E, N, K] (bytes) transposed into out [E, K, N], a BN x BK tile."""
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rk = tl.program_id(1) * BK + tl.arange(0, BK)
        base = tl.program_id(2).to(tl.int64) * N * K
        tile = tl.load(x_ptr + base + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K))
        tl.store(out_ptr + base + rk[:, None] * N + rn[None, :], tl.trans(tile),
                 mask=(rk[:, None] < K) & (rn[None, :] < N))


INDEX_LIMIT = 2 ** 31  # the kernel's offsets are 32-bit


def runs_on(x: torch.Tensor, width: int = 0) -> bool:
    """Whether the kernel takes ``x`` [M, K] (and a transposed buffer [K, ``width``]): bf16 rows on a
    GPU with Triton, every offset within 32 bits."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.numel() < INDEX_LIMIT
            and x.shape[-1] * width < INDEX_LIMIT and available())


def group_scales(rowmax: torch.Tensor, offs: torch.Tensor, fp8_dtype: torch.dtype):
    """From each row's largest magnitude ``rowmax`` [M] and the groups' row ends ``offs`` (int32 [G]):
    (scale [G], inverse [G], each row's scale [M], each row's inverse [M]), fp32, in one launch."""
    groups, rows = offs.shape[0], rowmax.shape[0]
    scale, inv = (torch.empty(groups, dtype=torch.float32, device=rowmax.device) for _ in range(2))
    row_scale, row_inv = (torch.empty(rows, dtype=torch.float32, device=rowmax.device) for _ in range(2))
    _group_scales_kernel[(groups,)](rowmax.contiguous(), offs, scale, inv, row_scale, row_inv,
                                    FMAX=FP8_MAX[fp8_dtype], BR=1024)
    return scale, inv, row_scale, row_inv


def padded_columns(offs: torch.Tensor, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(each column's row [width] (-1 for padding), the groups' padded ends [G]) of the 16-aligned
    token buffer of ``width`` columns (grouped_kernel.Groups.padded), in one launch."""
    groups = offs.shape[0]
    source = torch.empty(width, dtype=torch.int32, device=offs.device)
    ends = torch.empty(groups, dtype=torch.int32, device=offs.device)
    _padded_columns_kernel[(groups,)](offs, source, ends, groups, width, BG=triton.next_power_of_2(groups), BC=1024)
    return source, ends


def group_cast(x: torch.Tensor, row_scale: torch.Tensor, fp8_dtype: torch.dtype,
               source: Optional[torch.Tensor] = None, width: int = 0) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(rows of ``x`` [M, K] each cast with its ``row_scale`` (fp32 [M]), and with ``source`` (each
    column's row of ``x``, -1 for padding: ``padded_columns``) the same bytes transposed into a
    buffer [K, ``width``], zeros in the padding columns, else None)."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
    common = dict(FMAX=FP8_MAX[fp8_dtype], OUT=_tl_dtype(fp8_dtype), SATURATE=saturating_cast(x.device))
    if source is None:
        _group_cast_kernel[(triton.cdiv(m, 64), triton.cdiv(k, 64))](x, row_scale, q, m, k, BM=64, BK=64, **common)
        return q, None
    qt = torch.empty((k, width), dtype=fp8_dtype, device=x.device)  # every column is written
    _group_cast_padded_kernel[(triton.cdiv(width, BC), triton.cdiv(k, BK))](
        x, row_scale, source, q, qt, k, width, BC=BC, BK=BK, **common)
    return q, qt


BC, BK = 64, 64  # the padded cast's tile (token columns, features)


def transpose_bytes(data: torch.Tensor) -> torch.Tensor:
    """``data`` [E, N, K] (1-byte elements) with each matrix transposed, [E, K, N] contiguous: a tiled
    copy (torch's strided copy of bytes runs at a fraction of the bandwidth); torch's elsewhere."""
    if not (data.is_cuda and data.element_size() == 1 and data.dim() == 3 and available()
            and data.shape[1] * data.shape[2] < INDEX_LIMIT):
        return data.transpose(1, 2).contiguous()
    data = data.contiguous()
    e, n, k = data.shape
    out = torch.empty((e, k, n), dtype=data.dtype, device=data.device)
    if out.numel():
        _transpose_bytes_kernel[(triton.cdiv(n, 64), triton.cdiv(k, 64), e)](data.view(torch.uint8),
                                                                           out.view(torch.uint8), n, k, BN=64, BK=64)
    return out

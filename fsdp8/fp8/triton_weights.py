"""Triton kernels for the engine's FP8 weight shards, bit for bit kernels.py's results on CUDA.

Each runs once per unit or per step on the weights' fp32 main shards, with scales agreed
before the gather: quantizing every piece of a unit into a send buffer in one launch (a
table of offsets; per-tensor or 128x128 scales), and the amaxes or 128x128 block amax grids
of many weights in one launch (a table of pointers). The activation kernels, and the
shared cast and scale helpers, are in triton_kernels.py.
"""

from __future__ import annotations

import torch

from .formats import FP8_MAX
from .triton_kernels import _TL_FLOAT, _tl_dtype, triton

if triton is not None:
    import triton.language as tl

    from .triton_kernels import _clamp_cast

    @triton.jit
    def _pieces_kernel(src_ptr, out_ptr, scale_ptr, table_ptr, FMAX: tl.constexpr, OUT: tl.constexpr,
                       VIA: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        """Program (b, t) quantizes block b of piece t (table row t: source offset, output
        offset, length, scale index) with the piece's one scale; blocks past a piece's end
        return at once. A fixed block per program (no loop) lets the compiler see that
        every access is BLOCK-aligned; with ALIGNED (all offsets multiples of 16) loads
        and stores are vectorized."""
        b, t = tl.program_id(0), tl.program_id(1)
        n = tl.load(table_ptr + 4 * t + 2)
        if b * BLOCK >= n:
            return
        src_off = tl.load(table_ptr + 4 * t)
        out_off = tl.load(table_ptr + 4 * t + 1)
        scale = tl.load(scale_ptr + tl.load(table_ptr + 4 * t + 3))
        if ALIGNED:
            src_off = tl.multiple_of(src_off, 16)
            out_off = tl.multiple_of(out_off, 16)
        offs = b * BLOCK + tl.arange(0, BLOCK)
        if (b + 1) * BLOCK <= n:
            # A full block needs no mask: with a mask against a runtime length the compiler
            # cannot vectorize, and one-byte scalar stores ran at a third of the bandwidth.
            x = tl.load(src_ptr + src_off + offs)
            tl.store(out_ptr + out_off + offs, _via_scaled_cast(x, scale, FMAX, OUT, VIA))
        else:
            mask = offs < n
            x = tl.load(src_ptr + src_off + offs, mask=mask, other=0.0)
            tl.store(out_ptr + out_off + offs, _via_scaled_cast(x, scale, FMAX, OUT, VIA), mask=mask)

    @triton.jit
    def _block_pieces_kernel(src_ptr, out_ptr, scale_ptr, table_ptr, T, FMAX: tl.constexpr, OUT: tl.constexpr,
                             VIA: tl.constexpr, ALIGNED: tl.constexpr, TM: tl.constexpr, B: tl.constexpr):
        """Program (j, t) quantizes tile j (TM rows x B columns) of piece t with its 128x128
        block scales; tiles past a piece's end return at once. Table columns (T pieces):
        source offset, output offset, rows, columns, first row in its weight, grid offset.
        Full tiles of ALIGNED pieces (offsets and columns multiples of 16) go unmasked, so
        that loads and stores are vectorized (see _pieces_kernel)."""
        j, t = tl.program_id(0), tl.program_id(1)
        rows = tl.load(table_ptr + 2 * T + t)
        cols = tl.load(table_ptr + 3 * T + t)
        if ALIGNED:
            cols = tl.multiple_of(cols, 16)
        grid_cols = (cols + B - 1) // B
        if j >= ((rows + TM - 1) // TM) * grid_cols:
            return
        src_off = tl.load(table_ptr + t)
        out_off = tl.load(table_ptr + T + t)
        row_start = tl.load(table_ptr + 4 * T + t)
        grid_off = tl.load(table_ptr + 5 * T + t)
        if ALIGNED:
            src_off = tl.multiple_of(src_off, 16)
            out_off = tl.multiple_of(out_off, 16)
        rm = (j // grid_cols) * TM + tl.arange(0, TM)
        kb = j % grid_cols
        rk = kb * B + tl.arange(0, B)
        scale = tl.load(scale_ptr + grid_off + ((row_start + rm) // B) * grid_cols + kb, mask=rm < rows, other=1.0)
        src = src_ptr + src_off + rm[:, None] * cols + rk[None, :]
        dst = out_ptr + out_off + rm[:, None] * cols + rk[None, :]
        if ALIGNED and ((j // grid_cols) + 1) * TM <= rows and (kb + 1) * B <= cols:
            tl.store(dst, _via_scaled_cast(tl.load(src), scale[:, None], FMAX, OUT, VIA))
        else:
            mask = (rm[:, None] < rows) & (rk[None, :] < cols)
            x = tl.load(src, mask=mask, other=0.0)
            tl.store(dst, _via_scaled_cast(x, scale[:, None], FMAX, OUT, VIA), mask=mask)

    @triton.jit
    def _via_scaled_cast(x, scale, FMAX: tl.constexpr, OUT: tl.constexpr, VIA: tl.constexpr):
        if VIA is not None:
            x = x.to(VIA, fp_downcast_rounding="rtne")
        return _clamp_cast(x.to(tl.float32) * scale, FMAX, OUT)

    @triton.jit
    def _amaxes_kernel(ptrs_ptr, numels_ptr, partial_ptr, IN: tl.constexpr, BLOCK: tl.constexpr):
        """Program (t, j) reduces blocks j, j + S, j + 2S, ... of tensor t (S programs per
        tensor) to one partial amax, NaN if any element was NaN."""
        t, j, split = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
        base = tl.load(ptrs_ptr + t).to(tl.pointer_type(IN))
        n = tl.load(numels_ptr + t)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        nan = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(j * BLOCK, n, split * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < n, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x))
            nan = nan | (x != x).to(tl.int32)
        tile = tl.max(acc, axis=0)
        tl.store(partial_ptr + t * split + j, tl.where(tl.max(nan, axis=0) > 0, float("nan"), tile))


    @triton.jit
    def _block_amax_grids_kernel(table_ptr, out_ptr, T, IN: tl.constexpr, B: tl.constexpr, RB: tl.constexpr):
        """Program (j, t): 128x128 block j of tensor t's grid, over the rows this piece holds,
        read RB rows at a time (a whole block at once held 64 floats per thread and ran at a
        quarter of the H200's bandwidth; 8 rows with 4 warps reach 4.4 TB/s,
        benchmarks/debug/block_amax_kernels.py). Table row t: pointer, rows, cols, first
        global row, output offset, grid columns, first grid row touched, grid rows touched."""
        j, t = tl.program_id(0), tl.program_id(1)
        grid_cols = tl.load(table_ptr + 5 * T + t)
        touched = tl.load(table_ptr + 7 * T + t)
        if j < touched * grid_cols:
            base = tl.load(table_ptr + t).to(tl.pointer_type(IN))
            rows = tl.load(table_ptr + T + t)
            cols = tl.load(table_ptr + 2 * T + t)
            row_start = tl.load(table_ptr + 3 * T + t)
            block_row = tl.load(table_ptr + 6 * T + t) + j // grid_cols
            block_col = j % grid_cols
            c = block_col * B + tl.arange(0, B)
            acc = tl.zeros([RB, B], dtype=tl.float32)
            nan = tl.zeros([RB, B], dtype=tl.int32)
            for r0 in range(0, B, RB):
                r = block_row * B - row_start + r0 + tl.arange(0, RB)  # local rows of this block
                mask = (r[:, None] >= 0) & (r[:, None] < rows) & (c[None, :] < cols)
                x = tl.load(base + r[:, None] * cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
                acc = tl.maximum(acc, tl.abs(x))
                nan = nan | (x != x).to(tl.int32)
            tile = tl.max(tl.max(acc, axis=1), axis=0)
            has_nan = tl.max(tl.max(nan, axis=1), axis=0) > 0
            out = tl.load(table_ptr + 4 * T + t) + block_row * grid_cols + block_col
            tl.store(out_ptr + out, tl.where(has_nan, float("nan"), tile))


_TABLES: "dict[tuple, torch.Tensor]" = {}
_TABLES_MAX = 256
_PLANS: "dict[tuple, tuple]" = {}


def _plan(device: torch.device, pieces: tuple, make) -> tuple:
    """``make(device, pieces)`` (the longest piece, the device table, whether every offset is
    16-aligned), kept for the next call with the same pieces: the engine packs the same pieces
    every step, and going over them in Python (an experts unit has a few per expert) cost
    ~0.7 ms of host time a call (model Q, 2026-11-27)."""
    key = (device, pieces, make)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _TABLES_MAX:
            _PLANS.clear()
        plan = _PLANS[key] = make(device, pieces)
    return plan


def _plan_pieces(device, pieces):
    return (max(n for _, _, n, _ in pieces), _device_table(device, tuple(v for piece in pieces for v in piece)),
            all(s % 16 == 0 and o % 16 == 0 for s, o, _, _ in pieces))


def _plan_block_pieces(device, pieces):
    return (None, _device_table(device, tuple(v for field in zip(*pieces) for v in field)),
            all(s % 16 == 0 and o % 16 == 0 and c % 16 == 0 for s, o, _, c, _, _ in pieces))


def _device_table(device: torch.device, values: tuple) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, kept for the next call with the same values.

    The engine asks for the same pointer table (its main shards do not move) after every
    optimizer step; uploading it from pageable memory each time made every call wait for
    the GPU to drain (a cudaStreamSynchronize per unit in the profile). A hit returns a
    tensor holding exactly ``values``, so reuse cannot go stale."""
    key = (device, values)
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
        table = torch.tensor(values, dtype=torch.int64).to(device)
        _TABLES[key] = table
    return table


def quantize_pieces(src, out, scales, pieces, fp8_dtype, via, block: int = 4096, num_warps: int = 4):
    """See weight_kernels.quantize_pieces: one launch for every piece. Block 4096 measured best on H200
    (benchmarks/debug/pack_kernels.py: 3.55 TB/s for a model-B layer, 2.8 for the per-weight kernel it replaced)."""
    longest, table, aligned = _plan(src.device, pieces, _plan_pieces)
    if longest == 0:
        return
    rounds = via is not None and via != src.dtype and via != torch.float32
    _pieces_kernel[(triton.cdiv(longest, block), len(pieces))](
        src, out, scales, table, FMAX=FP8_MAX[fp8_dtype], OUT=_tl_dtype(fp8_dtype),
        VIA=_TL_FLOAT[via] if rounds else None, ALIGNED=aligned, BLOCK=block, num_warps=num_warps)


def quantize_block_pieces(src, out, scales, pieces, fp8_dtype, via, rows_per_tile: int = 32, num_warps: int = 4):
    """See weight_kernels.quantize_block_pieces: one launch for every piece (non-empty ones)."""
    longest, table, aligned = _plan(src.device, pieces, _plan_block_pieces)
    tiles = max(triton.cdiv(rows, rows_per_tile) * triton.cdiv(cols, 128) for _, _, rows, cols, _, _ in pieces)
    rounds = via is not None and via != src.dtype and via != torch.float32
    _block_pieces_kernel[(tiles, len(pieces))](
        src, out, scales, table, len(pieces), FMAX=FP8_MAX[fp8_dtype], OUT=_tl_dtype(fp8_dtype),
        VIA=_TL_FLOAT[via] if rounds else None, ALIGNED=aligned, TM=rows_per_tile, B=128, num_warps=num_warps)


def block_amax_grids(pieces, rows_per_step: int = 8, num_warps: int = 4):
    """See weight_kernels.block_amax_grids: every piece's 128x128 grid (zeros where it holds no
    rows) in one launch. ``rows_per_step`` (a power of two up to 128) and ``num_warps`` as
    measured best on an H200 (benchmarks/debug/block_amax_kernels.py sweeps them)."""
    device = pieces[0][0].device
    columns, offset, longest = [], 0, 0
    for rows, start, total in pieces:
        n, cols = rows.shape
        grid_rows, grid_cols = triton.cdiv(total, 128), triton.cdiv(cols, 128)
        first = start // 128
        touched = triton.cdiv(start + n, 128) - first if n else 0
        columns.append((rows.data_ptr(), n, cols, start, offset, grid_cols, first, touched))
        offset += grid_rows * grid_cols
        longest = max(longest, touched * grid_cols)
    table = _device_table(device, tuple(v for field in zip(*columns) for v in field))
    out = torch.zeros(offset, dtype=torch.float32, device=device)
    if longest:
        _block_amax_grids_kernel[(longest, len(pieces))](table, out, len(pieces), IN=_TL_FLOAT[pieces[0][0].dtype],
                                                         B=128, RB=rows_per_step, num_warps=num_warps)
    return out


def amaxes(tensors):
    """Per-tensor amaxes of same-dtype contiguous CUDA tensors: one launch, then one small
    reduction of the partial maxima (torch.amax keeps NaN)."""
    device = tensors[0].device
    table = _device_table(device, tuple(t.data_ptr() for t in tensors) + tuple(t.numel() for t in tensors))
    table = table.view(2, len(tensors))
    block = 1024
    split = max(1, min(512, triton.cdiv(max(t.numel() for t in tensors), block * 16)))
    partial = torch.empty((len(tensors), split), dtype=torch.float32, device=device)
    _amaxes_kernel[(len(tensors), split)](table[0], table[1], partial, IN=_TL_FLOAT[tensors[0].dtype], BLOCK=block)
    return partial.amax(dim=1)

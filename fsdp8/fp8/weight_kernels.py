"""The engine's weight-shard kernels: each rank quantizes its shard of every FP8 weight with
scales agreed across the ranks (a scalar, or a grid of 128x128 block scales of the whole
weight), packed into one send buffer, and takes the amaxes those scales come from.

As in kernels.py, the torch code here defines every result; ``triton_weights`` computes the
same bits on CUDA, one launch for all the weights of a unit (a table of offsets or pointers)
rather than one or more a weight: launches, not bytes, were the engine's cost there.
"""

from __future__ import annotations

import functools

import math
from typing import Optional, Sequence, Tuple

import torch

from .formats import Granularity
from .kernels import amax, saturate_cast, use_triton


def quantize_rows_with_grid(rows: torch.Tensor, row_start: int, scale_grid: torch.Tensor,
                            granularity: Granularity, fp8_dtype: torch.dtype, via: Optional[torch.dtype] = None,
                            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quantize a 2-D slice of rows ``[row_start, row_start + len)`` of a larger tensor whose
    scales are already known: a scalar, or a grid of 128x128 block scales of the whole tensor.
    This is how a rank quantizes its shard with scales agreed across all shards.

    ``via``: round the rows to this dtype first (the engine quantizes its fp32 main rows as
    the compute dtype holds them). ``out``: a contiguous FP8 tensor of the rows' shape to
    write into (a region of a send buffer). On CUDA it is one piece of the engine's pack
    kernels (quantize_pieces, quantize_block_pieces): read the rows once, write one byte
    per element."""
    if granularity not in (Granularity.TENSOR, Granularity.BLOCK_128x128):
        raise ValueError(f"agreed scales exist for whole-tensor and 128x128 scaling, not {granularity.value}")
    m, k = rows.shape
    if granularity is Granularity.BLOCK_128x128:
        need = (math.ceil((row_start + m) / 128), math.ceil(k / 128))
        if scale_grid.dim() != 2 or scale_grid.shape[0] < need[0] or scale_grid.shape[1] != need[1]:
            raise ValueError(f"rows [{row_start}, {row_start + m}) of {k} columns need a 128x128 scale grid of "
                             f"at least {need[0]} rows and exactly {need[1]} columns, got {tuple(scale_grid.shape)}")
    if out is not None and (not out.is_contiguous() or out.shape != rows.shape or out.dtype != fp8_dtype):
        raise ValueError(f"out must be a contiguous {fp8_dtype} tensor of shape {tuple(rows.shape)}, "
                         f"got {out.dtype} {tuple(out.shape)} (contiguous: {out.is_contiguous()})")
    if use_triton(rows) and rows.numel() and torch.float64 not in (rows.dtype, via):
        out = torch.empty((m, k), dtype=fp8_dtype, device=rows.device) if out is None else out
        src, scales = rows.contiguous().view(-1), scale_grid.float().contiguous().view(-1)
        if granularity is Granularity.TENSOR:
            quantize_pieces(src, out.view(-1), scales, [(0, 0, m * k, 0)], fp8_dtype, via)
        else:
            quantize_block_pieces(src, out.view(-1), scales, [(0, 0, m, k, row_start, 0)], fp8_dtype, via)
        return out
    q = _rows_with_grid_reference(rows, row_start, scale_grid, granularity, fp8_dtype, via)
    return q if out is None else out.copy_(q)


def _rows_with_grid_reference(rows, row_start, scale_grid, granularity, fp8_dtype, via):
    x = rows if via is None else rows.to(via)
    if granularity is Granularity.TENSOR:
        return saturate_cast(x, scale_grid, fp8_dtype)
    row_block = (torch.arange(x.shape[0], device=x.device) + row_start) // 128
    return saturate_cast(x, scale_grid[row_block].repeat_interleave(128, dim=1)[:, : x.shape[1]], fp8_dtype)


@functools.lru_cache(maxsize=256)  # the engine packs the same pieces into the same buffers every step
def _check_pieces(pieces: Tuple[Tuple[int, int, int, int], ...], src_numel: int, out_numel: int, scales_numel: int) -> int:
    """The longest piece's length, once every piece is found inside the buffers (ValueError if not)."""
    for s_off, o_off, n, k in pieces:
        if min(s_off, o_off, n, k) < 0 or s_off + n > src_numel or o_off + n > out_numel or k >= scales_numel:
            raise ValueError(f"piece {(s_off, o_off, n, k)} reaches outside src ({src_numel}), "
                             f"out ({out_numel}) or scales ({scales_numel})")
    return max((n for _, _, n, _ in pieces), default=0)


def quantize_pieces(src: torch.Tensor, out: torch.Tensor, scales: torch.Tensor, pieces: Sequence[Tuple[int, int, int, int]],
                    fp8_dtype: torch.dtype, via: Optional[torch.dtype] = None) -> torch.Tensor:
    """Whole-tensor-scaled quantization of many pieces of one flat tensor into one flat FP8
    tensor: for each ``(src_offset, out_offset, numel, scale_index)``,
    ``out[out_offset:][:numel] = saturate_cast(src[src_offset:][:numel] as via, scales[scale_index])``.

    This is the engine's gather pack for per-tensor recipes: every FP8 weight of a unit,
    from the fp32 main chunk into the send buffer. On CUDA it is one launch whose table of
    offsets is uploaded once (the offsets never change), instead of one launch per weight,
    each ~0.1 ms of host time; the host is what the backward pass waits on."""
    if src.dim() != 1 or out.dim() != 1 or scales.dim() != 1:
        raise ValueError("quantize_pieces works on flat (1-D) src, out and scales")
    if out.dtype != fp8_dtype:
        raise ValueError(f"out must be {fp8_dtype}, got {out.dtype}")
    pieces = pieces if isinstance(pieces, tuple) else tuple(map(tuple, pieces))
    longest = _check_pieces(pieces, src.numel(), out.numel(), scales.numel())
    if not pieces:
        return out
    if (use_triton(src) and src.is_contiguous() and out.is_contiguous() and scales.dtype == torch.float32
            and torch.float64 not in (src.dtype, via)  # the kernel has no fp64 path (fp64 tests)
            and longest < 2**31):  # the kernel indexes a piece in int32
        from . import triton_weights

        triton_weights.quantize_pieces(src, out, scales, pieces, fp8_dtype, via)
        return out
    for s_off, o_off, n, k in pieces:
        x = src[s_off : s_off + n]
        x = x if via is None else x.to(via)
        out[o_off : o_off + n].copy_(saturate_cast(x, scales[k], fp8_dtype))
    return out


def quantize_block_pieces(src: torch.Tensor, out: torch.Tensor, scales: torch.Tensor,
                          pieces: Sequence[Tuple[int, int, int, int, int, int]], fp8_dtype: torch.dtype,
                          via: Optional[torch.dtype] = None) -> torch.Tensor:
    """quantize_pieces for 128x128-scaled weights: for each ``(src_offset, out_offset, rows,
    cols, row_start, scale_offset)``, the ``rows x cols`` rows at ``src[src_offset:]`` are
    rows ``[row_start, row_start + rows)`` of a weight whose block scales are the grid
    ``scales[scale_offset:]`` (``ceil(cols / 128)`` columns), quantized as
    quantize_rows_with_grid defines into ``out[out_offset:]``.

    The engine's gather pack for block scaling: every FP8 weight of a unit in one launch on
    CUDA (the table of offsets uploaded once) instead of one launch per weight."""
    if src.dim() != 1 or out.dim() != 1 or scales.dim() != 1:
        raise ValueError("quantize_block_pieces works on flat (1-D) src, out and scales")
    if out.dtype != fp8_dtype:
        raise ValueError(f"out must be {fp8_dtype}, got {out.dtype}")
    for piece in pieces:
        s_off, o_off, rows, cols, row_start, g_off = piece
        n, grid_cols = rows * cols, math.ceil(cols / 128)
        grid_end = g_off + (math.ceil((row_start + rows) / 128)) * grid_cols
        if (min(piece) < 0 or cols == 0 or s_off + n > src.numel() or o_off + n > out.numel()
                or (rows and grid_end > scales.numel())):
            raise ValueError(f"piece {tuple(piece)} reaches outside src ({src.numel()}), out ({out.numel()}) "
                             f"or scales ({scales.numel()}), or has no columns")
    pieces = tuple(p for p in pieces if p[2])
    if not pieces:
        return out
    if (use_triton(src) and src.is_contiguous() and out.is_contiguous() and scales.dtype == torch.float32
            and torch.float64 not in (src.dtype, via)):
        from . import triton_weights

        triton_weights.quantize_block_pieces(src, out, scales, pieces, fp8_dtype, via)
        return out
    for s_off, o_off, rows, cols, row_start, g_off in pieces:
        grid_rows = math.ceil((row_start + rows) / 128)
        grid = scales[g_off : g_off + grid_rows * math.ceil(cols / 128)].view(grid_rows, -1)
        q = _rows_with_grid_reference(src[s_off : s_off + rows * cols].view(rows, cols), row_start, grid,
                                      Granularity.BLOCK_128x128, fp8_dtype, via)
        out[o_off : o_off + rows * cols].copy_(q.flatten())
    return out


def amaxes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One fp32 amax per tensor (0 for an empty one, NaN where a tensor holds NaN), as
    ``amax`` computes each. On CUDA one launch for all of them (a table of pointers), not
    one reduction and a few scalar ops per tensor: the engine takes the amax of every FP8
    weight shard after each optimizer step, and launches, not bytes, were the cost."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    first = tensors[0]
    if (use_triton(first) and all(t.dtype == first.dtype and t.device == first.device and t.is_contiguous()
                                  for t in tensors)):
        from . import triton_weights

        return triton_weights.amaxes(tensors)
    return torch.stack([amax(t) for t in tensors])


def partial_block_amax(rows: torch.Tensor, row_start: int, total_rows: int) -> torch.Tensor:
    """128x128 block amaxes of the whole tensor as seen from rows ``[row_start, +len)``:
    blocks this slice does not touch hold 0, so a max all-reduce over the ranks yields the
    amax of every block even where a block straddles two shards."""
    cols = rows.shape[1]
    grid = torch.zeros(math.ceil(total_rows / 128), math.ceil(cols / 128), dtype=torch.float32, device=rows.device)
    if rows.shape[0] == 0:
        return grid
    first = row_start // 128
    offset = row_start - first * 128  # pad in front so the slice starts on a block boundary
    # Each row's amax per 128 columns first (one pass over the rows, no temporary of their
    # size: this runs on every FP8 weight before every gather), then the 128-row blocks
    # over that 128x smaller tensor. Maxima of magnitudes are exact in any order.
    per_row = _row_block_amax(rows.detach())
    padded = torch.nn.functional.pad(per_row, (0, 0, offset, -(offset + per_row.shape[0]) % 128))
    local = padded.view(-1, 128, padded.shape[1]).amax(dim=1)
    grid[first : first + local.shape[0]] = local
    return grid


def block_amax_grids(pieces: Sequence[Tuple[torch.Tensor, int, int]]) -> torch.Tensor:
    """``partial_block_amax(rows, row_start, total_rows)`` of every piece, flattened and
    concatenated. On CUDA one launch for all of them (the engine takes them for every FP8
    weight after each optimizer step; per weight they were several launches each)."""
    if not pieces:
        return torch.zeros(0, dtype=torch.float32)
    first = pieces[0][0]
    if (use_triton(first) and all(r.dtype == first.dtype and r.device == first.device and r.is_contiguous()
                                  for r, _, _ in pieces)):
        from . import triton_weights

        return triton_weights.block_amax_grids(pieces)
    return torch.cat([partial_block_amax(rows, start, total).flatten() for rows, start, total in pieces])


def weight_amaxes(granularity: Granularity, pieces: Sequence) -> torch.Tensor:
    """What the engine's weights contribute to the scale agreement: ``amaxes`` of the tensors
    ``pieces`` (per-tensor scaling) or ``block_amax_grids`` of the pieces (128x128)."""
    return amaxes(pieces) if granularity is Granularity.TENSOR else block_amax_grids(pieces)


def _row_block_amax(x: torch.Tensor) -> torch.Tensor:
    """(rows, ceil(cols / 128)) fp32: the largest magnitude of each row's 128-column blocks
    (NaN propagates)."""
    rows, cols = x.shape
    whole = cols // 128 * 128
    inf = float("inf")
    parts = []
    if whole:
        parts.append(torch.linalg.vector_norm(x[:, :whole].reshape(rows, whole // 128, 128), ord=inf, dim=2,
                                              dtype=torch.float32))
    if whole < cols:
        parts.append(torch.linalg.vector_norm(x[:, whole:], ord=inf, dim=1, keepdim=True, dtype=torch.float32))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

"""Pack a unit's unsharded gradients rank-major for the reduce-scatter (see layout.py).

``pack_rank_major(grads, params, out)`` writes what ``torch._chunk_cat(grads, 0, n, out=out)``
writes: row ``k`` of ``out`` is chunk ``k`` of every gradient, each zero-padded to its
layout's ``chunk_numel``, cast to ``out``'s dtype on the way.

Why not ``_chunk_cat``: its CUDA path builds a host table with one entry per 2 KiB of
output (for a model-B decoder layer, 200k-400k entries), copies it into pinned memory and
uploads it, on every call. That is 1.2-3.7 ms of host time per unit inside the backward
pass, where the host is the bottleneck: in the H200 profile the GPU sat idle waiting for
it (2.9 ms at the end of backward alone). Here each chunk of each gradient is a
contiguous source and destination slice, and one ``_foreach_copy_`` (a multi-tensor
kernel with the bf16 -> fp32 cast fused; its launch arguments carry the pointers) moves
them all. Many chunks (large shard groups) would mean many Python slices, so past
``FOREACH_MAX_PIECES`` each gradient moves in one 2-D strided copy instead.
"""

from __future__ import annotations

import functools
from typing import List, Sequence, Tuple

import torch

from .layout import ParamLayout

# Above this many (gradient, chunk) pieces, one strided copy per gradient costs less host
# time than slicing every piece.
FOREACH_MAX_PIECES = 256


def pack_rank_major(grads: Sequence[torch.Tensor], params: Sequence[ParamLayout], out: torch.Tensor,
                    max_pieces: int = FOREACH_MAX_PIECES) -> None:
    """Write ``grads`` (full, unsharded, in ``params`` order) into ``out`` ``[n, width]``."""
    if len(grads) != len(params):
        raise ValueError(f"{len(grads)} gradients for {len(params)} parameter layouts")
    if out.dim() != 2 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [num_chunks, width] tensor, got {tuple(out.shape)}")
    n = out.shape[0]
    for g, p in zip(grads, params):
        if tuple(g.shape) != p.shape or p.num_chunks != n:
            raise ValueError(f"gradient of shape {tuple(g.shape)} does not match its layout "
                             f"{p.shape} over {p.num_chunks} chunks (out has {n})")
    pieces = sum(p.num_chunks for p in params)
    if pieces <= max_pieces:
        _pack_by_pieces(grads, params, out)
    else:
        _pack_by_params(grads, params, out)


def _pack_by_pieces(grads, params, out) -> None:
    copies, pads = _piece_plan(tuple(params))
    lines = out.unbind(0)
    flats = [g.reshape(-1) for g in grads]
    _copy_all([lines[k].narrow(0, at, n) for _, k, at, _, n in copies],
              [flats[i].narrow(0, src, n) for i, _, _, src, n in copies])
    if pads:
        torch._foreach_zero_([lines[k].narrow(0, at, n) for k, at, n in pads])


@functools.lru_cache(maxsize=None)
def _piece_plan(params: Tuple[ParamLayout, ...]):
    """Where each (gradient, chunk) piece goes: ``(copies, pads)``, copies as (gradient index,
    chunk, offset in the chunk's row of ``out``, offset in the flat gradient, length), pads as
    (chunk, offset, length). Pure layout arithmetic, fixed for a unit's life: computed once
    rather than in every backward pass (a 9-parameter pack: 134 -> 97 us of host time on the
    2-core CI machine)."""
    copies, pads = [], []
    for i, p in enumerate(params):
        row = p.row_numel
        for k in range(p.num_chunks):
            start, stop = p.chunk_row_range(k)
            used = (stop - start) * row
            if used:
                copies.append((i, k, p.offset, start * row, used))
            if used < p.chunk_numel:
                pads.append((k, p.offset + used, p.chunk_numel - used))
    return tuple(copies), tuple(pads)


def _pack_by_params(grads, params, out) -> None:
    for g, p in zip(grads, params):
        flat = g.reshape(-1)
        full = p.rows // p.chunk_rows if p.chunk_rows else 0  # chunks with every row present
        width = p.chunk_numel
        region = out[:, p.offset : p.offset + width]
        if full:
            region[:full].copy_(flat[: full * width].view(full, width))
        if full < p.num_chunks:
            rest = flat[full * width :]
            region[full, : rest.numel()].copy_(rest)
            region[full, rest.numel() :].zero_()
            region[full + 1 :].zero_()


def _copy_all(dests: List[torch.Tensor], sources: List[torch.Tensor]) -> None:
    if not dests:
        return
    # The CUDA multi-tensor copy wants one source dtype; mixed lists take plain copies.
    if all(s.dtype == sources[0].dtype for s in sources):
        torch._foreach_copy_(dests, sources)
    else:
        for d, s in zip(dests, sources):
            d.copy_(s)

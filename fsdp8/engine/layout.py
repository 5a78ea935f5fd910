"""Pure layout math: how a unit's parameters map onto flat chunk buffers and onto ranks.

[Note: the layout]
Each parameter is cut along dim 0 into ``num_chunks`` equal chunks of ``chunk_rows`` rows
(``ceil(rows / num_chunks)``, the ``torch.chunk`` / DTensor ``Shard(0)`` rule; the last
chunks may be short or empty and are zero-padded). Chunk ``k`` of a unit is the
concatenation of chunk ``k`` of every parameter, so every chunk has the same length
``chunk_numel`` and an all-gather of the chunks is one collective. The gathered buffer is
rank-major ``[num_chunks, chunk_numel]``; a parameter's full (padded) tensor is the
column slice ``[:, offset : offset + param_chunk_numel]`` of it, which one
``split_with_sizes_copy`` moves into the param-major unsharded buffer. That copy is the
price of exact ``Shard(0)`` DTensors, which make checkpoints reshard natively.

Trainable parameters come first, so gradients cover a prefix ``[0, trainable_numel)`` of
every chunk and frozen parameters cost no reduce-scatter bytes.

``row_multiple`` rounds ``chunk_rows`` up so a chunk boundary can sit on a block boundary
(FP8 128-row blocks); it is 1 unless a caller asks, because any other value no longer
matches the ``Shard(0)`` rule (see ``ParamLayout.is_torch_chunk``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence, Tuple


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    return ceil_div(a, multiple) * multiple


@dataclass(frozen=True)
class ParamLayout:
    """Where one parameter lives in a unit's chunk and unsharded buffers."""

    shape: Tuple[int, ...]
    num_chunks: int
    chunk_rows: int
    offset: int  # element offset of this parameter inside every chunk

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    @property
    def padded_numel(self) -> int:
        return self.chunk_numel * self.num_chunks

    @property
    def unsharded_offset(self) -> int:
        """Offset of the padded full parameter in the param-major unsharded buffer."""
        return self.offset * self.num_chunks

    @property
    def is_torch_chunk(self) -> bool:
        """True when chunks follow ``torch.chunk``, i.e. a ``Shard(0)`` DTensor describes them."""
        return self.chunk_rows == ceil_div(self.rows, self.num_chunks)

    def chunk_row_range(self, k: int) -> Tuple[int, int]:
        """Rows ``[start, stop)`` of the parameter that chunk ``k`` holds (possibly empty)."""
        if not 0 <= k < self.num_chunks:
            raise IndexError(f"chunk {k} out of range for {self.num_chunks} chunks")
        start = min(k * self.chunk_rows, self.rows)
        stop = min(start + self.chunk_rows, self.rows)
        return start, stop

    def chunk_shape(self, k: int) -> Tuple[int, ...]:
        start, stop = self.chunk_row_range(k)
        return (stop - start,) + tuple(self.shape[1:])

    def chunk_extent(self, k: int) -> Tuple[int, int, Tuple[int, ...]]:
        """(offset, elements, shape) of chunk ``k`` inside a flat chunk-layout buffer; cached,
        since the engine takes these views for every parameter in every step."""
        return _chunk_extent(self, k)


@functools.lru_cache(maxsize=None)
def _chunk_extent(layout: ParamLayout, k: int) -> Tuple[int, int, Tuple[int, ...]]:
    shape = layout.chunk_shape(k)
    return layout.offset, math.prod(shape), shape


@dataclass(frozen=True)
class UnitLayout:
    """The layout of one unit: its parameters, chunk count and buffer sizes (elements)."""

    params: Tuple[ParamLayout, ...]
    num_chunks: int
    chunk_numel: int
    trainable_numel: int

    @property
    def unsharded_numel(self) -> int:
        return self.num_chunks * self.chunk_numel

    @property
    def numel(self) -> int:
        """Unpadded element count of all parameters."""
        return sum(p.numel for p in self.params)

    @property
    def padding(self) -> int:
        """Elements at the end of every chunk that belong to no parameter (alignment)."""
        return self.chunk_numel - sum(p.chunk_numel for p in self.params)

    @property
    def split_sizes(self) -> Tuple[int, ...]:
        """How a chunk splits into parameters (and the alignment padding, if any)."""
        sizes = tuple(p.chunk_numel for p in self.params)
        return sizes + ((self.padding,) if self.padding else ())


def plan_unit(
    shapes: Sequence[Sequence[int]],
    num_trainable: int,
    num_chunks: int,
    row_multiple: int = 1,
    chunk_align: int = 1,
) -> UnitLayout:
    """Lay out parameters (the first ``num_trainable`` of them trainable) over ``num_chunks`` chunks.

    ``chunk_align`` pads every chunk to a multiple of that many elements, so that chunk
    ``k`` of a gathered buffer starts aligned (byte layouts mixing 1- and 2-byte entries)."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if not 0 <= num_trainable <= len(shapes):
        raise ValueError(f"num_trainable={num_trainable} outside [0, {len(shapes)}]")
    params = []
    offset = 0
    trainable_numel = 0
    for i, shape in enumerate(shapes):
        shape = tuple(int(s) for s in shape)
        if len(shape) == 0:
            raise ValueError("0-dim parameters cannot be sharded along dim 0; give them shape (1,)")
        chunk_rows = round_up(ceil_div(shape[0], num_chunks), row_multiple) if shape[0] else 0
        p = ParamLayout(shape, num_chunks, chunk_rows, offset)
        params.append(p)
        offset += p.chunk_numel
        if i < num_trainable:
            trainable_numel = offset
    return UnitLayout(tuple(params), num_chunks, round_up(offset, chunk_align) if offset else 0, trainable_numel)

"""FP8 expert weights in the engine: the layout and scale math of an experts module's 3-D
weights gathered as 8-bit bytes (pure functions; Float8Unit applies them).

[Note: FP8 expert weights on the wire]
An experts module that FP8 conversion marked (``fp8_recipe``, fsdp8.fp8.grouped) holds E
matrices as one weight [E, N, K], and ``fp8_grouped_mm`` quantizes each matrix as a dense
weight of its own (see [Note: FP8 experts]). The engine sends those bytes instead of the
compute dtype, as it does for a Float8Linear's weight ([Note: the FP8 wire]):

- the scales: one per expert (per tensor), or each expert's own 128x128 grid, its rows padded
  to whole blocks (zeros change no block's amax), ``ceil(N / 128) x ceil(K / 128)`` scales;
- the amaxes: each rank takes them on the experts its main chunk holds and puts zeros for the
  others, in the whole weight's expert order, so the one max all-reduce of fp8_scales.py gives
  every rank every expert's amax. The engine cuts a parameter along dim 0, so a chunk holds
  whole experts; under expert parallelism the engine's tensor is this ep rank's experts, placed
  at their global index (an expert's amax never meets another expert's, whatever rank held it);
- the pack: each held expert is one piece of the unit's pack kernel (quantize_pieces, or
  quantize_block_pieces with the expert's grid, rows counted from the expert's first row).

- MXFP8: 1x32 blocks lie inside a row, so nothing is agreed: each rank quantizes the rows of the
  experts it holds and sends their e8m0 scales with the bytes, as for a dense MX weight; the
  gathered scales are [E, N, ceil(K / 32)].

So the gathered bytes and scales are those ``fp8_grouped_mm`` makes from the high-precision
weight, and the module computes with a 3-D Float8Tensor over them. A weight another
model-parallel dim than dim 0 cuts (an expert's matrix split across tp ranks: not laid out by
fsdp8's plans) stays in the compute dtype on the wire, quantized at every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..fp8.formats import Granularity
from ..fp8.grouped import FP8_EXPERT_WEIGHTS
from ..fp8.recipes import Recipe

# The recipes whose expert weights travel as FP8 bytes: scales agreed before the gather (per
# tensor, 128x128) or row-local ones that travel with the bytes (MX).
WIRE_GRANULARITIES = (Granularity.TENSOR, Granularity.BLOCK_128x128, Granularity.MX_1x32)


def gathers_fp8_expert(slot, recipe: Optional[Recipe]) -> bool:
    """Whether ``slot`` is a 3-D weight that FP8 experts' grouped GEMMs read under ``recipe``, to
    be gathered as FP8 bytes (see the Note for those that are not)."""
    if recipe is None or recipe.delayed or recipe.w_granularity not in WIRE_GRANULARITIES:
        return False
    if len(slot.layout.shape) != 3 or not slot.aliases:
        return False
    if slot.inner is not None and any(slot.inner.local_region()[0][d] != slot.inner.shape[d] for d in (1, 2)):
        return False
    return all(attr in FP8_EXPERT_WEIGHTS and getattr(module, "fp8_recipe", None) is not None
               for module, attr in slot.aliases)


@dataclass(frozen=True)
class ExpertPlacement:
    """An FP8 experts weight as one rank sees it."""

    experts: int  # E of the engine's tensor (this ep rank's experts)
    total: int  # E of the whole weight
    first: int  # the whole weight's index of the engine's expert 0
    held: Tuple[int, int]  # [start, stop): the experts this rank's main chunk holds
    rows: int  # N
    cols: int  # K

    def grid(self) -> Tuple[int, int]:
        """One expert's 128x128 scale grid."""
        return math.ceil(self.rows / 128), math.ceil(self.cols / 128)

    def per_expert(self, granularity: Granularity) -> int:
        """Scales (and amaxes) of one expert."""
        return 1 if granularity is Granularity.TENSOR else math.prod(self.grid())

    def scale_shape(self, granularity: Granularity) -> Tuple[int, ...]:
        """The scales of the engine's experts, as the gathered Float8Tensor carries them."""
        if granularity is Granularity.MX_1x32:
            return self.experts, self.rows, math.ceil(self.cols / 32)
        return (self.experts,) if granularity is Granularity.TENSOR else (self.experts,) + self.grid()

    def amax_size(self, granularity: Granularity) -> int:
        """Amaxes this weight contributes to the all-reduce: every expert of the whole weight's."""
        return self.total * self.per_expert(granularity)

    def picks(self, granularity: Granularity, amax_start: int) -> torch.Tensor:
        """Where the engine's experts' scales sit among the weight's amaxes (which start at ``amax_start``)."""
        per = self.per_expert(granularity)
        return torch.arange(amax_start + self.first * per, amax_start + (self.first + self.experts) * per)

    def _by_expert(self, rows: torch.Tensor, empty: torch.Tensor) -> List[torch.Tensor]:
        """For each expert of the whole weight, its matrix where this rank holds it, else ``empty``."""
        start, stop = self.held
        held = list(rows.unbind(0))
        before, after = self.first + start, self.total - self.first - stop
        return [empty] * before + held + [empty] * after

    def amax_inputs(self, rows: torch.Tensor) -> List[torch.Tensor]:
        """Per tensor: the tensors whose amaxes (weight_kernels.amaxes, 0 for an empty one) are
        this weight's contribution, from ``rows`` [held, N, K], this rank's main rows."""
        return self._by_expert(rows, rows.new_empty(0))

    def grid_pieces(self, rows: torch.Tensor) -> List[Tuple[torch.Tensor, int, int]]:
        """128x128: the pieces of weight_kernels.block_amax_grids that are this weight's
        contribution (an expert is the whole of its rows; one not held is empty: zeros)."""
        return [(m, 0, self.rows) for m in self._by_expert(rows, rows.new_empty(0, self.cols))]

    def pack_pieces(self, granularity: Granularity, src: int, dest: int, scale_at: int) -> List[Tuple[int, ...]]:
        """The held experts as pieces of the unit's pack: their main rows start at element
        ``src`` of the main chunk, their bytes at ``dest`` of the send chunk, the engine's expert
        0's scales at ``scale_at`` of the scale buffer."""
        start, stop = self.held
        numel, per = self.rows * self.cols, self.per_expert(granularity)
        if granularity is Granularity.TENSOR:
            return [(src + i * numel, dest + i * numel, numel, scale_at + start + i) for i in range(stop - start)]
        return [(src + i * numel, dest + i * numel, self.rows, self.cols, 0, scale_at + (start + i) * per)
                for i in range(stop - start)]


def expert_placement(slot, chunk_index: int) -> ExpertPlacement:
    """``slot``'s experts as chunk ``chunk_index`` of its unit sees them."""
    experts, rows, cols = slot.layout.shape
    total, first = experts, 0
    if slot.inner is not None:
        total, first = slot.inner.shape[0], slot.inner.local_region()[1][0]
    return ExpertPlacement(experts, total, first, slot.layout.chunk_row_range(chunk_index), rows, cols)

"""Float8Unit: a unit whose Float8Linear weights travel and compute as 8-bit bytes.

[Note: the FP8 wire]
A unit's all-gather carries bytes. Each rank writes its rows of every parameter in the
form the GEMMs consume: FP8 weights quantized with scales agreed across all shards
beforehand (whole-tensor or 128x128 block amaxes, fp8_scales.py), MX weights quantized
with their row-local 1x32 scales (whose e8m0 bytes travel too), other parameters (norms,
biases) in the compute dtype. Compute-dtype entries come first so their byte offsets stay
aligned. After the gather, a Float8Linear's weight is a Float8Tensor viewing the gathered
bytes: the forward GEMM uses them directly, the input-gradient GEMM uses their transpose
(a copy made once per gather, freed at reshard), and no high-precision copy of an FP8
weight exists beyond the fp32 main chunk. FP8 experts' 3-D weights travel so too, each
expert a matrix with its own scales ([Note: FP8 expert weights on the wire]).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

from ..fp8.formats import SCALE_ALIGN, Granularity, e8m0_to_scale_inv, mx_scale_count, scale_inv_to_e8m0
from ..fp8.kernels import quantize
from ..fp8.weight_kernels import (
    block_amax_grids, partial_block_amax, quantize_block_pieces, quantize_pieces, weight_amaxes,
)
from ..fp8.recipes import DelayedState, Recipe
from ..fp8.tensor import Float8Tensor
from .fp8_experts import ExpertPlacement, expert_placement
from .layout import UnitLayout, plan_unit
from .unit import ParamSlot, ShardedUnit, alias_storage


class Float8Unit(ShardedUnit):
    """A ShardedUnit whose gather sends FP8 bytes for the weights of its Float8Linears."""

    def __init__(self, *args, recipe: Recipe, fp8_slots: List[ParamSlot], delayed: Dict[int, DelayedState],
                 primary: bool = False, **kwargs):
        self.recipe = recipe
        # FP8 primary weights (fp8_init): this rank's packed FP8 chunk is kept and re-packed
        # once per optimizer step, so gathers (forward and backward) only move bytes.
        self.primary = primary
        self.fp8_shard: torch.Tensor = None
        self._fp8_shard_version = None
        self.fp8_ids = {id(s) for s in fp8_slots}
        self.delayed = delayed  # id(slot) -> the DelayedState of the slot's Float8Linear
        self.granularity = recipe.w_granularity
        self.scales_version = 0
        self._scales_seen = None
        # Per FP8 weight: the agreed scale and the scale_inv its Float8Tensor carries.
        self._scale: Dict[int, torch.Tensor] = {}
        self._scale_inv: Dict[int, torch.Tensor] = {}
        self._pieces = None  # _pack_pieces(), once computed
        self._experts: Optional[Dict[int, ExpertPlacement]] = None  # _expert(), once computed
        super().__init__(*args, **kwargs)

    # -- layout ------------------------------------------------------------------------------
    def _plan_wire(self) -> Tuple[UnitLayout, torch.dtype]:
        itemsize = self.compute_dtype.itemsize
        entries = [(s, "value", s.layout.row_numel * itemsize) for s in self.slots if id(s) not in self.fp8_ids]
        entries += [(s, "fp8", s.layout.row_numel) for s in self.slots if id(s) in self.fp8_ids]
        if self.recipe.w_granularity is Granularity.MX_1x32:
            # Per row of the layout (an expert of a 3-D weight: its N rows): a byte per 32 columns.
            entries += [(s, "e8m0", mx_scale_count(s.layout.shape[1:])) for s in self.slots if id(s) in self.fp8_ids]
        layout = plan_unit([(s.layout.rows, row_bytes) for s, _, row_bytes in entries], len(entries),
                           self.layout.num_chunks, chunk_align=16)
        self._entries = [(s, kind, p) for (s, kind, _), p in zip(entries, layout.params)]
        self._entry_of = {(id(s), kind): p for s, kind, p in self._entries}
        return layout, torch.uint8

    def _entry(self, slot: ParamSlot, kind: str):
        return self._entry_of[(id(slot), kind)]

    def _expert(self, slot: ParamSlot) -> Optional[ExpertPlacement]:
        """Where an FP8 experts weight's experts sit (fp8_experts.py); None for a linear's weight."""
        if self._experts is None:
            self._experts = {id(s): expert_placement(s, self.chunk_index) for s in self.slots
                             if id(s) in self.fp8_ids and len(s.layout.shape) == 3}
        return self._experts.get(id(slot))

    def _scale_shape(self, slot: ParamSlot) -> Tuple[int, ...]:
        expert = self._expert(slot)
        if expert is not None:
            return expert.scale_shape(self.granularity)
        rows, cols = slot.layout.shape
        return {
            Granularity.TENSOR: (),
            Granularity.BLOCK_128x128: (math.ceil(rows / 128), math.ceil(cols / 128)),
            Granularity.MX_1x32: (rows, math.ceil(cols / 32)),
        }[self.granularity]

    def _block_grid(self, slot: ParamSlot) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """(grid shape, offset of this rank's blocks in it) of a 128x128-scaled weight's amaxes.

        A tensor-parallel piece is one part of a larger weight whose blocks the other tp ranks
        hold: its block amaxes sit in the whole weight's grid, so the max all-reduce over
        dp x tp reduces each block with its own rows only (the engine converts only pieces
        that are whole blocks, fp8/tp_forward.py)."""
        rows, cols = slot.layout.shape
        if slot.inner is None or slot.inner.is_replicated:
            return (math.ceil(rows / 128), math.ceil(cols / 128)), (0, 0)
        (_, _), (row0, col0) = slot.inner.local_region()
        full_rows, full_cols = slot.inner.shape
        if row0 % 128 or col0 % 128:
            raise ValueError(f"{slot.fqn}: its tensor-parallel piece starts at ({row0}, {col0}), inside a 128x128 "
                             "scaling block; use a tensor-parallel degree that keeps pieces whole blocks")
        return (math.ceil(full_rows / 128), math.ceil(full_cols / 128)), (row0 // 128, col0 // 128)

    def _allocate_scales(self) -> None:
        """Every FP8 weight's scale and scale_inv as views of two flat buffers, in slot order,
        so that new scales land with one indexed copy per unit (or one copy for all units,
        ScaleAgreement). MX weights get their scale_inv only: their scales are row-local
        (each rank's own, gathered with the bytes), so no scale buffer and no index maps into
        the agreement's layout, which at one int64 per 32 weight elements each had held 0.75
        bytes per weight element (1.2 GiB on model B). Each view starts at a multiple of
        SCALE_ALIGN elements (a 16-byte boundary), as cuBLAS wants."""
        fp8 = [s for s in self.slots if id(s) in self.fp8_ids]
        sizes = [math.prod(self._scale_shape(s)) for s in fp8]
        padded = [SCALE_ALIGN * math.ceil(n / SCALE_ALIGN) for n in sizes]
        starts = [sum(padded[:i]) for i in range(len(sizes))]
        total = sum(padded)
        agreed = self.granularity is not Granularity.MX_1x32
        self._scale_inv_flat = torch.ones(total, dtype=torch.float32, device=self.device)
        self._scale_flat = torch.ones(total, dtype=torch.float32, device=self.device) if agreed else None
        self._scale_ranges: Dict[int, Tuple[int, int]] = {}
        positions, picks, amax_start = [], [], 0
        for slot, size, start in zip(fp8, sizes, starts):
            shape = self._scale_shape(slot)
            self._scale_inv[id(slot)] = self._scale_inv_flat[start : start + size].view(shape)
            if not agreed:
                continue
            self._scale[id(slot)] = self._scale_flat[start : start + size].view(shape)
            amax_size = size
            pick = torch.arange(amax_start, amax_start + size)
            expert = self._expert(slot)
            if expert is not None:  # every expert of the whole weight; this tensor's are picked
                amax_size, pick = expert.amax_size(self.granularity), expert.picks(self.granularity, amax_start)
            elif self.granularity is Granularity.BLOCK_128x128:
                (grid_rows, grid_cols), (r0, c0) = self._block_grid(slot)
                amax_size = grid_rows * grid_cols
                grid = torch.arange(amax_size).view(grid_rows, grid_cols)
                pick = amax_start + grid[r0 : r0 + shape[0], c0 : c0 + shape[1]].flatten()
            self._scale_ranges[id(slot)] = (amax_start, amax_start + amax_size)
            positions.append(torch.arange(start, start + size))
            picks.append(pick)
            amax_start += amax_size
        # Where each of this rank's scales sits in local_amaxes() layout, and where it lands
        # in the (padded) flat buffers.
        self._scale_positions = torch.cat(positions).to(self.device) if positions else None
        self._scale_picks = torch.cat(picks).to(self.device) if picks else None
        self._picks_all = bool(positions) and amax_start == sum(sizes)  # no tp pieces: the amaxes are the scales

    def _ensure_scales(self) -> None:
        """Allocate the scale buffers on first use (the first compute copy asks for them)."""
        if not self._scale_inv:
            self._allocate_scales()

    def scale_buffers(self):
        """(scale buffer, scale_inv buffer, where each amax's scale lands in them) when this
        rank's scales are its amaxes (``local_amaxes`` order, no tensor-parallel picks); else None."""
        self._ensure_scales()
        return (self._scale_flat, self._scale_inv_flat, self._scale_positions) if self._picks_all else None

    def scale_of(self, slot: ParamSlot) -> torch.Tensor:
        """The agreed scale of a whole-tensor or 128x128-scaled weight."""
        if self.granularity is Granularity.MX_1x32:
            raise ValueError(f"{slot.fqn}: MX weights have row-local scales, kept as scale_inv only (scale_inv_of)")
        self._ensure_scales()
        return self._scale[id(slot)]

    def scale_inv_of(self, slot: ParamSlot) -> torch.Tensor:
        self._ensure_scales()
        return self._scale_inv[id(slot)]

    def _compute_local(self, slot: ParamSlot) -> torch.Tensor:
        if id(slot) not in self.fp8_ids:
            p = self._entry(slot, "value")
            return alias_storage(self.unsharded, p.unsharded_offset, self.compute_dtype, slot.layout.shape)
        p = self._entry(slot, "fp8")
        data = alias_storage(self.unsharded, p.unsharded_offset, self.recipe.fwd_dtype, slot.layout.shape)
        return Float8Tensor(data, self.scale_inv_of(slot), self.granularity, self.compute_dtype)

    # -- scales (agreed by fp8_scales.ScaleAgreement) --------------------------------------
    @property
    def gather_needs_scales(self) -> bool:
        return bool(self.fp8_ids)

    def _version_key(self):
        return super()._version_key() + (self.scales_version,)

    def _rows(self, slot: ParamSlot) -> Tuple[torch.Tensor, int]:
        """This rank's rows of a weight in the compute dtype, and the first row's index."""
        start, _ = slot.layout.chunk_row_range(self.chunk_index)
        return self.main_view(slot).to(self.compute_dtype), start

    def weights_changed(self) -> bool:
        return self._scales_seen != super()._version_key()

    def amax_slots(self) -> List[ParamSlot]:
        """The weights whose scales are agreed across ranks, in ``local_amaxes`` order (MX
        weights have row-local scales and need none)."""
        if self.granularity is Granularity.MX_1x32:
            return []
        return [s for s in self.slots if id(s) in self.fp8_ids]

    def amax_range(self, slot: ParamSlot) -> Tuple[int, int]:
        """Where ``slot``'s amaxes sit in ``local_amaxes()``."""
        self.scale_of(slot)
        return self._scale_ranges[id(slot)]

    def local_amaxes(self) -> torch.Tensor:
        """What this rank contributes to the max all-reduce, one flat fp32 tensor: one amax
        per weight (per tensor), or a grid with zeros outside this rank's rows (128x128).

        Amaxes are of the weights as the compute dtype holds them, taken on the main rows
        directly: rounding to nearest is monotonic and symmetric, so the largest magnitude
        of the rounded rows is the rounded largest magnitude of the rows (NaN stays NaN),
        and no rounded copy of the shard is needed. fp8_scales.local_amaxes_of batches units."""
        slots = self.amax_slots()
        if not slots:
            return torch.zeros(0, dtype=torch.float32, device=self.device)
        if self.granularity is Granularity.TENSOR or self.whole_grids():
            local = weight_amaxes(self.granularity, [p for s in slots for p in self.amax_pieces(s)])
        else:
            local = self._placed_grids()
        return local.to(self.compute_dtype).float()

    def amax_count(self) -> int:
        """The length of ``local_amaxes()``."""
        slots = self.amax_slots()
        return self.amax_range(slots[-1])[1] if slots else 0

    def whole_grids(self) -> bool:
        """Whether each weight's 128x128 grid is its own (no tensor-parallel piece of a larger one)."""
        return all(self._expert(s) is not None or self._block_grid(s) == (self._scale_shape(s), (0, 0))
                   for s in self.amax_slots())

    def amax_pieces(self, slot: ParamSlot) -> list:
        """What weight_kernels.amaxes (per tensor) or block_amax_grids (whole 128x128 grids) takes
        for ``slot``'s contribution: its main rows, or its experts one by one."""
        rows, expert = self.main_view(slot), self._expert(slot)
        if self.granularity is Granularity.TENSOR:
            return [rows] if expert is None else expert.amax_inputs(rows)
        if expert is not None:
            return expert.grid_pieces(rows)
        return [(rows, slot.layout.chunk_row_range(self.chunk_index)[0], slot.layout.rows)]

    def _placed_grids(self) -> torch.Tensor:
        """local_amaxes() for tensor-parallel pieces: each piece's grid inside its whole weight's."""
        grids = []
        for slot in self.amax_slots():
            if self._expert(slot) is not None:
                grids.append(block_amax_grids(self.amax_pieces(slot)))
                continue
            start, _ = slot.layout.chunk_row_range(self.chunk_index)
            grid = partial_block_amax(self.main_view(slot), start, slot.layout.rows)
            shape, (r0, c0) = self._block_grid(slot)
            if shape != tuple(grid.shape):
                whole = grid.new_zeros(shape)
                whole[r0 : r0 + grid.shape[0], c0 : c0 + grid.shape[1]] = grid
                grid = whole
            grids.append(grid.flatten())
        return torch.cat(grids) if grids else torch.zeros(0, dtype=torch.float32, device=self.device)

    def set_scales(self, scale: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Take this unit's slice of the agreed scales (``local_amaxes`` layout)."""
        if scale.numel():
            self.scale_of(self.amax_slots()[0])  # allocates the flat buffers
            if not self._picks_all:  # tp pieces: this rank's blocks of the whole weights' grids
                scale, scale_inv = scale[self._scale_picks], scale_inv[self._scale_picks]
            self._scale_flat.index_copy_(0, self._scale_positions, scale)
            self._scale_inv_flat.index_copy_(0, self._scale_positions, scale_inv)
        self._scales_agreed()

    def scales_agreed(self) -> None:
        """The scales were written from outside (delayed scaling: ScaleAgreement, from the
        histories that hold the reduced amaxes)."""
        self._scales_agreed()

    def _scales_agreed(self) -> None:
        self._scales_seen = super()._version_key()
        self.scales_version += 1

    # -- gather ------------------------------------------------------------------------------
    def gather(self) -> None:
        if self.primary and self.needs_gather():
            self._refresh_fp8_shard()
        super().gather()

    def _refresh_fp8_shard(self) -> None:
        if self.fp8_shard is None:
            self.fp8_shard = torch.empty(self.wire_layout.chunk_numel, dtype=torch.uint8, device=self.device)
        if self._fp8_shard_version != self._version_key():
            # On the compute stream: the shard is persistent and read by later gathers.
            self._pack_into(self.fp8_shard)
            self._fp8_shard_version = self._version_key()

    def _pack(self, dest: torch.Tensor) -> None:
        if self.primary:
            dest.copy_(self.fp8_shard)
        else:
            self._pack_into(dest)

    def _ready_chunk(self):
        return self.fp8_shard if self.primary else None

    def persistent_compute_bytes(self) -> int:
        return super().persistent_compute_bytes() + (self.wire_layout.chunk_numel if self.primary else 0)

    def _pack_into(self, dest: torch.Tensor) -> None:
        k = self.chunk_index
        e8m0 = {}
        fp8 = self.recipe.fwd_dtype
        agreed = self.granularity in (Granularity.TENSOR, Granularity.BLOCK_128x128)
        if agreed and self.fp8_ids:
            # Every FP8 weight in one pass (one launch on CUDA), from the fp32 main chunk,
            # with the scales agreed before the gather.
            pack = quantize_pieces if self.granularity is Granularity.TENSOR else quantize_block_pieces
            pack(self.main, dest.view(fp8), self._scale_flat, self._pack_pieces(), fp8, via=self.compute_dtype)
        for slot, kind, p in self._entries:
            rows = slot.layout.chunk_shape(k)[0]
            region = dest[p.offset : p.offset + rows * p.row_numel]
            if kind == "value":
                region.view(self.compute_dtype).view(slot.layout.chunk_shape(k)).copy_(self.main_view(slot))
            elif kind == "fp8" and not agreed and rows:
                # MX: 1x32 blocks stay inside a row, so each rank quantizes its rows on its own
                # (an experts weight's held experts as their matrices' rows).
                held = self._rows(slot)[0]
                mx = quantize(held.reshape(-1, held.shape[-1]), fp8, Granularity.MX_1x32)
                e8m0[id(slot)] = scale_inv_to_e8m0(mx.scale_inv)
                q = mx.data
                region.view(fp8).view(q.shape).copy_(q)
            elif kind == "e8m0" and rows:
                region.copy_(e8m0[id(slot)].flatten())

    def _pack_pieces(self) -> Tuple[Tuple[int, ...], ...]:
        """Where each FP8 weight's rows come from and go, for quantize_pieces (per-tensor: main
        offset, send-chunk byte offset, length, scale index) or quantize_block_pieces (128x128:
        main offset, byte offset, rows, columns, first row in the weight, grid offset); fixed
        for the unit's life (its buffers never move), so computed once."""
        if self._pieces is None:
            pieces = []
            for slot, kind, p in self._entries:
                if kind != "fp8":
                    continue
                rows = self.main_view(slot)
                scale = self.scale_of(slot)
                if (rows.untyped_storage().data_ptr() != self.main.untyped_storage().data_ptr()
                        or not rows.is_contiguous()):
                    raise RuntimeError(f"the main shard of {slot.fqn} no longer views its unit's main buffer as "
                                       "contiguous rows; replace parameter values with copy_ (load_state_dict does), "
                                       "not by assigning .data")
                src, scale_at = rows.storage_offset() - self.main.storage_offset(), \
                    scale.storage_offset() - self._scale_flat.storage_offset()
                expert = self._expert(slot)
                if expert is not None:
                    pieces += expert.pack_pieces(self.granularity, src, p.offset, scale_at)
                elif self.granularity is Granularity.TENSOR:
                    pieces.append((src, p.offset, rows.numel(), scale_at))
                else:
                    start, _ = slot.layout.chunk_row_range(self.chunk_index)
                    pieces.append((src, p.offset, rows.shape[0], rows.shape[1], start, scale_at))
            self._pieces = tuple(pieces)
        return self._pieces

    def _after_gather(self) -> None:
        for slot in self.slots:
            if id(slot) not in self.fp8_ids:
                continue
            self.compute_local(slot).clear_transpose()
            if self.granularity is Granularity.MX_1x32:
                p = self._entry(slot, "e8m0")
                rows, cols = slot.layout.rows, p.row_numel
                gathered = self.unsharded[p.unsharded_offset : p.unsharded_offset + rows * cols]
                scale_inv = self.scale_inv_of(slot)
                scale_inv.copy_(e8m0_to_scale_inv(gathered).view(scale_inv.shape))

    # MX weights' scale_inv (fp32, one per 32 elements: 0.125 bytes per weight element) is
    # made from the e8m0 bytes gathered with the weights and read only while they are
    # gathered, so it lives and dies with the unsharded parameters (0.20 GiB on model B);
    # per-tensor and 128x128 scales are agreed before the gather and stay.
    def _gathered_scale_inv(self) -> Optional[torch.Tensor]:
        if self.granularity is not Granularity.MX_1x32 or not self.fp8_ids:
            return None
        self._ensure_scales()
        return self._scale_inv_flat

    def _allocate_unsharded(self) -> None:
        super()._allocate_unsharded()
        scale_inv = self._gathered_scale_inv()
        if scale_inv is not None:
            nbytes = scale_inv.numel() * scale_inv.element_size()
            if scale_inv.untyped_storage().nbytes() != nbytes:
                scale_inv.untyped_storage().resize_(nbytes)

    def _free_unsharded(self) -> None:
        super()._free_unsharded()
        scale_inv = self._gathered_scale_inv()
        if scale_inv is not None:
            scale_inv.untyped_storage().resize_(0)

    def reshard(self) -> None:
        super().reshard()
        if self.shards_params:
            for slot in self.slots:
                if id(slot) in self.fp8_ids:
                    self.compute_local(slot).clear_transpose()

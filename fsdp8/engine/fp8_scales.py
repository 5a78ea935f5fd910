"""FP8 scale agreement: one max all-reduce per step for every weight and delayed amax.

[Note: agreeing on scales]
A weight sharded over ranks must be quantized with one scale (or one 128x128 block grid)
on every rank, or the gathered bytes would not form one tensor. Before the first forward
after an optimizer step, each rank computes the amax of its rows of every FP8 weight
(per tensor, or per 128x128 block with zeros for blocks it does not touch), appends the
amaxes that delayed scaling collected in the last step (inputs and output gradients of
every Float8Linear), and all ranks reduce the lot with a single max all-reduce. Delayed
scaling then rolls its histories (the weight's own amax included); every unit derives its
scales and gathers FP8 bytes with them.

The work is a few launches for the whole model, not a few per unit: the amaxes of every
weight (per tensor, or its 128x128 grid) in one kernel (``local_amaxes_of``), the scales
in one pass and, when every unit changed (each step after an optimizer step), one
multi-tensor copy into the units' scale buffers. They run on the host before the step's
first kernel can start; unit by unit they took ~13 ms of model A's step (16 layers, 1x
H200, py-spy).
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist

from ..fp8.formats import Granularity, scale_to_inv
from ..fp8.kernels import scales_for
from ..fp8.weight_kernels import weight_amaxes
from ..fp8.recipes import W, DelayedState, update_states
from ..distributed import comm
from .fp8_unit import Float8Unit


class ScaleAgreement:
    def __init__(self, units: Sequence[Float8Unit], states: Sequence[DelayedState], group):
        self.units = list(units)
        self.states = list(states)
        self.group = group
        # No unit when only FP8 experts' histories are agreed (their weights gather in high precision).
        self.device = self.units[0].device if self.units else self.states[0].scale.device
        self._positions_key, self._positions = None, None
        self._layout = None  # see _write_layout

    def refresh(self) -> None:
        """Agree on new scales where weights changed (every step under delayed scaling)."""
        delayed = bool(self.states)
        units = [u for u in self.units if delayed or u.weights_changed()]
        if not units and not delayed:
            return
        # One flat tensor: every unit's amaxes, then the delayed histories' pending amaxes;
        # one all-reduce; each unit takes its slice back.
        local = local_amaxes_of(units, self.device)
        sizes = [u.amax_count() for u in units]
        pieces = [local] + ([torch.stack([s.pending for s in self.states]).flatten()] if delayed else [])
        flat = torch.cat(pieces)
        if flat.numel():
            comm.all_reduce(flat, self.group, dist.ReduceOp.MAX, "fp8 amax")
        if delayed:
            self._roll_histories(units, flat, sizes)
            return
        # Every unit shares the recipe: the scales of all weights in one go.
        recipe = units[0].recipe
        scale, inv = scales_for(flat[: sum(sizes)], recipe.w_granularity, recipe.fwd_dtype)
        layout = self._write_layout() if len(units) == len(self.units) else None
        if layout is None:  # a slice each
            for unit, s, i in zip(units, torch.split(scale, sizes), torch.split(inv, sizes)):
                unit.set_scales(s, i)
            return
        positions, buffer_sizes, scale_bufs, inv_bufs = layout
        for new, buffers in ((scale, scale_bufs), (inv, inv_bufs)):
            # Laid out as the buffers side by side (their padding stays 1), then one copy each.
            padded = new.new_ones(sum(buffer_sizes)).index_copy_(0, positions, new)
            torch._foreach_copy_(buffers, list(padded.split(buffer_sizes)))
        for unit in self.units:
            unit.scales_agreed()

    def _write_layout(self):
        """(where each amax's scale lands in all units' scale buffers side by side, the buffers'
        sizes, the scale buffers, the scale_inv buffers), made once; None when some unit's
        scales are not its amaxes (tensor-parallel pieces pick theirs) and each unit takes its
        slice instead."""
        if self._layout is None:
            buffers = [u.scale_buffers() for u in self.units if u.amax_slots()]
            if not buffers or any(b is None for b in buffers):
                self._layout = False
            else:
                sizes = [b[0].numel() for b in buffers]
                offsets = [sum(sizes[:i]) for i in range(len(sizes))]
                positions = torch.cat([b[2] + off for b, off in zip(buffers, offsets)])
                self._layout = (positions, sizes, [b[0] for b in buffers], [b[1] for b in buffers])
        return self._layout or None

    def _roll_histories(self, units, flat: torch.Tensor, sizes: List[int]) -> None:
        """Every history takes its reduced input and gradient amaxes of the last step and its
        weight's reduced amax of now (so the weight's scale reflects the weight it quantizes);
        then every weight takes its new scale. Batched over all linears (update_states): a
        per-linear loop was ~30 launches each, enough to make the step host-bound."""
        n = len(self.states)
        rows = flat[sum(sizes):].view(n, 3)
        states_at, weights_at, owners = self._weight_positions(units, sizes)
        if owners:
            rows = rows.clone()
            rows[states_at, W] = flat[weights_at]
        scales = update_states(self.states, rows)
        if owners:
            weight_scales = scales[states_at, W]
            inverses = scale_to_inv(weight_scales)
            torch._foreach_copy_([unit.scale_of(slot) for unit, slot in owners], list(weight_scales.unbind(0)))
            torch._foreach_copy_([unit.scale_inv_of(slot) for unit, slot in owners], list(inverses.unbind(0)))
        for unit in units:
            unit.scales_agreed()

    def _weight_positions(self, units, sizes: List[int]):
        """(index of each FP8 weight's state, index of its amax in the flat all-reduce buffer,
        its (unit, slot)), the indices on the device; made once (the layout never changes).
        Delayed weights are scaled per tensor: one amax each."""
        key = tuple(id(u) for u in units)
        if self._positions_key != key:
            index = {id(state): i for i, state in enumerate(self.states)}
            states_at, weights_at, owners, offset = [], [], [], 0
            for unit, size in zip(units, sizes):
                for slot in unit.amax_slots():
                    if id(slot) in unit.delayed:
                        start, stop = unit.amax_range(slot)
                        if stop - start != 1:
                            raise AssertionError(f"delayed scaling keeps one amax per weight, {unit.name} has {stop - start}")
                        states_at.append(index[id(unit.delayed[id(slot)])])
                        weights_at.append(offset + start)
                        owners.append((unit, slot))
                offset += size
            device = self.states[0].scale.device
            self._positions = (torch.tensor(states_at, dtype=torch.long, device=device),
                               torch.tensor(weights_at, dtype=torch.long, device=device), owners)
            self._positions_key = key
        return self._positions


def delayed_states_of(units: Sequence[Float8Unit]) -> List[DelayedState]:
    seen, out = set(), []
    for unit in units:
        for state in unit.delayed.values():
            if id(state) not in seen:
                seen.add(id(state))
                out.append(state)
    return out


def local_amaxes_of(units: Sequence[Float8Unit], device: torch.device) -> torch.Tensor:
    """``torch.cat([u.local_amaxes() for u in units])`` in one launch where they allow it: the
    amaxes of every per-tensor-scaled weight, or the 128x128 grids of every whole weight (the
    engine takes them for all units before each step's first kernel, on the host's critical
    path; per unit and per weight they were ~13 ms of model A's step on an H200)."""
    slots = [(u, s) for u in units for s in u.amax_slots()]
    if not slots:
        return torch.zeros(0, dtype=torch.float32, device=device)
    granularity = units[0].granularity
    dtypes = {u.compute_dtype for u in units}
    if len(dtypes) > 1 or (granularity is not Granularity.TENSOR and not all(u.whole_grids() for u in units)):
        return torch.cat([u.local_amaxes() for u in units])
    local = weight_amaxes(granularity, [piece for u, s in slots for piece in u.amax_pieces(s)])
    return local.to(dtypes.pop()).float()

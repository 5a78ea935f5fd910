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
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist

from ..fp8.kernels import scales_for
from ..fp8.recipes import W, DelayedState
from . import comm
from .fp8_unit import Float8Unit


class ScaleAgreement:
    def __init__(self, units: Sequence[Float8Unit], states: Sequence[DelayedState], group):
        self.units = list(units)
        self.states = list(states)
        self.group = group

    def refresh(self) -> None:
        """Agree on new scales where weights changed (every step under delayed scaling)."""
        delayed = bool(self.states)
        units = [u for u in self.units if delayed or u.weights_changed()]
        if not units:
            return
        # One flat tensor: each unit's amaxes (one launch per unit on CUDA), then the
        # delayed histories' pending amaxes; one all-reduce; each unit takes its slice back.
        local = [unit.local_amaxes() for unit in units]
        pieces = local + ([torch.stack([s.pending for s in self.states]).flatten()] if delayed else [])
        flat = torch.cat(pieces)
        if flat.numel():
            comm.all_reduce(flat, self.group, dist.ReduceOp.MAX, "fp8 amax")
        reduced = list(torch.split(flat, [p.numel() for p in pieces]))
        if delayed:
            self._roll_histories(units, reduced)
            for unit in units:
                unit.set_scales_from_histories()
            return
        # Every unit shares the recipe: the scales of all weights in one go, then a slice each.
        recipe = units[0].recipe
        weights = flat[: sum(p.numel() for p in local)]
        scale, inv = scales_for(weights, recipe.w_granularity, recipe.fwd_dtype)
        sizes = [p.numel() for p in local]
        for unit, s, i in zip(units, torch.split(scale, sizes), torch.split(inv, sizes)):
            unit.set_scales(s, i)

    def _roll_histories(self, units, reduced) -> None:
        """Every history takes its reduced input and gradient amaxes of the last step and its
        weight's reduced amax of now (so the weight's scale reflects the weight it quantizes)."""
        rows = reduced[-1].view(len(self.states), 3)
        weight_amax = {}
        for unit, amaxes in zip(units, reduced):
            for slot in unit.amax_slots():
                if id(slot) in unit.delayed:
                    start, stop = unit.amax_range(slot)
                    weight_amax[id(unit.delayed[id(slot)])] = amaxes[start:stop].max()
        for state, row in zip(self.states, rows):
            if id(state) in weight_amax:
                row = row.clone()
                row[W] = weight_amax[id(state)]
            state.update(row)


def delayed_states_of(units: Sequence[Float8Unit]) -> List[DelayedState]:
    seen, out = set(), []
    for unit in units:
        for state in unit.delayed.values():
            if id(state) not in seen:
                seen.add(id(state))
                out.append(state)
    return out

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
        owners, pieces = [], []
        for unit in units:
            for slot, piece in unit.local_amaxes():
                owners.append((unit, slot))
                pieces.append(piece)
        pending = [torch.stack([s.pending for s in self.states]).flatten()] if delayed else []
        flat = torch.cat(pieces + pending) if pieces or pending else None
        if flat is None:
            for unit in units:
                unit.set_amaxes({})
            return
        comm.all_reduce(flat, self.group, dist.ReduceOp.MAX, "fp8 amax")
        reduced = list(torch.split(flat, [p.numel() for p in pieces] + ([flat.numel() - sum(p.numel() for p in pieces)] if delayed else [])))
        per_unit = {id(u): {} for u in units}
        for (unit, slot), r in zip(owners, reduced):
            per_unit[id(unit)][id(slot)] = r
        if delayed:
            rows = reduced[-1].view(len(self.states), 3)
            weight_amax = {id(unit.delayed[id(slot)]): r.max() for (unit, slot), r in zip(owners, reduced[: len(owners)])
                           if id(slot) in unit.delayed}
            for state, row in zip(self.states, rows):
                if id(state) in weight_amax:
                    row = row.clone()
                    row[W] = weight_amax[id(state)]
                state.update(row)
        for unit in units:
            unit.set_amaxes(per_unit[id(unit)])


def delayed_states_of(units: Sequence[Float8Unit]) -> List[DelayedState]:
    seen, out = set(), []
    for unit in units:
        for state in unit.delayed.values():
            if id(state) not in seen:
                seen.add(id(state))
                out.append(state)
    return out

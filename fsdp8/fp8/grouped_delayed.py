"""Delayed scaling of FP8 experts: an amax history per expert, as a dense Float8Linear keeps one.

[Note: delayed experts]
Under DelayedScaling each expert of an experts projection (``gate_up_proj``, ``down_proj``) is
scaled as a dense delayed Float8Linear on its rows would be: its input, its matrix and its output
gradient each take the scale its history gave at the last update, and the amax this step saw is
recorded for the next. The E experts' states are rows of shared tensors (history [E, 3, L],
scales [E, 3], pending amaxes [E, 3]), registered on the experts module as buffers, so the
experts' GEMMs read every expert's scale in one indexing, checkpoints keep the histories, and
each row is also a ``DelayedState`` of its own (``DelayedState.over``): the engine's one
all-reduce and batched roll per step (fsdp8/engine/fp8_scales.py) take them with the dense
linears' states and change nothing for them.

Every rank keeps all E rows, also under expert parallelism, where it computes E / ep experts: it
records amaxes into its own experts' rows only, the others stay zero, and the step's max
all-reduce over the data-parallel ranks gives each expert the largest amax any rank saw, which is
the amax one process would see on the global batch. So the histories are the same on every rank,
and a checkpoint loads at any ep degree.

All E histories roll together, once a step: an expert no row reached rolls in an amax of 0 (its
matrix's amax is not recorded either: it was not used), so every expert's history counts steps
alike. Standalone (no engine) each projection rolls its experts at its next forward after one of
them recorded, as a standalone Float8Linear does; under the engine with its per-step all-reduce.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn

from .recipes import DelayedScaling, DelayedState

# The buffers of projection ``name`` on its experts module.
_BUFFERS = ("amax_history", "scale", "amax_pending")


def buffer_names(name: str) -> List[str]:
    return [f"fp8_{name}_{b}" for b in _BUFFERS]


class DelayedExperts:
    """The delayed-scaling states of one experts projection's E experts (see the Note)."""

    def __init__(self, recipe: DelayedScaling, history: torch.Tensor, scale: torch.Tensor, pending: torch.Tensor):
        self.recipe = recipe
        self.history, self.scale, self.pending = history, scale, pending
        self.states = [DelayedState.over(recipe, history[e], scale[e], pending[e]) for e in range(scale.shape[0])]
        self.external_update = False  # under the engine: its per-step all-reduce updates them
        # Host-side, for a standalone module: amaxes recorded since the last roll. One flag for all
        # experts (the engine rolls them every step and reads none).
        self.dirty = False

    def rebind(self, history: torch.Tensor, scale: torch.Tensor, pending: torch.Tensor) -> None:
        """DelayedState.use for every expert: keeps this object and its states, which the engine's
        scale agreement holds."""
        self.history, self.scale, self.pending = history, scale, pending
        for e, state in enumerate(self.states):
            state.use(history[e], scale[e], pending[e])

    @classmethod
    def new(cls, recipe: DelayedScaling, experts: int, device) -> "DelayedExperts":
        return cls(recipe, torch.zeros(experts, 3, recipe.amax_history_len, device=device),
                   torch.ones(experts, 3, device=device), torch.zeros(experts, 3, device=device))

    def refresh_inverses(self) -> None:
        for state in self.states:
            state.refresh_inverses()

    def local(self, first: int, count: int) -> "LocalExperts":
        """The rows of experts ``first .. first + count - 1``, those this rank computes."""
        return LocalExperts(self, first, count)


class LocalExperts:
    """What one call of the experts' GEMMs reads and writes: its experts' scales and pending amaxes."""

    def __init__(self, experts: DelayedExperts, first: int, count: int):
        self.experts, self.rows = experts, slice(first, first + count)

    def scale(self, row: int) -> torch.Tensor:
        """[count]: each expert's scale for operand ``row`` (X, W or G)."""
        return self.experts.scale[self.rows, row]

    def record(self, row: int, amaxes: torch.Tensor) -> None:
        """Fold ``amaxes`` [count] (0 for an expert that saw nothing) into the pending amaxes."""
        pending = self.experts.pending
        pending[self.rows, row] = torch.maximum(pending[self.rows, row], amaxes.to(pending.device))
        self.experts.dirty = True


def attach(module: nn.Module, recipe: DelayedScaling, names) -> Dict[str, DelayedExperts]:
    """Give the experts ``module`` a DelayedExperts for each 3-D weight in ``names``, its tensors
    registered as buffers, on the weight's device (E: the weight's global first dimension)."""
    module.fp8_delayed = {}
    for name in names:
        weight = getattr(module, name)
        experts = DelayedExperts.new(recipe, weight.shape[0], weight.device)  # a DTensor's: its local device
        for buffer, tensor in zip(buffer_names(name), (experts.history, experts.scale, experts.pending)):
            module.register_buffer(buffer, tensor)
        module.fp8_delayed[name] = experts
    if not getattr(module, "_fsdp8_delayed_load_hook", False):
        module.register_load_state_dict_post_hook(_refresh_after_load)
        module._fsdp8_delayed_load_hook = True
    return module.fp8_delayed


def _refresh_after_load(module: nn.Module, incompatible_keys) -> None:
    """A state dict load copies into the buffers in place: the kept inverses follow the scales."""
    for name in getattr(module, "fp8_delayed", None) or {}:
        delayed_experts(module, name).refresh_inverses()


def delayed_experts(module: nn.Module, name: str) -> Optional[DelayedExperts]:
    """Projection ``name``'s states of the experts ``module``, rebound to its buffers when these
    were replaced (moved, materialized from the meta device, loaded by assignment); None when
    the module has none (not delayed)."""
    states = getattr(module, "fp8_delayed", None)
    if not states or name not in states:
        return None
    experts = states[name]
    history, scale, pending = (getattr(module, b) for b in buffer_names(name))
    if history is not experts.history or scale is not experts.scale or pending is not experts.pending:
        experts.rebind(history, scale, pending)
    return experts


def all_delayed_experts(model: nn.Module) -> List[DelayedExperts]:
    """Every experts projection's states in ``model``, module order."""
    return [delayed_experts(m, name) for m in model.modules() for name in getattr(m, "fp8_delayed", None) or {}]


def delayed_experts_on(model: nn.Module, device: torch.device) -> List[DelayedExperts]:
    """Every experts projection's states in ``model`` (module order), on ``device``: states whose
    buffers are still on the meta device (a model built there) start fresh there, as a delayed
    Float8Linear's do; others are moved with their values."""
    out = []
    for module in model.modules():
        for name in list(getattr(module, "fp8_delayed", None) or {}):
            experts = delayed_experts(module, name)
            if experts.scale.is_meta or experts.scale.device != torch.device(device):
                if experts.scale.is_meta:
                    fresh = DelayedExperts.new(experts.recipe, experts.scale.shape[0], device)
                    tensors = (fresh.history, fresh.scale, fresh.pending)
                else:
                    tensors = tuple(t.to(device) for t in (experts.history, experts.scale, experts.pending))
                for buffer, tensor in zip(buffer_names(name), tensors):
                    module.register_buffer(buffer, tensor)
                experts.rebind(*tensors)
            out.append(experts)
    return out


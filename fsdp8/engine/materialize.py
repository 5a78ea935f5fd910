"""Filling the main chunks: meta-device models module by module, real models by slicing."""

from __future__ import annotations

import hashlib
from typing import Dict, List

import torch
import torch.nn as nn

from ..fp8.convert import high_precision_value
from .unit import ParamSlot, ShardedUnit


def rng_fingerprint(device: torch.device) -> str:
    """A digest of the RNG state that ``reset_parameters`` will draw from on ``device``."""
    state = torch.random.get_rng_state()
    if device.type == "cuda":
        state = torch.cat([state, torch.cuda.get_rng_state(device)])
    return hashlib.sha256(bytes(state.tolist())).hexdigest()[:16]  # uint8 state; no numpy needed


def meta_leftovers(root: nn.Module) -> List[str]:
    """FQNs of parameters and buffers still on the meta device."""
    names = [n for n, p in root.named_parameters() if p.is_meta]
    return names + [n for n, b in root.named_buffers() if b.is_meta]


def materialize_and_load(
    root: nn.Module,
    units: Dict[str, ShardedUnit],
    originals: Dict[int, nn.Parameter],
    slot_unit: Dict[int, ShardedUnit],
    device: torch.device,
) -> None:
    """Copy this rank's rows of every parameter into its unit's main chunk.

    [Note: meta-device init]
    A module that directly owns meta parameters or buffers is given empty real tensors
    for them and its ``reset_parameters()`` is called, in ``root.modules()`` order; its
    rows are copied into the main chunks and the full tensors dropped before the next
    module, so no rank ever holds more than one module's parameters in full. Every rank
    draws the same values because fully_shard checked that all RNG states agree. Tied
    parameters are materialized once, through the first module that owns them."""
    slot_of: Dict[int, ParamSlot] = {}
    for unit in units.values():
        for slot in unit.slots:
            slot_of[id(originals[id(slot)])] = slot
    loaded = set()
    for module in root.modules():
        meta_params = [(a, p) for a, p in module._parameters.items() if p is not None and p.is_meta and id(p) not in loaded]
        meta_buffers = [(n, b) for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not meta_params and not meta_buffers:
            continue
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            if meta_params:
                raise ValueError(
                    f"{type(module).__name__} has parameters on the meta device but no reset_parameters(); "
                    "define reset_parameters() to initialize them, or build the model on a real device"
                )
            continue  # meta buffers without a reset: reported at the first forward
        fresh = []
        for _, p in meta_params:
            slot = slot_of[id(p)]
            real = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            for m, attr in slot.aliases:
                m._parameters[attr] = real
            fresh.append((p, slot, real))
        for name, b in meta_buffers:
            module._buffers[name] = torch.empty_like(b, device=device)
        with torch.no_grad():
            reset()
        for p, slot, real in fresh:
            slot_unit[id(slot)].load_full(slot, real.detach())
            loaded.add(id(p))
            for m, attr in slot.aliases:
                m._parameters[attr] = p  # drop the full tensor now; main DTensors replace it later
    for pid, slot in slot_of.items():
        p = originals[id(slot)]
        if not p.is_meta:
            slot_unit[id(slot)].load_full(slot, high_precision_value(p))
    for module in root.modules():
        for name, b in module._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                module._buffers[name] = b.to(device)

"""Loading state dicts into a sharded model: validation first, then rows into main chunks."""

from __future__ import annotations

from typing import Dict, List, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys


class StateDictError(RuntimeError):
    """A state dict does not fit the model."""


def _shape(value) -> tuple:
    return tuple(value.shape)


def describe_mismatch(missing: List[str], unexpected: List[str], mis_shaped: List[str]) -> str:
    parts = []
    if missing:
        parts.append(f"missing keys ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        parts.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
    if mis_shaped:
        parts.append(f"mis-shaped keys ({len(mis_shaped)}): {'; '.join(mis_shaped)}")
    return "; ".join(parts)


def load_sharded_state_dict(model: nn.Module, engine, expected: Mapping[str, torch.Tensor], given: Mapping, strict: bool):
    """Check ``given`` against ``expected`` (all problems at once), then copy values in.

    Parameter values may be full tensors or DTensors; each rank keeps only its rows.
    Tied parameters appear under several keys; the first one present is loaded."""
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    mis_shaped = [
        f"{k}: checkpoint {_shape(given[k])} vs model {_shape(expected[k])}"
        for k in expected
        if k in given and isinstance(given[k], torch.Tensor) and _shape(given[k]) != _shape(expected[k])
    ]
    not_tensors = [k for k in expected if k in given and not isinstance(given[k], torch.Tensor)]
    mis_shaped += [f"{k}: value is {type(given[k]).__name__}, not a tensor" for k in not_tensors]
    if mis_shaped or (strict and (missing or unexpected)):
        raise StateDictError(f"state dict does not match {type(model).__name__}: {describe_mismatch(missing, unexpected, mis_shaped)}")

    slot_by_param: Dict[int, tuple] = {id(s.main): (u, s) for u in engine.all_units for s in u.slots}
    done = set()
    with torch.no_grad():
        for key, target in expected.items():
            if key not in given:
                continue
            value = given[key]
            found = slot_by_param.get(id(target))
            if found is None:  # a buffer
                target.copy_(value.full_tensor() if isinstance(value, DTensor) else value)
                continue
            unit, slot = found
            if id(slot) in done:
                continue
            done.add(id(slot))
            if isinstance(value, DTensor):
                if value.device_mesh == slot.spec.mesh and tuple(value.placements) == tuple(slot.spec.placements):
                    unit.main_view(slot).copy_(value.to_local())
                    unit.mark_stale()
                    continue
                value = value.full_tensor()
            unit.load_full(slot, value)
    return _IncompatibleKeys(missing, unexpected)

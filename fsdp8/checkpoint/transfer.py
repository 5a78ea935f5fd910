"""Weights in and out of fsdp8: export a checkpoint as safetensors, fill a sharded model
from safetensors files (e.g. a Hugging Face checkpoint directory), each rank reading only
the rows it owns."""

from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ..engine.state_dict import StateDictError, describe_mismatch
from . import safetensors, store
from .safe_io import SafeReader


class _SafeEmptyPlanner(_EmptyStateDictLoadPlanner):
    """Builds full tensors from a checkpoint's metadata; non-tensor entries with weights_only."""

    def load_bytes(self, read_item, value) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_full_state(path: str, prefix: Optional[str] = None) -> Dict:
    """A checkpoint's entries (those under ``prefix``, e.g. "model"), full tensors, read in
    this process alone (no process group); nested as saved."""
    problems = store.problems(path, foreign_ok=True)
    if problems:
        raise store.CheckpointError("cannot read checkpoint: " + "; ".join(problems))
    reader = SafeReader(path)
    metadata = reader.read_metadata()
    keys = [k for k in metadata.state_dict_metadata if prefix is None or k.startswith(prefix + ".")]
    state: Dict = {}
    _load_state_dict(state, storage_reader=reader, planner=_SafeEmptyPlanner(keys=set(keys)), no_dist=True)
    return state


def read_full_model_state(path: str) -> Dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint, in full (an fsdp8 checkpoint, or a bare DCP model one)."""
    reader = SafeReader(path) if store.problems(path, foreign_ok=True) == [] else None
    nested = reader is not None and any(k.startswith("model.") for k in reader.read_metadata().state_dict_metadata)
    state = read_full_state(path, "model" if nested else None)
    flat = state.get("model", state) if nested else state
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def export(checkpoint: str, out: str, dtype: Optional[torch.dtype] = None) -> str:
    """Write a checkpoint's model weights as ``<out>/model.safetensors`` (full tensors)."""
    tensors = read_full_model_state(checkpoint)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    os.makedirs(out, exist_ok=True)
    target = os.path.join(out, "model.safetensors")
    safetensors.write(target, tensors, metadata={"format": "pt", "source": os.path.abspath(checkpoint)})
    return target


def load_pretrained(model: nn.Module, path: str, key_map: Optional[Callable[[str], str]] = None,
                    strict: bool = True) -> List[str]:
    """Fill ``model`` (sharded or not, e.g. just built on meta and sharded) from safetensors
    at ``path`` (a file or a directory). ``key_map(fqn) -> name in the files``. A sharded
    model's ranks read only their own rows. Returns the names that were not found (only
    with ``strict=False``; strict lists missing and mis-shaped names in one error)."""
    files = safetensors.SafetensorsDir(path)
    key_map = key_map or (lambda name: name)
    engine = getattr(model, "_fsdp8", None)
    sharded = {slot.fqn: (unit, slot) for unit in engine.all_units for slot in unit.slots} if engine else {}
    targets = dict(model.state_dict(keep_vars=True)) if engine is None else _sharded_targets(model, sharded)
    missing, mis_shaped = [], []
    for fqn, target in targets.items():
        name = key_map(fqn)
        if name not in files:
            missing.append(fqn if name == fqn else f"{fqn} (as {name})")
            continue
        shape = files.file_of(name).shape(name)
        if tuple(shape) != tuple(target.shape):
            mis_shaped.append(f"{fqn}: file {tuple(shape)} vs model {tuple(target.shape)}")
    if mis_shaped or (strict and missing):
        raise StateDictError(f"safetensors at {path} do not match the model: {describe_mismatch(missing, [], mis_shaped)}")
    with torch.no_grad():
        for fqn, target in targets.items():
            name = key_map(fqn)
            if name not in files:
                continue
            file = files.file_of(name)
            if fqn in sharded:
                unit, slot = sharded[fqn]
                rows = slot.layout.chunk_row_range(unit.chunk_index)
                unit.main_view(slot).copy_(file.read(name, rows))
                unit.mark_stale()
            else:
                target.copy_(file.read(name))
    return missing


def _sharded_targets(model: nn.Module, sharded) -> Dict[str, torch.Tensor]:
    """Every FQN a sharded model loads: its parameters (once per distinct parameter, under the
    name the engine knows it by) and its buffers."""
    targets = {fqn: unit_slot[1].main for fqn, unit_slot in sharded.items()}
    persistent = set(model.state_dict().keys())
    for name, buf in model.named_buffers():
        if name in persistent:  # non-persistent buffers (e.g. rotary tables) are not weights
            targets[name] = buf
    return targets

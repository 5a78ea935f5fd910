"""A checkpoint's extra values (step, RNG states, data position, a run's settings): one JSON
file per rank, tensors as base64 with their dtype and shape, no pickle. ``load`` reads and
checks its rank's file before it loads any weight, so a damaged one fails first, by name."""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
from typing import Any, Optional

import torch

from .safetensors import _to_bytes
from .store import CheckpointError, extra_path

_TENSOR_KEYS = {"__tensor__", "shape", "data"}


def encode(obj: Any) -> Any:
    """``obj`` (JSON values and tensors) as JSON values."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        return {"__tensor__": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                "data": base64.b64encode(_to_bytes(t)).decode()}
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"extra keys must be strings, got {bad[:3]}")
        return {k: encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"extra holds a {type(obj).__name__}; use JSON values and tensors")


def decode(obj: Any, where: str = "extra") -> Any:
    """What ``encode`` made of a value, back; ValueError naming the place (``where``) of a
    malformed tensor."""
    if isinstance(obj, dict) and "__tensor__" in obj:
        return _tensor(obj, where)
    if isinstance(obj, dict):
        return {k: decode(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    return obj


def _tensor(obj: dict, where: str) -> torch.Tensor:
    dtype = getattr(torch, obj["__tensor__"], None) if isinstance(obj["__tensor__"], str) else None
    shape = obj.get("shape")
    if obj.keys() != _TENSOR_KEYS or not isinstance(dtype, torch.dtype) or not isinstance(obj["data"], str):
        raise ValueError(f"{where} is not a tensor record "
                         "({'__tensor__': dtype name, 'shape': [...], 'data': base64})")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"{where} has the shape {shape!r}, not a list of sizes")
    try:
        raw = base64.b64decode(obj["data"], validate=True)
    except binascii.Error as e:
        raise ValueError(f"{where} holds no base64 data ({e})") from None
    element = dtype.itemsize
    if len(raw) != math.prod(shape) * element:
        raise ValueError(f"{where} holds {len(raw)} bytes, not the {math.prod(shape) * element} of a {dtype} "
                         f"tensor of shape {shape}")
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return data.view(dtype).reshape(shape).clone()


def file_for(checkpoint: str, rank: int) -> Optional[str]:
    """The extra file rank ``rank`` loads: its own, else rank 0's (the checkpoint was written by
    fewer ranks), else None (a checkpoint written by another library)."""
    for candidate in (extra_path(checkpoint, rank), extra_path(checkpoint, 0)):
        if os.path.exists(candidate):
            return candidate
    return None


def read(path: str) -> Any:
    """The extra values in file ``path``, or a CheckpointError naming it and what is wrong."""
    try:
        with open(path) as f:
            return decode(json.load(f))
    except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path} cannot be read: {e}; the checkpoint is damaged (the step, RNG states and "
                              "settings saved with its weights are unusable): load another one") from None

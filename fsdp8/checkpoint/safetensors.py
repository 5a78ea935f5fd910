"""The safetensors format, read and written without the safetensors package.

A file is an 8-byte little-endian header length, a JSON header mapping each name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the
header), then the raw little-endian bytes. Reading a row range of a row-major tensor is one
seek and one read, which is how each rank of a sharded model loads only its own rows.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsError(ValueError):
    """A file is not valid safetensors, or lacks what was asked for."""


def write(path: str, tensors: Mapping[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None) -> None:
    """Write ``tensors`` (any device; copied to CPU) to ``path`` atomically (temp file + rename)."""
    header: Dict[str, object] = {}
    offset = 0
    ordered = sorted(tensors.items())
    for name, t in ordered:
        if t.dtype not in _NAMES:
            raise SafetensorsError(f"{name}: dtype {t.dtype} has no safetensors name")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in ordered:
            f.write(_to_bytes(t))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _to_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a tensor (a copy of its memory; numpy is not needed)."""
    flat = t.detach().to("cpu").contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()) if flat.numel() else b""


class SafetensorsFile:
    """The header of one file, and reads of whole tensors or of row ranges."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > os.path.getsize(path):
                    raise SafetensorsError(f"{path}: header length {length} exceeds the file")
                header = json.loads(f.read(length))
        except (OSError, struct.error, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path} is not a readable safetensors file: {e}") from e
        self.metadata = header.pop("__metadata__", {})
        self.data_start = 8 + length
        self.entries = header

    def names(self) -> List[str]:
        return list(self.entries)

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self.entries[name]["dtype"]]

    def read(self, name: str, rows: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """The tensor, or rows ``[start, stop)`` of it along dim 0 (one contiguous read)."""
        if name not in self.entries:
            raise SafetensorsError(f"{self.path} has no tensor {name!r}")
        entry = self.entries[name]
        dtype, shape = _DTYPES[entry["dtype"]], list(entry["shape"])
        begin, end = entry["data_offsets"]
        itemsize = dtype.itemsize
        if rows is not None:
            if not shape:
                raise SafetensorsError(f"{name} is a scalar; it has no rows")
            row_bytes = math.prod(shape[1:]) * itemsize
            start, stop = rows
            begin, end = begin + start * row_bytes, begin + stop * row_bytes
            shape = [stop - start] + shape[1:]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            raw = f.read(end - begin)
        if len(raw) != end - begin:
            raise SafetensorsError(f"{self.path} is truncated: {name} needs {end - begin} bytes, found {len(raw)}")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return data.view(dtype).reshape(shape)


class SafetensorsDir:
    """Every tensor of a file, or of a directory of files (an HF checkpoint: one
    model.safetensors, or shards listed by model.safetensors.index.json, or all *.safetensors)."""

    def __init__(self, path: str):
        if os.path.isfile(path):
            files = [path]
        elif os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    shard_names = sorted(set(json.load(f)["weight_map"].values()))
                files = [os.path.join(path, n) for n in shard_names]
            else:
                files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
            if not files:
                raise SafetensorsError(f"{path} holds no .safetensors file")
        else:
            raise SafetensorsError(f"{path} does not exist")
        self.files = [SafetensorsFile(f) for f in files]
        self.where: Dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.names():
                self.where[name] = f

    def names(self) -> Iterable[str]:
        return self.where.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def file_of(self, name: str) -> SafetensorsFile:
        return self.where[name]

"""Safetensors files through the ``safetensors`` package: atomic writes, and memory-mapped
reads of whole tensors or of one block (a rank's rows, or rows and columns) of a tensor.

Reads go through ``safe_open(path, framework="pt").get_slice(name)[...]``: the file is
mapped, not loaded, and a block read copies only the bytes of that block, which is how each
rank of a sharded model loads only what it keeps.
"""

from __future__ import annotations

import ctypes
import json
import os
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .paths import inside

INDEX = "model.safetensors.index.json"
# A block of a tensor: one [start, stop) range per leading dim; the dims after them whole.
Region = Sequence[Tuple[int, int]]


class SafetensorsError(ValueError):
    """A file is not valid safetensors, or lacks what was asked for."""


def write(path: str, tensors: Mapping[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None) -> None:
    """Write ``tensors`` (any device; copied to CPU) to ``path`` atomically (temp file + rename)."""
    ready: Dict[str, torch.Tensor] = {}
    seen = set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage().data_ptr()
        # safetensors refuses tensors that share memory (tied weights); each gets its own bytes.
        ready[name] = t.clone() if storage in seen and t.numel() else t
        seen.add(storage)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        save_file(ready, tmp, metadata=dict(metadata) if metadata else None)
    except KeyError as e:  # safetensors' dtype table lacks it
        names = [n for n, t in ready.items() if t.dtype == e.args[0]]
        raise SafetensorsError(f"{', '.join(names) or e}: dtype {e.args[0]} cannot be stored in safetensors "
                               "(this version of the safetensors package has no name for it); cast it first") from None
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _unreadable(path: str, error: Exception) -> SafetensorsError:
    size = os.path.getsize(path)
    if "incomplete metadata" in str(error):
        return SafetensorsError(f"{path} is truncated: its {size} bytes do not hold all the data its header lists "
                                f"({error}); an interrupted write or download leaves such a file, so write or "
                                "fetch it again")
    return SafetensorsError(f"{path} ({size} bytes) is not a readable safetensors file: {error}")


class SafetensorsFile:
    """One file, memory-mapped: its names and shapes, and reads of whole tensors or blocks."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise SafetensorsError(f"{path} does not exist" if not os.path.exists(path) else f"{path} is not a file")
        try:
            self._file = safe_open(path, framework="pt")
        except (SafetensorError, OSError) as e:
            raise _unreadable(path, e) from e
        self.metadata = self._file.metadata() or {}
        self._shapes = {name: tuple(self._file.get_slice(name).get_shape()) for name in self._file.keys()}

    def names(self) -> List[str]:
        return list(self._shapes)

    def shape(self, name: str) -> Tuple[int, ...]:
        if name not in self._shapes:
            raise SafetensorsError(f"{self.path} has no tensor {name!r}")
        return self._shapes[name]

    def read(self, name: str, region: Optional[Region] = None) -> torch.Tensor:
        """The tensor ``name``, or only its block ``region``: ``[(r0, r1)]`` for rows
        ``r0:r1``, ``[(r0, r1), (c0, c1)]`` for those rows' columns ``c0:c1``, and so on."""
        shape = self.shape(name)
        if region is None:
            return self._file.get_tensor(name)
        region = [tuple(r) for r in region]
        if len(region) > len(shape) or not all(0 <= a <= b <= n for (a, b), n in zip(region, shape)):
            raise SafetensorsError(f"{self.path}: {name} has shape {list(shape)}, which holds no block "
                                   f"{[list(r) for r in region]} (one [start, stop) per leading dim)")
        return self._file.get_slice(name)[tuple(slice(a, b) for a, b in region)]


def _shard_names(index: str) -> List[str]:
    """The shard files a Hugging Face index (model.safetensors.index.json) lists."""
    try:
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        what = str(e) if not isinstance(e, AttributeError) else "it is not a JSON object"
        raise SafetensorsError(f"{index} cannot be read: {what}; write it again (save_pretrained writes it) or "
                               "remove it to read every *.safetensors file of the directory") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SafetensorsError(f"{index} has no \"weight_map\" object mapping tensor names to shard files; write it "
                               "again (save_pretrained writes it) or remove it to read every *.safetensors file of "
                               "the directory")
    return sorted(set(weight_map.values()))


class SafetensorsDir:
    """Every tensor of a file, or of a directory of files (an HF checkpoint: one
    model.safetensors, or shards listed by model.safetensors.index.json, or all *.safetensors)."""

    def __init__(self, path: str):
        if os.path.isfile(path):
            files = [path]
        elif os.path.isdir(path):
            index = os.path.join(path, INDEX)
            names = _shard_names(index) if os.path.exists(index) else sorted(
                n for n in os.listdir(path) if n.endswith(".safetensors"))
            files = []
            for name in names:  # each shard inside the directory, symlinks resolved
                inside(path, name, INDEX if os.path.exists(index) else "the directory listing")
                files.append(os.path.join(path, name))
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


def _to_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a tensor (a copy of its memory; numpy is not needed); store.py
    encodes the tensors of a checkpoint's extra values with it."""
    flat = t.detach().to("cpu").contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()) if flat.numel() else b""

"""Reading a checkpoint's data files: DCP's FileSystemReader, with every stored item checked
before it is used.

DCP's own reader opens whatever path the metadata names, hands each item's bytes to
``torch.load`` (non-tensor values with ``weights_only=False``) and copies what comes out into
the target with any dtype conversion. Here, for each item: its file resolves inside the
checkpoint; its bytes match their checksum (when the checkpoint has them); a tensor item's
zip archive unpacks to no more than the chunk it stands for before torch.load allocates
anything; the tensor that comes out has the dtype and shape the metadata declares; and it
lands only in a target of the same kind of dtype. Non-tensor values load with
``weights_only=True``.
"""

from __future__ import annotations

import io
import math
import os
import zipfile
from typing import Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.futures import Future

from . import checksums
from .paths import inside
from .store import METADATA, CheckpointError, DamagedCheckpointError

# What torch.save adds around a tensor's bytes in its zip archive (a pickle of ~150 bytes,
# version records, local and central headers); a generous bound.
ZIP_OVERHEAD_BYTES = 64 << 10


def same_kind(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether values of dtype ``a`` may land in a tensor of dtype ``b``: the same dtype, or both
    floating point (a bf16 checkpoint into fp32 weights); never integers into floats or back."""
    return a == b or (a.is_floating_point and b.is_floating_point)


class _Slice(io.RawIOBase):
    """Bytes ``offset`` to ``offset + length`` of an open file, as a seekable file of their own."""

    def __init__(self, file, offset: int, length: int):
        super().__init__()
        self._file, self._offset, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self._length - self._pos)
        if n <= 0:
            return 0
        self._file.seek(self._offset + self._pos)
        got = self._file.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


class SafeReader(FileSystemReader):
    """FileSystemReader of a checkpoint that ``verify.inspect`` found consistent: ``metadata``
    (its validated metadata) and ``table`` (its checksums, None if it has none)."""

    def __init__(self, path: str, metadata: Metadata, table: Optional[checksums.Table]):
        super().__init__(path)
        self._metadata, self._table = metadata, table

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan, planner) -> Future:
        per_file = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            with open(inside(str(self.path), name, f"its {METADATA}"), "rb") as file:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    self._read_item(name, file, item, planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_item(self, name: str, file, item: ReadItem, planner) -> None:
        info = self.storage_data[item.storage_index]
        if self._table is not None:
            checksums.check_item(str(self.path), name, file, info.offset, info.length, self._table)
        piece = _Slice(file, info.offset, info.length)
        fqn = item.storage_index.fqn
        where = f"checkpoint {self.path}: data file {name}, the item of {fqn}"
        if item.type == LoadItemType.BYTE_IO:  # a pickled value: torch.save stores it unpacked
            _check_archive(piece, info.length, where)
            _loading(where, lambda: planner.load_bytes(item, io.BytesIO(piece.read())))
            return
        entry = self._metadata.state_dict_metadata[fqn]
        chunk = _chunk_at(entry, item.storage_index)
        where += f" at {list(chunk.offsets)}"
        _check_archive(piece, math.prod(chunk.sizes) * entry.properties.dtype.itemsize,
                       where)
        tensor = _loading(where, lambda: torch.load(piece, map_location="cpu", weights_only=True))
        if type(tensor) is not torch.Tensor or tensor.dtype != entry.properties.dtype or tensor.shape != chunk.sizes:
            what = (f"a {tensor.dtype} tensor of shape {list(tensor.shape)}" if isinstance(tensor, torch.Tensor)
                    else f"a {type(tensor).__name__}")
            raise DamagedCheckpointError(f"{where} holds {what}, but the metadata declares "
                                         f"{entry.properties.dtype} {list(chunk.sizes)}: the checkpoint is damaged")
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if not same_kind(tensor.dtype, target.dtype) or target.shape != tensor.shape:
            raise CheckpointError(f"{where}: its {tensor.dtype} values {list(tensor.shape)} cannot load into a "
                                  f"{target.dtype} tensor {list(target.shape)}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def _loading(where: str, load):
    """What ``load`` (a torch.load of a stored item) returns, or a CheckpointError saying why not."""
    try:
        return load()
    except Exception as e:  # torch.load's refusals and parse errors: RuntimeError, UnpicklingError, ...
        cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DamagedCheckpointError(f"{where} cannot be read by torch.load ({type(e).__name__}: {cause}): the "
                                     "checkpoint is damaged") from e


def _chunk_at(entry, index):
    """The chunk of ``entry`` stored under ``index`` (DCP's lookup: the hint first, then a search)."""
    chunks = entry.chunks
    if index.index is not None and index.index < len(chunks) and chunks[index.index].offsets == index.offset:
        return chunks[index.index]
    return next(c for c in chunks if c.offsets == index.offset)


def _check_archive(piece, nbytes: int, where: str) -> None:
    """torch.load allocates what the zip archive's records claim (deflated records unpack up to
    a thousand times larger): they may hold at most ``nbytes`` and torch.save's small records
    around them. Leaves ``piece`` at its start."""
    try:
        claimed = sum(info.file_size for info in zipfile.ZipFile(piece).infolist())
    except (zipfile.BadZipFile, ValueError, EOFError) as e:
        raise DamagedCheckpointError(f"{where} is not a torch.save archive ({e}): the checkpoint is "
                                     "damaged") from None
    if claimed > nbytes + ZIP_OVERHEAD_BYTES:
        raise DamagedCheckpointError(f"{where} unpacks to {claimed} bytes, more than the {nbytes} it stands for: "
                                     "the checkpoint is damaged or malicious")
    piece.seek(0)


class _WeightsOnlyBytes:
    """Non-tensor entries (optimizer hyper-parameters) through ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    """DCP's planner of a load into an existing state dict."""


class SafeEmptyPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    """DCP's planner that builds full tensors from a checkpoint's (validated) metadata, of the
    entries in ``keys`` (exact names: DCP's own test also joins each entry's planner path,
    for every entry, which costs the square of a path's length)."""

    def _should_include_key(self, key: str, metadata) -> bool:
        return self.keys is None or key in self.keys

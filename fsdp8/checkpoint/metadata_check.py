"""Whether a checkpoint's metadata agrees with itself and with its directory, checked before
anything is allocated or read: every field of its type, every stored item inside the
directory and within its file, every tensor's chunks inside the tensor and covering each of
its elements exactly once, every chunk's stored item large enough for it, and planner paths
(how export nests the entries) that index only what exists."""

from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Dict, List, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)

from .paths import OutsidePathError, inside
from .store import shown

MAX_NDIM = 64  # torch's own kernels stop at 25 dims
MAX_LISTED = 5  # problems of one kind named; the rest counted
# How many chunk visits proving a cover may take, per chunk and dim: a grid or a stack of
# slabs (every layout DTensor makes) takes one; a crafted layout could take quadratically many.
COVER_WORK_PER_CHUNK = 16


def _name(fqn) -> str:
    """An entry's name for a message (cut short: a crafted one may be megabytes long)."""
    return fqn if type(fqn) is str and len(fqn) <= 200 else shown(fqn)


class _Found:
    """Problems as sentences, at most MAX_LISTED of each kind spelled out."""

    def __init__(self):
        self.listed: Dict[str, List[str]] = defaultdict(list)
        self.more: Dict[str, int] = defaultdict(int)

    def add(self, kind: str, sentence: str) -> None:
        if len(self.listed[kind]) < MAX_LISTED:
            self.listed[kind].append(sentence)
        else:
            self.more[kind] += 1

    def sentences(self) -> List[str]:
        out = []
        for kind, listed in self.listed.items():
            out += listed
            if self.more[kind]:
                out.append(f"and {self.more[kind]} more like the last")
        return out


def problems(path: str, metadata: Metadata) -> List[str]:
    """What in ``metadata`` (read from checkpoint ``path``) is inconsistent, as sentences.
    Fields are read with getattr: the unpickler builds instances with any subset of them."""
    found = _Found()
    entries = getattr(metadata, "state_dict_metadata", None)
    if type(entries) is not dict:
        return ["checkpoint metadata has no state_dict_metadata dict"]
    storage = getattr(metadata, "storage_data", None)
    storage = {} if storage is None else storage
    if type(storage) is not dict:
        return ["checkpoint metadata's storage_data is not a dict"]
    needed = _storage_items(path, storage, found)
    seen = set()  # tensor metadata and chunk lists: one entry each (else each use repeats the work)
    for fqn, entry in entries.items():
        if type(entry) is TensorStorageMetadata:
            chunks = getattr(entry, "chunks", None)
            if id(entry) in seen or id(chunks) in seen:
                found.add("shared", f"entry {_name(fqn)} shares its metadata or chunk list with another entry")
                continue
            seen.update((id(entry), id(chunks)))
            _tensor(fqn, entry, storage, found)
        elif type(entry) is BytesStorageMetadata:
            if MetadataIndex(fqn) not in storage:
                found.add("unstored", f"entry {_name(fqn)} has no stored item")
        else:
            found.add("type", f"entry {_name(fqn)} is a {type(entry).__name__}, not tensor or bytes metadata")
    _planner_paths(getattr(metadata, "planner_data", None), len(entries), found)
    _files(path, needed, found)
    return found.sentences()


def _storage_items(path: str, storage: dict, found: _Found) -> Dict[str, Tuple[str, int]]:
    """Checks each stored item's fields; returns {file name: (real path, bytes it must hold)}."""
    needed: Dict[str, Tuple[str, int]] = {}
    refused = set()  # names outside the directory, said once
    for key, info in storage.items():
        if type(key) is not MetadataIndex or type(info) is not _StorageInfo:
            found.add("type", "checkpoint metadata's storage_data maps other things than MetadataIndex to _StorageInfo")
            continue
        name, offset, length = (getattr(info, field, None) for field in ("relative_path", "offset", "length"))
        if type(name) is not str or type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            found.add("item", f"the stored item of {_name(key.fqn)} has file {shown(name)}, offset {shown(offset)} "
                              f"and length {shown(length)}")
            continue
        if getattr(info, "transform_descriptors", None):
            found.add("transform", f"the stored item of {_name(key.fqn)} is transformed by DCP stream extensions "
                                   f"({shown(info.transform_descriptors)}, e.g. zstd), whose output nothing bounds: "
                                   "fsdp8 reads only checkpoints written without them; if you trust this one, load it "
                                   "with torch.distributed.checkpoint and save it again without them")
            continue
        if name in refused:
            continue
        if name not in needed:
            try:
                needed[name] = (inside(path, name, "the checkpoint metadata"), 0)
            except OutsidePathError as e:
                found.add("outside", str(e))
                refused.add(name)
                continue
        real, end = needed[name]
        needed[name] = (real, max(end, offset + length))
    return needed


def _files(path: str, needed: Dict[str, Tuple[str, int]], found: _Found) -> None:
    for name, (real, end) in sorted(needed.items()):
        if not os.path.isfile(real):
            found.add("missing", f"data file {name} is missing")
        elif os.path.getsize(real) < end:
            found.add("truncated", f"data file {name} is truncated ({os.path.getsize(real)} of {end} bytes)")


def _tensor(fqn: str, entry: TensorStorageMetadata, storage: dict, found: _Found) -> None:
    props, size, chunks = (getattr(entry, field, None) for field in ("properties", "size", "chunks"))
    if type(props) is not TensorProperties or type(getattr(props, "dtype", None)) is not torch.dtype:
        found.add("type", f"tensor {_name(fqn)} has no dtype")
        return
    if type(size) is not torch.Size or len(size) > MAX_NDIM or any(n < 0 for n in size):
        found.add("type", f"tensor {_name(fqn)} has the size {shown(size)}, not a torch.Size of at most {MAX_NDIM} "
                          "dims >= 0")
        return
    if type(chunks) is not list:
        found.add("type", f"tensor {_name(fqn)} has no list of chunks")
        return
    element = props.dtype.itemsize
    boxes = []
    for chunk in chunks:
        if (type(chunk) is not ChunkStorageMetadata or type(getattr(chunk, "offsets", None)) is not torch.Size
                or type(getattr(chunk, "sizes", None)) is not torch.Size or len(chunk.offsets) != len(size)
                or len(chunk.sizes) != len(size)):
            found.add("chunk", f"tensor {_name(fqn)} has a chunk that is not a ChunkStorageMetadata of {len(size)} "
                               "dims")
            return
        if any(o < 0 or n < 0 or o + n > dim for o, n, dim in zip(chunk.offsets, chunk.sizes, size)):
            found.add("chunk", f"tensor {_name(fqn)} of size {list(size)} has a chunk at {list(chunk.offsets)} of size "
                               f"{list(chunk.sizes)}, which reaches outside it")
            return
        numel = math.prod(chunk.sizes)
        if numel == 0:
            continue
        info = storage.get(MetadataIndex(fqn, chunk.offsets))
        if info is None:
            found.add("unstored", f"tensor {_name(fqn)} has no stored item for its chunk at {list(chunk.offsets)}")
            return
        if type(info) is _StorageInfo and type(getattr(info, "length", None)) is int and info.length < numel * element:
            found.add("short", f"tensor {_name(fqn)}'s chunk at {list(chunk.offsets)} holds {numel * element} bytes, "
                               f"but its stored item has {info.length}")
            return
        boxes.append((chunk.offsets, chunk.sizes))
    if math.prod(size) and not _covers(size, boxes):
        found.add("cover", f"the chunks of tensor {_name(fqn)} (size {list(size)}) do not cover each of its elements "
                           "exactly once: some would be left unread or read twice")


_ABSENT = object()


class _TooIrregular(Exception):
    pass


def _covers(shape: torch.Size, boxes: List[tuple]) -> bool:
    """Whether ``boxes`` ((offsets, sizes), all inside ``shape``) tile it: no gap, no overlap."""
    if sum(math.prod(sizes) for _, sizes in boxes) != math.prod(shape):
        return False
    budget = [COVER_WORK_PER_CHUNK * (len(boxes) + 1) * max(len(shape), 1)]
    try:
        return _tiles(boxes, shape, 0, budget)
    except _TooIrregular:
        return False


def _tiles(boxes: List[tuple], shape: torch.Size, dim: int, budget: List[int]) -> bool:
    """Whether ``boxes``, which all span the same extent in the dims before ``dim``, tile the
    whole of ``shape`` in ``dim`` and after. Sweeps ``dim``: between two consecutive box
    edges the same boxes are present, and they must tile the remaining dims."""
    if dim == len(shape):
        return len(boxes) == 1
    budget[0] -= len(boxes)
    if budget[0] < 0:
        raise _TooIrregular
    starts, ends = defaultdict(list), defaultdict(list)
    for box in boxes:
        starts[box[0][dim]].append(box)
        ends[box[0][dim] + box[1][dim]].append(box)
    points = sorted(starts.keys() | ends.keys() | {0, shape[dim]})
    active: Dict[int, tuple] = {}
    for p in points[:-1]:
        for box in ends.get(p, ()):
            del active[id(box)]
        for box in starts.get(p, ()):
            active[id(box)] = box
        if not active or not _tiles(list(active.values()), shape, dim + 1, budget):
            return False
    return True


def _planner_paths(planner_data, entries: int, found: _Found) -> None:
    """Export nests the entries along these paths (lists grown to each int index): every
    index must be a str, or an int below the number of entries, and no entry may sit where
    another one's path passes through."""
    if planner_data is None:
        return
    if type(planner_data) is not dict:
        found.add("planner", "checkpoint metadata's planner_data is not a dict")
        return
    tree: dict = {}
    key_types: Dict[int, type] = {}  # id(node) -> the type of its keys: a dict's (str) or a list's (int)
    for fqn, route in planner_data.items():
        if type(route) not in (tuple, list) or not route or not all(
                type(k) is str or (type(k) is int and 0 <= k < entries) for k in route):
            found.add("planner", f"planner path of {_name(fqn)} is {shown(route)}: not a sequence of names and indices "
                                 f"below {entries}")
        elif not _place(tree, route, key_types):
            found.add("planner", f"planner path of {_name(fqn)} ({shown(route)}) collides with another entry's")
    if not found.listed["planner"] and not _dense(tree, key_types):
        found.add("planner", "planner paths index a list with gaps (indices 0 to n-1 must all be there)")


def _dense(tree: dict, key_types: Dict[int, type]) -> bool:
    """Whether every node indexed by ints (a list) has the indices 0 to n-1."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if key_types.get(id(node)) is int and set(node) != set(range(len(node))):
            return False
        stack += [child for child in node.values() if child is not None]
    return True


def _place(tree: dict, route, key_types: Dict[int, type]) -> bool:
    """Put a leaf at ``route`` in ``tree`` (nested dicts, None at leaves), unless a leaf is on
    its way, something is already there, or a node would hold both names and indices."""
    node = tree
    for depth, key in enumerate(route):
        if key_types.setdefault(id(node), type(key)) is not type(key):
            return False
        child = node.get(key, _ABSENT)
        if depth == len(route) - 1:
            if child is not _ABSENT:
                return False
            node[key] = None
        elif child is None:
            return False
        elif child is _ABSENT:
            node[key] = {}
            node = node[key]
        else:
            node = child
    return True

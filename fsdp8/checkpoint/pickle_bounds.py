"""Bounds of the checkpoint metadata unpickler: what objects it may build cost no more than a
real checkpoint's metadata, however the pickle is crafted.

[Note: bounds of the metadata unpickler]
Allowed objects can still exhaust a reader: a length field claiming terabytes, a tuple
nested a million deep (hashing or printing it recurses in C and overflows the stack), dict
keys that share one hash (each insert compares with all before it: quadratic time),
memo references that make a small file describe a huge structure. So:
- no opcode may claim more bytes than the file has left;
- nesting depth is counted as objects are built, and a list or dict can no longer change
  once it is inside another object (else a structure could be deepened after its parents
  counted it); pickles built top-down like that are not what pickle.dump writes;
- dict keys are strings, or what a subclass's ``check_key`` allows before they are hashed
  (safe_io: MetadataIndex values of checked fields); strings hash with a per-process random
  key, the others do not, so at most ``MAX_SAME_HASH`` of those may share a hash;
- every container slot, call result and instance field built counts against ``MAX_ITEMS``,
  and so does every item of any one structure counting each reference to a shared part (a
  list of a million references to one large list holds a million times its items: what any
  walk over it visits).
"""

from __future__ import annotations

import itertools
import pickle
from typing import Tuple

import torch

from .store import CheckpointError

# [Note: the sizes of a very large checkpoint's metadata]
# A 1T-parameter dense transformer has about 1,500 weight tensors (160 layers of 9); with
# Adam's two moments a checkpoint holds 4,500 tensors. Sharded 128 ways and tensor-parallel
# 8 ways, each is 1,024 chunks: 4.6M chunks (8,192-way sharding: 37M). pickle.dump writes
# 150 to 230 bytes per chunk (a ChunkStorageMetadata with two torch.Size, a MetadataIndex
# with one, a _StorageInfo: 45 built items, 21 in the finished structure), so 1 GB of
# metadata (37M chunks: 8.5 GB); reading it takes about 3 KB of memory per chunk, 20 times
# the file (pickle's memo holds every object), for a crafted file as for a real one. The
# bounds below hold the 37M-chunk checkpoint; what they stop is growth faster than the file:
# calls and repeated references that make a few bytes describe much more.
MAX_METADATA_BYTES = 16 << 30
MAX_ITEMS = 1 << 31  # built items, and items of any one structure counting each reference
MAX_CONTAINER_LEN = 1 << 26  # the largest dict, storage_data, has an entry per chunk
# Real metadata nests 6 deep (Metadata > dict > TensorStorageMetadata > list >
# ChunkStorageMetadata > torch.Size); CPython's C recursion overflows near 10,000.
MAX_DEPTH = 32
# Of 37M keys with 64-bit hashes, two share one with odds of 4e-5. Crafted MetadataIndex
# keys of one hash cost quadratic time: 6,000 of them (250 KB) took 4.6 s, 20,000 would
# take a minute.
MAX_SAME_HASH = 8

# Objects measured at least this large (or 3 deep) keep their measure in a table; the rest
# (a chunk's metadata measures about 7) are measured again when put into another object.
_TRACKED = 64


class MetadataBoundError(CheckpointError):
    """The checkpoint's metadata is larger or deeper than any real checkpoint's."""


def too_big(what: str) -> MetadataBoundError:
    return MetadataBoundError(f"checkpoint metadata {what}, beyond what any real checkpoint needs (fsdp8.checkpoint."
                              "pickle_bounds states its bounds): the file is damaged or malicious")


class OpcodeTable(dict):
    """An unpickler's dispatch table that names an unknown opcode (a dict's KeyError did not)."""

    def __missing__(self, code: int):
        raise pickle.UnpicklingError(f"invalid opcode {code:#04x}")


class _BoundedFile:
    """The metadata file, read so that no length an opcode claims is read (or allocated) past
    what the file has left."""

    def __init__(self, stream, size: int):
        self._stream, self._left, self._size = stream, size, size

    def _claim(self, n: int) -> None:
        if n > self._left:
            raise CheckpointError(f"checkpoint metadata needs {n} bytes at byte {self._size - self._left}, but its "
                                  f"file ends {self._left} bytes later: it is truncated or damaged")

    def read(self, n: int) -> bytes:
        self._claim(n)
        data = self._stream.read(n)
        self._left -= len(data)
        return data

    def readline(self) -> bytes:
        line = self._stream.readline(self._left)
        self._left -= len(line)
        return line


_CONTAINERS = (tuple, list, dict)


def _children(obj):
    if type(obj) is dict:
        return itertools.chain(obj.keys(), obj.values())
    return obj if type(obj) in (tuple, list) else vars(obj).values()  # an instance's fields


class BoundedUnpickler(pickle._Unpickler):
    """The pure-Python unpickler, its containers built within the bounds. A subclass says
    which classes' instances hold fields (``instance_types``) and checks each dict key before
    it is hashed (``check_key``)."""

    instance_types: frozenset = frozenset()

    def __init__(self, stream, size: int):
        super().__init__(_BoundedFile(stream, size))
        self._built = 0  # container slots, call results and fields built so far
        self._large = {}  # id -> (depth, size) of containers and instances at least 3 deep or _TRACKED large
        self._sealed = set()  # ids of lists and dicts inside another object, and of unfilled instances there
        self._hashes = {}  # hash -> how many keys other than strings have it

    # -- accounting (see the Note on bounds) ---------------------------------------------------
    def _spend(self, n: int) -> None:
        self._built += n
        if self._built > MAX_ITEMS:
            raise too_big(f"builds more than {MAX_ITEMS} items")

    def _measure(self, obj) -> Tuple[int, int]:
        """(depth, size) of ``obj``: how deep it nests, and how many items it holds counting
        every reference (what a walk over it visits; a string counts 1 per 8 characters).
        Objects not in ``_large`` are small and shallow, so they are simply counted again."""
        kind = type(obj)
        if kind is torch.Size:
            return 1, 1 + len(obj)
        if kind not in _CONTAINERS and kind not in self.instance_types:
            return 0, 1 + (len(obj) >> 3 if kind is str or kind is bytes else 0)
        known = self._large.get(id(obj))
        return known if known is not None else self._combine(_children(obj))

    def _combine(self, children, depth: int = 1, size: int = 1) -> Tuple[int, int]:
        """(depth, size) of an object of (``depth``, ``size``) once it also holds ``children``."""
        for child in children:
            child_depth, child_size = self._measure(child)
            depth, size = max(depth, child_depth + 1), size + child_size
        return depth, size

    def _record(self, obj, measured: Tuple[int, int]) -> None:
        depth, size = measured
        if depth > MAX_DEPTH:
            raise too_big(f"nests deeper than {MAX_DEPTH} levels")
        if size > MAX_ITEMS:
            raise too_big(f"describes a structure of more than {MAX_ITEMS} items (through repeated references)")
        if depth >= 3 or size >= _TRACKED:
            self._large[id(obj)] = measured
        else:
            self._large.pop(id(obj), None)

    def _fresh(self, obj):
        """A new object: whatever an earlier object at its address was known for is forgotten."""
        self._large.pop(id(obj), None)
        self._sealed.discard(id(obj))
        return obj

    def _contain(self, parent, children, before: Tuple[int, int] = (1, 1)) -> None:
        """``parent``, which measured ``before``, now holds ``children`` too: they can no longer
        change (else ``parent``'s measure would go stale)."""
        self._record(parent, self._combine(children, *before))
        for child in children:
            kind = type(child)
            if kind is list or kind is dict or (kind in self.instance_types and not vars(child)):
                self._sealed.add(id(child))

    def check_key(self, key) -> None:
        """Raise unless ``key`` may be a dict key: its hash must not recurse (a nested tuple
        overflows the C stack) nor run code. A subclass allows more than strings."""
        if type(key) is not str:
            raise pickle.UnpicklingError(f"a {type(key).__qualname__} as a dictionary key")

    def _count_hash(self, key) -> None:
        h = hash(key)
        seen = self._hashes.get(h, 0) + 1
        if seen > MAX_SAME_HASH:
            raise too_big(f"has more than {MAX_SAME_HASH} dictionary keys with one hash")
        self._hashes[h] = seen

    def _mutable(self, target, kind: type, opcode: str):
        if type(target) is not kind:
            raise pickle.UnpicklingError(f"{opcode} on a {type(target).__qualname__}")
        if id(target) in self._sealed:
            raise too_big(f"changes a {kind.__name__} already inside another object with {opcode} (pickle.dump "
                          "never does; it could deepen a structure after its parents were measured)")
        return target

    def _grow(self, length: int, added: int) -> None:
        """A container reaches ``length`` items by ``added`` new ones."""
        if length > MAX_CONTAINER_LEN:
            raise too_big(f"has a container of more than {MAX_CONTAINER_LEN} items")
        self._spend(added)

    # -- containers -----------------------------------------------------------------------------
    def _push_tuple(self, items) -> None:
        value = self._fresh(tuple(items))
        self._grow(len(value), len(value))
        self._contain(value, value)
        self.append(value)

    def _tuple(self):
        self._push_tuple(self.pop_mark())

    def _tuple1(self):
        self._push_tuple([self.stack.pop()])

    def _tuple2(self):
        items = self.stack[-2:]
        del self.stack[-2:]
        self._push_tuple(items)

    def _tuple3(self):
        items = self.stack[-3:]
        del self.stack[-3:]
        self._push_tuple(items)

    def _empty_list(self):
        self.append(self._fresh([]))

    def _empty_dict(self):
        self.append(self._fresh({}))

    def _list(self):
        items = self._fresh(self.pop_mark())
        self._grow(len(items), len(items))
        self._contain(items, items)
        self.append(items)

    def _dict(self):
        items = self.pop_mark()
        value = self._fresh({})
        self._setitems(value, items)
        self.append(value)

    def _extend(self, items, opcode: str) -> None:
        target = self._mutable(self.stack[-1], list, opcode)
        self._grow(len(target) + len(items), len(items))
        self._contain(target, items, self._measure(target))
        target.extend(items)

    def _append(self):
        self._extend([self.stack.pop()], "APPEND")

    def _appends(self):
        self._extend(self.pop_mark(), "APPENDS")

    def _setitems(self, target, items) -> None:
        self._grow(len(target) + len(items) // 2, len(items))
        for key in items[0::2]:
            self.check_key(key)
            if type(key) is not str:  # strings hash with a per-process random key
                self._count_hash(key)
        self._contain(target, items, self._measure(target))
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def _setitem(self):
        value = self.stack.pop()
        key = self.stack.pop()
        self._setitems(self._mutable(self.stack[-1], dict, "SETITEM"), [key, value])

    def _setitems_op(self):
        items = self.pop_mark()
        self._setitems(self._mutable(self.stack[-1], dict, "SETITEMS"), items)

    dispatch = OpcodeTable(pickle._Unpickler.dispatch)
    dispatch.update({pickle.TUPLE[0]: _tuple, pickle.TUPLE1[0]: _tuple1, pickle.TUPLE2[0]: _tuple2,
                     pickle.TUPLE3[0]: _tuple3, pickle.EMPTY_LIST[0]: _empty_list, pickle.LIST[0]: _list,
                     pickle.EMPTY_DICT[0]: _empty_dict, pickle.DICT[0]: _dict, pickle.APPEND[0]: _append,
                     pickle.APPENDS[0]: _appends, pickle.SETITEM[0]: _setitem, pickle.SETITEMS[0]: _setitems_op})

"""Reading a DCP checkpoint's metadata file without unpickling arbitrary objects, within bounds.

torch.distributed.checkpoint pickles its metadata file. fsdp8 reads it through an unpickler
that only builds the checkpoint library's own metadata classes and plain containers, and
only as large and as deep as a real checkpoint's metadata gets.

[Note: the metadata unpickler]
A pickle runs code wherever an opcode looks up a global (GLOBAL, STACK_GLOBAL, INST,
EXT1/2/4), calls one (REDUCE, NEWOBJ, NEWOBJ_EX, INST, OBJ), hands state to an object
(BUILD: ``__setstate__`` or attribute writes) or asks for an outside object (PERSID,
BINPERSID). So:
- a global is one of the exact (module, name) pairs of ``_GLOBALS``, looked up in that
  table and never imported or resolved by attribute (protocol 4 resolves ``a.b`` names
  through attributes: ``os.system`` was reachable through any module that imports ``os``);
- only the callables of ``_CALLS`` are called, each with the argument types it takes (the
  two functions torch pickles a layout and a memory format with are replaced by lookups in
  fixed tables), and NEWOBJ only makes empty instances of the metadata classes;
- BUILD only fills the fields of an instance of a DCP metadata dataclass, once (on a class
  it would set attributes of that class for the whole process);
- every other opcode that builds or calls is refused: DCP metadata never uses them.
The pure-Python unpickler is used because the C one cannot be restricted per opcode (and
resolves EXT codes already cached by copyreg without asking ``find_class``); it reads
metadata about four times slower than the C one.

[Note: bounds of the metadata unpickler]
Allowed objects can still exhaust a reader: a length field claiming terabytes, a tuple
nested a million deep (hashing or printing it recurses in C and overflows the stack), dict
keys that share one hash (each insert compares with all before it: quadratic time),
memo references that make a small file describe a huge structure. So:
- no opcode may claim more bytes than the file has left;
- nesting depth is counted as objects are built, and a list or dict can no longer change
  once it is inside another object (else a structure could be deepened after its parents
  counted it); pickles built top-down like that are not what pickle.dump writes;
- dict keys are strings or MetadataIndex values (whose fields are checked before they are
  hashed); strings hash with a per-process random key, MetadataIndex values do not, so at
  most ``MAX_SAME_HASH`` of them may share a hash;
- every container slot, call result and instance field built counts against ``MAX_ITEMS``,
  and so does every item of any one structure counting each reference to a shared part (a
  list of a million references to one large list holds a million times its items: what any
  walk over it visits).
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import pickle
import pickletools

from typing import Tuple

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta

from .store import CheckpointError, shown

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

_DATACLASSES = (Metadata, MetadataIndex, StorageMeta, dcp_metadata.TensorStorageMetadata,
                dcp_metadata.BytesStorageMetadata, dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties)
_FIELDS = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in _DATACLASSES + (_StorageInfo,)}
# torch pickles a layout as torch.serialization._get_layout("torch.strided") and
# TensorProperties' memory format as _MEM_FORMAT_ENCODING(0); a bound __getitem__ of a
# fixed table can only ever return one of its values.
_LAYOUT_BY_NAME = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}.__getitem__
_MEM_FORMAT_BY_VALUE = {e.value: e for e in dcp_metadata._MEM_FORMAT_ENCODING}.__getitem__
_PATHS = (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath)

_GLOBALS = {
    **{("torch.distributed.checkpoint.metadata", cls.__name__): cls for cls in _DATACLASSES},
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_BY_VALUE,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.serialization", "_get_layout"): _LAYOUT_BY_NAME,
    ("torch", "Size"): torch.Size,
    **{("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)},
    # StorageMeta.checkpoint_id; Python 3.13 pickles paths as pathlib._local.<class>
    **{(module, cls.__name__): cls for cls in _PATHS for module in ("pathlib", "pathlib._local")},
}


def _one(kind: type):
    return lambda args: len(args) == 1 and type(args[0]) is kind


# The callables REDUCE may call, by identity (a set lookup of the object itself would call
# its __hash__), each with a test of its arguments: types whose hashing and size are known.
_CALLS = {
    id(torch.Size): lambda args: (len(args) == 1 and type(args[0]) in (tuple, list)
                                  and all(type(v) is int for v in args[0])),
    id(_LAYOUT_BY_NAME): _one(str),
    id(_MEM_FORMAT_BY_VALUE): _one(int),
    **{id(cls): lambda args: all(type(a) is str for a in args) for cls in _PATHS},
}
_NEWOBJ_CLASS_IDS = frozenset(id(cls) for cls in _FIELDS)
# Objects that hold others; the rest (strings, numbers, dtypes, classes) nest 0 deep.
_NESTING = frozenset((tuple, list, dict) + tuple(_FIELDS))
# Objects measured at least this large (or 3 deep) keep their measure in a table; the rest
# (a chunk's metadata measures about 7) are measured again when put into another object.
_TRACKED = 64
_OPCODE_NAMES = {ord(op.code): op.name for op in pickletools.opcodes}
# Opcodes that only push or store plain data, plus the global lookups (through find_class).
# Not here besides the calls: sets (DCP metadata has none, and their items are hashed),
# BYTEARRAY8 (allocates its claimed length before reading) and the text memo opcodes of
# protocol 0 (their indices are arbitrary integers, which collide in the memo dict).
_PLAIN_OPCODES = frozenset("""
    PROTO FRAME STOP MARK POP POP_MARK DUP NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG
    LONG1 LONG4 FLOAT BINFLOAT STRING BINSTRING SHORT_BINSTRING UNICODE SHORT_BINUNICODE BINUNICODE
    BINUNICODE8 BINBYTES SHORT_BINBYTES BINBYTES8 EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3
    EMPTY_LIST LIST APPEND APPENDS EMPTY_DICT DICT SETITEM SETITEMS
    BINGET LONG_BINGET BINPUT LONG_BINPUT MEMOIZE GLOBAL STACK_GLOBAL""".split())


class UnsafeCheckpointError(CheckpointError):
    """The checkpoint's metadata asks to build or call something fsdp8 does not allow."""


class MetadataBoundError(CheckpointError):
    """The checkpoint's metadata is larger or deeper than any real checkpoint's."""


def _refuse(what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"checkpoint metadata asks for {what}, which fsdp8 refuses to unpickle: the checkpoint may be "
        "malicious, or written by a torch version whose metadata fsdp8 does not know (it reads what "
        "torch.distributed.checkpoint writes in torch >= 2.11); if you trust its source, "
        "torch.distributed.checkpoint can load it directly")


def _too_big(what: str) -> MetadataBoundError:
    return MetadataBoundError(f"checkpoint metadata {what}, beyond what any real checkpoint needs (fsdp8.checkpoint."
                              "safe_io states its bounds): the file is damaged or malicious")


def _describe(obj) -> str:
    return f"the class {obj.__qualname__}" if isinstance(obj, type) else f"a {type(obj).__qualname__}"


def _refused_opcode(name: str):
    def refuse(self):
        raise _refuse(f"pickle opcode {name}")
    return refuse


class _Dispatch(dict):
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


def _children(obj):
    if type(obj) is dict:
        return itertools.chain(obj.keys(), obj.values())
    return obj if type(obj) in (tuple, list) else vars(obj).values()


class _MetadataUnpickler(pickle._Unpickler):
    def __init__(self, stream, size: int):
        super().__init__(_BoundedFile(stream, size))
        self._built = 0  # container slots, call results and fields built so far
        self._large = {}  # id -> (depth, size) of containers and instances at least 3 deep or _TRACKED large
        self._sealed = set()  # ids of lists and dicts inside another object, and of unfilled instances there
        self._hashes = {}  # hash -> how many MetadataIndex keys have it

    # -- accounting (see the Note on bounds) ---------------------------------------------------
    def _spend(self, n: int) -> None:
        self._built += n
        if self._built > MAX_ITEMS:
            raise _too_big(f"builds more than {MAX_ITEMS} items")

    def _measure(self, obj) -> Tuple[int, int]:
        """(depth, size) of ``obj``: how deep it nests, and how many items it holds counting
        every reference (what a walk over it visits; a string counts 1 per 8 characters).
        Objects not in ``_large`` are small and shallow, so they are simply counted again."""
        kind = type(obj)
        if kind is torch.Size:
            return 1, 1 + len(obj)
        if kind not in _NESTING:
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
            raise _too_big(f"nests deeper than {MAX_DEPTH} levels")
        if size > MAX_ITEMS:
            raise _too_big(f"describes a structure of more than {MAX_ITEMS} items (through repeated references)")
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
            if kind is list or kind is dict or (kind in _FIELDS and not vars(child)):
                self._sealed.add(id(child))

    def _check_key(self, key) -> None:
        kind = type(key)
        if kind is str:
            return
        if kind is not MetadataIndex or not vars(key):
            raise _refuse(f"{_describe(key)} as a dictionary key")
        if (type(key.fqn) is not str or type(key.offset) not in (torch.Size, type(None))
                or type(key.index) not in (int, type(None))):
            raise _refuse("a MetadataIndex key with fields of other types than (str, torch.Size, int)")
        h = hash(key)
        seen = self._hashes.get(h, 0) + 1
        if seen > MAX_SAME_HASH:
            raise _too_big(f"has more than {MAX_SAME_HASH} dictionary keys with one hash")
        self._hashes[h] = seen

    def _mutable(self, target, kind: type, opcode: str):
        if type(target) is not kind:
            raise _refuse(f"{opcode} on {_describe(target)}")
        if id(target) in self._sealed:
            raise _refuse(f"{opcode} on a {kind.__name__} already inside another object")
        return target

    def _grow(self, length: int, added: int) -> None:
        """A container reaches ``length`` items by ``added`` new ones."""
        if length > MAX_CONTAINER_LEN:
            raise _too_big(f"has a container of more than {MAX_CONTAINER_LEN} items")
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
            self._check_key(key)
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

    # -- globals, calls and instances ----------------------------------------------------------
    def find_class(self, module: str, name: str):
        found = _GLOBALS.get((module, name))
        if found is None:
            raise _refuse(f"{module}.{name}")
        return found

    def _reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        accepts = _CALLS.get(id(func))
        if accepts is None:
            raise _refuse(f"a call of {_describe(func)}")
        if type(args) is not tuple or not accepts(args):
            raise _refuse(f"a call of {_describe(func)} with arguments of other types than it takes")
        self._spend(sum(len(a) if type(a) in (str, tuple, list) else 1 for a in args))
        self.stack[-1] = self._fresh(func(*args))

    def _newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        if id(cls) not in _NEWOBJ_CLASS_IDS:
            raise _refuse(f"NEWOBJ of {_describe(cls)}")
        if type(args) is not tuple or args:
            raise _refuse(f"NEWOBJ of {cls.__qualname__} with arguments")
        self._spend(1)
        self.append(self._fresh(cls.__new__(cls)))

    def _build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        fields = _FIELDS.get(type(inst))
        if fields is None:
            raise _refuse(f"state set on {_describe(inst)}")
        if vars(inst) or id(inst) in self._sealed:
            raise _refuse(f"state set twice on a {type(inst).__qualname__}, or set after it was put into another "
                          "object")
        if type(inst) is dcp_metadata.TensorProperties:
            self._properties(inst, state)
            return
        if type(state) is not dict:
            raise _refuse(f"a {type(state).__qualname__} as the state of a {type(inst).__qualname__}")
        if not state.keys() <= fields:
            extra = ", ".join(sorted(shown(k) for k in state if k not in fields))
            raise _refuse(f"{extra} in the state of a {type(inst).__qualname__}")
        self._spend(len(state))
        self._contain(inst, state.values())
        inst.__dict__.update(state)

    def _properties(self, inst, state) -> None:
        """torch's own state of a TensorProperties: (dtype, layout, requires_grad, memory format, pin_memory)."""
        kinds = (torch.dtype, torch.layout, bool, dcp_metadata._MEM_FORMAT_ENCODING, bool)
        if type(state) is not tuple or len(state) != 5 or not all(type(v) is k for v, k in zip(state, kinds)):
            raise _refuse("a TensorProperties state other than (dtype, layout, bool, memory format, bool)")
        self._spend(len(state))
        inst.__setstate__(state)

    dispatch = _Dispatch({code: handler if _OPCODE_NAMES[code] in _PLAIN_OPCODES
                          else _refused_opcode(_OPCODE_NAMES[code])
                          for code, handler in pickle._Unpickler.dispatch.items()})
    dispatch.update({pickle.REDUCE[0]: _reduce, pickle.NEWOBJ[0]: _newobj, pickle.BUILD[0]: _build,
                     pickle.TUPLE[0]: _tuple, pickle.TUPLE1[0]: _tuple1, pickle.TUPLE2[0]: _tuple2,
                     pickle.TUPLE3[0]: _tuple3, pickle.EMPTY_LIST[0]: _empty_list, pickle.LIST[0]: _list,
                     pickle.EMPTY_DICT[0]: _empty_dict, pickle.DICT[0]: _dict, pickle.APPEND[0]: _append,
                     pickle.APPENDS[0]: _appends, pickle.SETITEM[0]: _setitem, pickle.SETITEMS[0]: _setitems_op})


def read_metadata_safely(stream) -> Metadata:
    """The Metadata pickled in ``stream`` (a binary file or BytesIO, read from its position), or
    a CheckpointError saying why not."""
    start = stream.tell()
    size = stream.seek(0, 2) - start
    stream.seek(start)
    if size > MAX_METADATA_BYTES:
        raise _too_big(f"is {size} bytes, more than {MAX_METADATA_BYTES}")
    try:
        metadata = _MetadataUnpickler(stream, size).load()
    except CheckpointError:
        raise
    except Exception as e:  # truncated or garbled: every way a pickle can fail to parse
        raise CheckpointError(f"checkpoint metadata is not a readable pickle ({type(e).__name__}: {e}); the file "
                              "is damaged or was not written by torch.distributed.checkpoint") from e
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"checkpoint metadata is a {type(metadata).__name__}, not a Metadata")
    return metadata

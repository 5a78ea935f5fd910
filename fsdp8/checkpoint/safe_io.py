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
metadata about four times slower than the C one. What it builds stays within the bounds of
``pickle_bounds`` (depth, size, hash collisions).

"""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
import pickletools

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta

from .pickle_bounds import MAX_METADATA_BYTES, BoundedUnpickler, OpcodeTable, too_big
from .store import CheckpointError, shown

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


def _refuse(what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"checkpoint metadata asks for {what}, which fsdp8 refuses to unpickle: the checkpoint may be "
        "malicious, or written by a torch version whose metadata fsdp8 does not know (it reads what "
        "torch.distributed.checkpoint writes in torch >= 2.11); if you trust its source, "
        "torch.distributed.checkpoint can load it directly")


def _describe(obj) -> str:
    return f"the class {obj.__qualname__}" if isinstance(obj, type) else f"a {type(obj).__qualname__}"


def _refused_opcode(name: str):
    def refuse(self):
        raise _refuse(f"pickle opcode {name}")
    return refuse


class _MetadataUnpickler(BoundedUnpickler):
    instance_types = frozenset(_FIELDS)

    def check_key(self, key) -> None:
        if type(key) is str:
            return
        if type(key) is not MetadataIndex or not vars(key):
            raise _refuse(f"{_describe(key)} as a dictionary key")
        if (type(key.fqn) is not str or type(key.offset) not in (torch.Size, type(None))
                or type(key.index) not in (int, type(None))):
            raise _refuse("a MetadataIndex key with fields of other types than (str, torch.Size, int)")

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

    dispatch = OpcodeTable(
        {code: handler if _OPCODE_NAMES[code] in _PLAIN_OPCODES else _refused_opcode(_OPCODE_NAMES[code])
         for code, handler in BoundedUnpickler.dispatch.items()})
    dispatch.update({pickle.REDUCE[0]: _reduce, pickle.NEWOBJ[0]: _newobj, pickle.BUILD[0]: _build})


def read_metadata_safely(stream) -> Metadata:
    """The Metadata pickled in ``stream`` (a binary file or BytesIO, read from its position), or
    a CheckpointError saying why not."""
    start = stream.tell()
    size = stream.seek(0, 2) - start
    stream.seek(start)
    if size > MAX_METADATA_BYTES:
        raise too_big(f"is {size} bytes, more than {MAX_METADATA_BYTES}")
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

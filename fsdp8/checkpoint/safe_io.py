"""Reading DCP checkpoints without unpickling arbitrary objects.

torch.distributed.checkpoint pickles its metadata file and loads non-tensor entries with
``torch.load(weights_only=False)``. fsdp8 reads the metadata through an unpickler that only
builds the checkpoint library's own metadata classes and plain containers, and loads
non-tensor entries (optimizer hyper-parameters) with ``weights_only=True``.

[Note: the metadata unpickler]
A pickle runs code wherever an opcode looks up a global (GLOBAL, STACK_GLOBAL, INST,
EXT1/2/4), calls one (REDUCE, NEWOBJ, NEWOBJ_EX, INST, OBJ), hands state to an object
(BUILD: ``__setstate__`` or attribute writes) or asks for an outside object (PERSID,
BINPERSID). So:
- a global is one of the exact (module, name) pairs of ``_GLOBALS``, looked up in that
  table and never imported or resolved by attribute (protocol 4 resolves ``a.b`` names
  through attributes: ``os.system`` was reachable through any module that imports ``os``);
- only the classes of that table are called, and the two functions torch pickles a
  layout and a memory format with are replaced by lookups in fixed tables;
- BUILD only fills the fields of an instance of a DCP metadata dataclass (on a class it
  would set attributes of that class for the whole process);
- every other opcode that builds or calls is refused: DCP metadata never uses them.
The pure-Python unpickler is used because the C one cannot be restricted per opcode (and
resolves EXT codes already cached by copyreg without asking ``find_class``); it reads
metadata about three times slower (64k tensor chunks: about 3 s instead of 1 s).
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import pickle
import pickletools

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from .store import CheckpointError

_DATACLASSES = (Metadata, dcp_metadata.MetadataIndex, StorageMeta, dcp_metadata.TensorStorageMetadata,
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
# By identity: a set lookup of the object itself would call its __hash__.
_CALLABLE_IDS = frozenset(id(v) for v in _GLOBALS.values() if callable(v))
_CLASS_IDS = frozenset(id(v) for v in _GLOBALS.values() if isinstance(v, type))
_OPCODE_NAMES = {ord(op.code): op.name for op in pickletools.opcodes}
# Opcodes that only push or store plain data, plus the global lookups (through find_class).
# APPEND(S)/SETITEM(S)/ADDITEMS call the target's append/extend/__setitem__/add, which
# nothing in _GLOBALS has besides real lists, dicts and sets.
_PLAIN_OPCODES = frozenset("""
    PROTO FRAME STOP MARK POP POP_MARK DUP NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG
    LONG1 LONG4 FLOAT BINFLOAT STRING BINSTRING SHORT_BINSTRING UNICODE SHORT_BINUNICODE BINUNICODE
    BINUNICODE8 BINBYTES SHORT_BINBYTES BINBYTES8 BYTEARRAY8 EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3
    EMPTY_LIST LIST APPEND APPENDS EMPTY_DICT DICT SETITEM SETITEMS EMPTY_SET ADDITEMS FROZENSET
    GET BINGET LONG_BINGET PUT BINPUT LONG_BINPUT MEMOIZE GLOBAL STACK_GLOBAL""".split())


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


class _MetadataUnpickler(pickle._Unpickler):
    def find_class(self, module: str, name: str):
        found = _GLOBALS.get((module, name))
        if found is None:
            raise _refuse(f"{module}.{name}")
        return found

    def _reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if id(func) not in _CALLABLE_IDS:
            raise _refuse(f"a call of {_describe(func)}")
        self.stack[-1] = func(*args)

    def _newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        if id(cls) not in _CLASS_IDS:
            raise _refuse(f"NEWOBJ of {_describe(cls)}")
        self.append(cls.__new__(cls, *args))

    def _build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        fields = _FIELDS.get(type(inst))
        if fields is None:
            raise _refuse(f"state set on {_describe(inst)}")
        if "__setstate__" in vars(type(inst)):  # torch's own (TensorProperties: a tuple of fields)
            inst.__setstate__(state)
            return
        if type(state) is not dict:
            raise _refuse(f"a {type(state).__qualname__} as the state of a {type(inst).__qualname__}")
        if not state.keys() <= fields:
            extra = ", ".join(sorted(repr(k) for k in state if k not in fields))
            raise _refuse(f"{extra} in the state of a {type(inst).__qualname__}")
        inst.__dict__.update(state)

    dispatch = {code: handler if _OPCODE_NAMES[code] in _PLAIN_OPCODES else _refused_opcode(_OPCODE_NAMES[code])
                for code, handler in pickle._Unpickler.dispatch.items()}
    dispatch.update({pickle.REDUCE[0]: _reduce, pickle.NEWOBJ[0]: _newobj, pickle.BUILD[0]: _build})


def read_metadata_safely(stream) -> Metadata:
    metadata = _MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"checkpoint metadata is a {type(metadata).__name__}, not a Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata goes through the allow-listing unpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = read_metadata_safely(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

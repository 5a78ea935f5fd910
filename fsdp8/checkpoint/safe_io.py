"""Reading DCP checkpoints without unpickling arbitrary objects.

torch.distributed.checkpoint pickles its metadata file and loads non-tensor entries with
``torch.load(weights_only=False)``. fsdp8 reads the metadata through an unpickler that only
builds the checkpoint library's own metadata classes and plain containers, and loads
non-tensor entries (optimizer hyper-parameters) with ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool", "complex", "slice"}
_TORCH_NAMES = {"Size", "device", "dtype", "layout", "memory_format"}


class UnsafeCheckpointError(RuntimeError):
    """The checkpoint's metadata asks to build an object fsdp8 does not allow."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "builtins" and name in _BUILTINS:
            return super().find_class(module, name)
        if module in ("collections",) and name in ("OrderedDict", "defaultdict"):
            return super().find_class(module, name)
        if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
            return super().find_class(module, name)  # DCP records the checkpoint directory
        if module == "torch.serialization" and name == "_get_layout":  # how torch.layout pickles
            return super().find_class(module, name)
        if module == "copyreg" and name in ("_reconstructor",):
            return super().find_class(module, name)
        if module == "torch" and (name in _TORCH_NAMES or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))):
            return super().find_class(module, name)
        if module.startswith("torch.distributed.checkpoint.") or module == "torch.distributed.checkpoint":
            return super().find_class(module, name)
        if module == "torch._utils" and name in ("_rebuild_tensor_v2",):
            raise UnsafeCheckpointError("checkpoint metadata unexpectedly holds tensors")
        if module == "enum" and name == "Enum":
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata asks for {module}.{name}, which fsdp8 does not unpickle; "
            "only torch.distributed.checkpoint metadata and plain containers are allowed"
        )


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

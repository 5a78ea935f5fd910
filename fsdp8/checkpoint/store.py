"""The on-disk protocol of a checkpoint directory: written aside, published by rename.

[Note: atomic checkpoints]
A save writes everything into ``<path>.partial``; once every rank has finished, rank 0
writes the completion marker into it and renames it to ``<path>`` (an existing ``<path>``
is first renamed aside and deleted only after the new one is in place). A crash at any
moment therefore leaves either the old checkpoint or the new one complete at ``<path>``,
plus perhaps a ``.partial`` or ``.old-*`` directory that the next save removes. A
checkpoint counts only with its marker, so ``latest()`` never returns a half-written one.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
from typing import Any, Dict, List, Optional

import torch

MARKER = "COMPLETE.json"
METADATA = ".metadata"
FORMAT = "fsdp8-checkpoint-v1"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or does not fit the model."""


def partial_path(path: str) -> str:
    return f"{path}.partial"


def extra_path(path: str, rank: int) -> str:
    return os.path.join(path, f"extra.rank{rank}.json")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def read_marker(path: str) -> Dict[str, Any]:
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prepare(path: str) -> None:
    """Rank 0, before a save: a fresh ``.partial`` directory (leftovers of a crash removed)."""
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = partial_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    for name in os.listdir(parent):
        if name.startswith(os.path.basename(path) + ".old-"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    os.makedirs(tmp)


def publish(path: str, info: Dict[str, Any]) -> None:
    """Rank 0, after every rank finished writing: marker, then the rename (see the Note)."""
    tmp = partial_path(path)
    marker = dict(info, format=FORMAT, sequence=time.time_ns())
    write_json_atomic(os.path.join(tmp, MARKER), marker)
    _fsync_dir(tmp)
    old = None
    if os.path.exists(path):
        old = f"{path}.old-{time.time_ns()}"
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def complete_checkpoints(directory: str) -> List[str]:
    """Complete checkpoints directly inside ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isdir(path) and is_complete(path):
            try:
                found.append((read_marker(path).get("sequence", 0), name, path))
            except (OSError, ValueError):
                continue
    return [p for _, _, p in sorted(found)]


def latest(directory: str) -> Optional[str]:
    """The newest complete checkpoint in ``directory``, or None."""
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def prune(directory: str, keep_last: int, protect: str) -> List[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints (never ``protect``)."""
    found = complete_checkpoints(directory)
    doomed = [p for p in found[: max(0, len(found) - keep_last)] if os.path.abspath(p) != os.path.abspath(protect)]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def problems(path: str, storage_files: Optional[Dict[str, int]] = None, foreign_ok: bool = False) -> List[str]:
    """What makes ``path`` unloadable, as sentences (empty when fine). ``storage_files`` maps
    the data files the metadata names to the bytes each must at least hold. ``foreign_ok``
    accepts a checkpoint without fsdp8's marker if fsdp8 did not write it (no extra files)."""
    if not os.path.isdir(path):
        hint = " (a save was interrupted before it finished)" if os.path.isdir(partial_path(path)) else ""
        return [f"checkpoint {path} does not exist{hint}"]
    found = []
    written_by_fsdp8 = any(n.startswith("extra.rank") for n in os.listdir(path))
    if not is_complete(path) and (written_by_fsdp8 or not foreign_ok):
        found.append(f"{path} has no {MARKER}: the save that wrote it did not finish")
    if not os.path.isfile(os.path.join(path, METADATA)):
        found.append(f"{path} has no {METADATA} file")
    for name, size in sorted((storage_files or {}).items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            found.append(f"data file {name} is missing")
        elif os.path.getsize(file) < size:
            found.append(f"data file {name} is truncated ({os.path.getsize(file)} of {size} bytes)")
    return found


# -- extra (step, RNG states, data position): JSON, tensors base64-encoded, no pickle ------------
def encode_extra(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        from .safetensors import _to_bytes

        return {"__tensor__": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                "data": base64.b64encode(_to_bytes(t)).decode()}
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"extra keys must be strings, got {bad[:3]}")
        return {k: encode_extra(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_extra(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"extra holds a {type(obj).__name__}; use JSON values and tensors")


def decode_extra(obj: Any) -> Any:
    if isinstance(obj, dict) and "__tensor__" in obj:
        raw = base64.b64decode(obj["data"])
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return data.view(getattr(torch, obj["__tensor__"])).reshape(obj["shape"]).clone()
    if isinstance(obj, dict):
        return {k: decode_extra(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_extra(v) for v in obj]
    return obj

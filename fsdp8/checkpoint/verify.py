"""Whether a checkpoint directory can be loaded, decided in one process without collectives:
the launcher's ``--resume`` and ``fsdp8 export`` check with it before anything starts, and
``load`` checks with it on every rank before it agrees with the others."""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from . import store
from .safe_io import read_metadata_safely


def storage_files(metadata) -> Dict[str, int]:
    """The data files a checkpoint's metadata names, with the bytes each must at least hold."""
    files: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            files[name] = max(files.get(name, 0), info.offset + info.length)
    return files


def inspect(path: str) -> Tuple[List[str], Optional[object]]:
    """What makes the checkpoint at ``path`` unloadable, as sentences (empty when fine), and its
    metadata when it could be read. A plain DCP checkpoint (no marker, no fsdp8 extra files,
    e.g. written by torch FSDP2) is accepted; an fsdp8 one without its marker is an
    interrupted save and is not."""
    found = store.problems(path, foreign_ok=True)
    if found:
        return found, None
    try:
        with open(os.path.join(path, store.METADATA), "rb") as f:
            metadata = read_metadata_safely(f)
    except Exception as e:  # unreadable or disallowed metadata
        return [f"{path}/{store.METADATA} cannot be read: {e}"], None
    return store.problems(path, storage_files(metadata), foreign_ok=True), metadata


def verify(path: str) -> List[str]:
    """What makes the checkpoint at ``path`` unloadable, as sentences; empty when it is fine."""
    return inspect(path)[0]

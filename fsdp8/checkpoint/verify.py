"""Whether a checkpoint directory can be loaded, decided in one process without collectives:
the launcher's ``--resume`` and ``fsdp8 export`` check with it before anything starts, and
``load`` checks with it on every rank before it agrees with the others.

It reads the marker, the metadata (through the bounded, allow-listing unpickler), the
checksums and the extra files, and checks the metadata against itself and the directory
(``metadata_check``); ``verify(path, data=True)`` also reads every stored item against its
checksum.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from . import checksums, extra, metadata_check, store
from .paths import inside
from .safe_io import read_metadata_safely


@dataclass
class Inspection:
    """What ``examine`` found: the problems (empty when the checkpoint loads), and what it read."""

    problems: List[str]
    metadata: Any = None
    table: Optional[checksums.Table] = None  # None: saved without checksums
    extra: Any = None  # the extra values of the rank examined for (examine's ``rank``)


def read_metadata(path: str):
    """The metadata of checkpoint ``path``, or a CheckpointError (of the unpickler's kind) naming the file."""
    file = os.path.join(path, store.METADATA)
    try:
        with open(file, "rb") as f:
            return read_metadata_safely(f)
    except store.CheckpointError as e:
        raise type(e)(f"{file}: {e}") from None
    except OSError as e:
        raise store.CheckpointError(f"{file} cannot be read: {e.strerror or e}") from None


def examine(path: str, rank: Optional[int] = None) -> Inspection:
    """Everything that makes checkpoint ``path`` unloadable, and its metadata, checksums and
    extra values. ``rank``: read that rank's extra file (the one ``load`` on that rank would
    use); None: check every extra file."""
    found = store.problems(path, foreign_ok=True)
    if found:
        return Inspection(found)
    try:
        metadata = read_metadata(path)
    except store.CheckpointError as e:
        return Inspection([str(e)])
    result = Inspection(metadata_check.problems(path, metadata), metadata)
    if store.is_complete(path):
        try:
            result.table = checksums.read_table(path, store.read_marker(path))
        except (OSError, ValueError, AttributeError) as e:
            result.problems.append(f"{os.path.join(path, store.MARKER)} cannot be read: {e}")
        except store.CheckpointError as e:
            result.problems.append(str(e))
    files = [extra.file_for(path, rank)] if rank is not None else sorted(
        os.path.join(path, n) for n in os.listdir(path) if n.startswith("extra.rank") and n.endswith(".json"))
    for file in files:
        try:
            result.extra = extra.read(file) if file is not None else {}
        except store.CheckpointError as e:
            result.problems.append(str(e))
    return result


def inspect(path: str) -> Tuple[List[str], Optional[object]]:
    """What makes the checkpoint at ``path`` unloadable, as sentences (empty when fine), and its
    metadata when it could be read. A plain DCP checkpoint (no marker, no fsdp8 extra files,
    e.g. written by torch FSDP2) is accepted; an fsdp8 one without its marker is an
    interrupted save and is not."""
    result = examine(path)
    return result.problems, result.metadata


def verify(path: str, data: bool = False) -> List[str]:
    """What makes the checkpoint at ``path`` unloadable, as sentences; empty when it is fine.
    ``data=True`` also reads every stored item against its checksum (all of the checkpoint's
    bytes; a checkpoint saved without checksums is not read)."""
    result = examine(path)
    if result.problems or not data or result.table is None:
        return result.problems
    damaged = []
    by_file = {}
    for info in result.metadata.storage_data.values():
        by_file.setdefault(info.relative_path, []).append(info)
    for name, infos in sorted(by_file.items()):
        with open(inside(path, name, f"its {store.METADATA}"), "rb") as f:
            for info in sorted(infos, key=lambda i: i.offset):
                try:
                    checksums.check_item(path, name, f, info.offset, info.length, result.table)
                except store.CheckpointError as e:
                    damaged.append(str(e))
                    break  # one sentence per damaged file
    return damaged
